"""Shared pieces of the CUDA test suite (tests/test_cuda_*.py).

The GPU machine has ONE GPU: N ranks are N processes all on cuda:0 (under the MPS
daemon, which the launcher starts).  Every rank calls
``torch.cuda.set_device(rank % torch.cuda.device_count())`` before
``init_process_group`` (so the jobs run with ``init=False`` and initialise
themselves, see :func:`setup_rank`).

Dry run: with ``RESIDENT_GPU_TESTS_DEVICE=cpu`` (read only by the CUDA test
modules) the same test bodies run on CPU tensors through the resident backend,
so that data generation, references and comparisons can be checked on a machine
without a GPU.  In that mode the modules do NOT carry the ``gpu`` marker (the
conftest would skip them), so select the files explicitly::

    RESIDENT_GPU_TESTS_DEVICE=cpu python -m pytest -q tests/test_cuda_*.py -p no:cacheprovider

Graph capture and the device-side parts of the timeout test need CUDA; in the
dry run a "graph" is its capture function called eagerly on every replay.

Shared helpers besides the data ones: :func:`warm_up_on_side_stream` and
:func:`capture_replay` (graph programs with ``name``, ``fill``, ``step``, ``check``), and rank
0's side of a device-side timeout, :func:`timeout_phase` (test_cuda_faults).

``RESIDENT_GPU_TESTS_WS`` (default ``2,4,8``) limits the world sizes of the
collective and graph jobs (the collectives' 9-rank jobs run with the 8-rank ones).
``RESIDENT_GPU_TESTS_TIME_SCALE`` multiplies every job timeout (default 1 on
the GPU, 6 in the dry run, whose 8-rank jobs share a 2-core machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import traceback

import pytest

import dist_harness as H
from dist_harness import itemsize, make_input, tdtype

DRY_RUN: bool = os.environ.get("RESIDENT_GPU_TESTS_DEVICE", "").strip().lower() == "cpu"
DEVICE: str = "cpu" if DRY_RUN else "cuda"
ON_GPU: bool = not DRY_RUN
TIME_SCALE: float = float(os.environ.get("RESIDENT_GPU_TESTS_TIME_SCALE", "6" if DRY_RUN else "1"))
PATHS = ("direct", "proxy")
# RESIDENT_GPU_TESTS_WS=2,4 drops the 8-rank jobs (a knob for short device time; default all)
WORLD_SIZES = tuple(int(x) for x in os.environ.get("RESIDENT_GPU_TESTS_WS", "2,4,8").split(",")
                    if x.strip())
MiB = 1 << 20
ALL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")
REDUCED_DTYPES = ("float32", "bfloat16", "int64")  # the 8-rank matrix
SIZE_LABELS = ("8B", "4KiB", "64KiB", "large")


def module_marks():
    """pytestmark for a CUDA test module: gpu (except in the dry run) and resident_only."""
    marks = [pytest.mark.resident_only]
    if not DRY_RUN:
        marks.append(pytest.mark.gpu)
    return marks


def n_elems(label: str, dtype_name: str) -> int:
    """Element count of one message: 8 B, 4 KiB, 64 KiB, or 1 MiB + 3 elements."""
    isz = itemsize(dtype_name)
    if label == "large":
        return MiB // isz + 3
    nbytes = {"8B": 8, "4KiB": 4096, "64KiB": 65536}[label]
    return max(1, nbytes // isz)


def sizes_for(dtype_name: str):
    return [(lab, n_elems(lab, dtype_name)) for lab in SIZE_LABELS]


# --------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------


def setup_rank(rank, ws, *, timeout_s=None, init=True):
    """Pick the device (before init, as the contract says), then init_process_group."""
    import torch

    if ON_GPU:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda").add_(1)  # the CUDA context exists before the group
    if init:
        H.init_pg(timeout_s=timeout_s)


def dev(t):
    """A CPU tensor -> a fresh tensor on DEVICE (never aliasing the CPU original)."""
    return t.to(DEVICE, copy=True)


def host(t):
    """A DEVICE tensor -> CPU (ordered after everything on the current stream)."""
    return t.detach().to("cpu", copy=True)


def sentinel_value(dtype_name):
    """The recognisable non-result value that output buffers are filled with."""
    return 123 if dtype_name == "uint8" else (-77 if dtype_name.startswith("int") else -77.25)


def sentinel(n, dtype_name, shape=None):
    """An output buffer on DEVICE pre-filled with a recognisable non-result value."""
    import torch

    t = torch.full((n,), sentinel_value(dtype_name), dtype=tdtype(dtype_name), device=DEVICE)
    return t.reshape(shape) if shape is not None else t


def inputs_for(key, ws, n, dtype_name, kind="normal"):
    return [make_input(key, r, n, dtype_name, kind) for r in range(ws)]


def call(fn, async_op, label):
    """fn(async_op) -> Work or None; with async_op the Work is waited on.  Returns errors."""
    w = fn(async_op)
    if async_op:
        if w is None:
            return [f"{label}: async_op=True returned None instead of a Work"]
        w.wait()
    return []


def is_async(*indices) -> bool:
    """Alternate sync / async over (dtype index, size index, ...) so that every op x dtype
    gets both modes and every size is seen in both modes across dtypes."""
    return sum(indices) % 2 == 1


def reduce_op(name):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


def kind_for(op, dtype_name):
    if op == "PRODUCT" and H.is_float_name(dtype_name):
        return "near1"
    if op == "AVG" and not H.is_float_name(dtype_name):
        return "avg"
    return "normal"


def pair_exchange(rank, partner, send, recv, tag):
    """Blocking send/recv with ``partner``, the even rank of the pair sending first."""
    import torch.distributed as dist

    if rank % 2 == 0:
        dist.send(send, dst=partner, tag=tag)
        dist.recv(recv, src=partner, tag=tag)
    else:
        dist.recv(recv, src=partner, tag=tag)
        dist.send(send, dst=partner, tag=tag)


def ring_post(rank, send, right, recv, left, tag):
    """isend to ``right`` and irecv from ``left``, the irecv posted first on even ranks and the
    isend first on odd ones; returns (recv work, send work)."""
    import torch.distributed as dist

    if rank % 2 == 0:
        wr = dist.irecv(recv, src=left, tag=tag)
        return wr, dist.isend(send, dst=right, tag=tag)
    wsend = dist.isend(send, dst=right, tag=tag)
    return dist.irecv(recv, src=left, tag=tag), wsend


def store_agree(tag, rank, ws, ok: bool, timeout_s=60.0) -> bool:
    """All ranks agree through the parent's TCPStore (never through the backend under
    test) whether a step succeeded everywhere; used before replaying captured graphs."""
    import datetime

    store = H.connect_store()
    store.set(f"agree/{tag}/{rank}", b"1" if ok else b"0")
    keys = [f"agree/{tag}/{r}" for r in range(ws)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    return all(store.get(k) == b"1" for k in keys)


def exc_text(e):
    """An exception as text for a problem list: type, message and a short traceback."""
    return f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=6)


# ---- CUDA graphs (dry run: the capture function is called eagerly on every replay) ----------


def warm_up_on_side_stream(prog, side=None, key="warm"):
    """prog.fill(key) and prog.step() once, eagerly, on a side stream (as torch recommends
    before a capture); returns prog.check(...) -> (errors, digests).

    ``prog`` has ``name``, ``fill(key)``, ``step()`` and ``check(label)``."""
    import torch

    if side is None and ON_GPU:
        side = torch.cuda.Stream()
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        prog.fill(key)
        prog.step()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    return prog.check(f"{prog.name} warm-up")


def capture_replay(step):
    """``step`` captured into a CUDA graph; returns a callable that replays it (and keeps the
    graph alive).  Dry run: returns ``step`` itself (a "replay" runs the ops eagerly)."""
    import torch

    if not ON_GPU:
        return step
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


# ---- device-side timeout (rank 0's side; used by test_cuda_faults) ---

DEVICE_LIMIT_S = 30  # GPU work after a timed-out collective must complete within this
NAMES_RANK_1 = re.compile(r"rank\D{0,3}1\b", re.IGNORECASE)
MENTIONS_TIME = re.compile(r"time", re.IGNORECASE)


def check_all_reduce(rank, ws, key, group):
    """One 16 KiB float32 SUM all_reduce on ``group``, checked; raises AssertionError."""
    import torch.distributed as dist

    ins = [make_input(key, r, 4099, "float32") for r in range(ws)]
    t = dev(ins[rank])
    dist.all_reduce(t, group=group)
    errs = H.compare_reduction(host(t), H.reference_reduce(ins, "SUM", "float32"), ins, "SUM",
                               "float32", key)
    if errs:
        raise AssertionError(errs)


def wait_device(t0, limit_s=DEVICE_LIMIT_S):
    """Poll an event recorded now on the current stream; seconds since t0 when it completed,
    or None if it did not within limit_s of t0."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        if time.monotonic() - t0 > limit_s:
            return None
        time.sleep(0.02)
    return time.monotonic() - t0


