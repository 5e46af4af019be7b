"""The command line of resident_pg.bench: ``python -m resident_pg.bench [options]``.

A thin front end: the options become a plan (ladder.make_plan), ladder.run measures and prints
it, report.write_json writes the document. benchmarks/conftest.py runs the same plan from pytest.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Tuple

from . import common, ladder, rank, report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m resident_pg.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Latency ladder of torch.distributed collectives for several backends side by side.\n"
            "One set of rank processes per (world size, backend) runs all ops and sizes;\n"
            "backends alternate within each world size.  Reported: µs per op, median over\n"
            "repetitions, max over ranks (p10/p90 likewise), plus ratios to --baseline."),
        epilog=(
            "sizes: all_reduce = tensor; all_to_all_single = per-rank buffer;\n"
            "all_gather_into_tensor = gathered output; reduce_scatter_tensor = input;\n"
            "send_recv = message (ping-pong rank 0 <-> 1, one-way time = round trip / 2).\n"
            "float32; tiny sizes are rounded up to one element per rank (marked * in the\n"
            "table).  A table entry is the median over repetitions of (batch time / ops in\n"
            "the batch), max over ranks; --rounds N repeats whole groups.\n\n"
            "The bench changes no backend setting: RESIDENT_* variables of the environment are\n"
            "passed to the ranks as they are (use --env to add some) and recorded in the JSON.\n\n"
            "examples:\n"
            "  python -m resident_pg.bench                       # full default run (~3-5 min)\n"
            "  python -m resident_pg.bench --quick               # short run, 2 ranks\n"
            "  python -m resident_pg.bench --backends gloo --world-sizes 2 --ops all_reduce\n"
            "  python -m resident_pg.bench --json out.json --env RESIDENT_PATH=proxy\n"
            "  python -m resident_pg.bench --device cuda --floors floors.json --json c.json\n"
            "      # GPU: resident direct vs proxy path, eager and graph modes, ratios to\n"
            "      # the floors of benchmarks/floors (run under MPS when ranks share a GPU)\n"
            "  python -m resident_pg.bench --device cuda --mode graph --world-sizes 2 \\\n"
            "      --backends resident,resident:transport=tcp \\\n"
            "      --floors floors.json --floors tcp_floors.json   # the tcp path beside shm\n"
            "  python -m resident_pg.bench --backends resident:transport=tcp,gloo \\\n"
            "      --floors tcp_floors.json    # CPU tensors over tcp: ratio to the tcp floor\n"
            "  torchrun --nnodes 2 --node-rank I --nproc-per-node 1 --master-addr HOST0 \\\n"
            "      -m resident_pg.bench --backends resident,gloo   # on each of two hosts\n\n"
            "Under a launcher (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun\n"
            "does) the bench spawns nothing: the launcher's processes are the ranks, of its one\n"
            "world size, across its hosts; rank 0 prints and writes --json.  CUDA: the GPU of\n"
            "LOCAL_RANK.  gloo needs GLOO_SOCKET_IFNAME where a host's name does not resolve to\n"
            "an address its peers reach.  Their tcp floor: tcp_floor --listen PORT on one host,\n"
            "tcp_floor --connect HOST:PORT --json tcp_floors.json on the other (its tcp_hosts\n"
            "rows take precedence over loopback's in --floors).\n"
))
    g = p.add_argument_group("what to run")
    g.add_argument("--backends", default=None, metavar="LIST",
                   help="comma list of torch.distributed backends, run in this order for each "
                        "world size (a name may repeat); NAME:key=value passes pg_options "
                        "{key: value} to that group, NAME:KEY=VALUE (upper case) sets an "
                        f"environment variable in its ranks [{common.DEFAULT_BACKENDS}; "
                        f"--device cuda: {common.DEFAULT_CUDA_BACKENDS}]")
    g.add_argument("--world-sizes", default=None, metavar="LIST",
                   help=f"comma list of rank counts [{common.DEFAULT_WORLD_SIZES}; "
                        f"--quick: {common.QUICK_WORLD_SIZES}]")
    g.add_argument("--sizes", default=None, metavar="LIST",
                   help=f"comma list of message sizes in bytes, K/M suffixes are binary "
                        f"[{common.DEFAULT_SIZES}; --quick: {common.QUICK_SIZES}, "
                        f"cuda {common.QUICK_SIZES_CUDA}]")
    g.add_argument("--ops", default="all", metavar="LIST",
                   help=f"comma list of ops, or 'all' [all = {', '.join(common.ALL_OPS)}]")
    g.add_argument("--device", default="cpu", choices=sorted(rank.DEVICES),
                   help="where the buffers live [%(default)s]")
    g.add_argument("--mode", default=None, metavar="LIST",
                   help="comma list of ways batches of ops are issued: eager (back-to-back "
                        "calls), graph (one CUDA graph of the batch, replayed; cuda only); "
                        "several modes run as separate groups "
                        f"[cpu: {common.DEFAULT_MODES['cpu']}; "
                        f"cuda: {common.DEFAULT_MODES['cuda']}]")
    g.add_argument("--baseline", default=None, metavar="LABEL",
                   help="backend label that ratios are computed against [cpu: gloo, else the "
                        "first backend; cuda: none]")
    g.add_argument("--floors", metavar="PATH", action="append",
                   help="floors JSON of benchmarks/floors/build/floors --json and/or "
                        "build/tcp_floor --json (repeat the option for both; their results are "
                        "pooled): cuda rows get median / floor (8 B: cross-process flag floor; "
                        "larger: SM data floor at that size; over tcp: that plus the tcp "
                        "one-way floor at that size), cpu rows over tcp median / tcp one-way "
                        "floor, and the targets are evaluated; the files go into the JSON "
                        "metadata")
    g.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="extra module to import in the ranks before init (for other plugin "
                        "backends; 'resident' imports resident_pg by itself); may repeat")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", type=_kv,
                   help="set an environment variable for the rank processes (e.g. "
                        "RESIDENT_...); may repeat")
    t = p.add_argument_group("timing")
    t.add_argument("--quick", action="store_true",
                   help="short run: fewer sizes, world size 2, fewer/shorter repetitions "
                        "(explicit options win)")
    t.add_argument("--iters", type=float, default=None, metavar="SCALE",
                   help="scale of the ops per repetition and of the per-cell time budget "
                        "[1.0; --quick: 0.3]")
    t.add_argument("--reps", type=int, default=None, metavar="N",
                   help="timed repetitions (batches) per cell; slow cells use fewer, "
                        "never under --min-reps [21; --quick: 7]")
    t.add_argument("--min-reps", type=int, default=5, metavar="N",
                   help="fewest repetitions of a slow cell [%(default)s]")
    t.add_argument("--warmup", type=int, default=4, metavar="N",
                   help="single timed warm-up ops per cell, used to plan the batch; one "
                        "untimed batch follows [%(default)s]")
    t.add_argument("--rep-ms", type=float, default=None, metavar="MS",
                   help="target duration of one repetition, times --iters [10; cuda: 3]")
    t.add_argument("--cell-s", type=float, default=None, metavar="S",
                   help="time budget of the timed part of one cell, times --iters "
                        "[1.0; cuda: 0.3]")
    t.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="most ops in one repetition (cuda graph: ops in the graph) "
                        "[2000; cuda: 500]")
    t.add_argument("--graph-min-batch", type=int, default=200, metavar="N",
                   help="fewest ops captured into one graph (mode graph), so that the "
                        "replay's launch + synchronize is amortized; fewer for slow ops (at "
                        "most 4x --rep-ms of eager-estimated time per graph) [%(default)s]")
    t.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="launch every (world size, backend) group N times, alternating "
                        "backends (A B A B ...); a table entry is then the median over "
                        "rounds of the per-round medians, and the table shows the range "
                        "of the round medians.  Catches run-to-run (e.g. process "
                        "placement) effects that repetitions inside one run cannot "
                        "[%(default)s]")
    t.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the per-cell correctness check")
    o = p.add_argument_group("robustness and output")
    o.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds without progress before a group is killed (at least 60 "
                        "during start-up); the store/process-group timeout is the larger "
                        "of this and 60 [%(default)s]")
    o.add_argument("--max-restarts", type=int, default=2, metavar="N",
                   help="relaunches of a group after a crash/hang, skipping the op that "
                        "failed [%(default)s]")
    o.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="launch no new group after S seconds of bench time; groups not run "
                        "are reported as such (for runs with a hard wall-clock limit)")
    o.add_argument("--json", metavar="PATH", help="write all results and metadata here")
    o.add_argument("--spread", action=argparse.BooleanOptionalAction, default=True,
                   help="show p10-p90 columns in the tables [on]")
    return p


def _kv(text: str) -> Tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k, v


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = ladder.make_plan(args)
    except ValueError as e:
        parser.error(str(e))
    doc = ladder.run(plan, argv)
    if doc is not None and args.json:   # None: a launched rank other than 0
        report.write_json(doc, args.json)
    return 0
