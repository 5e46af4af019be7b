"""Latency ladder benchmark for torch.distributed backends (resident vs gloo, ...).

Run as ``python -m resident_pg.bench``.  ``python resident_pg/bench.py`` runs the
same code without importing the ``resident_pg`` package: ``-m`` executes the
package's ``__init__`` (which loads the compiled extension) in this process and in
every spawned rank, so while the extension is not built only the script form
works (e.g. ``--backends gloo``).

For every world size and every backend, one set of rank processes is spawned
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

Devices and modes (``DEVICES``, ``MODES``): "cpu" + "eager" is the CPU ladder.
``--device cuda`` (module ``bench_cuda``) puts the buffers on GPU
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
physical floor (benchmarks/floors) and the run prints the CUDA targets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

SCHEMA = "resident_pg.bench/1"

ALL_OPS = (
    "all_reduce",
    "all_to_all_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "send_recv",
)
OP_ALIASES = {
    "allreduce": "all_reduce",
    "all_to_all": "all_to_all_single",
    "alltoall": "all_to_all_single",
    "all_gather": "all_gather_into_tensor",
    "allgather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter_tensor",
    "sendrecv": "send_recv",
    "p2p": "send_recv",
}
DEFAULT_SIZES = "8,64,512,4K,16K,64K,256K,1M"
QUICK_SIZES = "8,512,16K,1M"
QUICK_SIZES_CUDA = "8,512,16K,64K,1M"
DEFAULT_BACKENDS = "resident,gloo"
# --device cuda: no baseline backend; the direct and the proxy path side by side.
DEFAULT_CUDA_BACKENDS = "resident:path=direct,resident:path=proxy"
DEFAULT_MODES = {"cpu": "eager", "cuda": "eager,graph"}
DEFAULT_WORLD_SIZES = "2,4,8"
QUICK_WORLD_SIZES = "2"

# Backends provided by a Python module that must be imported in the rank
# processes (importing it registers the backend with torch.distributed).
BACKEND_MODULES = {"resident": "resident_pg"}

# Project target: for 2 ranks, 8 B all_reduce, resident median <= gloo / 20.
TARGET = {"world_size": 2, "op": "all_reduce", "size": 8, "backend": "resident",
          "baseline": "gloo", "min_speedup": 20.0}

ELEM_BYTES = 4  # float32 everywhere


# --------------------------------------------------------------------------
# small helpers (also used by the tests)
# --------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024,
          "m": 1024 ** 2, "mb": 1024 ** 2, "mib": 1024 ** 2,
          "g": 1024 ** 3, "gb": 1024 ** 3, "gib": 1024 ** 3}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' / '4KiB' / '4kb' -> 4096, '1M' -> 1048576 (binary units)."""
    s = text.strip().lower().replace(" ", "")
    i = 0
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    num, unit = s[:i], s[i:]
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 8, 512, 4K, 64KiB, 1M)")
    value = float(num) * _UNITS[unit]
    if value != int(value) or value < ELEM_BYTES:
        raise ValueError(f"size {text!r} must be a whole number of bytes >= {ELEM_BYTES}")
    return int(value)


def parse_sizes(text: str) -> List[int]:
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def parse_ops(text: str) -> List[str]:
    ops = []
    for t in text.split(","):
        t = t.strip().lower()
        if not t:
            continue
        if t == "all":
            ops.extend(o for o in ALL_OPS if o not in ops)
            continue
        t = OP_ALIASES.get(t, t)
        if t not in ALL_OPS:
            raise ValueError(f"unknown op {t!r}; choose from {', '.join(ALL_OPS)}")
        if t not in ops:
            ops.append(t)
    if not ops:
        raise ValueError("no ops given")
    return ops


def parse_int_list(text: str, what: str) -> List[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"bad {what} list {text!r}") from None
    if not vals:
        raise ValueError(f"no {what} given")
    return vals


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def parse_backend_spec(spec: str) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """'resident:path=proxy:RESIDENT_SPIN_US=10' -> ('resident', {'path': 'proxy'},
    {'RESIDENT_SPIN_US': '10'}): lower-case keys are pg_options of the group, upper-case
    keys environment variables of its rank processes."""
    name, *opts = [x.strip() for x in spec.strip().split(":")]
    if not name:
        raise ValueError(f"bad backend {spec!r} (expected NAME[:KEY=VALUE...])")
    pg_options: Dict[str, str] = {}
    env: Dict[str, str] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or not k.strip():
            raise ValueError(f"bad backend option {o!r} in {spec!r} (expected KEY=VALUE)")
        k = k.strip()
        (env if k.isupper() else pg_options)[k] = v.strip()
    return name, pg_options, env


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