def exc_info(e, t0):
    return {"type": type(e).__name__, "is_runtime_error": isinstance(e, RuntimeError),
            "message": str(e), "at_s": time.monotonic() - t0}


def timeout_phase(rank, ws, tg):
    """Rank 0's side of one timeout: the all_reduce (4099 float32) rank 1 never joins, then the
    checks.  Returns {"raised": [(where, exc_info)], "device_done_s", "synchronize",
    "next_device_done_s", "cuda_usable", "stuck"} (device keys only on the GPU)."""
    import torch
    import torch.distributed as dist

    res = {"raised": []}
    x = dev(make_input("cuda/tmo/x", 0, 4099, "float32"))
    t0 = time.monotonic()
    work = None
    try:
        work = dist.all_reduce(x, group=tg, async_op=True)
    except Exception as e:  # noqa: BLE001
        res["raised"].append(("all_reduce call", exc_info(e, t0)))
    if ON_GPU:
        res["device_done_s"] = wait_device(t0)
        if res["device_done_s"] is None:
            res["stuck"] = True  # the GPU is stuck: report it, do nothing more on it
            return res
        try:
            torch.cuda.synchronize()
            res["synchronize"] = "ok"
        except Exception as e:  # noqa: BLE001
            res["synchronize"] = f"{type(e).__name__}: {e}"
    if work is not None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            res["raised"].append(("work.wait()", exc_info(e, t0)))
    try:
        y = dev(make_input("cuda/tmo/y", 0, 4099, "float32"))
        dist.all_reduce(y, group=tg)
        if ON_GPU:
            res["next_device_done_s"] = wait_device(time.monotonic())
            if res["next_device_done_s"] is None:
                res["stuck"] = True
                return res
    except Exception as e:  # noqa: BLE001
        res["raised"].append(("next all_reduce", exc_info(e, t0)))
    if ON_GPU:
        try:
            v = (torch.arange(100, device="cuda", dtype=torch.int64) * 3).sum().item()
            res["cuda_usable"] = v == 3 * 4950 or f"wrong value {v}"
        except Exception as e:  # noqa: BLE001
            res["cuda_usable"] = f"{type(e).__name__}: {e}"
    return res


