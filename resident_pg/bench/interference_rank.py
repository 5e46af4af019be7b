"""The rank processes of the interference benchmark (``python -m resident_pg.bench.interference``
launches them; its docstring describes the conditions): the GEMM and all_reduce graphs, their
timing on two streams, the replay plan and the arithmetic of the communication window.
Imports torch only inside the functions that need CUDA."""

from __future__ import annotations

import datetime
import itertools
import math
import os
import traceback
from typing import Any, Dict, List, Optional, Sequence

from . import common, cuda
from . import rank as rank_side
from .interference_report import stats


def plan_replays(gemm_window_us: float, comm_replay_us: float, margin: float = 1.5,
                 max_replays: int = 4000) -> int:
    """Communication graph replays to queue so that they cover a GEMM window of
    ``gemm_window_us`` (alone) with a ``margin`` for the mutual slowdown; at least 2."""
    if not (comm_replay_us > 0) or not math.isfinite(comm_replay_us):
        return 2
    return int(max(2, min(max_replays, math.ceil(margin * gemm_window_us / comm_replay_us) + 1)))


def window_stats(marks_ms: Sequence[float], gemm_start_ms: float, gemm_end_ms: float,
                 ops_per_replay: int) -> Dict[str, Any]:
    """From the communication stream's marks (start, then the end of each graph replay; all
    in ms on one clock) and the GEMM window: the fraction of the GEMM window the
    communication covered, and the per-op latency (µs) of the replays entirely inside the
    window (of all replays when none is)."""
    if len(marks_ms) < 2 or ops_per_replay < 1:
        raise ValueError("need a start mark, at least one replay and ops_per_replay >= 1")
    gemm = gemm_end_ms - gemm_start_ms
    cov = min(marks_ms[-1], gemm_end_ms) - max(marks_ms[0], gemm_start_ms)
    coverage = max(0.0, min(1.0, cov / gemm)) if gemm > 0 else 0.0
    spans = list(zip(marks_ms[:-1], marks_ms[1:]))
    inside = [(a, b) for a, b in spans if a >= gemm_start_ms and b <= gemm_end_ms]
    used = inside or spans
    per_op_us = sum(b - a for a, b in used) * 1000.0 / (len(used) * ops_per_replay)
    return {"coverage": coverage, "per_op_us": per_op_us, "replays_inside": len(inside),
            "replays": len(spans)}


def capture_graph(fn, count: int, stream, warmup: int = 2):
    """``count`` calls of ``fn`` captured into one CUDA graph on ``stream``, after ``warmup``
    eager calls there.  Unlike torch.cuda.graph, no device-wide synchronize and no
    empty_cache (which synchronizes too): stream synchronization only."""
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(count):
                fn()
        finally:
            g.capture_end()
    stream.synchronize()
    return g