def backend_labels(backends: Sequence[str]) -> List[str]:
    """Unique display labels; a backend given twice becomes 'gloo', 'gloo#2'."""
    seen: Dict[str, int] = {}
    labels = []
    for b in backends:
        seen[b] = seen.get(b, 0) + 1
        labels.append(b if seen[b] == 1 else f"{b}#{seen[b]}")
    return labels


# --------------------------------------------------------------------------
# devices and timing modes (rank side)
# --------------------------------------------------------------------------

class CpuDevice:
    """Host memory; collectives are complete when the torch.distributed call returns."""

    name = "cpu"

    def __init__(self, rank: int, world_size: int) -> None:
        import torch
        self.torch = torch
        self.device = torch.device("cpu")

    def alloc(self, numel: int, fill: Optional[float] = 0.0):
        t = self.torch
        if fill is None:
            return t.empty(numel, dtype=t.float32, device=self.device)
        return t.full((numel,), float(fill), dtype=t.float32, device=self.device)

    def arange(self, numel: int, start: float = 0.0):
        t = self.torch
        return t.arange(numel, dtype=t.float32, device=self.device) + start

    def synchronize(self) -> None:
        # Nothing to wait for on the host.  A device backend must make the
        # timed region include completion of the communication.
        pass


def _bench_cuda():
    """The CUDA half of the bench (a sibling module; imported only when used)."""
    if __package__:
        from . import bench_cuda
    else:  # run as a script: this file's directory is on sys.path
        import bench_cuda  # type: ignore[no-redef]
    return bench_cuda


def _cuda_device(rank: int, world_size: int):
    return _bench_cuda().CudaDevice(rank, world_size)


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
    return _bench_cuda().graph_batch(step, count, dev)


# name -> factory(step, count, device) -> batch callable (the caller synchronizes)
MODES: Dict[str, Callable[..., Callable[[], None]]] = {"eager": eager_batch,
                                                        "graph": graph_batch}


# --------------------------------------------------------------------------
# ops (rank side)
# --------------------------------------------------------------------------

class OpCase:
    """One (op, size) cell on one rank.

    The correctness check is split so that graph mode can capture it: `setup`
    writes known inputs (and poisons outputs), `body` issues the op(s), `verify`
    raises CheckError on a wrong result.  Eager check: setup, body, verify."""

    def __init__(self, step, actual_bytes, participates, setup=None, body=None, verify=None,
                 scale=1.0, reset=None):
        self.step = step                  # issues one op (one round trip for send_recv)
        self.actual_bytes = actual_bytes  # bytes of the buffer the size refers to
        self.participates = participates  # False: this rank is idle for this op
        self.setup, self.body, self.verify = setup, body, verify
        self.scale = scale                # per-step time -> reported time
        self.reset = reset                # () -> None, restores timing buffers

    def check(self) -> None:
        self.setup()
        self.body()
        self.verify()


class CheckError(RuntimeError):
    pass


POISON = -7.0  # outputs are filled with this before a checked op


def _expect(name, got, want) -> None:
    import torch
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        idx = int(bad[0]) if bad.numel() else -1
        raise CheckError(f"{name}: wrong result at element {idx}: got "
                         f"{got.flatten()[idx].item()} want {want.flatten()[idx].item()} "
                         f"({bad.numel()} of {got.numel()} elements differ)")


