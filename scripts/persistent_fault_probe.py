"""Where does the resident kernel's illegal memory access (bench_interference, mode persistent)
come from?  2 ranks on GPU 0 (under MPS) run the interference benchmark's sequence step by step,
with a device check after each step (a short idle wait, a tiny kernel, a stream synchronize),
so the first step after which the context is broken is named.  One launch per variant:

    python3 scripts/persistent_fault_probe.py [--variants "idle0 idle500ms idle30s idle0-nogemm"]

Variant words (joined by '-'): idle0 / idle500ms / idle30s (RESIDENT_GPU_PERSISTENT_IDLE_US),
nogemm (no GEMM graph captured before the group), lazysleep (the first launch of
torch.cuda._sleep's kernel comes only after the resident kernel runs; the checks launch nothing),
eagerload (CUDA_MODULE_LOADING=EAGER; torch sets LAZY when unset), kernelgraphs (captured ops as kernel nodes,
RESIDENT_GPU_PERSISTENT_GRAPHS=kernel; default here: resident), noeager (no eager warm-up of the
captured op), blocks1 (RESIDENT_GPU_PERSISTENT_BLOCKS=1).
Prints one line per step and rank, and a summary line per variant.
"""
import argparse
import datetime
import os
import sys
import time

import torch.multiprocessing as mp

IDLE = {"idle0": "0", "idle500ms": "500000", "idle30s": "30000000"}


def env_of(variant):
    env = {"RESIDENT_GPU_PERSISTENT": "1", "RESIDENT_GPU_PERSISTENT_GRAPHS": "resident"}
    for w in variant.split("-"):
        if w in IDLE:
            env["RESIDENT_GPU_PERSISTENT_IDLE_US"] = IDLE[w]
        elif w == "kernelgraphs":
            env["RESIDENT_GPU_PERSISTENT_GRAPHS"] = "kernel"
        elif w == "blocks1":
            env["RESIDENT_GPU_PERSISTENT_BLOCKS"] = "1"
        elif w == "eagerload":
            env["CUDA_MODULE_LOADING"] = "EAGER"
        elif w not in ("nogemm", "noeager", "lazysleep"):
            raise ValueError(f"unknown variant word {w!r}")
    return env


def rank_main(rank, ws, port, variant, q):
    os.environ.update(env_of(variant))
    import torch
    import torch.distributed as dist
    import resident_pg  # noqa: F401

    torch.cuda.set_device(0)
    words = variant.split("-")
    step = ["start"]

    def say(what, **kw):
        q.put((variant, rank, what, kw))

    def check(name):
        step[0] = name
        time.sleep(0.05)
        if "lazysleep" in words:  # no kernel launch of our own: only the synchronize
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda._sleep(1000)
            torch.cuda.current_stream().synchronize()
        say(name)

    be = None
    try:
        cap, comm = torch.cuda.Stream(), torch.cuda.Stream()
        if "nogemm" not in words:
            w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, 14336, device="cuda", dtype=torch.bfloat16)
            gg = torch.cuda.CUDAGraph()
            cap.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(cap):
                torch.matmul(x, w, out=out)
                cap.synchronize()
                gg.capture_begin(capture_error_mode="thread_local")
                for _ in range(5):
                    torch.matmul(x, w, out=out)
                gg.capture_end()
            cap.synchronize()
        buf = torch.zeros(2, device="cuda")
        big = torch.zeros(16384, device="cuda")
        torch.cuda.synchronize()
        check("before group")
        dist.init_process_group("resident", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=ws, timeout=datetime.timedelta(seconds=10))
        be = dist.group.WORLD._get_backend(torch.device("cuda"))
        warm = torch.full((2,), float(rank + 1), device="cuda")
        dist.all_reduce(warm)
        got = warm.cpu()
        check(f"eager all_reduce ({got.tolist()})")
        time.sleep(0.2)
        check("idle 0.2 s after the eager op")
        graphs = []
        for t in (buf, big):
            if "noeager" not in words:
                cap.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(cap):
                    for _ in range(2):
                        dist.all_reduce(t)
                cap.synchronize()
                check(f"eager warm-up on a side stream ({t.numel() * 4} B)")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(cap):
                g.capture_begin(capture_error_mode="thread_local")
                for _ in range(8):
                    dist.all_reduce(t)
                g.capture_end()
            cap.synchronize()
            check(f"captured 8 x {t.numel() * 4} B")
            t.fill_(float(rank + 1) / 64)
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                g.replay()
            comm.synchronize()
            v = t[0].item()
            check(f"replayed once ({v} vs {(ws * (ws + 1) / 2) * ws ** 7 / 64})")
            t.zero_()
            graphs.append(g)
        torch.cuda.current_stream().synchronize()
        check("zeroed")
        time.sleep(0.5)
        check("idle 0.5 s after the graphs")
        t0 = time.monotonic()
        torch.cuda._sleep(1000)  # with lazysleep: the first launch of this kernel in the process
        torch.cuda.current_stream().synchronize()
        check(f"a sleep kernel launched and done in {time.monotonic() - t0:.3f} s")
        for g in graphs:
            torch.cuda._sleep(2_000_000)
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                for _ in range(20):
                    g.replay()
            comm.synchronize()
            check("20 replays behind a sleep kernel")
        say("status", status=dict(be.persistent_status()))
        dist.destroy_process_group()
        say("done")
    except BaseException as e:  # noqa: BLE001
        st = None
        try:
            st = dict(be.persistent_status()) if be is not None else None
        except BaseException:  # noqa: BLE001
            pass
        say("FAULT", after=step[0], error=f"{type(e).__name__}: {str(e).splitlines()[0]}",
            status=st)
        os._exit(3)


def run_variant(variant, ws, limit_s):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29700 + (os.getpid() + hash(variant)) % 1000
    procs = [ctx.Process(target=rank_main, args=(r, ws, port, variant, q)) for r in range(ws)]
    for p in procs:
        p.start()
    t0 = time.time()
    done, faults = set(), []
    while len(done) + len(faults) < ws and time.time() - t0 < limit_s:
        try:
            v, r, what, kw = q.get(timeout=0.5)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(p.exitcode is not None for p in procs):
                break
            continue
        print(f"[{variant} r{r} {time.time() - t0:6.2f}s] {what} {kw if kw else ''}", flush=True)
        if what == "done":
            done.add(r)
        elif what == "FAULT":
            faults.append((r, kw.get("after")))
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    verdict = "ok" if len(done) == ws else (f"FAULT {faults}" if faults else "stuck/timeout")
    print(f"== {variant}: {verdict} ({time.time() - t0:.1f} s)", flush=True)
    return verdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="idle0 idle500ms idle30s idle0-nogemm")
    ap.add_argument("--ws", type=int, default=2)
    ap.add_argument("--limit-s", type=float, default=40)
    a = ap.parse_args()
    verdicts = {v: run_variant(v, a.ws, a.limit_s) for v in a.variants.split()}
    print("summary", verdicts, flush=True)
    sys.exit(0 if all(v == "ok" for v in verdicts.values()) else 1)


if __name__ == "__main__":
    main()
