"""Where the time of one small all_reduce goes: the full `dist.all_reduce` call, the
ProcessGroup call without torch's Python wrapper, and the backend object's own call, for each
backend, 2 ranks, 8 bytes, side by side in one run. Medians of batches, µs per op.

With `--device cuda` (rank r on GPU r % device_count; several ranks on one GPU need MPS): the
host's time per eager op, as batches of 200 back-to-back calls then one synchronize, beside a
bare torch kernel (`t.add_(1)`) timed the same way in the same processes, and the target line
(an eager all_reduce at most 1.5x a bare kernel launch); for resident also the call the vLLM
plugin makes (`resident_pg.vllm_plugin.direct_all_reduce`: the backend's own all_reduce with
asyncOp off, no Work to wait on).

    python benchmarks/overhead.py [--backends resident,gloo] [--device cpu|cuda] [--iters 5000]
                                  [--spawns N] [--json PATH]

`--spawns N` runs each backend's pair of processes N times afresh (the host's speed moves
between process pairs more than between calls of one pair) and reports every pair and the
medians over them.
"""

import argparse
import json
import os
import queue as queue_module
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


BARE = "bare torch kernel t.add_(1)"
BATCH = 200  # CUDA: calls issued back to back before one synchronize
DIRECT = "vllm_plugin.direct_all_reduce (asyncOp off)"
BARE_INFERENCE = "t.add_(1) under torch.inference_mode"
INFERENCE = "dist.all_reduce under torch.inference_mode"


def _rank(rank, world, port, backend, iters, device, queue):
    if backend == "resident":
        import resident_pg  # noqa: F401
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", port, None, False)  # the parent's
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    t = torch.ones(2, device=device)
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device(device))
    calls = {
        "dist.all_reduce": lambda: dist.all_reduce(t),
        "ProcessGroup.allreduce().wait()": lambda: pg.allreduce([t]).wait(),
        "Backend.allreduce().wait()": lambda: be.allreduce([t]).wait(),
    }
    if cuda:
        # Without wait(): stream-ordered, so the op runs all the same; the row shows what the
        # wait costs the host.
        calls = {BARE: lambda: t.add_(1), **calls,
                 "Backend.allreduce() (no wait)": lambda: be.allreduce([t]),
                 # Under torch.inference_mode (vLLM's model runs in it) the dispatcher skips
                 # the autograd keys: the c10d op's boxed autograd fallback and add_'s autograd
                 # kernel.
                 BARE_INFERENCE: lambda: t.add_(1),
                 INFERENCE: lambda: dist.all_reduce(t)}
        if backend == "resident":
            # What the vLLM plugin calls: the backend's own all_reduce with asyncOp off.
            from resident_pg.vllm_plugin import direct_all_reduce

            direct = direct_all_reduce(pg, device)
            calls[DIRECT] = lambda: direct(t)
    queue.put((rank, _time_calls(calls, iters, cuda, t)))
    dist.destroy_process_group()


def _time_calls(calls, iters, cuda, t):
    """Median µs per call of each row over batches of calls (CUDA: `BATCH` calls, then one
    synchronize). The rows' batches alternate, one batch of each row per round, so that the
    host's speed, which drifts within a process's life, moves every row alike."""
    batch = BATCH if cuda else max(1, iters // 9)
    # (a batch runs in the row's mode as a whole: entering it per call would cost more)
    mode = {name: name in (BARE_INFERENCE, INFERENCE) for name in calls}
    for name, fn in calls.items():
        with torch.inference_mode(mode[name]):
            for _ in range(iters // 5):
                fn()
    if cuda:
        torch.cuda.synchronize()
    samples = {name: [] for name in calls}
    for _ in range(9 if not cuda else max(9, iters // BATCH)):
        for name, fn in calls.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
                t.zero_()
            with torch.inference_mode(mode[name]):
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                if cuda:
                    torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / batch * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _collect(queue, procs, backend):
    """Each rank's results; a rank that exits without them ends the run at once, named."""
    per_rank, empty_after_exit = {}, 0
    while len(per_rank) < len(procs):
        try:
            rank, res = queue.get(timeout=1.0)
            per_rank[rank] = res
            continue
        except queue_module.Empty:
            pass
        gone = [(i, p.exitcode) for i, p in enumerate(procs)
                if p.exitcode is not None and i not in per_rank]
        # A failed rank at once; one that exited cleanly after a second empty wait (its results
        # may still be in the pipe).
        empty_after_exit = empty_after_exit + 1 if gone else 0
        if any(c != 0 for _i, c in gone) or empty_after_exit >= 2:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            raise SystemExit(f"overhead.py: {backend}: " + ", ".join(
                f"rank {i} exited with code {c} without its results" for i, c in gone))
    return per_rank


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="resident,gloo")
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--spawns", type=int, default=1, help="fresh process pairs per backend")
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results, spawns = {}, {}
    for backend in args.backends.split(","):
        runs = []
        for _ in range(args.spawns):
            # the pair's store, on a port it picks itself
            store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            port = store.port
            queue = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, 2, port, backend, args.iters, args.device, queue))
                     for r in range(2)]
            for p in procs:
                p.start()
            per_rank = _collect(queue, procs, backend)
            for p in procs:
                p.join()
            del store
            runs.append({k: max(per_rank[r][k] for r in per_rank) for k in per_rank[0]})
        spawns[backend] = runs
        results[backend] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    names = list(next(iter(results.values())))
    what = f"2 ranks, 8 B, {args.device}, µs/op, max over ranks"
    if args.spawns > 1:
        what += f", median of {args.spawns} process pairs"
    print(f"{f'call ({what})':48s}" + "".join(f"{b:>12s}" for b in results))
    for n in names:
        print(f"{n:48s}" + "".join(f"{results[b][n]:12.2f}" for b in results))
    for b, r in results.items():
        if BARE in r and b == "resident":
            # Ratios are the median of the pairs' own: each pair's rows ran side by side in the
            # same processes, while the pairs' speeds differ.
            def ratio(num, den):
                return statistics.median(run[num] / run[den] for run in spawns[b])

            if args.spawns > 1:
                print("dist.all_reduce / bare kernel per process pair: "
                      + " ".join(f"{run['dist.all_reduce'] / run[BARE]:.2f}" for run in spawns[b]))
            x = ratio("dist.all_reduce", BARE)
            verdict = "PASS" if x <= 1.5 else "MISS"
            print(f"TARGET cuda eager all_reduce 8 B host time <= 1.5x a bare kernel launch: {verdict}"
                  f"  ({x:.2f}x, the median of the pairs' ratios; medians {r['dist.all_reduce']:.2f}"
                  f" against {r[BARE]:.2f} µs)")
            if INFERENCE in r:
                print(f"under torch.inference_mode: dist.all_reduce {r[INFERENCE]:.2f} µs = "
                      f"{ratio(INFERENCE, BARE_INFERENCE):.2f}x t.add_(1) there "
                      f"({r[BARE_INFERENCE]:.2f} µs)")
            if DIRECT in r:
                print(f"the vLLM plugin's all_reduce: {r[DIRECT]:.2f} µs = "
                      f"{ratio(DIRECT, BARE):.2f}x the bare kernel")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "spawns": spawns, "device": args.device, "torch": torch.__version__, "host": socket.gethostname(),
                       "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
