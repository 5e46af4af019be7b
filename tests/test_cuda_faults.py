"""Faults and bad input with CUDA tensors.

Device-side timeout (one 2-rank job, both paths): the ranks share two subgroups whose
timeout is 3 s, one on the direct path and one made with pg_options={"path": "proxy"};
after a few good all_reduces on each, rank 1 stops calling (it stays alive, waiting for
rank 0's "done" key in the parent's store, so that the failure is a timeout, not a peer
that exited).  On each subgroup in turn, rank 0 calls all_reduce(async_op=True) on a
CUDA tensor:

* the GPU must not hang: an event recorded after the collective completes within 30 s
  and torch.cuda.synchronize() returns without a CUDA error (the kernel gives up);
* the error must then surface on the host: work.wait() or the next collective on the
  group raises RuntimeError / DistBackendError, naming rank 1 and a timeout;
* the CUDA context is still usable afterwards.

Bad input (2 ranks, one job, each call on a fresh subgroup so that one rejected call
cannot affect the next): CUDA and CPU tensors mixed in one call, and non-contiguous CUDA
tensors, must raise ValueError naming the problem on every rank; the world group still
works afterwards.

Abort (2 ranks, one job): checked eager and graph-replayed CUDA all_reduces on the world
group (direct) and a proxy-path subgroup, then torch.distributed's _abort_process_group(); it
returns in time, the device drains, nothing is left in /dev/shm, and a second world in the same
process works.

Destroy right after the last op (3 ranks, the proxy path over shm and over tcp): one rank joins
an all_reduce, or sends to the others, 20 ms late and destroys its group at once; the others'
results must be complete and their groups healthy (tests/destroy_after_last_op.py).

Dry run (RESIDENT_GPU_TESTS_DEVICE=cpu): the timeout and abort jobs run on CPU tensors (no
device checks) and the device-mix cases are skipped.
"""

from __future__ import annotations

import datetime
import re
import time

import pytest

import cuda_harness as C
import destroy_after_last_op
import dist_harness as H
from cuda_harness import dev, sentinel
from dist_harness import make_input

pytestmark = C.module_marks()

GROUP_TIMEOUT_S = 3


def _timeout_job(rank, ws):
    """World group on the direct path (env); two 3 s subgroups: one on the direct path,
    one with pg_options={"path": "proxy"}.  Both are warmed up, then rank 0 runs one
    timeout on each while rank 1 waits in the store."""
    import torch
    import torch.distributed as dist

    import resident_pg

    C.setup_rank(rank, ws)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    groups = {path: dist.new_group(list(range(ws)), backend="resident", timeout=timeout,
                                   pg_options={"path": path})
              for path in C.PATHS}
    for path, g in groups.items():
        for i in range(2):
            C.check_all_reduce(rank, ws, f"cuda/tmo/warm/{path}/{i}", g)
    if C.ON_GPU:
        torch.cuda.synchronize()
    store = H.connect_store()
    if rank != 0:
        # never calls the all_reduces rank 0 calls; stays alive until rank 0 is done
        store.wait(["cuda_timeout/done"], datetime.timedelta(seconds=120))
        return {"role": "absent"}
    out = {}
    try:
        for path, g in groups.items():
            peers = resident_pg.describe(g, device=C.DEVICE)["peers"]
            out[path] = C.timeout_phase(rank, ws, g)
            out[path]["paths"] = sorted({v["path"] for p, v in peers.items() if p != rank})
            if out[path].get("stuck"):
                break
        return out
    finally:
        store.set("cuda_timeout/done", b"1")


_TIMEOUT: dict = {}


def _caller(path):
    if "r" not in _TIMEOUT:
        _TIMEOUT["r"] = H.run_ranks_collect(
            _timeout_job, 2, env=C.path_env("direct"), init=False, init_timeout_s=60,
            timeout_s=120 * C.TIME_SCALE, stop_when_done=[0], destroy_grace_s=15)
    outcomes = _TIMEOUT["r"]
    o = outcomes[0]
    desc = "\n".join(x.describe() + (f"\n  value: {x.value!r}" if x.value is not None else "")
                     for x in outcomes)
    if o.status != "ok":
        pytest.fail(f"rank 0 did not get through the timeout job:\n{desc}", pytrace=False)
    if path not in o.value:
        pytest.fail(f"the {path} phase did not run (the GPU was stuck in an earlier phase):\n{desc}",
                    pytrace=False)
    v = o.value[path]
    if v["paths"] != [path]:
        pytest.fail(f"the subgroup made with pg_options={{'path': {path!r}}} reports paths {v['paths']}",
                    pytrace=False)
    return v, desc