# --------------------------------------------------------------------------
# Parent side: one spawned job per (world size, path)
# --------------------------------------------------------------------------


# Variants of a path: "PATH+knob+knob" runs PATH with these settings of the CUDA path's knobs.
PATH_KNOBS = {
    "own": {"RESIDENT_GPU_P2P_STREAM": "own"},        # send/recv launched at once on their own streams
    # one block per op: several 2 KiB parts per block, one trigger over them (proxy path)
    "blocks1": {"RESIDENT_GPU_MAX_BLOCKS": "1"},
    # direct peers: LL lines for every op (the default, simple, sends payload + one flag per part
    # for ops whose first round to a direct peer exceeds half a chunk)
    "ll": {"RESIDENT_GPU_PROTOCOL": "ll"},
    # every peer over the tcp transport, even on one host (the cross-host path; every peer is
    # then proxied, so it goes with the proxy path: RESIDENT_PATH=direct refuses to form)
    "tcp": {"RESIDENT_TRANSPORT": "tcp"},
    # every channel starts at the last round number before the 32-bit wrap: the job's first round
    # with each peer has generation 0 over memory no round has written, and every later op runs
    # past the wrap (a long-running group gets there after 2^32 rounds with a peer)
    "wrap": {"RESIDENT_GPU_FIRST_ROUND": str(2**32 - 1)},
}
# Knobs that choose the transport rather than a setting of the CUDA path: a path with only
# these runs a suite's whole matrix, not the reduced one of the variants.
TRANSPORT_KNOBS = ("tcp",)
# 2-rank jobs over the reduced dtypes that cover the knobs' other settings.
PATH_VARIANTS = ("proxy+blocks1", "direct+ll", "direct+wrap", "proxy+wrap")
# More ranks for the settings whose device code differs with the number of partners.
WIDE_VARIANTS = ((4, "direct+ll"), (8, "direct+ll"))


