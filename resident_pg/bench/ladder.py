"""Latency ladder benchmark for torch.distributed backends (resident vs gloo, ...).

Run as ``python -m resident_pg.bench`` (cli.py parses the options) or through pytest
(benchmarks/conftest.py); both build a plan with make_plan and run it with run.

Under a launcher (torchrun; launched.py) the launcher's processes are the ranks, across its
hosts, and nothing is spawned.  Otherwise, for every world size and every backend, one set of
rank processes is spawned
(multiprocessing "spawn", rendezvous through a TCPStore hosted by this parent
process on 127.0.0.1 with an OS-chosen free port).  That set runs the whole
ladder (all ops x all sizes) so the start-up cost is paid once per
(world size, backend).  Backends alternate within one world size, so that all
backends are measured under the same machine conditions in one run.

Timing method, per (op, size) "cell":
  * a store barrier aligns all ranks;
  * one correctness check of the op with known values;
  * a few single timed warm-up ops; rank 0 derives from them a batch count
    (ops per timed repetition) and a repetition count, so that each repetition
    lasts about ``--rep-ms`` x ``--iters`` and a cell stays within a time
    budget; all ranks read the plan from the store so they issue the same
    number of ops;
  * one untimed batch, then R timed batches of back-to-back ops with
    time.perf_counter_ns; one sample = batch time / batch count;
  * per rank: median, p10, p90 over the R samples; reported value: the maximum
    over ranks of each per-rank statistic.
send/recv is a ping-pong between ranks 0 and 1 (other ranks idle); reported
time is one-way = round trip / 2.  ``--rounds N`` launches every group N times
(backends alternating) and reports the median over rounds, for effects that
last a whole run (process placement, back-off state of a backend).

A failing backend or op is reported and the run goes on: an exception in an op
is recorded for that cell and the op is skipped for larger sizes; a rank that
dies or a group that makes no progress for ``--timeout`` seconds is killed and
relaunched without the op it was in.  Each cell first checks the op's result
with known values (``--no-check`` skips it); a wrong result is flagged, not fatal.

The bench sets no environment variable and no torch setting that could change
a backend's behaviour; RESIDENT_* (and any other) variables in the environment
are inherited by the rank processes, and ``--env KEY=VALUE`` adds some.

Devices and modes (``DEVICES``, ``MODES`` in rank.py): "cpu" + "eager" is the CPU ladder.
``--device cuda`` (cuda.py) puts the buffers on GPU
``rank % device_count`` and synchronizes the current stream around timed regions; in mode
"eager" a repetition is `batch` back-to-back calls then one synchronize, in
mode "graph" the `batch` calls are captured once into one CUDA graph and a
repetition is one replay plus a synchronize (per op = replay time / batch).
In graph mode the correctness check is also captured and replayed (twice,
fresh inputs) so that ops which a graph does not really capture fail the check.
``--mode eager,graph`` runs both, as separate groups.  The op builders allocate
only through the device object.

Backend variants: ``--backends NAME[:KEY=VALUE...]``, e.g. ``resident:path=proxy``;
lower-case keys go to the group as ``pg_options`` ({"path": "proxy"}), upper-case
keys (``resident:RESIDENT_PATH=proxy``) are set in that group's rank processes'
environment.  Without a baseline (cuda: there is none, NCCL cannot run two
ranks on one GPU), ``--floors floors.json`` gives each cuda row its ratio to the
physical floor (benchmarks/floors) and the run prints the CUDA targets.  Rows over
tcp (``resident:transport=tcp``, or RESIDENT_TRANSPORT=tcp) are held to the tcp
floors (``--floors tcp_floors.json``, from benchmarks/floors/build/tcp_floor; the
option repeats, the files' results are pooled): CUDA tensors to the GPU floor plus
the tcp one-way floor at that size, CPU tensors to the tcp one-way floor.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

from ..doctor import MPS_START, mps_pipe
from . import common, launched, report
from . import cuda as cuda_side
from . import rank as rank_side

_log, fmt_size = common._log, common.fmt_size


# --------------------------------------------------------------------------
# parent side: launching groups
# --------------------------------------------------------------------------

class GroupRun(common.GroupRecord):
    """Runs the ladder for one (world size, backend), relaunching after a crash or hang."""

    def run(self) -> None:
        pending = list(self.cells)
        failed_ops = set()
        for attempt in range(self.args.max_restarts + 1):
            pending = [c for c in pending if c[0] not in self.results
                       and c[0] not in self.cell_errors and c[1] not in failed_ops]
            if not pending:
                return
            info = self._launch(pending, attempt)
            self.launches.append(info)
            for cid in self.cell_errors:
                failed_ops.add(self._cell(cid)[1])
            if info["status"] == "ok":
                return
            stuck = info.get("in_progress")
            if stuck is None:
                # failed before any cell ran (import, init, ...): no point retrying
                return
            failed_ops.add(self._cell(stuck)[1])
            self.cell_errors.setdefault(stuck, {})[-1] = info["error"]
            _log(f"  [ws={self.ws} {self.label}] {info['error'].splitlines()[0]}; "
                 f"relaunching without op {self._cell(stuck)[1]}")

    def _cell(self, cid):
        for c in self.cells:
            if c[0] == cid:
                return c
        raise KeyError(cid)

    def _launch(self, cells, attempt) -> dict:
        import torch.distributed as dist
        ctx = mp.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, None, True,
                              timeout=datetime.timedelta(seconds=self.cfg["timeout"]),
                              wait_for_workers=False)
        q = ctx.Queue()
        t0 = time.time()
        procs = []
        for r in range(self.ws):
            p = ctx.Process(target=rank_side.rank_main,
                            name=f"bench-{self.backend}-ws{self.ws}-r{r}",
                            args=(r, self.ws, self.backend, store.port, cells, self.cfg, q))
            p.start()
            procs.append(p)
        info: Dict[str, Any] = {"attempt": attempt, "cells": len(cells), "status": "ok"}
        done, exited, in_progress = set(), set(), None
        last = time.time()
        fatal: Dict[int, str] = {}
        while True:
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                msg = None
            now = time.time()
            if msg is not None:
                last = now
                kind, rank = msg[0], msg[1]
                self.take(rank, msg)
                if kind == "ready" and rank == 0:
                    info["startup_s"] = now - t0
                elif kind == "start":
                    in_progress = msg[2]
                elif kind == "done":
                    done.add(rank)
                    if len(done) == self.ws:
                        in_progress = None
                        info["ladder_s"] = now - t0
                elif kind == "exited":
                    exited.add(rank)
                elif kind == "fatal":
                    fatal[rank] = msg[2]
                continue
            if len(exited) == self.ws and all(not p.is_alive() for p in procs):
                break
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if fatal or dead:
                # give the others a moment to report too, then stop the group
                grace = time.time() + 2.0
                while time.time() < grace:
                    try:
                        m = q.get(timeout=0.2)
                        self.take(m[1], m)
                        if m[0] == "fatal":
                            fatal[m[1]] = m[2]
                        elif m[0] == "done":
                            done.add(m[1])
                    except queue_mod.Empty:
                        pass
                if len(done) == self.ws:
                    # ladder finished, only tear-down failed: keep the results
                    info["status"] = "teardown_error"
                    in_progress = None
                else:
                    info["status"] = "crashed"
                if fatal:
                    r0 = min(fatal)
                    info["error"] = f"rank {r0}: {fatal[r0]}"
                else:
                    info["error"] = ", ".join(f"rank {procs.index(p)} exited with code {p.exitcode}"
                                              for p in dead)
                break
            if len(done) == self.ws and now - last > 15:
                info["status"] = "teardown_error"
                info["error"] = "destroy_process_group did not return within 15 s"
                break
            limit = self.args.timeout if "startup_s" in info else max(self.args.timeout, 60.0)
            if now - last > limit:
                info["status"] = "timeout"
                where = (f" in {self._cell(in_progress)[1]} {fmt_size(self._cell(in_progress)[2])}"
                         if in_progress is not None else
                         (" during start-up" if "startup_s" not in info else ""))
                info["error"] = f"no progress for {limit:.0f} s{where}"
                break
        for p in procs:
            if p.is_alive():
                p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        q.close()
        q.cancel_join_thread()
        del store
        info["wall_s"] = time.time() - t0
        info["in_progress"] = in_progress
        if info["status"] != "ok" and in_progress is None:
            # (an error inside a cell is reported with that cell instead)
            self.errors.append({"attempt": attempt, "status": info["status"],
                                "error": info.get("error", "")})
        return info


# per-device defaults of the timing options (cpu: as always; cuda: ~4 min for the default
# ladder of 2 paths x 2 modes x 3 world sizes on one H200, see scripts/device_run.sh)
TIMING_DEFAULTS = {
    "cpu": {"reps": 21, "rep_ms": 10.0, "cell_s": 1.0, "max_batch": 2000},
    "cuda": {"reps": 21, "rep_ms": 3.0, "cell_s": 0.3, "max_batch": 500},
}


def mps_warning(ranks_on_host: int, env: Optional[Dict[str, str]] = None,
                gpus_dir: str = "/proc/driver/nvidia/gpus") -> Optional[str]:
    """A warning when `ranks_on_host` ranks outnumber this host's GPUs (CUDA_VISIBLE_DEVICES'
    entries, else the driver's list) and no MPS daemon's control pipe is there: several ranks
    on one GPU without MPS time-slice it, milliseconds per op, which the ladder would report
    as results. None when the ranks have a GPU each, the GPUs cannot be counted, or the pipe
    exists."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = len([d for d in visible.split(",") if d.strip()])
    else:
        try:
            gpus = len(os.listdir(gpus_dir))
        except OSError:
            return None
    if gpus == 0 or ranks_on_host <= gpus:
        return None
    pipe, reachable = mps_pipe(env)
    if reachable:
        return None
    return (f"{ranks_on_host} ranks on {gpus} GPU(s) and no MPS control pipe in {pipe}: ranks "
            "that share a GPU without the MPS daemon time-slice it (milliseconds per op); "
            f"start it first: {MPS_START}")