def build_op(op: str, nbytes: int, rank: int, ws: int, dev) -> OpCase:
    """Buffers and a step function for one (op, size) cell.

    Size conventions (as nccl-tests): all_reduce: the tensor; all_to_all_single:
    the per-rank input (= output) buffer, rounded up to a multiple of world
    size elements; all_gather_into_tensor: the gathered output; reduce_scatter
    _tensor: the input; send_recv: the message.  Buffers are at least one
    float32 per rank; `actual_bytes` says what was really used.
    """
    import torch
    import torch.distributed as dist
    n = max(1, nbytes // ELEM_BYTES)

    if op == "all_reduce":
        t = dev.alloc(n, 0.0)

        def step():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

        want = torch.full_like(t, ws * (ws + 1) / 2)
        return OpCase(step, n * ELEM_BYTES, True,
                      setup=lambda: t.fill_(rank + 1), body=step,
                      verify=lambda: _expect(op, t, want), reset=lambda: t.zero_())

    if op == "all_to_all_single":
        n = max(ws, -(-n // ws) * ws)
        chunk = n // ws
        inp, out = dev.alloc(n, 0.0), dev.alloc(n, None)
        # every element of chunk j sent by rank r holds r*ws + j
        known = rank * ws + dev.arange(n) // chunk
        want = dev.arange(n) // chunk * ws + rank  # chunk i came from rank i

        def step():
            dist.all_to_all_single(out, inp)

        def setup():
            inp.copy_(known)
            out.fill_(POISON)

        return OpCase(step, n * ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want), reset=lambda: inp.zero_())

    if op == "all_gather_into_tensor":
        chunk = max(1, n // ws)
        inp, out = dev.alloc(chunk, float(rank)), dev.alloc(chunk * ws, None)
        want = dev.arange(chunk * ws) // chunk

        def step():
            dist.all_gather_into_tensor(out, inp)

        def setup():
            inp.fill_(rank)
            out.fill_(POISON)

        return OpCase(step, chunk * ws * ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want))

    if op == "reduce_scatter_tensor":
        chunk = max(1, n // ws)
        inp, out = dev.alloc(chunk * ws, 0.0), dev.alloc(chunk, None)
        # element of chunk j on rank r: r + j  -> rank i gets sum_r (r + i)
        known = dev.arange(chunk * ws) // chunk + rank
        want = torch.full_like(out, ws * (ws - 1) / 2 + ws * rank)

        def step():
            dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)

        def setup():
            inp.copy_(known)
            out.fill_(POISON)

        return OpCase(step, chunk * ws * ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want), reset=lambda: inp.zero_())

    if op == "send_recv":
        if ws < 2:
            raise ValueError("send_recv needs at least 2 ranks")
        t = dev.alloc(n, 0.0)
        sent, back = dev.arange(n), dev.arange(n) + 1
        # rank 0 sends 0..n-1, rank 1 adds 1 and sends it back: both end with 1..n
        if rank == 0:
            def step():
                dist.send(t, 1)
                dist.recv(t, 1)

            setup = lambda: t.copy_(sent)  # noqa: E731
            body = step
            what = op + " (rank 0 got back)"
        elif rank == 1:
            def step():
                dist.recv(t, 0)
                dist.send(t, 0)

            def body():
                dist.recv(t, 0)
                t.add_(1)
                dist.send(t, 0)

            setup = lambda: t.fill_(POISON)  # noqa: E731
            what = op + " (rank 1 got, plus 1)"
        else:
            return OpCase(None, n * ELEM_BYTES, False, scale=0.5)
        return OpCase(step, n * ELEM_BYTES, True, setup=setup, body=body,
                      verify=lambda: _expect(what, t, back), scale=0.5)

    raise ValueError(f"unknown op {op!r}")


# --------------------------------------------------------------------------
# rank process
# --------------------------------------------------------------------------

def _barrier(store, key: str, ws: int, timeout_s: float) -> None:
    """All-rank barrier through the TCPStore (independent of the backend under test)."""
    if store.add(key, 1) == ws:
        store.set(key + "/go", "1")
    else:
        store.wait([key + "/go"], datetime.timedelta(seconds=timeout_s))


def _median(v: Sequence[float]) -> float:
    return percentile(v, 50.0)


def rank_main(rank: int, ws: int, backend: str, store_port: int,
              cells: List[Tuple[int, str, int]], cfg: Dict[str, Any], q) -> None:
    """Entry point of one rank process.  Reports to the parent through `q`."""
    t_start = time.time()
    phase = "start-up"
    try:
        os.environ.update(cfg.get("env") or {})   # a variant's upper-case options
        import importlib
        for mod in cfg["imports"]:
            phase = f"import {mod}"
            importlib.import_module(mod)
        import torch  # noqa: F401
        import torch.distributed as dist
        import warnings
        # torch >= 2.13 marks all_gather_into_tensor / reduce_scatter_tensor as
        # deprecated (in favour of *_single); they are what we benchmark.
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use",
                                category=FutureWarning)

        phase = f"device {cfg['device']}"
        dev = DEVICES[cfg["device"]](rank, ws)   # before init: a CUDA rank picks its GPU first
        make_batch = MODES[cfg["mode"]]
        phase = "store connect"
        store = dist.TCPStore("127.0.0.1", store_port, None, False,
                              timeout=datetime.timedelta(seconds=cfg["timeout"]))
        phase = f"init_process_group(backend={backend!r})"
        extra = {"pg_options": cfg["pg_options"]} if cfg.get("pg_options") else {}
        dist.init_process_group(backend=backend, store=dist.PrefixStore("pg", store),
                                rank=rank, world_size=ws,
                                timeout=datetime.timedelta(seconds=cfg["timeout"]), **extra)
        bstore = dist.PrefixStore("bench", store)
        info = _rank_info(backend, dev, cfg["device"])
        _barrier(bstore, "ready", ws, cfg["timeout"])
        q.put(("ready", rank, time.time() - t_start, info))

        failed_ops = set()
        for cid, op, nbytes in cells:
            phase = f"{op} {fmt_size(nbytes)}"
            _barrier(bstore, f"c{cid}/a", ws, cfg["timeout"])
            if op in failed_ops:
                continue
            if rank == 0:
                q.put(("start", rank, cid))
            err = None
            res = None
            try:
                res = _run_cell(cid, op, nbytes, rank, ws, dev, make_batch, bstore, cfg)
            except Exception as e:  # reported, the other cells still run
                err = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=6)
                bstore.set(f"c{cid}/err", "1")
            if res is not None:
                q.put(("result", rank, cid, res))
            if err is not None:
                q.put(("cell_error", rank, cid, err))
            _barrier(bstore, f"c{cid}/b", ws, cfg["timeout"])
            if bstore.check([f"c{cid}/err"]):
                failed_ops.add(op)   # same decision on every rank

        phase = "destroy_process_group"
        _barrier(bstore, "end", ws, cfg["timeout"])
        q.put(("done", rank, time.time() - t_start))
        dist.destroy_process_group()
        q.put(("exited", rank, time.time() - t_start))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("fatal", rank, f"[{phase}] {type(e).__name__}: {e}\n"
               + traceback.format_exc(limit=8)))
        raise SystemExit(1)


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

    case = build_op(op, nbytes, rank, ws, dev)
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
        except CheckError as e:
            check_status = f"FAILED on rank {rank}: {e}"
        lap("check")
        if cfg["mode"] == "graph":
            # the same check captured into a graph and replayed twice (fresh inputs,
            # poisoned outputs): replays that do not run the op fail here
            try:
                _bench_cuda().graph_check(case.setup, case.body, case.verify, dev)
            except CheckError as e:
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
        est = _median(times[1:] if len(times) > 1 else times)
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
        "median_us": _median(samples),
        "p10_us": percentile(samples, 10),
        "p90_us": percentile(samples, 90),
        "min_us": min(samples),
        "samples_us": samples,
        "warmup_us": [x * case.scale / 1000.0 for x in times],
        "batch": batch,
        "reps": reps,
        "actual_bytes": case.actual_bytes,
        "check": check_status,
        "phase_s": {k: round(v, 6) for k, v in phases.items()},
    }