@pytest.mark.skipif(C.DRY_RUN, reason="device-side behaviour needs CUDA")
@pytest.mark.parametrize("path", C.PATHS)
def test_device_timeout_gpu_does_not_hang(path):
    v, desc = _caller(path)
    gpu, _ = C.device_timeout_problems(v, desc, C.DEVICE_LIMIT_S, "stopped calling")
    assert not gpu, "\n".join(gpu)


@pytest.mark.parametrize("path", C.PATHS)
def test_device_timeout_error_surfaces_naming_peer(path):
    v, desc = _caller(path)
    _, host = C.device_timeout_problems(v, desc, C.DEVICE_LIMIT_S, "stopped calling")
    assert not host, "\n".join(host)


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------

DEVICE_MIX = re.compile(r"device|cpu.*cuda|cuda.*cpu", re.IGNORECASE)
CONTIGUOUS = re.compile(r"contiguous", re.IGNORECASE)
BAD = {
    # name: (needs CUDA, message pattern)
    "all_gather_cuda_input_cpu_outputs": (True, DEVICE_MIX),
    "all_gather_one_cpu_output": (True, DEVICE_MIX),
    "all_gather_into_tensor_cpu_output": (True, DEVICE_MIX),
    "all_to_all_single_cpu_input_cuda_output": (True, DEVICE_MIX),
    "all_reduce_non_contiguous": (False, CONTIGUOUS),
    "all_gather_into_tensor_non_contiguous_output": (False, CONTIGUOUS),
    "send_recv_non_contiguous": (False, CONTIGUOUS),
}


def _bad_call(name, rank, ws, g):
    import torch
    import torch.distributed as dist

    n = 1031
    mine = dev(make_input(f"cuda/bad/{name}", rank, n, "float32"))
    if name == "all_gather_cuda_input_cpu_outputs":
        dist.all_gather([torch.empty(n) for _ in range(ws)], mine, group=g)
    elif name == "all_gather_one_cpu_output":
        outs = [sentinel(n, "float32") for _ in range(ws - 1)] + [torch.empty(n)]
        dist.all_gather(outs, mine, group=g)
    elif name == "all_gather_into_tensor_cpu_output":
        dist.all_gather_into_tensor(torch.empty(ws * n), mine, group=g)
    elif name == "all_to_all_single_cpu_input_cuda_output":
        dist.all_to_all_single(sentinel(ws * 10, "float32"), make_input("cuda/bad/a2a", rank, ws * 10, "float32"),
                               group=g)
    elif name == "all_reduce_non_contiguous":
        t = mine[: 30 * 31].reshape(30, 31).t()
        assert not t.is_contiguous()
        dist.all_reduce(t, group=g)
    elif name == "all_gather_into_tensor_non_contiguous_output":
        out = sentinel(2 * ws * n, "float32")[::2]
        assert not out.is_contiguous()
        dist.all_gather_into_tensor(out, mine, group=g)
    elif name == "send_recv_non_contiguous":
        t = sentinel(2 * n, "float32")[::2] if rank else mine.repeat(2)[::2]
        assert not t.is_contiguous()
        if rank == 0:
            dist.send(t, dst=1, group=g)
        elif rank == 1:
            dist.recv(t, src=0, group=g)
    else:
        raise AssertionError(name)
    if C.ON_GPU:
        torch.cuda.synchronize()


