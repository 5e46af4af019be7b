"""EP decode dispatch + combine, three ways side by side in one run, per decode shape:

* ``ep``: resident_pg.ep.Buffer (the resident all_to_all with counts read on the device, which
  moves only the routed (token, expert) rows, both ways; dispatch's counts travel ahead of its
  rows up to ``--counts-with-rows-max-bytes`` of capacity per peer, else in an exchange first);
* ``moe``: resident_pg.moe.MoEDispatcher (counts, then all_to_all_single of the padded
  buffers of ``C = tokens * min(top_k, experts/rank)`` slots per peer, both ways);
* ``a2a``: two plain all_to_all_single of the padded payload buffer (the data movement of
  ``moe`` alone, without its index work).

With ``--fp8`` also: ``ep8`` -- the ``ep`` step with FP8 dispatch (``use_fp8=True``: e4m3fn
values plus one float32 scale per 128 channels, about half the bytes of bf16; combine in bf16,
from a static bf16 expert output), and the dispatch alone in bf16 (``d16``) and in FP8 (``d8``).

Experts are the identity (communication and layout work only). Routing: top-k of uniform random
scores per token (fresh each step is not needed: the same shapes move the same bytes). Each
step is captured in a CUDA graph (``--eager``: eager calls) and timed replay by replay with CUDA
events; printed: the median per rank, the maximum over ranks, in microseconds, and the payload
bytes per peer each way (``ep``: the mean routed rows of this routing; the others: padded).

    python benchmarks/ep_bench.py --ranks 8 [--path direct|proxy|proxy+tcp] [--hidden 2048,4096,7168]
        [--tokens 1,8,32,128] [--experts 64,256] [--top-k 8] [--iters 200] [--eager] [--fp8]
        [--json PATH]

Rows print as each shape finishes; a rank that fails ends the run at once (exit status 1, the
failing ranks named; ``--json`` keeps the shapes measured, with ``"complete": false``).
Rank r runs on GPU r % device_count (several ranks on one GPU need MPS). ``--device cpu`` runs
the same on CPU tensors (a functional dry run; the times mean little).
"""

import argparse
import json
import os
import queue as queue_module
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PATH_ENV = {"direct": {"RESIDENT_PATH": "direct"}, "proxy": {"RESIDENT_PATH": "proxy"},
            "proxy+tcp": {"RESIDENT_PATH": "proxy", "RESIDENT_TRANSPORT": "tcp"}}


def _timed(step, iters, device, graph):
    """Median microseconds of ``step`` (replayed as a CUDA graph when ``graph``)."""
    import time

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    run = step
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
        run()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _fp8_times(out, buf, x, idx, w, tokens, experts, iters, device, graph):
    """``ep8`` (FP8 dispatch + bf16 combine), ``d16`` / ``d8`` (dispatch alone) and the FP8
    dispatch's bytes per peer, into ``out``."""
    from resident_pg.ep import Buffer

    def d16_step():
        buf.low_latency_dispatch(x, idx, tokens, experts)
    out["d16"] = _timed(d16_step, iters, device, graph)

    top_k = idx.shape[1]
    buf8 = Buffer(None, tokens, x.shape[1], experts, x.dtype, device, num_topk=top_k,
                  transport="splits", use_fp8=True)
    d8 = buf8.dispatcher(top_k, use_fp8=True)
    y = torch.zeros(d8.local_experts, d8.max_slots, x.shape[1], dtype=x.dtype, device=device)

    def d8_step():
        buf8.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
    out["d8"] = _timed(d8_step, iters, device, graph)

    def ep8_step():
        _, _, handle, _, _ = buf8.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
        buf8.low_latency_combine(y, idx, w, handle)
    out["ep8"] = _timed(ep8_step, iters, device, graph)
    _, _, handle, _, _ = buf8.low_latency_dispatch(x, idx, tokens, experts, use_fp8=True)
    out["ep8_bytes_per_peer"] = handle.dispatch.send_counts.sum(1).float().mean().item() * \
        d8.dispatch_row_bytes()


