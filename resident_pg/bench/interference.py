"""Interference benchmark: how much a communicator slows a concurrent compute kernel, per mode.

Run as ``python -m resident_pg.bench.interference`` (needs CUDA; the ranks share the GPUs as in
``resident_pg.bench --device cuda``: rank r on GPU ``r % device_count``, so several ranks on
one GPU need the MPS daemon).

For each mode (``default``: the configuration the environment gives; ``proxy``: the same with
RESIDENT_PATH=proxy, every write through the spinning proxy thread) one set of ``--ws`` rank
processes is spawned (rendezvous through a TCPStore hosted by this process, as
resident_pg.bench).  Each rank times a bf16 decode-shaped GEMM
``x[batch, K] @ W[K, N]`` (default K=4096, N=14336), ``--gemm-reps`` of them captured into one
CUDA graph; one sample = one replay timed with CUDA events / gemm-reps; reported: median (p10,
p90) over ``--reps`` replays, max over the ranks that time the GEMM (``--gemm-ranks``).  All
ranks start each replay together (a barrier through the store).  Conditions, in this order:

* ``baseline``: before the process group exists (no CUDA path);
* ``alone``: the group exists and its CUDA path is installed (one eager all_reduce before each
  batch, not timed), no communication during the timing;
* ``concurrent SIZE``: a second stream on every rank replays graphs of ``--comm-ops``
  back-to-back all_reduces (SUM, float32, SIZE bytes) over the whole GEMM replay (the replay
  count is planned from the alone timings so that the communication covers the GEMM window;
  ``overlap`` reports the covered fraction).  ``all_reduce µs``: per-op latency from the
  communication graphs that ran entirely inside the GEMM window (all of them if none did);
  ``alone µs``: the same all_reduce graphs timed without the GEMM.

``vs baseline`` is the GEMM median of the condition / the baseline median of the same rank
and launch (max over ranks).  After the group exists, only streams and events are synchronized
(graphs are captured without torch.cuda.graph's device-wide synchronize), so that each timing
waits for the work it measures and nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

from . import common, cuda, report
from . import rank as rank_side

SCHEMA = "resident_pg.bench_interference/1"
# Settings each mode adds to the rank processes' environment.
MODES = {
    "default": {},
    "proxy": {"RESIDENT_PATH": "proxy"},
}
DEFAULT_MODES = "default"
DEFAULT_BATCHES = "1,8,64"
DEFAULT_SIZES = "8,64K"
DEFAULT_SHAPE = "4096x14336"
NO_CUDA_EXIT = 2
GATE_CYCLES = 2_000_000  # the spin kernel that holds both streams while they are filled (~1 ms)


# --------------------------------------------------------------------------
# pure helpers (tested on the CPU: tests/test_bench_interference.py)
# --------------------------------------------------------------------------


def parse_shape(text: str):
    """'4096x14336' -> (4096, 14336): K (hidden) and N (output features) of the GEMM."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"bad shape {text!r} (expected KxN, e.g. {DEFAULT_SHAPE})") from None
    if k < 1 or n < 1:
        raise ValueError(f"bad shape {text!r}: K and N must be >= 1")
    return k, n


def parse_modes(text: str) -> List[str]:
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        if not t:
            continue
        if t not in MODES:
            raise ValueError(f"unknown mode {t!r}; choose from {', '.join(MODES)}")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("no modes given")
    return out


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


def stats(samples: Sequence[float]) -> Dict[str, float]:
    return {"median": common.percentile(samples, 50), "p10": common.percentile(samples, 10),
            "p90": common.percentile(samples, 90)}


def condition_names(sizes: Sequence[int]) -> List[str]:
    return ["baseline", "alone"] + [f"concurrent {common.fmt_size(s)}" for s in sizes]