# --------------------------------------------------------------------------
# parent side: launching groups
# --------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class GroupRun:
    """Runs the ladder for one (world size, backend), relaunching after a crash or hang."""

    def __init__(self, ws, backend, label, cells, cfg, args):
        self.ws, self.backend, self.label = ws, backend, label
        self.cells = cells        # [(cid, op, size)]
        self.cfg, self.args = cfg, args
        self.results: Dict[int, Dict[int, dict]] = {}  # cid -> rank -> result
        self.cell_errors: Dict[int, Dict[int, str]] = {}
        self.errors: List[dict] = []   # group-level problems
        self.launches: List[dict] = []
        self.rank_info: Dict[int, dict] = {}  # rank -> _rank_info() of its latest launch
        self.skip_reason: Optional[str] = None  # set when the group was never launched

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
            p = ctx.Process(target=rank_main, name=f"bench-{self.backend}-ws{self.ws}-r{r}",
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
                if kind == "ready":
                    if rank == 0:
                        info["startup_s"] = now - t0
                    if len(msg) > 3:
                        self.rank_info[rank] = msg[3]
                elif kind == "start":
                    in_progress = msg[2]
                elif kind == "result":
                    self.results.setdefault(msg[2], {})[rank] = msg[3]
                elif kind == "cell_error":
                    self.cell_errors.setdefault(msg[2], {})[rank] = msg[3]
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
                        if m[0] == "fatal":
                            fatal[m[1]] = m[2]
                        elif m[0] == "result":
                            self.results.setdefault(m[2], {})[m[1]] = m[3]
                        elif m[0] == "cell_error":
                            self.cell_errors.setdefault(m[2], {})[m[1]] = m[3]
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


# --------------------------------------------------------------------------
# aggregation and output
# --------------------------------------------------------------------------

TAG_KEYS = ("device", "mode", "variant", "path", "path_configured", "pg_options", "env_options")


def aggregate(group: GroupRun, tags: Optional[Dict[str, Any]] = None) -> List[dict]:
    """One row per cell; `tags` (device, mode, variant, path, ...) are copied into each."""
    rows = []
    for cid, op, size in group.cells:
        per_rank = group.results.get(cid, {})
        errs = group.cell_errors.get(cid, {})
        row: Dict[str, Any] = {
            "world_size": group.ws, "backend": group.backend, "label": group.label,
            **(tags or {}), "op": op, "size_bytes": size,
        }
        if per_rank and not errs:
            ranks = sorted(per_rank)
            r0 = per_rank[ranks[0]]
            row.update({
                "median_us": max(per_rank[r]["median_us"] for r in ranks),
                "p10_us": max(per_rank[r]["p10_us"] for r in ranks),
                "p90_us": max(per_rank[r]["p90_us"] for r in ranks),
                "slowest_rank": max(ranks, key=lambda r: per_rank[r]["median_us"]),
                "actual_bytes": r0["actual_bytes"],
                "batch": r0["batch"], "reps": r0["reps"],
                "check": next((per_rank[r]["check"] for r in ranks
                               if per_rank[r]["check"] != "ok"), "ok"),
                "ranks": {str(r): per_rank[r] for r in ranks},
            })
        elif errs:
            row["error"] = _first_error(errs)
        else:
            row["error"] = (group.skip_reason or
                            "not run (earlier failure of this op or of the group)")
        rows.append(row)
    return rows


def combine_rounds(rows: List[dict], rounds: int) -> List[dict]:
    """One row per (world size, label, op, size): median over rounds of each statistic.

    With one round the rows are returned as they are (plus round_medians_us)."""
    by_key: Dict[tuple, List[dict]] = {}
    for r in rows:
        by_key.setdefault((r["world_size"], r["label"], r["op"], r["size_bytes"]), []).append(r)
    out = []
    for key, rs in by_key.items():
        ok = [r for r in rs if "median_us" in r]
        if rounds == 1 and len(rs) == 1:
            row = dict(rs[0])
            row.pop("round", None)
        elif not ok:
            row = {k: v for k, v in rs[0].items() if k not in ("round",)}
        else:
            row = {k: ok[0][k] for k in ("world_size", "backend", "label", *TAG_KEYS, "op",
                                         "size_bytes", "actual_bytes", "check") if k in ok[0]}
            for k in ("median_us", "p10_us", "p90_us"):
                row[k] = _median([r[k] for r in ok])
            bad = [r["check"] for r in ok if r["check"] != "ok"]
            row["check"] = bad[0] if bad else "ok"
            errs = [r["error"] for r in rs if "error" in r]
            if errs:
                row["round_errors"] = errs
        row["rounds"] = len(ok)
        row["round_medians_us"] = [r["median_us"] for r in ok]
        out.append(row)
    return out


def _first_error(errs: Dict[int, str]) -> str:
    r = min(errs)
    who = "parent" if r < 0 else f"rank {r}"
    return f"{who}: {errs[r]}"


def _fmt_us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.1f}"
    return f"{v:.2f}"


