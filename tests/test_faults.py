"""Faults and bad input.

Faults: in a 3-rank job, rank 1 dies (os._exit), is SIGKILLed by the parent, or
simply stops calling collectives (sleeps).  Ranks 0 and 2 must raise within the
group timeout (5 s) plus slack, and (resident) the message must name rank 1.
After a crash, a fresh job in fresh processes must work.

Bad input (resident): mismatched sizes across ranks, dtype mixes, unsupported
reduce ops and non-contiguous tensors must raise on every rank (never hang,
never return garbage).  Each bad-input case runs in its own job because the
group may be unusable after the error.
"""

from __future__ import annotations

import os
import re
import time

import pytest

import destroy_after_last_op
import dist_harness as H
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce

GROUP_TIMEOUT_S = 5
SLACK_S = 10
FAILING_RANK = 1
WS = 3
SURVIVORS = [r for r in range(WS) if r != FAILING_RANK]
NAMES_RANK_1 = re.compile(r"rank\D{0,3}1\b", re.IGNORECASE)


def _warmup(rank, ws):
    import torch.distributed as dist

    for i in range(3):
        inputs = [make_input(f"fault/warm/{i}", r, 1031, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs = compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                 "float32", "warm-up")
        if errs:
            raise AssertionError(errs)


def _fault_job(rank, ws, mode):
    import torch.distributed as dist

    _warmup(rank, ws)
    big = make_input("fault/big", rank, (4 << 20) // 4 + 1, "float32")
    if rank == FAILING_RANK:
        if mode == "exit":
            time.sleep(0.5)  # the survivors are already waiting inside the collective
            os._exit(1)
        elif mode == "sigkill":
            dist.all_reduce(big.clone(), async_op=True)  # die with a large collective in flight
            H.request_sigkill("fault test")
        elif mode == "sleep":
            time.sleep(120)  # stops calling collectives; the parent kills it
            return {"raised": False, "note": "sleeper woke up"}
        raise AssertionError(f"unknown mode {mode}")
    t0 = time.monotonic()
    try:
        for i in range(20):
            dist.all_reduce(big.clone() if mode == "sigkill" else make_input("fault/x", rank, 4099, "float32"))
        return {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {
            "raised": True,
            "elapsed": time.monotonic() - t0,
            "type": type(e).__name__,
            "is_runtime_error": isinstance(e, RuntimeError),
            "message": str(e),
        }


def _healthy_job(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    for n in (1, 4099, (2 << 20) // 4 + 1):
        inputs = [make_input(f"fault/after/{n}", r, n, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                  "float32", f"after crash n={n}")
    out = torch.empty(ws * 10, dtype=torch.int64)
    inputs = [make_input("fault/after/ag", r, 10, "int64") for r in range(ws)]
    dist.all_gather_into_tensor(out, inputs[rank].clone())
    errs += compare_exact(out, torch.cat(inputs), "all_gather after crash")
    return errs


_FAULT_RESULTS: dict = {}


def fault_outcomes(mode):
    if mode not in _FAULT_RESULTS:
        t0 = time.monotonic()
        outcomes = H.run_ranks_collect(
            _fault_job, WS, args=(mode,), init_timeout_s=GROUP_TIMEOUT_S, timeout_s=90,
            stop_when_done=SURVIVORS, destroy_grace_s=15,
        )
        wall = time.monotonic() - t0
        after = None
        if mode in ("exit", "sigkill"):
            try:
                per_rank = H.run_ranks(_healthy_job, WS, timeout_s=90)
                after = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
            except H.RanksFailed as e:
                after = [str(e)]
        _FAULT_RESULTS[mode] = (outcomes, wall, after)
    return _FAULT_RESULTS[mode]


def _describe(outcomes):
    return "\n".join(o.describe() + (f"\n  value: {o.value!r}" if o.value is not None else "")
                     for o in outcomes)


MODES = ["exit", "sigkill", "sleep"]


@pytest.mark.parametrize("mode", MODES)
def test_survivors_raise_within_timeout(mode):
    outcomes, wall, _ = fault_outcomes(mode)
    failed = outcomes[FAILING_RANK]
    if mode == "exit":
        assert failed.status == "died" and failed.exitcode == 1, _describe(outcomes)
    elif mode == "sigkill":
        assert failed.kill_requested and failed.status == "killed", _describe(outcomes)
    for r in SURVIVORS:
        o = outcomes[r]
        assert o.status == "ok", f"rank {r} did not get through the job:\n{_describe(outcomes)}"
        v = o.value
        assert v["raised"], f"rank {r} never raised although rank {FAILING_RANK} is gone: {v}"
        assert v["elapsed"] <= GROUP_TIMEOUT_S + SLACK_S, (
            f"rank {r} raised only after {v['elapsed']:.1f}s (group timeout {GROUP_TIMEOUT_S}s): {v}"
        )


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", MODES)
def test_error_names_failing_peer(mode):
    outcomes, _, _ = fault_outcomes(mode)
    msgs = []
    for r in SURVIVORS:
        v = outcomes[r].value
        if not (outcomes[r].status == "ok" and v and v.get("raised")):
            pytest.fail(f"rank {r} did not raise:\n{_describe(outcomes)}")
        if not NAMES_RANK_1.search(v["message"]):
            msgs.append(f"rank {r} ({v['type']}): {v['message']!r}")
    assert not msgs, "error messages do not name the failing peer (rank 1):\n" + "\n".join(msgs)


@pytest.mark.parametrize("mode", MODES)
def test_survivors_teardown_does_not_hang(mode):
    outcomes, _, _ = fault_outcomes(mode)
    for r in SURVIVORS:
        assert outcomes[r].destroy_status in ("ok", "error"), (
            f"rank {r}: destroy_process_group after the fault: {outcomes[r].destroy_status} "
            f"(waited 15 s)\n{_describe(outcomes)}"
        )


@pytest.mark.parametrize("mode", ["exit", "sigkill"])
def test_fresh_job_after_crash_works(mode):
    _, _, after = fault_outcomes(mode)
    assert not after, "\n".join(after)


def _two_exits_job(rank, ws):
    import torch
    import torch.distributed as dist

    _warmup(rank, ws)
    if rank == 1:
        os._exit(1)
    if rank == 0:
        time.sleep(1.0)  # exits after rank 1, as a rank that raised on rank 1's death would
        os._exit(1)
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(7, dtype=torch.float32), src=0)  # waits on rank 0 only
        return {"raised": False}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "elapsed": time.monotonic() - t0, "message": str(e)}


@pytest.mark.resident_only
def test_error_names_every_dead_peer():
    """Rank 2 waits on rank 0, which exits after rank 1: the error names both (the root cause
    is not always the awaited peer)."""
    outcomes = H.run_ranks_collect(_two_exits_job, WS, init_timeout_s=GROUP_TIMEOUT_S,
                                   timeout_s=60, stop_when_done=[2], destroy_grace_s=15)
    o = outcomes[2]
    assert o.status == "ok" and o.value["raised"], _describe(outcomes)
    msg = o.value["message"]
    assert NAMES_RANK_1.search(msg) and re.search(r"rank\D{0,3}0\b", msg), msg
    assert o.value["elapsed"] <= GROUP_TIMEOUT_S + SLACK_S, o.value


def _stuck_here_for_good():
    time.sleep(600)


def _one_rank_stuck_job(rank, ws):
    if rank == 1:
        _stuck_here_for_good()
    return rank


def test_harness_reports_where_a_timed_out_rank_hung():
    """The harness (tests/dist_harness.py) asks a rank that outlived the job's timeout for its
    Python stacks before killing it, so a hang in any GPU or CPU test says where it was; the
    dump files do not outlive the job."""
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "resident_test_stack_*")
    before = set(glob.glob(pattern))
    # The bound covers each rank's start (import torch: seconds on a loaded 2-core machine).
    outcomes = H.run_ranks_collect(_one_rank_stuck_job, 2, init=False, timeout_s=20)
    assert outcomes[0].status == "ok" and outcomes[0].value == 0, _describe(outcomes)
    assert outcomes[1].status == "timeout", _describe(outcomes)
    text = outcomes[1].describe()
    assert "_stuck_here_for_good" in text and "_one_rank_stuck_job" in text, text
    assert set(glob.glob(pattern)) <= before


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------


def _bad_input_job(rank, ws, what):
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    garbage = None
    try:
        if what == "mismatched_sizes":
            t = make_input("bad/size", rank, 1000 + 3 * rank, "float32")
            dist.all_reduce(t)
            garbage = t[:4].tolist()
        elif what == "mismatched_sizes_large":
            t = make_input("bad/sizeL", rank, (2 << 20) // 4 + rank, "float32")
            dist.all_reduce(t)
            garbage = t[:4].tolist()
        elif what == "all_gather_dtype_mix":
            out = [torch.empty(10, dtype=torch.float32), torch.empty(10, dtype=torch.float64)]
            out += [torch.empty(10, dtype=torch.float32) for _ in range(ws - 2)]
            dist.all_gather(out, make_input("bad/ag", rank, 10, "float32"))
            garbage = [o.dtype for o in out]
        elif what == "all_gather_dtype_mix_backend":
            # straight to the ProcessGroup (bypasses torch's Python-level dtype check)
            out = [torch.empty(10, dtype=torch.float32), torch.empty(10, dtype=torch.float64)]
            out += [torch.empty(10, dtype=torch.float32) for _ in range(ws - 2)]
            dist.group.WORLD.allgather([out], [make_input("bad/agb", rank, 10, "float32")]).wait()
            garbage = [o.dtype for o in out]
        elif what == "all_gather_into_tensor_dtype_mix_backend":
            out = torch.empty(ws * 10, dtype=torch.float64)
            dist.group.WORLD._allgather_base(out, make_input("bad/agtb", rank, 10, "float32")).wait()
            garbage = out[:4].tolist()
        elif what == "premul_sum":
            op = dist._make_nccl_premul_sum(2.0)
            t = make_input("bad/premul", rank, 10, "float32")
            dist.all_reduce(t, op=op)
            garbage = t[:4].tolist()
        elif what == "band_on_float":
            t = make_input("bad/band", rank, 10, "float32")
            dist.all_reduce(t, op=dist.ReduceOp.BAND)
            garbage = t[:4].tolist()
        elif what == "avg_on_bool":
            t = make_input("bad/avgb", rank, 10, "bool")
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            garbage = t[:4].tolist()
        elif what == "max_on_complex":  # dist.reduce passes complex tensors to the backend as such
            t = make_input("bad/maxc", rank, 10, "complex64")
            dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
            garbage = t[:4].tolist()
        elif what == "unsupported_dtype":
            t = torch.ones(10, dtype=torch.int16)
            dist.all_reduce(t)
            garbage = t[:4].tolist()
        elif what == "non_contiguous":
            base = make_input("bad/nc", rank, 4 * 6, "float32").reshape(4, 6)
            t = base.t()
            assert not t.is_contiguous()
            dist.all_reduce(t)
            garbage = t.reshape(-1)[:4].tolist()
        else:
            raise AssertionError(what)
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "type": type(e).__name__, "message": str(e),
                "ok_type": isinstance(e, (RuntimeError, ValueError)) or "dtype_mix" in what,
                "elapsed": time.monotonic() - t0}
    return {"raised": False, "result": garbage, "elapsed": time.monotonic() - t0}


BAD_INPUT = {
    # what: regex the message must match (None: any message)
    "mismatched_sizes": re.compile(r"size|mismatch", re.IGNORECASE),
    "mismatched_sizes_large": re.compile(r"size|mismatch", re.IGNORECASE),
    "all_gather_dtype_mix": None,
    "all_gather_dtype_mix_backend": None,
    "all_gather_into_tensor_dtype_mix_backend": None,
    "premul_sum": re.compile(r"PREMUL_?SUM", re.IGNORECASE),
    "band_on_float": re.compile(r"BAND", re.IGNORECASE),
    "avg_on_bool": re.compile(r"AVG .*bool"),
    "max_on_complex": re.compile(r"MAX .*complex"),
    "unsupported_dtype": re.compile(r"dtype Short"),
    "non_contiguous": re.compile(r"contiguous", re.IGNORECASE),
}


@pytest.mark.resident_only
@pytest.mark.parametrize("what", list(BAD_INPUT))
def test_bad_input_raises_on_every_rank(what):
    if what == "premul_sum" and not hasattr(__import__("torch").distributed, "_make_nccl_premul_sum"):
        pytest.skip("torch has no _make_nccl_premul_sum")
    timeout = 10
    outcomes = H.run_ranks_collect(_bad_input_job, 2, args=(what,), init_timeout_s=timeout,
                                   timeout_s=60, stop_when_done=[0, 1], destroy_grace_s=10)
    pattern = BAD_INPUT[what]
    problems = []
    for o in outcomes:
        if o.status != "ok":
            problems.append(f"rank {o.rank}: {o.describe()}")
            continue
        v = o.value
        if not v["raised"]:
            problems.append(f"rank {o.rank} did not raise (returned {v['result']!r})")
            continue
        if not v["ok_type"]:
            problems.append(f"rank {o.rank} raised {v['type']}, expected RuntimeError/ValueError: {v['message']!r}")
        if v["elapsed"] > timeout + SLACK_S:
            problems.append(f"rank {o.rank} raised only after {v['elapsed']:.1f}s")
        if pattern is not None and not pattern.search(v["message"]):
            problems.append(f"rank {o.rank}: message does not match /{pattern.pattern}/: {v['message']!r}")
    assert not problems, f"{what}:\n" + "\n".join(problems)


def _cuda_mix_job(rank, ws):
    import torch
    import torch.distributed as dist

    out = [torch.empty(10, device="cuda") for _ in range(ws)]
    out[-1] = torch.empty(10)  # one CPU tensor among CUDA tensors
    try:
        dist.all_gather(out, torch.ones(10, device="cuda"))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


@pytest.mark.gpu
@pytest.mark.resident_only
def test_cuda_cpu_device_mix_raises():
    """A CUDA tensor with a CPU tensor in one call must raise (needs a GPU)."""
    res = H.run_ranks_collect(_cuda_mix_job, 2, init_timeout_s=10, timeout_s=60, stop_when_done=[0, 1])
    for o in res:
        assert o.status == "ok" and o.value is not None, o.describe()


def _small_dev_shm_job(rank, ws):
    """In a mount namespace of its own, /dev/shm as a tmpfs of 64 KiB (less than a rank's
    segment), then of 64 MiB: group creation fails naming /dev/shm, then works."""
    import ctypes

    import torch
    import torch.distributed as dist

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    if libc.unshare(clone_newns) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_private, None) != 0:
        return {"skip": f"no mount namespace here: {os.strerror(ctypes.get_errno())}"}
    out = {}
    for size, prefix in (("64k", "small"), ("64m", "large")):
        if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size}".encode()) != 0:
            return {"skip": f"mount of a tmpfs failed: {os.strerror(ctypes.get_errno())}"}
        try:
            H.init_pg(prefix=prefix)
            t = torch.arange(5, dtype=torch.int64)
            dist.all_reduce(t)
            out[prefix] = t.tolist()
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001
            out[prefix] = f"{type(e).__name__}: {e}"
        out[prefix + "_left"] = sorted(os.listdir("/dev/shm"))
    return out


@pytest.mark.resident_only
def test_small_dev_shm_fails_group_creation_clearly():
    """A /dev/shm too small for a rank's segment (a container's default of 64 MiB against a
    large group) fails group creation with an error that names /dev/shm and how to enlarge it,
    leaving no segment behind, instead of a SIGBUS at the first write to a page past the limit."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a mount namespace")
    out = H.run_ranks(_small_dev_shm_job, 1, init=False, timeout_s=60)[0]
    if "skip" in out:
        pytest.skip(out["skip"])
    assert "/dev/shm has" in out["small"] and "--shm-size" in out["small"], out
    assert out["small_left"] == [], out
    assert out["large"] == [0, 1, 2, 3, 4], out
    assert out["large_left"] == [], out


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(destroy_after_last_op.MODES))
@pytest.mark.parametrize("op", ["all_reduce", "send"])
def test_destroy_right_after_the_last_op(op, mode):
    """A rank that destroys its group right after its last op, the others still waiting inside
    it for its share: they complete (tests/destroy_after_last_op.py)."""
    problems = destroy_after_last_op.run(op, mode, "cpu")
    assert not problems, "\n".join(problems)