def summarize(mode: str, per_rank: Dict[int, dict], batches: Sequence[int],
              sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per (condition, batch) of one mode from the ranks' raw results: GEMM median /
    p10 / p90 (max over the ranks that timed it), slowdown vs the baseline (max over ranks of
    the per-rank ratio), all_reduce latency concurrent and alone (max over ranks), the lowest
    overlap over ranks and replays, and whether every check passed."""
    rows = []
    timed = {r: v for r, v in per_rank.items() if v.get("times_gemm")}
    for cond in condition_names(sizes):
        size = None if not cond.startswith("concurrent") else sizes[condition_names(sizes).index(cond) - 2]
        for b in batches:
            row: Dict[str, Any] = {"mode": mode, "condition": cond, "batch": b, "size_bytes": size}
            meds, p10s, p90s, ratios, comm, alone, covs = [], [], [], [], [], [], []
            for r, v in timed.items():
                g = v["gemm"].get(cond, {}).get(str(b))
                base = v["gemm"].get("baseline", {}).get(str(b))
                if not g:
                    continue
                s = stats(g)
                meds.append(s["median"])
                p10s.append(s["p10"])
                p90s.append(s["p90"])
                if base:
                    ratios.append(s["median"] / stats(base)["median"])
            for r, v in per_rank.items():
                if size is None:
                    continue
                c = v.get("concurrent", {}).get(str(size), {}).get(str(b))
                if c:
                    comm.append(stats(c["per_op_us"])["median"])
                    covs.append(min(c["coverage"]))
                a = v.get("comm_alone", {}).get(str(size))
                if a:
                    alone.append(stats(a)["median"])
            if meds:
                row.update(gemm_median_us=max(meds), gemm_p10_us=max(p10s), gemm_p90_us=max(p90s))
            if ratios:
                row["vs_baseline"] = max(ratios)
            if comm:
                row["allreduce_us"] = max(comm)
                row["overlap_min"] = min(covs)
            if alone:
                row["allreduce_alone_us"] = max(alone)
            row["check"] = "ok" if all(not v.get("check_errors") for v in per_rank.values()) else "FAILED"
            rows.append(row)
    return rows


def format_table(rows: Sequence[Dict[str, Any]], title: str) -> str:
    """The rows as a text table (blank line between modes), with a legend."""
    fmt = common.fmt_us
    head = ["mode", "condition", "batch", "GEMM µs", "p10-p90", "vs baseline", "all_reduce µs",
            "alone µs", "overlap"]
    lines, notes = [], set()
    for r in rows:
        mark = ""
        if r.get("check") not in (None, "ok"):
            mark = "!"
            notes.add("!")
        if "overlap_min" in r and r["overlap_min"] < 0.95:
            notes.add("~")
        lines.append([
            r["mode"], r["condition"], r["batch"],
            (fmt(r["gemm_median_us"]) + mark) if "gemm_median_us" in r else "-",
            f"{fmt(r['gemm_p10_us'])}-{fmt(r['gemm_p90_us'])}" if "gemm_p10_us" in r else "",
            f"{r['vs_baseline']:.3f}x" if "vs_baseline" in r else "-",
            fmt(r["allreduce_us"]) if "allreduce_us" in r else "",
            fmt(r["allreduce_alone_us"]) if "allreduce_alone_us" in r else "",
            (f"{r['overlap_min'] * 100:.0f}%" + ("~" if r["overlap_min"] < 0.95 else ""))
            if "overlap_min" in r else "",
        ])
    out = io.StringIO()
    print(f"\n== {title}", file=out)
    report.print_table(head, lines, "", out)
    if "!" in notes:
        print("  ! a correctness check FAILED in this launch (see errors)", file=out)
    if "~" in notes:
        print("  ~ the all_reduces covered less than 95% of some GEMM replay", file=out)
    return out.getvalue()


# --------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------


def launch(mode: str, cfg: Dict[str, Any], ws: int, timeout_s: float) -> Dict[str, Any]:
    """Spawn the ranks of one mode; results by rank, or the error that stopped them."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg["timeout"]))
    q = ctx.Queue()
    t0 = time.time()
    procs = [ctx.Process(target=rank_main, name=f"interference-{mode}-r{r}",
                         args=(r, ws, store.port, cfg, q)) for r in range(ws)]
    for p in procs:
        p.start()
    results: Dict[int, dict] = {}
    errors: List[str] = []
    last = time.time()
    last_what = "start-up"
    while len(results) < ws:
        try:
            msg = q.get(timeout=0.5)
        except queue_mod.Empty:
            msg = None
        now = time.time()
        if msg is not None:
            last = now
            kind, rank = msg[0], msg[1]
            if kind == "progress":
                last_what = msg[2]
                if rank == 0:
                    common._log(f"  [{mode}] {msg[2]} ({now - t0:.1f} s)")
            elif kind == "result":
                results[rank] = msg[2]
            elif kind == "fatal":
                errors.append(f"rank {rank}: {msg[2]}")
            continue
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
        if errors or dead:
            time.sleep(1.0)
            while True:
                try:
                    m = q.get_nowait()
                except queue_mod.Empty:
                    break
                if m[0] == "fatal":
                    errors.append(f"rank {m[1]}: {m[2]}")
            if not errors:
                errors.append(", ".join(f"rank {r} exited with code {procs[r].exitcode}" for r in dead))
            break
        if now - last > timeout_s:
            errors.append(f"no progress for {timeout_s:.0f} s after {last_what!r}")
            break
    for r, p in enumerate(procs):
        p.join(timeout=15.0 if not errors else 1.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)
            if not errors:
                errors.append(f"rank {r} did not exit within 15 s of its result "
                              f"(destroy_process_group or the exit hung)")
        elif p.exitcode != 0 and not errors:
            errors.append(f"rank {r} exited with code {p.exitcode} after its result")
    while True:  # a failure after the result (destroy_process_group)
        try:
            m = q.get_nowait()
        except (queue_mod.Empty, OSError, ValueError):
            break
        if m[0] == "fatal":
            errors.append(f"rank {m[1]}: {m[2]}")
    q.close()
    q.cancel_join_thread()
    del store
    return {"mode": mode, "results": results, "errors": errors, "wall_s": time.time() - t0,
            "exitcodes": [p.exitcode for p in procs]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m resident_pg.bench.interference",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Slowdown a resident communicator causes to a concurrent bf16 decode GEMM, per mode\n"
            "(default: the environment's configuration; proxy: RESIDENT_PATH=proxy).\n"
            "Conditions: baseline (no process group), alone (CUDA path installed, no\n"
            "communication), concurrent SIZE (all_reduce graphs on a second stream during the\n"
            "GEMM).  Needs CUDA; ranks sharing one GPU need the MPS daemon."),
        epilog=(
            "examples:\n"
            "  python -m resident_pg.bench.interference                  # 2 ranks, default mode\n"
            "  python -m resident_pg.bench.interference --modes default,proxy\n"
            "  python -m resident_pg.bench.interference --batches 1 --sizes 8 --reps 11\n"
            "  python -m resident_pg.bench.interference --json interference.json\n"))
    p.add_argument("--ws", type=int, default=2, help="ranks [%(default)s]")
    p.add_argument("--batches", default=DEFAULT_BATCHES, metavar="LIST",
                   help="GEMM batch sizes (rows of x) [%(default)s]")
    p.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LIST",
                   help="all_reduce sizes of the concurrent conditions, bytes, K/M binary "
                        "[%(default)s]")
    p.add_argument("--modes", default=DEFAULT_MODES, metavar="LIST",
                   help=f"modes, in this order [%(default)s; known: {', '.join(MODES)}]")
    p.add_argument("--shape", default=DEFAULT_SHAPE, metavar="KxN",
                   help="GEMM x[batch, K] @ W[K, N] [%(default)s]")
    p.add_argument("--reps", type=int, default=21, metavar="R",
                   help="timed replays per condition (and batch) [%(default)s]")
    p.add_argument("--gemm-reps", type=int, default=50, metavar="N",
                   help="GEMMs captured into one graph (one replay = one sample) [%(default)s]")
    p.add_argument("--comm-ops", type=int, default=8, metavar="K",
                   help="all_reduces captured into one communication graph [%(default)s]")
    p.add_argument("--comm-replays-alone", type=int, default=20, metavar="M",
                   help="communication graph replays per sample of the alone all_reduce "
                        "latency [%(default)s]")
    p.add_argument("--gemm-ranks", choices=("all", "0"), default="all",
                   help="ranks that run and time the GEMM (the others only communicate) "
                        "[%(default)s]")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds without progress before a launch is killed [%(default)s]")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="launch no new mode after S seconds (modes not run are reported)")
    p.add_argument("--json", metavar="PATH", help="write rows, raw samples and metadata here")
    return p