def _case(rank, world, device, hidden, tokens, experts, top_k, iters, graph, fp8):
    from resident_pg.ep import Buffer
    from resident_pg.moe import MoEDispatcher

    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.to(device)
    w = torch.rand(tokens, top_k, generator=gen).to(device)
    out = {}

    buf = Buffer(None, tokens, hidden, experts, dtype, device, num_topk=top_k, transport="splits")

    def ep_step():
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts)
        buf.low_latency_combine(recv_x, idx, w, handle)
    out["ep"] = _timed(ep_step, iters, device, graph)
    d = buf.dispatcher(top_k)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts)
    rows = handle.dispatch.send_counts.sum(1).float().mean().item()
    row_bytes = hidden * dtype.itemsize
    out["ep_bytes_per_peer"] = rows * row_bytes
    out["padded_bytes_per_peer"] = d.message_bytes()
    if fp8:
        _fp8_times(out, buf, x, idx, w, tokens, experts, iters, device, graph)
    del buf, d, recv_x, handle

    moe = MoEDispatcher(None, experts, hidden, tokens, top_k, dtype, device)

    def moe_step():
        ex, _, h = moe.dispatch(x, idx, w)
        moe.combine(ex, h)
    out["moe"] = _timed(moe_step, iters, device, graph)
    world_slots = moe.world * moe.slots_per_rank
    del moe

    send = torch.zeros(world_slots, hidden, dtype=dtype, device=device)
    recv = torch.zeros_like(send)

    def a2a_step():
        dist.all_to_all_single(recv, send)
        dist.all_to_all_single(send, recv)
    out["a2a"] = _timed(a2a_step, iters, device, graph)
    del send, recv
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _rank(rank, world, port, env, args, queue):
    os.environ.update(env)
    import resident_pg.ep

    if args.counts_with_rows_max_bytes is not None:  # where dispatch's counts ride with its rows
        bound = args.counts_with_rows_max_bytes
        # the Buffer's bound whatever the group's transports (looked up when a Buffer is made)
        resident_pg.ep.counts_with_rows_max_bytes = lambda transports: bound

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda").add_(1)
    store = dist.TCPStore("127.0.0.1", port, None, False)  # the parent's
    dist.init_process_group("resident", store=store, rank=rank, world_size=world)
    rows = []
    graph = device == "cuda" and not args.eager
    for hidden in args.hidden:
        for experts in args.experts:
            for tokens in args.tokens:
                r = _case(rank, world, device, hidden, tokens, experts, args.top_k, args.iters,
                          graph, args.fp8)
                fp8 = [r.get(k, 0.0) for k in ("ep8", "d16", "d8", "ep8_bytes_per_peer")]
                t = torch.tensor([r["ep"], r["moe"], r["a2a"], r["ep_bytes_per_peer"]] + fp8,
                                 dtype=torch.float64, device=device)
                mx = t.clone()
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                dist.all_reduce(t)
                rows.append({"ranks": world, "hidden": hidden, "tokens": tokens,
                             "experts": experts, "top_k": args.top_k,
                             "ep_us": mx[0].item(), "moe_us": mx[1].item(),
                             "a2a_us": mx[2].item(),
                             "ep_bytes_per_peer": t[3].item() / world,
                             "padded_bytes_per_peer": r["padded_bytes_per_peer"]})
                if args.fp8:
                    rows[-1].update({"ep8_us": mx[4].item(), "d16_us": mx[5].item(),
                                     "d8_us": mx[6].item(),
                                     "ep8_bytes_per_peer": t[7].item() / world})
                if rank == 0:  # each shape as it is done: a run cut short keeps what it measured
                    queue.put(("row", rows[-1]))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(("done", None))


def _failed(procs):
    """(rank, exit code) of each rank process that exited with an error."""
    return [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--path", choices=sorted(PATH_ENV), default="direct")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--hidden", type=ints, default=[2048, 4096, 7168])
    p.add_argument("--tokens", type=ints, default=[1, 8, 32, 128])
    p.add_argument("--experts", type=ints, default=[64, 256])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--eager", action="store_true", help="time eager calls, not graph replays")
    p.add_argument("--fp8", action="store_true",
                   help="also time FP8 dispatch (ep8 step, d16 / d8 dispatch alone)")
    p.add_argument("--counts-with-rows-max-bytes", type=int, default=None,
                   help="CUDA: the largest capacity per peer at which dispatch sends its counts "
                        "with its rows, whatever the group's transports (default: the Buffer's "
                        "rule, resident_pg.ep.counts_with_rows_max_bytes); 0: always first, in "
                        "an exchange of their own")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    for e in args.experts:
        if e % args.ranks or e < args.top_k:
            p.error(f"--experts {e}: each value must be a multiple of --ranks ({args.ranks}) and at "
                    f"least --top-k ({args.top_k})")
    # The ranks' store, on a port it picks itself, held until the run ends.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = store.port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, PATH_ENV[args.path], args,
                                             queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    print(f"EP decode dispatch+combine, {args.ranks} ranks, path {args.path}, bf16, top-"
          f"{args.top_k}, {'eager' if args.eager or args.device == 'cpu' else 'CUDA graph'}; "
          "median us per step (max over ranks); KiB per peer each way")
    fp8_head = (f" {'ep8':>9} {'d16':>9} {'d8':>9} {'ep8 KiB':>8}" if args.fp8 else "")
    print(f"{'hidden':>6} {'experts':>7} {'tokens':>6} {'ep':>9} {'moe':>9} {'a2a':>9} "
          f"{'ep KiB':>8} {'padded KiB':>10} {'moe/ep':>7}" + fp8_head, flush=True)
    rows, failure, all_exited = [], None, False
    while failure is None:
        try:
            kind, r = queue.get(timeout=1.0)
        except queue_module.Empty:
            # A rank that died ends the run now, not when its peers' waits time out.
            if _failed(procs):
                # Its peers usually fail the same way a moment later: name them too.
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
                    time.sleep(0.05)
                dead = _failed(procs)
                failure = ", ".join(f"rank {i} exited with code {c}" for i, c in dead)
            elif all_exited:  # a second empty wait after every rank exited: nothing is coming
                failure = "the ranks exited before rank 0 reported the end of the run"
            all_exited = all(p.exitcode == 0 for p in procs)
            continue
        if kind == "done":
            break
        rows.append(r)
        fp8_cols = (f" {r['ep8_us']:>9.1f} {r['d16_us']:>9.1f} {r['d8_us']:>9.1f} "
                    f"{r['ep8_bytes_per_peer'] / 1024:>8.1f}" if args.fp8 else "")
        print(f"{r['hidden']:>6} {r['experts']:>7} {r['tokens']:>6} {r['ep_us']:>9.1f} "
              f"{r['moe_us']:>9.1f} {r['a2a_us']:>9.1f} {r['ep_bytes_per_peer'] / 1024:>8.1f} "
              f"{r['padded_bytes_per_peer'] / 1024:>10.1f} {r['moe_us'] / r['ep_us']:>7.2f}"
              + fp8_cols, flush=True)
    for proc in procs:
        if failure is not None and proc.is_alive():
            proc.terminate()
        proc.join(120)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "complete": failure is None}, f, indent=1)
    if failure is not None:
        raise SystemExit(f"ep_bench: {failure}; {len(rows)} shapes measured before that")


if __name__ == "__main__":
    main()