def rank_main(rank: int, ws: int, store_port: int, cfg: Dict[str, Any], q) -> None:
    """One rank of one mode's launch; reports ("progress" | "result" | "fatal", rank, ...)."""
    phase = "start-up"
    dist = None
    try:
        os.environ.update(cfg["env"])
        import importlib
        importlib.import_module("resident_pg")
        import torch
        import torch.distributed as dist

        phase = "device"
        dev = cuda.CudaDevice(rank, ws)  # synchronizes the device: no group yet
        store = dist.TCPStore("127.0.0.1", store_port, None, False,
                              timeout=datetime.timedelta(seconds=cfg["timeout"]))
        bstore = dist.PrefixStore("interference", store)
        seq = itertools.count()

        def barrier() -> None:
            rank_side._barrier(bstore, f"b{next(seq)}", ws, cfg["timeout"])

        def progress(what: str) -> None:
            q.put(("progress", rank, what))

        times_gemm = cfg["gemm_ranks"] == "all" or rank == 0
        k_in, n_out = cfg["shape"]
        reps, n_gemm, k_ops = cfg["reps"], cfg["gemm_reps"], cfg["comm_ops"]
        res: Dict[str, Any] = {"rank": rank, "times_gemm": times_gemm, "device": dev.info(),
                               "gemm": {}, "comm_alone": {}, "concurrent": {}, "plan": {},
                               "check_errors": []}

        # everything allocated and the GEMM graphs captured before the group exists
        phase = "GEMM set-up"
        gen = torch.Generator(device=dev.device)
        gen.manual_seed(1234 + rank)
        bf16 = torch.bfloat16
        w = torch.randn(k_in, n_out, generator=gen, device=dev.device, dtype=bf16) * 0.02
        xs = {b: torch.randn(b, k_in, generator=gen, device=dev.device, dtype=bf16)
              for b in cfg["batches"]}
        outs = {b: torch.empty(b, n_out, device=dev.device, dtype=bf16) for b in cfg["batches"]}
        cap, gemm_stream, comm_stream = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        graphs = {b: capture_graph(lambda b=b: torch.matmul(xs[b], w, out=outs[b]), n_gemm, cap)
                  for b in cfg["batches"]}
        bufs = {s: torch.zeros(max(1, s // 4), device=dev.device, dtype=torch.float32)
                for s in cfg["sizes"]}
        warm = torch.full((2,), float(rank + 1), device=dev.device)
        dev.synchronize()

        def ev():
            return torch.cuda.Event(enable_timing=True)

        def time_gemm(b: int) -> List[float]:
            samples = []
            for i in range(reps + 1):  # the first replay is not timed
                barrier()
                if not times_gemm:
                    continue
                e0, e1 = ev(), ev()
                e0.record(gemm_stream)
                with torch.cuda.stream(gemm_stream):
                    graphs[b].replay()
                e1.record(gemm_stream)
                e1.synchronize()
                if i:
                    samples.append(e0.elapsed_time(e1) * 1000.0 / n_gemm)
            return samples

        sleep = getattr(torch.cuda, "_sleep", None)

        def run_comm(g, m: int, with_gemm: Optional[int]):
            """m replays of graph g on the comm stream (and one GEMM replay at the same time):
            marks (ms) of the comm stream and the GEMM window, relative to a common start.
            Both streams wait for a start event behind a short spin kernel, so that everything
            is enqueued before either starts."""
            if sleep is not None:  # ~1 ms plus ~10 µs per replay to enqueue (at ~2 GHz)
                with torch.cuda.stream(gemm_stream):
                    sleep(cfg["gate_cycles"] + 20_000 * m)
            t0 = ev()
            t0.record(gemm_stream)
            window = None
            if with_gemm is not None:
                g0, g1 = ev(), ev()
                g0.record(gemm_stream)
                with torch.cuda.stream(gemm_stream):
                    graphs[with_gemm].replay()
                g1.record(gemm_stream)
            comm_stream.wait_event(t0)
            marks = [ev() for _ in range(m + 1)]
            marks[0].record(comm_stream)
            with torch.cuda.stream(comm_stream):
                for j in range(m):
                    g.replay()
                    marks[j + 1].record(comm_stream)
            marks[-1].synchronize()
            if with_gemm is not None:
                g1.synchronize()
                window = (t0.elapsed_time(g0), t0.elapsed_time(g1))
            gemm_stream.synchronize()
            return [t0.elapsed_time(x) for x in marks], window

        phase = "baseline"
        res["gemm"]["baseline"] = {str(b): time_gemm(b) for b in cfg["batches"]}
        progress("baseline")

        phase = "init_process_group"
        dist.init_process_group("resident", store=dist.PrefixStore("pg", store), rank=rank,
                                world_size=ws, timeout=datetime.timedelta(seconds=cfg["timeout"]))
        phase = "first all_reduce"
        def eager_all_reduce(what: str) -> None:
            """One checked eager all_reduce of `warm` (rank + 1 everywhere)."""
            warm.fill_(float(rank + 1))
            dist.all_reduce(warm)
            got = warm.cpu()  # synchronizes the current stream only
            if not bool((got == ws * (ws + 1) / 2).all()):
                res["check_errors"].append(f"{what}: got {got.tolist()}")

        eager_all_reduce("warm-up all_reduce")  # installs the CUDA path

        phase = "all_reduce graphs"
        comm_graphs = {}
        # the check of one replay: (rank+1) * 2^-e everywhere -> S1 * ws^(k-1) * 2^-e, exact
        # for a power-of-two ws; e keeps every value a normal float32
        growth = math.log2(ws * (ws + 1) / 2) + (k_ops - 1) * math.log2(max(ws, 1))
        e_scale = min(120, math.ceil(growth))
        checkable = growth - e_scale <= 120
        for s, buf in bufs.items():
            comm_graphs[s] = capture_graph(lambda buf=buf: dist.all_reduce(buf), k_ops, cap)
            buf.fill_((rank + 1) * 2.0 ** -e_scale)
            comm_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm_stream):
                comm_graphs[s].replay()
            comm_stream.synchronize()
            expect = ws * (ws + 1) / 2 * float(ws) ** (k_ops - 1) * 2.0 ** -e_scale
            got = buf.cpu()
            if checkable and not bool(((got - expect).abs() <= 1e-5 * expect).all()):
                res["check_errors"].append(f"all_reduce graph of {k_ops} x {s} B: got "
                                           f"{got[:4].tolist()}..., expected {expect!r}")
            buf.zero_()  # the timed replays add zeros
        torch.cuda.current_stream().synchronize()
        progress("captured")

        phase = "all_reduce alone"
        for s, g in comm_graphs.items():
            samples = []
            for i in range(reps + 1):
                barrier()
                marks, _ = run_comm(g, cfg["comm_replays_alone"], None)
                if i:
                    samples.append((marks[-1] - marks[0]) * 1000.0 / (len(marks) - 1) / k_ops)
            res["comm_alone"][str(s)] = samples
        progress("all_reduce alone")

        phase = "alone"
        res["gemm"]["alone"] = {}
        for b in cfg["batches"]:
            # One checked eager all_reduce before each batch (not timed).
            eager_all_reduce(f"all_reduce before alone batch {b}")
            res["gemm"]["alone"][str(b)] = time_gemm(b)
        progress("alone")

        for s, g in comm_graphs.items():
            cond = f"concurrent {common.fmt_size(s)}"
            res["gemm"][cond] = {}
            res["concurrent"][str(s)] = {}
            for b in cfg["batches"]:
                phase = f"{cond} batch {b}"
                # plan: replays to cover the GEMM window, the largest over ranks
                gw = max(stats(res["gemm"]["alone"][str(b)])["median"] * n_gemm, 1.0) \
                    if times_gemm else 1.0
                cr = stats(res["comm_alone"][str(s)])["median"] * k_ops
                bstore.set(f"plan/{s}/{b}/{rank}", str(plan_replays(gw, cr)))
                keys = [f"plan/{s}/{b}/{r}" for r in range(ws)]
                bstore.wait(keys, datetime.timedelta(seconds=cfg["timeout"]))
                m = max(int(bstore.get(k)) for k in keys)
                res["plan"][f"{s}/{b}"] = m
                gemm_s, per_op, cov = [], [], []
                for i in range(reps + 1):
                    barrier()
                    marks, window = run_comm(g, m, b if times_gemm else None)
                    if not i:
                        continue
                    if window is None:  # this rank does not time the GEMM
                        per_op.append((marks[-1] - marks[0]) * 1000.0 / m / k_ops)
                        continue
                    st = window_stats(marks, window[0], window[1], k_ops)
                    gemm_s.append((window[1] - window[0]) * 1000.0 / n_gemm)
                    per_op.append(st["per_op_us"])
                    cov.append(st["coverage"])
                if times_gemm:
                    res["gemm"][cond][str(b)] = gemm_s
                res["concurrent"][str(s)][str(b)] = {"per_op_us": per_op,
                                                     "coverage": cov or [1.0]}
            got = bufs[s].cpu()
            if bool((got != 0).any()):
                res["check_errors"].append(f"{cond}: sums of zeros are not zero: {got[:4].tolist()}")
            progress(cond)
        barrier()
        q.put(("result", rank, res))
        phase = "destroy_process_group"
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("fatal", rank, f"[{phase}] {type(e).__name__}: {e}\n" + traceback.format_exc(limit=8)))
        try:
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
        raise SystemExit(1)