def path_env(path):
    base, *knobs = path.split("+")
    env = {"RESIDENT_PATH": base}
    for k in knobs:
        env.update(PATH_KNOBS[k])
    return env


def is_variant(path) -> bool:
    """Whether ``path`` sets knobs of the CUDA path (the transport's knobs do not count)."""
    return any(k not in TRANSPORT_KNOBS for k in path.split("+")[1:])


# The jobs of the collectives matrix (test_cuda_collectives, test_cuda_async_ops): both paths at
# 2, 4, 8 and WIDE_GROUP_WS ranks; the knobs' non-default settings (one block per op, LL lines
# for every direct op, round numbers that wrap) at 2 ranks (LL lines also 4 and 8), over the
# reduced dtypes.
# WIDE_GROUP_WS ranks: a group of an odd size, larger than one host's 8 GPUs (the other jobs'
# sizes are powers of two); its jobs run with the 8-rank ones.
WIDE_GROUP_WS = 9
COLLECTIVE_KEYS = [(ws, p) for ws in (2, 4, 8, WIDE_GROUP_WS) for p in PATHS]
COLLECTIVE_JOB_KEYS = [k for k in COLLECTIVE_KEYS
                       if k[0] in WORLD_SIZES or (k[0] == WIDE_GROUP_WS and 8 in WORLD_SIZES)]
COLLECTIVE_VARIANT_KEYS = [(2, v) for v in PATH_VARIANTS if 2 in WORLD_SIZES]
COLLECTIVE_VARIANT_KEYS += [(ws, v) for ws, v in WIDE_VARIANTS if ws in WORLD_SIZES]


def collective_params(cases, keys, case_dtype=None):
    """pytest params (cid, ws, path) of the collectives matrix at ``keys``: 8-rank jobs and knob
    variants run only the cases of REDUCED_DTYPES and the dtype-free ones (``case_dtype``: cid ->
    dtype name, None or absent for a dtype-free case)."""
    case_dtype = case_dtype or {}
    out = []
    for ws, path in keys:
        for cid in cases:
            reduced = ws >= 8 or is_variant(path)
            if reduced and case_dtype.get(cid) not in (None,) + REDUCED_DTYPES:
                continue
            out.append(pytest.param(cid, ws, path, id=f"{cid}-ws{ws}-{path}"))
    return out