def print_tables(rows: List[dict], world_sizes, ops, sizes, labels, baseline,
                 spread: bool, rounds: int = 1, out=None) -> None:
    out = out or sys.stdout
    idx = {(r["world_size"], r["label"], r["op"], r["size_bytes"]): r for r in rows}
    others = [lb for lb in labels if lb != baseline] if baseline else []
    for ws in world_sizes:
        head = ["op", "size"]
        for lb in labels:
            head.append(f"{lb} µs")
            if spread:
                head.append("p10-p90")
            if rounds > 1:
                head.append("rounds")
        for lb in others:
            head += [f"{lb}/{baseline}", f"{baseline}/{lb}"]
        lines = []
        notes = set()
        for op in ops:
            for size in sizes:
                cells = [op, fmt_size(size)]
                meds = {}
                for lb in labels:
                    r = idx.get((ws, lb, op, size))
                    if r is None or "median_us" not in r:
                        cells.append("ERR" if r is not None and "error" in r else "-")
                        cells += [""] * (int(spread) + int(rounds > 1))
                        continue
                    mark = ""
                    if r.get("actual_bytes") != size:
                        mark += "*"
                        notes.add("*")
                    if r.get("check") not in ("ok", "skipped"):
                        mark += "!"
                        notes.add("!")
                    meds[lb] = r["median_us"]
                    cells.append(_fmt_us(r["median_us"]) + mark)
                    if spread:
                        cells.append(f"{_fmt_us(r['p10_us'])}-{_fmt_us(r['p90_us'])}")
                    if rounds > 1:
                        rm = r["round_medians_us"]
                        cells.append(f"{_fmt_us(min(rm))}-{_fmt_us(max(rm))} ({len(rm)})")
                for lb in others:
                    if lb in meds and baseline in meds and meds[lb] > 0 and meds[baseline] > 0:
                        cells += [f"{meds[lb] / meds[baseline]:.3f}",
                                  f"{meds[baseline] / meds[lb]:.2f}x"]
                    else:
                        cells += ["-", "-"]
                lines.append(cells)
        title = (f"world size {ws}: µs per op, median over repetitions, max over ranks"
                 + ("; p10-p90 likewise" if spread else "")
                 + (f"; median over {rounds} rounds (rounds: min-max of the round "
                    f"medians, rounds with a result)" if rounds > 1 else ""))
        print(f"\n== {title}", file=out)
        _bench_cuda().print_table(head, lines, notes, out)
    out.flush()