def parse_args(argv: Optional[Sequence[str]] = None):
    """Parsed and validated options (argparse exits with code 2 on an error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.batches = common.parse_int_list(args.batches, "batch")
        args.sizes = common.parse_sizes(args.sizes)
        args.modes = parse_modes(args.modes)
        args.shape = parse_shape(args.shape)
        if args.ws < 1 or any(b < 1 for b in args.batches):
            raise ValueError("--ws and the batches must be >= 1")
        if args.reps < 1 or args.gemm_reps < 1 or args.comm_ops < 1 or args.comm_replays_alone < 1:
            raise ValueError("--reps, --gemm-reps, --comm-ops and --comm-replays-alone must be >= 1")
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("resident_pg.bench.interference needs CUDA: torch.cuda.is_available() is False "
              "(a GPU, a CUDA build of torch and, for several ranks on one GPU, the MPS daemon)",
              file=sys.stderr)
        return NO_CUDA_EXIT
    cfg_base = {"batches": args.batches, "sizes": args.sizes, "shape": args.shape,
                "reps": args.reps, "gemm_reps": args.gemm_reps, "comm_ops": args.comm_ops,
                "comm_replays_alone": args.comm_replays_alone, "gemm_ranks": args.gemm_ranks,
                "timeout": max(args.timeout, 60.0), "gate_cycles": GATE_CYCLES}
    common._log(f"resident_pg.bench.interference: {args.ws} ranks, modes {args.modes}, batches "
               f"{args.batches}, all_reduce sizes {[common.fmt_size(s) for s in args.sizes]}, "
               f"GEMM [b,{args.shape[0]}]x[{args.shape[0]},{args.shape[1]}] bf16")
    t_run = time.time()
    launches, rows, errors = [], [], []
    for mode in args.modes:
        if args.time_limit is not None and time.time() - t_run > args.time_limit:
            msg = f"not run (--time-limit {args.time_limit:g} s reached)"
            launches.append({"mode": mode, "results": {}, "errors": [msg], "wall_s": 0.0})
            errors.append({"mode": mode, "error": msg})
            common._log(f"[{mode}] skipped: --time-limit reached")
            continue
        common._log(f"[{mode}] launching {args.ws} ranks ...")
        cfg = dict(cfg_base, env=dict(MODES[mode]))
        res = launch(mode, cfg, args.ws, args.timeout)
        launches.append(res)
        for e in res["errors"]:
            errors.append({"mode": mode, "error": e})
            common._log(f"[{mode}] ERROR: {e.rstrip()}")
        for r, v in sorted(res["results"].items()):
            for e in v.get("check_errors", []):
                errors.append({"mode": mode, "rank": r, "error": e})
                common._log(f"[{mode}] rank {r}: {e}")
        if len(res["results"]) == args.ws:
            rows += summarize(mode, res["results"], args.batches, args.sizes)
        common._log(f"[{mode}] wall {res['wall_s']:.1f} s")
    total = time.time() - t_run

    gpu = next((v["device"] for ln in launches for v in ln["results"].values()), None)
    title = (f"interference, {args.ws} ranks ({(gpu or {}).get('name', '?')}, "
             f"{'all ranks' if args.gemm_ranks == 'all' else 'rank 0'} timing): bf16 GEMM "
             f"[b,{args.shape[0]}]x[{args.shape[0]},{args.shape[1]}], {args.gemm_reps} per graph; "
             f"µs per GEMM, median over {args.reps} replays, max over ranks; all_reduce µs per "
             f"op (float32 SUM, graphs of {args.comm_ops})")
    print(format_table(rows, title), end="")
    if errors:
        print(f"\n{len(errors)} problem(s):")
        for e in errors:
            print(f"  {e['mode']}{' rank ' + str(e['rank']) if 'rank' in e else ''}: "
                  f"{e['error'].strip().splitlines()[0]}")
    print(f"\ntotal {total:.1f} s")
    sys.stdout.flush()
    if args.json:
        doc = {
            "schema": SCHEMA,
            "metadata": {
                "hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                "platform": platform.platform(), "python": sys.version.split()[0],
                "torch_version": torch.__version__, "gpu": gpu,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "git": report._git_info(), "loadavg": report._loadavg(),
                "command_line": [sys.executable, "-m", "resident_pg.bench.interference"] + argv,
                "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RESIDENT_")},
                "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
            },
            "config": {**{k: v for k, v in cfg_base.items()}, "ws": args.ws, "modes": args.modes,
                       "mode_env": {m: MODES[m] for m in args.modes}, "time_limit_s": args.time_limit,
                       "statistic": "GEMM: per rank, median/p10/p90 over replays of (replay time / "
                                    "gemm_reps), max over ranks; vs_baseline: max over ranks of "
                                    "the per-rank median ratio; all_reduce: max over ranks of "
                                    "the per-rank median"},
            "results": rows,
            "launches": [{**ln, "results": {str(r): v for r, v in ln["results"].items()}}
                         for ln in launches],
            "errors": errors,
            "total_s": total,
        }
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=True)
        os.replace(tmp, args.json)
        common._log(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