class GpuJobCache:
    """Like dist_harness.JobCache, keyed by (ws, path): each job runs with
    RESIDENT_PATH=path, init=False (the rank sets its device, then initialises),
    and exactly the cases pytest selected.  It also records the /dev/shm entries
    named resident* that appeared during the job and were still there after it.
    ``env`` given to :meth:`check` (e.g. network namespaces, only known to a fixture) is added
    to the environment of the key's job when it runs."""

    def __init__(self, registry, job_fn, test_name, timeout_s=90, init_timeout_s=30):
        self.registry = registry
        self.job_fn = job_fn
        self.test_name = test_name
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self.results = {}
        self.shm_left = {}
        self.wall = {}

    def _selected(self, key, session):
        ws, path = key
        return {
            it.callspec.params["cid"]
            for it in session.items
            if getattr(it, "originalname", None) == self.test_name
            and hasattr(it, "callspec")
            and it.callspec.params.get("ws") == ws
            and it.callspec.params.get("path") == path
        }

    def get(self, key, session, ids=None, env=None):
        if key not in self.results:
            ws, path = key
            if ids is None:
                selected = self._selected(key, session)
                ids = [c for c in self.registry.runnable(ws) if c in selected]
            before = set(H.list_shm())
            t0 = time.monotonic()
            try:
                per_rank = H.run_ranks(self.job_fn, ws, args=(ids,), env={**path_env(path), **(env or {})},
                                       init=False,
                                       timeout_s=self.timeout_s * TIME_SCALE,
                                       init_timeout_s=self.init_timeout_s)
                self.results[key] = (per_rank, None)
            except H.RanksFailed as e:
                self.results[key] = (None, str(e))
            self.wall[key] = time.monotonic() - t0
            self.shm_left[key] = H.new_shm_entries(before)
        return self.results[key]

    def shm_left_after(self, key, session, short_ids):
        """(/dev/shm entries named resident* the job of ``key`` left, whether it failed); the
        entries are removed. A key not run in this session (the shm test selected alone) gets
        a short job of ``short_ids``."""
        if key not in self.results:
            self.get(key, session, ids=short_ids)
        left = self.shm_left[key]
        if left:
            H.remove_shm(left)
        return left, self.results[key][1] is not None

    def check(self, cid, key, session, env=None):
        per_rank, job_err = self.get(key, session, env=env)
        if job_err is not None:
            pytest.fail(f"the ws={key[0]} path={key[1]} job of {self.test_name} failed as a whole:\n"
                        f"{job_err}", pytrace=False)
        problems = H.case_problems(per_rank, self.registry, cid)
        if problems:
            pytest.fail(f"{cid} ws={key[0]} path={key[1]}:\n" + "\n".join(problems[:40]),
                        pytrace=False)


def device_timeout_problems(v: dict, desc: str, limit_s: float, what: str) -> tuple:
    """Checks of a device-side timeout job's outcome ``v`` (test_cuda_faults):
    (problems with the GPU not hanging, problems with the host error). ``what``: how rank 1 failed
    its peer; ``limit_s``: by when the error must have surfaced."""
    gpu = []
    if v.get("device_done_s") is None:
        gpu.append(f"the GPU work after an all_reduce whose peer never came did not complete within "
                   f"{DEVICE_LIMIT_S}s: the kernel does not give up")
    if v.get("synchronize") != "ok":
        gpu.append(f"torch.cuda.synchronize() after the timeout: {v.get('synchronize')}")
    if v.get("next_device_done_s", 0.0) is None:
        gpu.append("the collective issued after the timeout hung the GPU")
    if v.get("cuda_usable") is not True:
        gpu.append(f"CUDA context after the timeout: {v.get('cuda_usable')}")
    if not v["raised"]:
        return gpu, [f"neither work.wait() nor the next collective raised after rank 1 {what}\n{desc}"]
    where, e = v["raised"][0]
    host = []
    if not e["is_runtime_error"]:
        host.append(f"{where} raised {e['type']}, expected RuntimeError / DistBackendError")
    if not NAMES_RANK_1.search(e["message"]):
        host.append(f"{where}: the message does not name rank 1")
    if not MENTIONS_TIME.search(e["message"]):
        host.append(f"{where}: the message does not mention the timeout")
    if e["at_s"] > limit_s:
        host.append(f"{where} raised only {e['at_s']:.1f}s after the call (limit {limit_s:.0f}s)")
    if host:
        host.append(f"message: {e['message']!r}\n{desc}")
    return [g + f"\n{desc}" for g in gpu], host