def target_line(rows: List[dict], labels: Sequence[str]) -> str:
    t = TARGET
    what = (f"TARGET {t['world_size']} ranks, {t['op']} {fmt_size(t['size'])}: "
            f"{t['baseline']}/{t['backend']} >= {t['min_speedup']:.0f}x")
    if t["backend"] not in labels or t["baseline"] not in labels:
        return f"{what}: N/A (needs backends {t['backend']} and {t['baseline']})"
    got = {}
    for r in rows:
        if (r["world_size"], r["op"], r["size_bytes"]) == (t["world_size"], t["op"], t["size"]) \
                and r["label"] in (t["backend"], t["baseline"]):
            got[r["label"]] = r
    missing = [lb for lb in (t["backend"], t["baseline"])
               if lb not in got or "median_us" not in got[lb]]
    if missing:
        return f"{what}: N/A (no result for {', '.join(missing)})"
    res, base = got[t["backend"]]["median_us"], got[t["baseline"]]["median_us"]
    speedup = base / res if res > 0 else float("inf")
    verdict = "PASS" if speedup >= t["min_speedup"] else "MISS"
    if got[t["backend"]].get("check", "ok") not in ("ok", "skipped"):
        verdict += " but INVALID: wrong results"
    return (f"{what}: {verdict}  ({t['baseline']} {_fmt_us(base)} µs, {t['backend']} "
            f"{_fmt_us(res)} µs, speed-up {speedup:.1f}x)")


def _git_info() -> Dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    info: Dict[str, Any] = {"commit": None, "dirty": None}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
        st = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True,
                            text=True, timeout=10)
        if st.returncode == 0:
            info["dirty"] = bool(st.stdout.strip())
    except Exception:
        pass
    return info


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _metadata(args, argv) -> Dict[str, Any]:
    import torch
    try:
        from importlib.metadata import version
        rpg_version = version("resident_pg")
    except Exception:
        rpg_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except Exception:
        affinity = None
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": affinity,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "torch_num_threads_parent": torch.get_num_threads(),
        "loadavg_start": _loadavg(),
        "resident_pg_version": rpg_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_info(),
        "command_line": (list(getattr(sys, "orig_argv", [])) if argv == sys.argv[1:]
                         else [sys.executable, "-m", "resident_pg.bench"] + list(argv)),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RESIDENT_")},
        "env_overrides": dict(args.env),
    }


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

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
            "  python resident_pg/bench.py --backends gloo    # same, without importing the\n"
            "                                                 # resident_pg package (extension)\n"))
    g = p.add_argument_group("what to run")
    g.add_argument("--backends", default=None, metavar="LIST",
                   help="comma list of torch.distributed backends, run in this order for each "
                        "world size (a name may repeat); NAME:key=value passes pg_options "
                        "{key: value} to that group, NAME:KEY=VALUE (upper case) sets an "
                        f"environment variable in its ranks [{DEFAULT_BACKENDS}; --device cuda: "
                        f"{DEFAULT_CUDA_BACKENDS}]")
    g.add_argument("--world-sizes", default=None, metavar="LIST",
                   help=f"comma list of rank counts [{DEFAULT_WORLD_SIZES}; "
                        f"--quick: {QUICK_WORLD_SIZES}]")
    g.add_argument("--sizes", default=None, metavar="LIST",
                   help=f"comma list of message sizes in bytes, K/M suffixes are binary "
                        f"[{DEFAULT_SIZES}; --quick: {QUICK_SIZES}, cuda {QUICK_SIZES_CUDA}]")
    g.add_argument("--ops", default="all", metavar="LIST",
                   help=f"comma list of ops, or 'all' [all = {', '.join(ALL_OPS)}]")
    g.add_argument("--device", default="cpu", choices=sorted(DEVICES),
                   help="where the buffers live [%(default)s]")
    g.add_argument("--mode", default=None, metavar="LIST",
                   help="comma list of ways batches of ops are issued: eager (back-to-back "
                        "calls), graph (one CUDA graph of the batch, replayed; cuda only); "
                        "several modes run as separate groups "
                        f"[cpu: {DEFAULT_MODES['cpu']}; cuda: {DEFAULT_MODES['cuda']}]")
    g.add_argument("--baseline", default=None, metavar="LABEL",
                   help="backend label that ratios are computed against [cpu: gloo, else the "
                        "first backend; cuda: none]")
    g.add_argument("--floors", metavar="PATH",
                   help="floors JSON of benchmarks/floors/build/floors --json: cuda rows get "
                        "median / floor (8 B: cross-process flag floor; larger: SM data floor "
                        "at that size) and the CUDA targets are evaluated; the file goes into "
                        "the JSON metadata")
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


