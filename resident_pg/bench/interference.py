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
import multiprocessing as mp
import queue as queue_mod
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .interference_rank import rank_main
from .interference_report import format_table, summarize, write_json

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
# option parsing (tested on the CPU: tests/test_bench_interference.py)
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
        config = {**cfg_base, "ws": args.ws, "modes": args.modes,
                  "mode_env": {m: MODES[m] for m in args.modes}, "time_limit_s": args.time_limit}
        write_json(args.json, config, rows, launches, errors, total, gpu, argv, torch.__version__)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