def _transport_of(name: str, pg_options: Dict[str, str], env: Dict[str, str]) -> Optional[str]:
    """The transport a variant asks for: pg_options, else its env, else the inherited env."""
    if name != "resident":
        return None
    return (pg_options.get("transport") or env.get("RESIDENT_TRANSPORT")
            or os.environ.get("RESIDENT_TRANSPORT") or "auto")


def _path_of(name: str, pg_options: Dict[str, str], env: Dict[str, str]) -> Optional[str]:
    """The path a variant asks for: pg_options, else its env, else the inherited env."""
    if name != "resident":
        return None
    return (pg_options.get("path") or env.get("RESIDENT_PATH")
            or os.environ.get("RESIDENT_PATH") or "auto")


def make_plan(args: argparse.Namespace) -> SimpleNamespace:
    """What a run of the ladder does, from the options of cli.build_parser (the CLI's and the
    pytest plugin's); raises ValueError naming a bad option."""
    device = args.device
    cuda = device == "cuda"
    backends = [b.strip() for b in (args.backends or (common.DEFAULT_CUDA_BACKENDS if cuda else
                                                      common.DEFAULT_BACKENDS)).split(",")
                if b.strip()]
    if not backends:
        raise ValueError("no backends given")
    specs = [common.parse_backend_spec(b) for b in backends]
    default_ws = common.QUICK_WORLD_SIZES if args.quick else common.DEFAULT_WORLD_SIZES
    world_sizes = common.parse_int_list(args.world_sizes or default_ws, "world size")
    if any(w < 1 for w in world_sizes):
        raise ValueError("world sizes must be >= 1")
    is_launched = launched.launched()
    if is_launched:   # the launcher's processes are the ranks (launched.py)
        launcher_ws = int(os.environ["WORLD_SIZE"])
        if args.world_sizes and world_sizes != [launcher_ws]:
            raise ValueError(f"--world-sizes {args.world_sizes}: under a launcher the world size "
                             f"is the launcher's ({launcher_ws} processes, WORLD_SIZE)")
        world_sizes = [launcher_ws]
    quick_sizes = common.QUICK_SIZES_CUDA if cuda else common.QUICK_SIZES
    sizes = common.parse_sizes(args.sizes or (quick_sizes if args.quick else common.DEFAULT_SIZES))
    ops = common.parse_ops(args.ops)
    modes = rank_side.parse_modes(args.mode or common.DEFAULT_MODES.get(device, "eager"))
    if "graph" in modes and not cuda:
        raise ValueError("mode 'graph' needs --device cuda")
    td = TIMING_DEFAULTS.get(device, TIMING_DEFAULTS["cpu"])
    iters = args.iters if args.iters is not None else (0.3 if args.quick else 1.0)
    reps = args.reps if args.reps is not None else (7 if args.quick else td["reps"])
    rep_ms = args.rep_ms if args.rep_ms is not None else td["rep_ms"]
    cell_s = args.cell_s if args.cell_s is not None else td["cell_s"]
    max_batch = args.max_batch if args.max_batch is not None else td["max_batch"]
    if iters <= 0 or reps < 1 or args.warmup < 1 or args.rounds < 1 or max_batch < 1:
        raise ValueError("--iters must be > 0, --reps, --warmup, --rounds and --max-batch >= 1")

    return SimpleNamespace(args=args, device=device, cuda=cuda, backends=backends, specs=specs,
                           launched=is_launched, world_sizes=world_sizes, sizes=sizes, ops=ops,
                           modes=modes, iters=iters, reps=reps, rep_ms=rep_ms, cell_s=cell_s,
                           max_batch=max_batch)