# per-device defaults of the timing options (cpu: as always; cuda: ~4 min for the default
# ladder of 2 paths x 2 modes x 3 world sizes on one H200, see scripts/device_run.sh)
TIMING_DEFAULTS = {
    "cpu": {"reps": 21, "rep_ms": 10.0, "cell_s": 1.0, "max_batch": 2000},
    "cuda": {"reps": 21, "rep_ms": 3.0, "cell_s": 0.3, "max_batch": 500},
}


def _path_of(name: str, pg_options: Dict[str, str], env: Dict[str, str]) -> Optional[str]:
    """The path a variant asks for: pg_options, else its env, else the inherited env."""
    if name != "resident":
        return None
    return (pg_options.get("path") or env.get("RESIDENT_PATH")
            or os.environ.get("RESIDENT_PATH") or "auto")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device
    cuda = device == "cuda"
    try:
        backends = [b.strip() for b in (args.backends or (DEFAULT_CUDA_BACKENDS if cuda else
                                                          DEFAULT_BACKENDS)).split(",")
                    if b.strip()]
        if not backends:
            raise ValueError("no backends given")
        specs = [parse_backend_spec(b) for b in backends]
        world_sizes = parse_int_list(args.world_sizes or
                                     (QUICK_WORLD_SIZES if args.quick else DEFAULT_WORLD_SIZES),
                                     "world size")
        if any(w < 1 for w in world_sizes):
            raise ValueError("world sizes must be >= 1")
        sizes = parse_sizes(args.sizes or (
            (QUICK_SIZES_CUDA if cuda else QUICK_SIZES) if args.quick else DEFAULT_SIZES))
        ops = parse_ops(args.ops)
        modes = parse_modes(args.mode or DEFAULT_MODES.get(device, "eager"))
        if "graph" in modes and not cuda:
            raise ValueError("mode 'graph' needs --device cuda")
    except ValueError as e:
        parser.error(str(e))
    td = TIMING_DEFAULTS.get(device, TIMING_DEFAULTS["cpu"])
    iters = args.iters if args.iters is not None else (0.3 if args.quick else 1.0)
    reps = args.reps if args.reps is not None else (7 if args.quick else td["reps"])
    rep_ms = args.rep_ms if args.rep_ms is not None else td["rep_ms"]
    cell_s = args.cell_s if args.cell_s is not None else td["cell_s"]
    max_batch = args.max_batch if args.max_batch is not None else td["max_batch"]
    if iters <= 0 or reps < 1 or args.warmup < 1 or args.rounds < 1 or max_batch < 1:
        parser.error("--iters must be > 0, --reps, --warmup, --rounds and --max-batch >= 1")

    for k, v in args.env:
        os.environ[k] = v   # inherited by the spawned ranks; the parent never uses a backend

    labels = backend_labels(backends)
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
    meta = _metadata(args, argv)
    floors = None
    if args.floors:
        try:
            floors = _bench_cuda().load_floors(args.floors)
            meta["floors"] = {k: floors[k] for k in ("path", "cross_process_flag_us",
                                                     "gpu_cpu_gpu_flag_us", "data_floor_sm_us",
                                                     "warnings", "contents")}
        except (OSError, ValueError) as e:
            meta["floors"] = {"path": os.path.abspath(args.floors),
                              "error": f"{type(e).__name__}: {e}"}
            _log(f"  WARNING: --floors {args.floors}: {e}; no ratios to the floors")
    _log(f"resident_pg.bench: backends {labels}, world sizes {world_sizes}, "
         f"{len(ops)} ops x {len(sizes)} sizes, device {device}, modes {modes}, reps {reps}, "
         f"iters x{iters:g}, {meta['cpu_count']} cpus")
    if meta["env"]:
        _log(f"  RESIDENT_* env: {meta['env']}")
    load = meta["loadavg_start"]
    if load and meta["cpu_count"] and load[0] > 0.5 * meta["cpu_count"]:
        _log(f"  WARNING: machine busy (load average {load[0]:.2f} on {meta['cpu_count']} cpus); "
             f"timings will be noisy")

    t_run = time.time()
    rows: List[dict] = []
    groups: List[dict] = []
    errors: List[dict] = []
    group_labels: List[str] = []
    for ws, rnd in ((w, r) for w in world_sizes for r in range(args.rounds)):
        ws_ops = [o for o in ops if not (o == "send_recv" and ws < 2)]
        cells = [(i, op, s) for i, (op, s) in enumerate((op, s) for op in ws_ops for s in sizes)]
        for mode, (spec, variant) in ((m, v) for m in modes for v in zip(specs, labels)):
            backend, pg_options, venv = spec
            label0 = variant if len(modes) == 1 else f"{variant} {mode}"
            if label0 not in group_labels:
                group_labels.append(label0)
            label = label0 if args.rounds == 1 else f"{label0} round {rnd + 1}/{args.rounds}"
            gcfg = dict(cfg, mode=mode, pg_options=pg_options, env=venv,
                        imports=imports + [m for m in [BACKEND_MODULES.get(backend)]
                                           if m and m not in imports])
            g = GroupRun(ws, backend, label0, cells, gcfg, args)
            t0 = time.time()
            if args.time_limit is not None and t0 - t_run > args.time_limit:
                g.skip_reason = f"not run (--time-limit {args.time_limit:g} s reached)"
                g.errors.append({"attempt": -1, "status": "time_limit", "error": g.skip_reason})
                _log(f"[ws={ws} {label}] skipped: --time-limit {args.time_limit:g} s reached")
            else:
                _log(f"[ws={ws} {label}] launching {ws} ranks, {len(cells)} cells ...")
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
            tags = {"device": device, "mode": mode, "variant": variant,
                    "path": seen[0] if len(seen) == 1 else configured,
                    "path_configured": configured, "pg_options": pg_options,
                    "env_options": venv}
            grows = aggregate(g, tags)
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
    rows = combine_rounds(round_rows, args.rounds)
    meta["loadavg_end"] = _loadavg()
    if cuda:
        gpu = next((i["device"] for gr in groups for i in gr["rank_info"].values()
                    if "device" in i), None)
        meta["gpu"] = gpu
        meta["cuda_mps_pipe_directory"] = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        _bench_cuda().annotate_rows(rows, floors)

    git = meta["git"]
    print(f"resident_pg.bench on {meta['hostname']} ({meta['cpu_count']} cpus, load "
          f"{meta['loadavg_start']}), torch {meta['torch_version']}, {meta['date']}, "
          f"commit {(git['commit'] or 'none')[:12]}{' (dirty)' if git['dirty'] else ''}")
    print(f"device {device}"
          + (f" ({meta['gpu'].get('name')}, MPS pipe {meta['cuda_mps_pipe_directory']})"
             if cuda and meta.get("gpu") else "")
          + f", mode {','.join(modes)}, float32, reps {reps}, iters x{iters:g}"
          + (f", RESIDENT_* env {meta['env']}" if meta["env"] else ", no RESIDENT_* env"))
    if cuda:
        bc = _bench_cuda()
        bc.print_cuda_tables(rows, world_sizes, modes, labels, ops, sizes, floors, args.spread)
        if baseline:
            print_tables(rows, world_sizes, ops, sizes, group_labels, baseline, args.spread,
                         args.rounds)
        results = bc.evaluate_targets(rows, floors, sizes)
        tline = "\n".join(t["line"] for t in results)
        target_doc: Dict[str, Any] = {"cuda_targets": results, "line": tline}
    else:
        print_tables(rows, world_sizes, ops, sizes, group_labels, baseline, args.spread,
                     args.rounds)
        tline = target_line(rows, labels)
        target_doc = {**TARGET, "line": tline}
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

    if args.json:
        doc = {
            "schema": SCHEMA,
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
                "backend_modules": {sp[0]: BACKEND_MODULES[sp[0]] for sp in specs
                                    if sp[0] in BACKEND_MODULES},
                "statistic": "per rank: median/p10/p90 over repetitions of (batch time / "
                             "batch); reported: max over ranks; send_recv: one-way = "
                             "round trip / 2" + (
                                 "; cuda: a repetition ends with a synchronize of the current stream; "
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
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=True)
        os.replace(tmp, args.json)
        _log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
