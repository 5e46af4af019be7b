"""Smallest run of the resident kernel (RESIDENT_GPU_PERSISTENT=1) with logs: 2 ranks on GPU 0,
status, eager all_reduce, a captured graph replayed, destroy.  Each step is printed with the
kernel's status; a rank stuck for longer than --stuck-s dumps its Python stacks and exits.

    python3 scripts/persistent_probe.py [--ws 2] [--path direct|proxy]
"""
import argparse
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_last_step = [time.monotonic()]


def say(rank, *a):
    _last_step[0] = time.monotonic()
    print(f"[rank {rank} {time.monotonic():.3f}]", *a, flush=True)


def watch(rank, be):
    """While a step makes no progress for 3 s, print the resident kernel's status every 3 s:
    running (began, not left) vs queued (launched, not begun), served, launches, exits."""
    import threading

    def loop():
        while True:
            time.sleep(3)
            if time.monotonic() - _last_step[0] > 3:
                print(f"[rank {rank} {time.monotonic():.3f}] STUCK", dict(be.persistent_status()),
                      flush=True)
    threading.Thread(target=loop, daemon=True).start()


def rank_main(rank, ws, port, path, stuck_s):
    faulthandler.dump_traceback_later(stuck_s, exit=True)
    os.environ["RESIDENT_PATH"] = path
    import resident_pg  # noqa: F401  (registers the backend)
    torch.cuda.set_device(0)
    dist.init_process_group("resident", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws)
    be = dist.group.WORLD._get_backend(torch.device("cuda"))
    say(rank, "init", dict(be.persistent_status()))
    watch(rank, be)
    x = torch.arange(4, device="cuda", dtype=torch.float32) + rank
    dist.all_reduce(x)
    say(rank, "all_reduce issued", dict(be.persistent_status()))
    torch.cuda.current_stream().synchronize()
    want = torch.arange(4, dtype=torch.float32) * ws + sum(range(ws))
    say(rank, "all_reduce", x.cpu().tolist(), "ok" if torch.equal(x.cpu(), want) else "WRONG",
        dict(be.persistent_status()))
    for i in range(3):
        y = torch.full((1024,), float(rank + i), device="cuda")
        dist.all_reduce(y)
    torch.cuda.current_stream().synchronize()
    say(rank, "3 more", y[0].item(), dict(be.persistent_status()))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    z = torch.ones(256, device="cuda")
    with torch.cuda.stream(s):
        dist.all_reduce(z)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(z)
    say(rank, "captured", dict(be.persistent_status()))
    for i in range(3):
        z.fill_(float(rank + 1 + i))
        g.replay()
    torch.cuda.current_stream().synchronize()
    say(rank, "replayed", z[0].item(), dict(be.persistent_status()))
    # Replays after the kernel idled out (each needs a relaunch by the proxy thread), with
    # eager ops between them.
    for i in range(5):
        time.sleep(0.01)
        z.fill_(float(rank + i))
        g.replay()
        w = torch.full((64,), float(rank), device="cuda")
        dist.all_reduce(w)
        torch.cuda.current_stream().synchronize()
        if z[0].item() != sum(range(ws)) + ws * i or w[0].item() != sum(range(ws)):
            say(rank, f"WRONG after idle replay {i}: {z[0].item()} {w[0].item()}")
    say(rank, "idle replays", dict(be.persistent_status()))
    t0 = time.monotonic()
    torch.cuda.synchronize()
    say(rank, f"device synchronize {time.monotonic() - t0:.3f}s")
    dist.destroy_process_group()
    say(rank, "destroyed")
    faulthandler.cancel_dump_traceback_later()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ws", type=int, default=2)
    p.add_argument("--path", default="direct")
    p.add_argument("--stuck-s", type=float, default=25)
    a = p.parse_args()
    os.environ.setdefault("RESIDENT_GPU_PERSISTENT", "1")
    os.environ.setdefault("RESIDENT_DEBUG", "debug")
    port = 29600 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, a.ws, port, a.path, a.stuck_s))
             for r in range(a.ws)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + a.stuck_s + 15
    for pr in procs:
        pr.join(max(0.1, deadline - time.monotonic()))
    codes = []
    for pr in procs:
        if pr.is_alive():
            pr.kill()
        codes.append(pr.exitcode)
    print("exit codes", codes, flush=True)
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