def _groups(plan: SimpleNamespace, cfg: Dict[str, Any]):
    """The groups of a run in the order they run (every rank of a launched run walks the same
    list): (index, world size, round, mode, backend spec, label, label with round, cells,
    the group's cfg)."""
    args, imports = plan.args, cfg["imports"]
    n = 0
    for ws, rnd in ((w, r) for w in plan.world_sizes for r in range(args.rounds)):
        ws_ops = [o for o in plan.ops if not (o == "send_recv" and ws < 2)]
        cells = [(i, op, s) for i, (op, s) in
                 enumerate((op, s) for op in ws_ops for s in plan.sizes)]
        labels = common.backend_labels(plan.backends)
        for mode, (spec, variant) in ((m, v) for m in plan.modes for v in zip(plan.specs, labels)):
            backend, pg_options, venv = spec
            label0 = variant if len(plan.modes) == 1 else f"{variant} {mode}"
            label = label0 if args.rounds == 1 else f"{label0} round {rnd + 1}/{args.rounds}"
            gcfg = dict(cfg, mode=mode, pg_options=pg_options, env=venv, variant=variant,
                        imports=imports + [m for m in [common.BACKEND_MODULES.get(backend)]
                                           if m and m not in imports])
            yield n, ws, rnd, mode, spec, label0, label, cells, gcfg
            n += 1


