"""The rank side of resident_pg.bench: devices and timing modes (eager, graph), and one rank's
part of a group's ladder of cells (run_ladder), in a process the parent's GroupRun spawned
(rank_main) or in a launcher's process (launched.py)."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

from . import common, cuda
from . import ops as bench_ops




# --------------------------------------------------------------------------
# devices and timing modes (rank side)
# --------------------------------------------------------------------------

class CpuDevice(common.TorchBuffers):
    """Host memory; collectives are complete when the torch.distributed call returns."""

    name = "cpu"

    def __init__(self, rank: int, world_size: int) -> None:
        import torch
        self.torch = torch
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        # Nothing to wait for on the host.  A device backend must make the
        # timed region include completion of the communication.
        pass


def _cuda_device(rank: int, world_size: int):
    return cuda.CudaDevice(rank, world_size)


# name -> class(rank, world_size)
DEVICES: Dict[str, Callable[..., Any]] = {"cpu": CpuDevice, "cuda": _cuda_device}


def eager_batch(step: Callable[[], None], count: int, dev) -> Callable[[], None]:
    """Return a callable that issues `count` back-to-back ops."""
    rng = range(count)

    def run() -> None:
        for _ in rng:
            step()
    return run


def graph_batch(step: Callable[[], None], count: int, dev) -> Callable[[], None]:
    """Capture `count` back-to-back ops into one CUDA graph; the callable replays it."""
    if getattr(dev, "name", None) != "cuda":
        raise RuntimeError("mode 'graph' needs --device cuda")
    return cuda.graph_batch(step, count, dev)


# name -> factory(step, count, device) -> batch callable (the caller synchronizes)
MODES: Dict[str, Callable[..., Callable[[], None]]] = {"eager": eager_batch,
                                                        "graph": graph_batch}


# --------------------------------------------------------------------------
# rank process
# --------------------------------------------------------------------------

def _barrier(store, key: str, ws: int, timeout_s: float) -> None:
    """All-rank barrier through the TCPStore (independent of the backend under test)."""
    if store.add(key, 1) == ws:
        store.set(key + "/go", "1")
    else:
        store.wait([key + "/go"], datetime.timedelta(seconds=timeout_s))


class Phase:
    """What a rank is doing, for the report of an error that ends its ladder."""

    def __init__(self) -> None:
        self.name = "start-up"


def rank_main(rank: int, ws: int, backend: str, store_port: int,
              cells: List[Tuple[int, str, int]], cfg: Dict[str, Any], q) -> None:
    """Entry point of one spawned rank process.  Reports to the parent through `q`."""
    phase = Phase()
    try:
        os.environ.update(cfg.get("env") or {})   # a variant's upper-case options

        def connect():
            import torch.distributed as dist
            return dist.TCPStore("127.0.0.1", store_port, None, False,
                                 timeout=datetime.timedelta(seconds=cfg["timeout"]))
        run_ladder(rank, ws, backend, connect, cells, cfg, q.put, phase, device_rank=rank)
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("fatal", rank, f"[{phase.name}] {type(e).__name__}: {e}\n"
               + traceback.format_exc(limit=8)))
        raise SystemExit(1)


def run_ladder(rank: int, ws: int, backend: str, connect: Callable[[], Any],
               cells: List[Tuple[int, str, int]], cfg: Dict[str, Any],
               post: Callable[[tuple], None], phase: Phase, device_rank: int) -> None:
    """One rank's part of a group's ladder: a process group of `backend` on the store that
    `connect()` returns (under the prefix "pg"; the bench's barriers under "bench"), every cell,
    then the group destroyed.  Reports through `post` (the messages GroupRun reads); raises
    what ends the ladder early.  `device_rank`: picks the GPU (``device_rank % count``)."""
    t_start = time.time()
    import importlib
    for mod in cfg["imports"]:
        phase.name = f"import {mod}"
        importlib.import_module(mod)
    import torch  # noqa: F401
    import torch.distributed as dist
    import warnings
    # torch >= 2.13 marks all_gather_into_tensor / reduce_scatter_tensor as
    # deprecated (in favour of *_single); they are what we benchmark.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use",
                            category=FutureWarning)

    phase.name = f"device {cfg['device']}"
    dev = DEVICES[cfg["device"]](device_rank, ws)   # before init: a CUDA rank picks its GPU first
    make_batch = MODES[cfg["mode"]]
    phase.name = "store connect"
    store = connect()
    phase.name = f"init_process_group(backend={backend!r})"
    extra = {"pg_options": cfg["pg_options"]} if cfg.get("pg_options") else {}
    dist.init_process_group(backend=backend, store=dist.PrefixStore("pg", store),
                            rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]), **extra)
    bstore = dist.PrefixStore("bench", store)
    info = _rank_info(backend, dev, cfg["device"])
    _barrier(bstore, "ready", ws, cfg["timeout"])
    post(("ready", rank, time.time() - t_start, info))

    failed_ops = set()
    for cid, op, nbytes in cells:
        phase.name = f"{op} {common.fmt_size(nbytes)}"
        _barrier(bstore, f"c{cid}/a", ws, cfg["timeout"])
        if op in failed_ops:
            continue
        if rank == 0:
            post(("start", rank, cid))
        err = None
        res = None
        try:
            res = _run_cell(cid, op, nbytes, rank, ws, dev, make_batch, bstore, cfg)
        except Exception as e:  # reported, the other cells still run
            err = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=6)
            bstore.set(f"c{cid}/err", "1")
        if res is not None:
            post(("result", rank, cid, res))
        if err is not None:
            post(("cell_error", rank, cid, err))
        _barrier(bstore, f"c{cid}/b", ws, cfg["timeout"])
        if bstore.check([f"c{cid}/err"]):
            failed_ops.add(op)   # same decision on every rank

    phase.name = "destroy_process_group"
    _barrier(bstore, "end", ws, cfg["timeout"])
    post(("done", rank, time.time() - t_start))
    dist.destroy_process_group()
    post(("exited", rank, time.time() - t_start))


def _rank_info(backend: str, dev, device: str) -> Dict[str, Any]:
    """What this rank runs on: the GPU (cuda) and, for resident, the path to each peer."""
    info: Dict[str, Any] = {}
    if hasattr(dev, "info"):
        try:
            info["device"] = dev.info()
        except Exception as e:  # informational only
            info["device"] = {"error": f"{type(e).__name__}: {e}"}
    if backend == "resident":
        try:
            import resident_pg
            for d in dict.fromkeys([device, "cpu"]):
                try:
                    desc = resident_pg.describe(device=d)
                    info["paths"] = sorted({p["path"] for r, p in desc["peers"].items()
                                            if r != desc["rank"]})
                    info["transports"] = sorted({p["transport"] for r, p in
                                                 desc["peers"].items() if r != desc["rank"]})
                    info["describe_device"] = d
                    break
                except Exception as e:  # e.g. no such backend object for that device
                    info["describe_error"] = f"{type(e).__name__}: {e}"
        except Exception as e:
            info["describe_error"] = f"{type(e).__name__}: {e}"
    return info


def _run_cell(cid, op, nbytes, rank, ws, dev, make_batch, bstore, cfg):
    tp = time.perf_counter()
    phases: Dict[str, float] = {}   # seconds per phase of this cell (where bench time goes)

    def lap(name: str) -> None:
        nonlocal tp
        now = time.perf_counter()
        phases[name] = now - tp
        tp = now

    case = bench_ops.build_op(op, nbytes, rank, ws, dev)
    check_status = "skipped"
    if not case.participates:
        return None
    lap("build")
    if cfg["check"]:
        # A wrong result is recorded, not raised: the op itself completed on every
        # rank, so all ranks go on timing it in step (raising on one rank only
        # would leave the others waiting inside the next collective).
        try:
            case.check()
            dev.synchronize()
            check_status = "ok"
        except bench_ops.CheckError as e:
            check_status = f"FAILED on rank {rank}: {e}"
        lap("check")
        if cfg["mode"] == "graph":
            # the same check captured into a graph and replayed twice (fresh inputs,
            # poisoned outputs): replays that do not run the op fail here
            try:
                cuda.graph_check(case.setup, case.body, case.verify, dev)
            except bench_ops.CheckError as e:
                if check_status == "ok":
                    check_status = f"FAILED on rank {rank} (graph replay): {e}"
            lap("graph_check")
    if case.reset is not None:
        case.reset()
    dev.synchronize()

    # timed single-op warm-up; rank 0 turns it into the plan for this cell
    step = case.step
    times = []
    for _ in range(cfg["warmup"]):
        t0 = time.perf_counter_ns()
        step()
        dev.synchronize()
        times.append(time.perf_counter_ns() - t0)
    plan_key = f"c{cid}/plan"
    if rank == 0:
        est = common._median(times[1:] if len(times) > 1 else times)
        est = max(est, 100.0)
        batch_f = cfg["rep_ns"] / est
        if cfg["mode"] == "graph":
            # est (one eager op + synchronize) overstates a captured op, so graphs would be
            # short: take at least graph_min_batch ops, so that the replay's own launch +
            # synchronize (~6 us on an H200) adds little per op; but not more than 4x the
            # repetition target by est (large messages, where that overhead is negligible)
            batch_f = max(batch_f, min(cfg.get("graph_min_batch", 1), 4 * cfg["rep_ns"] / est))
        batch = int(min(cfg["max_batch"], max(1, round(batch_f))))
        reps = cfg["reps"]
        per_rep = est * batch
        if per_rep * reps > cfg["cell_budget_ns"]:
            reps = max(cfg["min_reps"], int(cfg["cell_budget_ns"] // per_rep))
        reps = min(reps, cfg["reps"])
        bstore.set(plan_key, f"{batch},{reps}")
    else:
        batch, reps = (int(x) for x in bstore.get(plan_key).decode().split(","))

    lap("plan")
    run = make_batch(step, batch, dev)
    lap("make_batch")
    run()  # untimed: settle at the new rate
    dev.synchronize()
    lap("untimed_batch")
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        run()
        dev.synchronize()
        dt = time.perf_counter_ns() - t0
        samples.append(dt / batch * case.scale / 1000.0)  # µs per op
    lap("timed")
    return {
        "median_us": common._median(samples),
        "p10_us": common.percentile(samples, 10),
        "p90_us": common.percentile(samples, 90),
        "min_us": min(samples),
        "samples_us": samples,
        "warmup_us": [x * case.scale / 1000.0 for x in times],
        "batch": batch,
        "reps": reps,
        "actual_bytes": case.actual_bytes,
        "check": check_status,
        "phase_s": {k: round(v, 6) for k, v in phases.items()},
    }

def parse_modes(text: str) -> List[str]:
    modes = []
    for t in text.split(","):
        t = t.strip().lower()
        if t and t not in modes:
            if t not in MODES:
                raise ValueError(f"unknown mode {t!r}; choose from {', '.join(sorted(MODES))}")
            modes.append(t)
    if not modes:
        raise ValueError("no modes given")
    return modes