def _bad_input_job(rank, ws):
    import torch.distributed as dist

    C.setup_rank(rank, ws)
    out = {}
    for name, (needs_cuda, _) in BAD.items():
        if needs_cuda and not C.ON_GPU:
            out[name] = {"skipped": True}
            continue
        g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=10))
        t0 = time.monotonic()
        try:
            _bad_call(name, rank, ws, g)
            out[name] = {"raised": False, "elapsed": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001
            out[name] = {"raised": True, "type": type(e).__name__, "is_value_error": isinstance(e, ValueError),
                         "message": str(e), "elapsed": time.monotonic() - t0}
    try:
        C.check_all_reduce(rank, ws, "cuda/bad/after", dist.group.WORLD)
        out["world_group_still_works"] = None
    except Exception as e:  # noqa: BLE001
        out["world_group_still_works"] = f"{type(e).__name__}: {e}"
    return out


_BAD: dict = {}


def _bad_outcomes():
    if "r" not in _BAD:
        _BAD["r"] = H.run_ranks_collect(_bad_input_job, 2, env=C.path_env("direct"), init=False,
                                        init_timeout_s=30, timeout_s=120 * C.TIME_SCALE,
                                        stop_when_done=[0, 1], destroy_grace_s=10)
    return _BAD["r"]


@pytest.mark.parametrize("what", list(BAD))
def test_bad_cuda_input_raises_value_error(what):
    needs_cuda, pattern = BAD[what]
    if needs_cuda and C.DRY_RUN:
        pytest.skip("needs CUDA tensors")
    problems = []
    for o in _bad_outcomes():
        if o.status != "ok":
            problems.append(o.describe())
            continue
        v = o.value[what]
        if not v["raised"]:
            problems.append(f"rank {o.rank} did not raise")
            continue
        if not v["is_value_error"]:
            problems.append(f"rank {o.rank} raised {v['type']}, expected ValueError: {v['message']!r}")
        if not pattern.search(v["message"]):
            problems.append(f"rank {o.rank}: message does not match /{pattern.pattern}/: {v['message']!r}")
        if v["elapsed"] > 5:
            problems.append(f"rank {o.rank} raised only after {v['elapsed']:.1f}s (validation, not a timeout?)")
    assert not problems, f"{what}:\n" + "\n".join(problems)


def test_world_group_works_after_rejected_calls():
    problems = []
    for o in _bad_outcomes():
        if o.status != "ok":
            problems.append(o.describe())
        elif o.value["world_group_still_works"] is not None:
            problems.append(f"rank {o.rank}: {o.value['world_group_still_works']}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# abort
# --------------------------------------------------------------------------

ABORT_LIMIT_S = 20.0 * C.TIME_SCALE  # _abort_process_group() must return within this


def _abort_job(rank, ws):
    """Two cycles: a world group (direct path) and a subgroup on the proxy path, each with
    checked eager CUDA all_reduces and a captured one replayed with fresh data, then
    torch.distributed's _abort_process_group() of the world. Abort must return in time, the
    device must drain (no kernel left waiting on a peer), and the second cycle — a new world in
    the same process, its CUDA path installed again — must work."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    C.setup_rank(rank, ws, init=False)
    H.connect_store()
    out = {"errors": [], "abort_s": [], "drain_s": []}
    for c in range(2):
        H.init_pg(prefix=f"cuda_abort{c}/")
        sub = dist.new_group(list(range(ws)), backend="resident", pg_options={"path": "proxy"})
        try:
            for name, g in (("world", None), ("proxy subgroup", sub)):
                C.check_all_reduce(rank, ws, f"cuda/abort/{c}/{name}", g)
            static = C.dev(make_input("cuda/abort/static", rank, 2053, "int64"))
            replay = C.capture_replay(lambda: dist.all_reduce(static, group=sub))
            for k in range(3):
                ins = [make_input(f"cuda/abort/{c}/graph{k}", r, 2053, "int64") for r in range(ws)]
                static.copy_(C.dev(ins[rank]))
                replay()
                out["errors"] += H.compare_exact(C.host(static), sum(ins[1:], ins[0].clone()),
                                                 f"cycle {c} graph replay {k}")
        except AssertionError as e:
            out["errors"].append(f"cycle {c}: {e}")
        dist.barrier()  # nobody aborts while a peer still needs it
        t0 = time.monotonic()
        _abort_process_group()
        out["abort_s"].append(time.monotonic() - t0)
        if C.ON_GPU:
            drained = C.wait_device(time.monotonic(), ABORT_LIMIT_S)
            out["drain_s"].append(drained)
            if drained is None:
                out["errors"].append(f"cycle {c}: the device did not drain within "
                                     f"{ABORT_LIMIT_S:.0f}s of _abort_process_group()")
            else:
                torch.cuda.synchronize()
        if dist.is_initialized():
            out["errors"].append(f"cycle {c}: still initialised after _abort_process_group()")
    return out


def test_abort_process_group_with_cuda_ops(shm_snapshot):
    outcomes = H.run_ranks_collect(_abort_job, 2, env=C.path_env("direct"), init=False,
                                   init_timeout_s=30, timeout_s=120 * C.TIME_SCALE)
    problems = H.job_errors(outcomes)
    for o in outcomes:
        slow = [s for s in o.value["abort_s"] if s > ABORT_LIMIT_S] if o.status == "ok" else []
        if slow:
            problems.append(f"rank {o.rank}: _abort_process_group() took {slow} s")
    problems += H.shm_left_problems(shm_snapshot, "after _abort_process_group()")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mode", ["proxy", "tcp"])
@pytest.mark.parametrize("op", ["all_reduce", "send"])
def test_destroy_right_after_the_last_op(op, mode):
    problems = destroy_after_last_op.run(op, mode, C.DEVICE, timeout_s=180 * C.TIME_SCALE)
    assert not problems, "\n".join(problems)