def run(plan: SimpleNamespace, argv: Sequence[str]) -> Optional[Dict[str, Any]]:
    """Runs the ladder of `plan` (make_plan), prints its tables, targets and problems on stdout
    and returns the run's document (schema resident_pg.bench/1; report.write_json writes it).
    `argv`: the command line recorded in the metadata.  In a launcher's processes
    (launched.py) rank 0 does so; the other ranks measure and return None."""
    args, device, cuda = plan.args, plan.device, plan.cuda
    backends, specs, world_sizes = plan.backends, plan.specs, plan.world_sizes
    sizes, ops, modes = plan.sizes, plan.ops, plan.modes
    iters, reps, rep_ms, cell_s = plan.iters, plan.reps, plan.rep_ms, plan.cell_s
    max_batch = plan.max_batch
    for k, v in args.env:
        os.environ[k] = v   # inherited by the spawned ranks; the parent never uses a backend

    labels = common.backend_labels(backends)
    if cuda:   # no baseline unless asked for
        baseline = args.baseline if args.baseline in labels else None
    else:
        want = args.baseline or "gloo"
        baseline = want if want in labels else labels[0]
    imports = list(args.imports)   # for every backend; BACKEND_MODULES only for theirs
    cfg = {
        "device": device, "mode": modes[0], "check": args.check,
        "warmup": args.warmup, "reps": reps, "min_reps": min(args.min_reps, reps),
        "rep_ns": rep_ms * 1e6 * iters, "cell_budget_ns": cell_s * 1e9 * iters,
        "max_batch": max_batch, "graph_min_batch": args.graph_min_batch, "imports": imports,
        # store / process-group timeout: generous, the parent's watchdog catches hangs
        "timeout": max(args.timeout, 60.0),
    }
    launch = launched.join(cfg["timeout"]) if plan.launched else None
    if launch is not None and launch.rank != 0:   # a rank that measures; rank 0 reports
        launched.follow(_groups(plan, cfg), args, launch)
        return None
    meta = report._metadata(args, argv)
    if launch is not None:
        meta["launcher"] = {"rank_hosts": {str(r): h for r, h in sorted(launch.hosts.items())},
                            "hosts": len(set(launch.hosts.values()))}
    floors = None
    if args.floors:
        try:
            floors = cuda_side.load_floors(args.floors)
            hosts = meta.get("launcher", {}).get("hosts", 1)
            if (hosts > 1 and floors["tcp_one_way_us"]
                    and floors["tcp_one_way_name"] != cuda_side.TCP_HOSTS):
                floors["warnings"].append(
                    f"the ranks span {hosts} hosts but the tcp floor is "
                    f"{floors['tcp_one_way_name']}: measure it between two of them with "
                    "tcp_floor --listen / --connect (benchmarks/floors/README.md)")
            meta["floors"] = {k: floors[k] for k in ("path", "cross_process_flag_us",
                                                     "gpu_cpu_gpu_flag_us", "data_floor_sm_us",
                                                     "tcp_one_way_us", "tcp_one_way_variant",
                                                     "tcp_one_way_name", "tcp_netns_one_way_us",
                                                     "warnings", "contents")}
        except (OSError, ValueError) as e:
            meta["floors"] = {"path": " + ".join(os.path.abspath(p) for p in args.floors),
                              "error": f"{type(e).__name__}: {e}"}
            _log(f"  WARNING: --floors {args.floors}: {e}; no ratios to the floors")
    _log(f"resident_pg.bench: backends {labels}, world sizes {world_sizes}, "
         f"{len(ops)} ops x {len(sizes)} sizes, device {device}, modes {modes}, reps {reps}, "
         f"iters x{iters:g}, {meta['cpu_count']} cpus")
    if meta["env"]:
        _log(f"  RESIDENT_* env: {meta['env']}")
    if cuda and not plan.launched:   # spawned here: every rank on this host
        mps = mps_warning(max(world_sizes))
        if mps:
            _log(f"  WARNING: {mps}")
    load = meta["loadavg_start"]
    if load and meta["cpu_count"] and load[0] > 0.5 * meta["cpu_count"]:
        _log(f"  WARNING: machine busy (load average {load[0]:.2f} on {meta['cpu_count']} cpus); "
             f"timings will be noisy")

    t_run = time.time()
    rows: List[dict] = []
    groups: List[dict] = []
    errors: List[dict] = []
    group_labels: List[str] = []
    for n, ws, rnd, mode, spec, label0, label, cells, gcfg in _groups(plan, cfg):
        backend, pg_options, venv = spec
        variant = gcfg["variant"]
        if label0 not in group_labels:
            group_labels.append(label0)
        g = (GroupRun(ws, backend, label0, cells, gcfg, args) if launch is None else
             launched.LaunchedGroupRun(ws, backend, label0, cells, gcfg, args, launch, n))
        t0 = time.time()
        late = args.time_limit is not None and t0 - t_run > args.time_limit
        if g.skip(f"not run (--time-limit {args.time_limit:g} s reached)" if late else None):
            _log(f"[ws={ws} {label}] skipped: --time-limit {args.time_limit:g} s reached")
        else:
            _log(f"[ws={ws} {label}] {'launching' if launch is None else 'running'} {ws} ranks, "
                 f"{len(cells)} cells ...")
            try:
                g.run()
            except Exception as e:  # a bug here must not lose the other backends
                g.errors.append({"attempt": -1, "status": "bench_error",
                                 "error": f"{type(e).__name__}: {e}\n"
                                          f"{traceback.format_exc()}"})
        wall = time.time() - t0
        configured = _path_of(backend, pg_options, venv)
        seen = sorted({p for i in g.rank_info.values() for p in i.get("paths", [])})
        if configured in ("direct", "proxy") and seen and seen != [configured]:
            g.errors.append({"attempt": -1, "status": "path_mismatch",
                             "error": f"asked for path {configured!r}, ranks report "
                                      f"{seen} (resident_pg.describe)"})
        transport = _transport_of(backend, pg_options, venv)
        seen_t = sorted({t for i in g.rank_info.values() for t in i.get("transports", [])})
        if transport in ("shm", "tcp", "ib") and seen_t and seen_t != [transport]:
            g.errors.append({"attempt": -1, "status": "transport_mismatch",
                             "error": f"asked for transport {transport!r}, ranks report "
                                      f"{seen_t} (resident_pg.describe)"})
        tags = {"device": device, "mode": mode, "variant": variant,
                "path": seen[0] if len(seen) == 1 else configured,
                "path_configured": configured,
                "transport": seen_t[0] if len(seen_t) == 1 else transport,
                "transport_configured": transport, "pg_options": pg_options,
                "env_options": venv}
        grows = report.aggregate(g, tags)
        for r in grows:
            r["round"] = rnd
        rows.extend(grows)
        n_ok = sum("median_us" in r for r in grows)
        groups.append({"world_size": ws, "backend": backend, "label": label0, "round": rnd,
                       "mode": mode, "variant": variant, "pg_options": pg_options,
                       "env_options": venv, "paths_observed": seen,
                       "rank_info": {str(r): i for r, i in sorted(g.rank_info.items())},
                       "wall_s": wall, "cells": len(cells), "cells_ok": n_ok,
                       "launches": g.launches, "errors": g.errors})
        for e in g.errors:
            errors.append({"world_size": ws, "backend": backend, "label": label0,
                           "round": rnd, **e})
            _log(f"[ws={ws} {label}] ERROR ({e['status']}): {e['error'].rstrip()}")
        for r in grows:
            if r.get("check", "ok") not in ("ok", "skipped"):
                errors.append({"world_size": ws, "backend": backend, "label": label0,
                               "round": rnd, "op": r["op"], "size_bytes": r["size_bytes"],
                               "status": "check_failed", "error": r["check"]})
                _log(f"[ws={ws} {label}] {r['op']} {fmt_size(r['size_bytes'])}: "
                     f"wrong result, {r['check']}")
            if "error" in r and not r["error"].startswith("not run"):
                errors.append({"world_size": ws, "backend": backend, "label": label0,
                               "round": rnd, "op": r["op"], "size_bytes": r["size_bytes"],
                               "status": "cell_error", "error": r["error"]})
                _log(f"[ws={ws} {label}] {r['op']} {fmt_size(r['size_bytes'])}: "
                     f"{r['error'].rstrip()}")
        st = (f"startup {g.launches[0]['startup_s']:.1f} s, "
              if g.launches and "startup_s" in g.launches[0] else "")
        pth = f"path {', '.join(seen)}, " if seen else ""
        _log(f"[ws={ws} {label}] {n_ok}/{len(cells)} cells ok, {pth}{st}wall {wall:.1f} s")
    total = time.time() - t_run
    round_rows = rows
    rows = report.combine_rounds(round_rows, args.rounds)
    meta["loadavg_end"] = report._loadavg()
    if cuda:
        gpu = next((i["device"] for gr in groups for i in gr["rank_info"].values()
                    if "device" in i), None)
        meta["gpu"] = gpu
        meta["cuda_mps_pipe_directory"] = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    cuda_side.annotate_rows(rows, floors)  # cpu: the rows over tcp
    if round_rows is not rows:
        cuda_side.annotate_rows(round_rows, floors)  # each round's ratio (the gate's rounds)

    git = meta["git"]
    print(f"resident_pg.bench on {meta['hostname']} ({meta['cpu_count']} cpus, load "
          f"{meta['loadavg_start']}), torch {meta['torch_version']}, {meta['date']}, "
          f"commit {(git['commit'] or 'none')[:12]}{' (dirty)' if git['dirty'] else ''}"
          f", tree {(git.get('tree') or 'none')[:12]}")
    print(f"device {device}"
          + (f" ({meta['gpu'].get('name')}, MPS pipe {meta['cuda_mps_pipe_directory']})"
             if cuda and meta.get("gpu") else "")
          + f", mode {','.join(modes)}, float32, reps {reps}, iters x{iters:g}"
          + (f", RESIDENT_* env {meta['env']}" if meta["env"] else ", no RESIDENT_* env"))
    if launch is not None:
        print(f"ranks of a launcher (env://): {len(launch.hosts)} on "
              f"{meta['launcher']['hosts']} host(s)")
    if cuda:
        bc = cuda_side
        bc.print_cuda_tables(rows, world_sizes, modes, labels, ops, sizes, floors, args.spread)
        if baseline:
            report.print_tables(rows, world_sizes, ops, sizes, group_labels, baseline,
                                args.spread, args.rounds)
        results = bc.evaluate_targets(rows, floors, sizes)
        tline = "\n".join(t["line"] for t in results)
        target_doc: Dict[str, Any] = {"cuda_targets": results, "line": tline}
    else:
        report.print_tables(rows, world_sizes, ops, sizes, group_labels, baseline, args.spread,
                            args.rounds)
        tline = report.target_line(rows, labels)
        target_doc = {**common.TARGET, "line": tline}
        bc = cuda_side
        over_tcp = any(bc.row_floor_kind(r) == "tcp" for r in rows)
        if floors and over_tcp:
            bc.print_tcp_floor_table(rows, world_sizes, labels, ops, sizes, floors)
        if floors or over_tcp:  # the tcp target of CPU tensors
            results = bc.evaluate_targets(rows, floors, sizes, device="cpu")
            tline = "\n".join([tline] + [t["line"] for t in results])
            target_doc.update(tcp_targets=results, line=tline)
    print("\n" + tline)
    if errors:
        print(f"\n{len(errors)} problem(s):")
        for e in errors:
            where = (f" {e['op']} {fmt_size(e['size_bytes'])}" if "op" in e else "")
            rd = f" round {e['round'] + 1}" if args.rounds > 1 else ""
            print(f"  ws={e['world_size']} {e['label']}{rd}{where}: "
                  f"{e['error'].strip().splitlines()[0] if e['error'].strip() else e['status']}")
    print(f"\ntotal bench time {total:.1f} s  (load average at start "
          f"{meta['loadavg_start']}, at end {meta['loadavg_end']})")
    sys.stdout.flush()

    doc = {
        "schema": common.SCHEMA,
        "metadata": meta,
        "config": {
            "backends": backends, "labels": labels, "baseline": baseline,
            "group_labels": group_labels,
            "variants": [{"spec": b, "label": lb, "backend": sp[0], "pg_options": sp[1],
                          "env_options": sp[2]}
                         for b, lb, sp in zip(backends, labels, specs)],
            "world_sizes": world_sizes, "sizes": sizes, "ops": ops,
            "device": device, "mode": ",".join(modes), "modes": modes, "dtype": "float32",
            "iters_scale": iters, "reps": reps, "min_reps": cfg["min_reps"],
            "warmup": args.warmup, "rep_ms": rep_ms, "cell_s": cell_s,
            "max_batch": max_batch, "graph_min_batch": args.graph_min_batch,
            "check": args.check, "timeout_s": args.timeout,
            "time_limit_s": args.time_limit, "floors": args.floors,
            "quick": args.quick, "imports": imports, "rounds": args.rounds,
            "backend_modules": {sp[0]: common.BACKEND_MODULES[sp[0]] for sp in specs
                                if sp[0] in common.BACKEND_MODULES},
            "statistic": "per rank: median/p10/p90 over repetitions of (batch time / "
                         "batch); reported: max over ranks; send_recv: one-way = "
                         "round trip / 2" + (
                             "; cuda: a repetition ends with a synchronize of the "
                             "current stream; "
                             "graph: a repetition is one replay of a graph of `batch` ops"
                             if cuda else ""),
        },
        "results": rows,
        "results_by_round": round_rows if args.rounds > 1 else None,
        "groups": groups,
        "errors": errors,
        "target": target_doc,
        "total_s": total,
    }
    return doc
