"""The large-message hand-off (docs/handoff.md) on CPU: a ProcessGroupGloo installed as the
hand-off backend stands in for NCCL, so that the adapter's dispatch runs here. Ops below the
crossover must stay resident and ops at or above it must go to gloo (the adapter's per-kind
counters and the profiler's event names say which path served each), with results checked
against references computed from the inputs for several dtypes and odd sizes, sync and async,
in sequences that mix both paths; the sequence number counts both paths' collectives alike.
The policy that turns the NCCL hand-off on or off (resident_pg.handoff.decide) is checked on
fake device lists, and a CUDA group on this GPU-less machine reports it off with its reason.
"""

from __future__ import annotations

import pytest

import dist_harness as H
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce, tdtype

pytestmark = pytest.mark.skipif(not H.IS_RESIDENT, reason="tests resident's own hand-off")

CROSSOVER = 4096  # bytes: sizes below and above it in every case
GROUP_TIMEOUT_S = 60


# --------------------------------------------------------------------------
# The policy, on fake records (no processes)
# --------------------------------------------------------------------------


def _rec(gpu, nbytes=262144, missing=None):
    return {"bytes": nbytes, "gpu": gpu, "missing": missing}


def test_decide_on_with_one_rank_per_gpu():
    from resident_pg import handoff

    assert handoff.decide([_rec("GPU-a"), _rec("GPU-b"), _rec("GPU-c")]) == (262144, None)


def test_decide_off_when_ranks_share_a_gpu():
    from resident_pg import handoff

    crossover, reason = handoff.decide([_rec("GPU-a"), _rec("GPU-b"), _rec("GPU-a")])
    assert crossover == 0
    assert "ranks 0 and 2 share GPU GPU-a" in reason and "one rank per GPU" in reason


def test_decide_off_when_a_rank_cannot_run_nccl():
    from resident_pg import handoff

    crossover, reason = handoff.decide([_rec("GPU-a"), _rec(None, missing="no CUDA device")])
    assert (crossover, reason) == (0, "rank 1 cannot run NCCL: no CUDA device")


def test_decide_off_when_ranks_disagree_or_it_is_zero():
    from resident_pg import handoff

    crossover, reason = handoff.decide([_rec("GPU-a", 4096), _rec("GPU-b", 8192)])
    assert crossover == 0 and "differ (4096, 8192)" in reason
    assert handoff.decide([_rec("GPU-a", 0), _rec("GPU-b", 0)]) == (0, "RESIDENT_HANDOFF_BYTES=0")


def test_decide_cpu_standin_ignores_gpus():
    from resident_pg import handoff

    assert handoff.decide([_rec(None, 4096), _rec(None, 4096)], one_rank_per_gpu=False) == (4096, None)


def test_local_record_names_what_is_missing():
    import torch
    import torch.distributed as dist

    from resident_pg import handoff

    rec = handoff.local_record(1234)
    assert rec["bytes"] == 1234
    if not dist.is_nccl_available():
        assert rec["missing"] == "torch was built without NCCL"
    elif not torch.cuda.is_available():
        assert rec["missing"] == "no CUDA device" and rec["gpu"] is None
    else:
        assert rec["missing"] is None and rec["gpu"]


def test_cpu_standin_value_is_checked(monkeypatch):
    from resident_pg import handoff

    monkeypatch.setenv("RESIDENT_HANDOFF_CPU_STANDIN", "nccl")
    with pytest.raises(ValueError, match="RESIDENT_HANDOFF_CPU_STANDIN must be off or gloo"):
        handoff.cpu_standin()


# --------------------------------------------------------------------------
# Inside the ranks
# --------------------------------------------------------------------------


def _backend(group=None):
    import torch
    import torch.distributed as dist

    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def _forwarded():
    return dict(_backend().handoff()["forwarded"])


def _install_gloo(tag, crossover=CROSSOVER):
    import datetime

    import torch.distributed as dist

    from resident_pg import _backend as B

    store = dist.PrefixStore(f"handoff-test/{tag}/", H.connect_store())
    gloo = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(),
                                 datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    B.handoff._set_handoff(dist.group.WORLD, gloo, crossover)
    return gloo


class _Path:
    """Checks that each op went the expected way: the forwarded count of its kind."""

    def __init__(self, errs):
        self.errs = errs
        self.before = _forwarded()

    def expect(self, kind, forwarded, label):
        after = _forwarded()
        got = after[kind] - self.before[kind]
        if got != (1 if forwarded else 0):
            self.errs.append(f"{label}: {'expected' if forwarded else 'not expected'} to go to "
                             f"gloo, {kind} forwarded count rose by {got}")
        self.before = after


def _ops_check(rank, ws, async_op):
    """Every covered op, below and at/above the crossover, on random data."""
    import torch
    import torch.distributed as dist

    errs = []
    path = _Path(errs)
    seq = _backend()._get_sequence_number_for_group()
    collectives = 0
    mode = "async" if async_op else "sync"

    def done(work):
        if async_op:
            work.wait()

    for dtype in ("float32", "float64", "int32", "int64", "uint8", "bfloat16"):
        isz = H.itemsize(dtype)
        below = max(1, CROSSOVER // isz - 7)  # odd counts on both sides
        above = CROSSOVER // isz + 13
        for n in (below, CROSSOVER // isz, above):
            big = n * isz >= CROSSOVER
            key = f"ho/{mode}/{dtype}/{n}"
            label = f"{mode} {dtype} n={n}"
            inputs = [make_input(f"{key}/ar", r, n, dtype) for r in range(ws)]
            # all_reduce: SUM for numbers (bfloat16: MAX, exact whatever the order)
            op = "MAX" if dtype == "bfloat16" else "SUM"
            t = inputs[rank].clone()
            done(dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=async_op))
            ref = reference_reduce(inputs, op, dtype)
            errs += compare_reduction(t, ref, inputs, op, dtype, f"all_reduce {label}")
            path.expect("all_reduce", big, f"all_reduce {label}")
            collectives += 1
            # broadcast from the last rank
            t = inputs[rank].clone()
            done(dist.broadcast(t, src=ws - 1, async_op=async_op))
            errs += compare_exact(t, inputs[ws - 1], f"broadcast {label}")
            path.expect("broadcast", big, f"broadcast {label}")
            collectives += 1
            # all_gather_into_tensor: n elements per rank
            out = torch.zeros(ws * n, dtype=tdtype(dtype))
            done(dist.all_gather_into_tensor(out, inputs[rank].clone(), async_op=async_op))
            errs += compare_exact(out, torch.cat(inputs), f"all_gather_into_tensor {label}")
            path.expect("all_gather_into_tensor", big, f"all_gather_into_tensor {label}")
            collectives += 1
            # reduce_scatter_tensor: n elements out per rank
            rs_in = [make_input(f"{key}/rs", r, ws * n, dtype) for r in range(ws)]
            out = torch.zeros(n, dtype=tdtype(dtype))
            done(dist.reduce_scatter_tensor(out, rs_in[rank].clone(),
                                            op=getattr(dist.ReduceOp, op), async_op=async_op))
            ref = reference_reduce(rs_in, op, dtype)[rank * n:(rank + 1) * n]
            errs += compare_reduction(out, ref, [x[rank * n:(rank + 1) * n] for x in rs_in], op,
                                      dtype, f"reduce_scatter_tensor {label}")
            path.expect("reduce_scatter_tensor", big, f"reduce_scatter_tensor {label}")
            collectives += 1
            # all_to_all_single, equal splits: n elements per peer
            a_in = [make_input(f"{key}/a2a", r, ws * n, dtype) for r in range(ws)]
            out = torch.zeros(ws * n, dtype=tdtype(dtype))
            done(dist.all_to_all_single(out, a_in[rank].clone(), async_op=async_op))
            want = torch.cat([a_in[r][rank * n:(rank + 1) * n] for r in range(ws)])
            errs += compare_exact(out, want, f"all_to_all_single {label}")
            path.expect("all_to_all_single", big, f"all_to_all_single {label}")
            collectives += 1
            # send/recv in a ring
            dst, src = (rank + 1) % ws, (rank - 1) % ws
            buf = torch.zeros(n, dtype=tdtype(dtype))
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, inputs[rank].clone(), dst),
                                            dist.P2POp(dist.irecv, buf, src)])
            for w in works:
                w.wait()
            errs += compare_exact(buf, inputs[src], f"send/recv {label}")
            after = _forwarded()["send_recv"]
            if after - path.before["send_recv"] != (2 if big else 0):
                errs.append(f"send/recv {label}: forwarded count rose by "
                            f"{after - path.before['send_recv']}, expected {2 if big else 0}")
            path.before = _forwarded()
    got_seq = _backend()._get_sequence_number_for_group() - seq
    if got_seq != collectives:
        errs.append(f"sequence number rose by {got_seq} for {collectives} collectives")
    return errs


def _mixed_async_check(rank, ws):
    """Async ops of both paths in flight together, waited in reverse order."""
    import torch
    import torch.distributed as dist

    errs = []
    before = _forwarded()
    pending = []
    for i, n in enumerate((5, 4096, 1, 70001, 1023, 1025, 33, 20000)):
        dtype = ("int64", "float32", "int32")[i % 3]
        key = f"ho/mix/{i}"
        inputs = [make_input(key, r, n, dtype) for r in range(ws)]
        t = inputs[rank].clone()
        pending.append((dist.all_reduce(t, async_op=True), t, reference_reduce(inputs, "SUM", dtype),
                        inputs, dtype, f"mixed all_reduce {i} ({dtype} n={n})"))
        out = torch.zeros(ws * n, dtype=tdtype(dtype))
        pending.append((dist.all_gather_into_tensor(out, inputs[rank].clone(), async_op=True), out,
                        torch.cat(inputs), None, dtype, f"mixed all_gather {i} ({dtype} n={n})"))
    for work, got, ref, inputs, dtype, label in reversed(pending):
        work.wait()
        if inputs is None:
            errs += compare_exact(got, ref, label)
        else:
            errs += compare_reduction(got, ref, inputs, "SUM", dtype, label)
    after = _forwarded()
    # float32 4096 and 1025 (>= 4096 B), int32 1023 (< 4096 B), int64 70001 and 20000, ...
    want_big = sum(1 for i, n in enumerate((5, 4096, 1, 70001, 1023, 1025, 33, 20000))
                   if n * (8, 4, 4)[i % 3] >= CROSSOVER)
    for kind in ("all_reduce", "all_gather_into_tensor"):
        if after[kind] - before[kind] != want_big:
            errs.append(f"mixed {kind}: {after[kind] - before[kind]} forwarded, expected {want_big}")
    return errs


def _uneven_a2a_stays_resident(rank, ws):
    """all_to_all_single with split sizes stays resident whatever its size."""
    import torch
    import torch.distributed as dist

    errs = []
    before = _forwarded()["all_to_all_single"]
    rows = lambda s, d: 3000 + 7 * s + d  # noqa: E731 (rows rank s sends rank d)
    inputs = {s: [make_input(f"ho/a2av/{s}/{d}", s, rows(s, d), "int64") for d in range(ws)]
              for s in range(ws)}
    out = torch.zeros(sum(rows(s, rank) for s in range(ws)), dtype=torch.int64)
    dist.all_to_all_single(out, torch.cat(inputs[rank]),
                           output_split_sizes=[rows(s, rank) for s in range(ws)],
                           input_split_sizes=[rows(rank, d) for d in range(ws)])
    errs += compare_exact(out, torch.cat([inputs[s][rank] for s in range(ws)]), "uneven a2a")
    if _forwarded()["all_to_all_single"] != before:
        errs.append("all_to_all_single with split sizes was handed off")
    return errs


def _profiler_names(rank, ws):
    """The profiler names the path: resident:all_reduce below, resident:all_reduce->gloo above."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    small = torch.ones(3)
    large = torch.ones(CROSSOVER)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(small)
        dist.all_reduce(large)
        dist.broadcast(large, src=0)
    names = [e.name for e in prof.events()]
    errs = []
    for want in ("resident:all_reduce", "resident:all_reduce->gloo", "resident:broadcast->gloo"):
        if names.count(want) != 1:
            errs.append(f"profiler: {names.count(want)} events named {want!r}, expected 1")
    if "resident:broadcast" in names:
        errs.append("profiler: the handed-off broadcast also has a resident event")
    if float(small[0]) != ws or float(large[-1]) != ws:
        errs.append(f"profiled all_reduce results: {float(small[0])}, {float(large[-1])}")
    return errs


def _errors_are_alike(rank, ws):
    """A dtype resident refuses is refused on both sides of the crossover, before any hand-off."""
    import torch
    import torch.distributed as dist

    errs = []
    for n in (3, CROSSOVER * 2):
        try:
            dist.all_reduce(torch.ones(n, dtype=torch.int16))
            errs.append(f"int16 all_reduce of {n} elements was accepted")
        except ValueError as e:
            if "dtype" not in str(e):
                errs.append(f"int16 all_reduce error does not name the dtype: {e}")
    return errs


def handoff_job(rank, ws):
    import torch.distributed as dist

    import resident_pg

    errs = []
    # One backend serves CPU and CUDA tensors; on this machine its NCCL hand-off is off, for a
    # reason every rank names alike.
    info = resident_pg.describe(None, "cuda")["handoff"]
    if info["on"] or info["reason"] not in ("RESIDENT_HANDOFF_BYTES=0",) and \
            "cannot run NCCL" not in info["reason"]:
        errs.append(f"NCCL hand-off on a GPU-less machine: {info}")
    _install_gloo("main")
    info = resident_pg.describe()["handoff"]
    if not info["on"] or info["backend"] != "gloo" or info["device"] != "cpu" or \
            set(info["crossover_bytes"].values()) != {CROSSOVER}:
        errs.append(f"describe after installing gloo: {info}")
    errs += _ops_check(rank, ws, async_op=False)
    errs += _ops_check(rank, ws, async_op=True)
    errs += _mixed_async_check(rank, ws)
    errs += _uneven_a2a_stays_resident(rank, ws)
    errs += _profiler_names(rank, ws)
    errs += _errors_are_alike(rank, ws)
    dist.barrier()
    return errs, info["reason"]


@pytest.mark.parametrize("ws", (2, 3))
def test_handoff_dispatch_to_gloo_standin(ws):
    per_rank = H.run_ranks(handoff_job, ws, timeout_s=300, init_timeout_s=GROUP_TIMEOUT_S)
    problems = [f"rank {r}: {e}" for r, (errs, _) in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems[:40])


def cuda_reason_job(rank, ws):
    import resident_pg

    return resident_pg.describe(None, "cuda")["handoff"]


def test_nccl_handoff_reported_off_alike_on_every_rank():
    # Off by default, saying so; with a crossover set, off on this machine for its lack of CUDA.
    per_rank = H.run_ranks(cuda_reason_job, 2, timeout_s=120, init_timeout_s=GROUP_TIMEOUT_S)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0]["on"] is False and per_rank[0]["backend"] is None
    assert per_rank[0]["reason"] == "RESIDENT_HANDOFF_BYTES=0", per_rank[0]
    per_rank = H.run_ranks(cuda_reason_job, 2, env={"RESIDENT_HANDOFF_BYTES": "262144"},
                           timeout_s=120, init_timeout_s=GROUP_TIMEOUT_S)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0]["on"] is False and per_rank[0]["backend"] is None
    assert per_rank[0]["reason"] in ("rank 0 cannot run NCCL: no CUDA device",
                                     "rank 0 cannot run NCCL: torch was built without NCCL")


def bad_handoff_job(rank, ws):
    import torch.distributed as dist

    from resident_pg import handoff

    out = []
    gloo = _install_gloo("bad")
    for args, kw in (((dist.group.WORLD, gloo, {"all_reduc": 1}), {}),
                     ((dist.group.WORLD, gloo, 1), {"device": "meta"}),
                     ((dist.group.WORLD, None, 1), {})):
        try:
            handoff._set_handoff(*args, **kw)
            out.append("accepted")
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_bad_handoff_settings_are_clear_errors():
    per_rank = H.run_ranks(bad_handoff_job, 2, timeout_s=120, init_timeout_s=GROUP_TIMEOUT_S)
    unknown, device, none = per_rank[0]
    assert "hand-off op kind 'all_reduc' is unknown" in unknown and "all_reduce" in unknown
    assert "meta" in device
    assert none.startswith(("ValueError", "TypeError"))


# --------------------------------------------------------------------------
# Seeded op mixes (tests/op_mix.py) with the gloo stand-in on every group
# --------------------------------------------------------------------------

MIX_CROSSOVER = 2048
# The reductions stay resident: the op mix issues AVG, which gloo lacks (NCCL has it); so do
# send/recv: the op mix waits on some Works through get_future(), which gloo's send/recv Works
# lack (NCCL's have it). _ops_check covers those kinds' hand-off.
MIX_KINDS = ("broadcast", "all_gather_into_tensor", "all_to_all_single")
MIX_MODES = [("handoff-gloo", {"RESIDENT_HANDOFF_CPU_STANDIN": "gloo",
                               "RESIDENT_HANDOFF_BYTES": str(MIX_CROSSOVER)})]


def op_mix_handoff_job(rank, ws, job):
    """run_modes with the stand-in restricted to MIX_KINDS; also returns how many ops of each
    kind all groups of this rank handed to gloo."""
    from op_mix_run import Hooks, run_modes

    from resident_pg import handoff

    handoff.STANDIN_OPS = MIX_KINDS
    backends = []
    set_up = handoff.set_up

    def recording_set_up(pg, *args):
        set_up(pg, *args)
        backends.append(pg)

    handoff.set_up = recording_set_up
    hooks = Hooks()
    hooks.settle_s = 1.0  # gloo's Works may say completed just after their future did
    out = run_modes(rank, ws, job, hooks)
    total = {}
    for pg in backends:
        for kind, n in pg.handoff()["forwarded"].items():
            total[kind] = total.get(kind, 0) + n
    out["forwarded"] = total
    return out


def _mix_jobs():
    from op_mix_run import OpMixJobs

    return OpMixJobs(op_mix_handoff_job, "test_op_mix_with_handoff", "tests/test_handoff_cpu.py",
                     "cpu", per_mode=False, timeout_s=lambda runs: 120 + 90 * runs,
                     group_timeout_s=GROUP_TIMEOUT_S, modes=MIX_MODES)


MIX_JOBS = None


@pytest.mark.parametrize("ws,mode,seed", [pytest.param(ws, "handoff-gloo", seed,
                                                       id=f"ws{ws}-handoff-gloo-seed{seed}")
                                          for ws in (2, 3) for seed in (1, 2)])
def test_op_mix_with_handoff(ws, mode, seed, request):
    global MIX_JOBS
    MIX_JOBS = MIX_JOBS or _mix_jobs()
    MIX_JOBS.check(ws, mode, seed, request.session)
    per_rank, _err, _wall = MIX_JOBS.get((ws,), request.session)
    forwarded = [r["forwarded"] for r in per_rank]
    # Both paths served ops: some kinds were handed off, and no reduction was.
    assert all(sum(f.get(k, 0) for k in MIX_KINDS) > 0 for f in forwarded), forwarded
    assert all(f.get("all_reduce", 0) == 0 and f.get("reduce_scatter_tensor", 0) == 0
               for f in forwarded), forwarded


def _handoff_agreement_job(rank, ws):
    import torch
    import torch.distributed as dist

    import resident_pg

    try:
        dist.new_group([0, 1], backend="resident",
                       pg_options={"handoff_bytes": 4096 if rank == 0 else 8192})
        differ = "no error"
    except Exception as e:  # noqa: BLE001
        differ = f"{type(e).__name__}: {e}"
    g = dist.new_group([0, 1], backend="resident", pg_options={"handoff_bytes": 0})
    t = torch.arange(4, dtype=torch.int64) * (rank + 3)
    dist.all_reduce(t, group=g)
    return {"differ": differ, "sum": t.tolist(), "off": resident_pg.describe(g)["handoff"]}


@pytest.mark.resident_only
def test_handoff_bytes_must_agree():
    """The hand-off's set-up is one exchange every rank joins, or none: ranks whose
    RESIDENT_HANDOFF_BYTES differ fail group creation at once, naming both values; with 0 on
    every rank the group forms without that exchange and says the hand-off is off."""
    for out in H.run_ranks(_handoff_agreement_job, 2, timeout_s=90):
        assert out["differ"].startswith("ValueError") and "all ranks must agree" in out["differ"], out
        assert "RESIDENT_HANDOFF_BYTES=4096" in out["differ"] or "uses 4096" in out["differ"], out
        assert "8192" in out["differ"], out
        assert out["sum"] == [0, 7, 14, 21], out
        assert out["off"]["on"] is False and out["off"]["reason"] == "RESIDENT_HANDOFF_BYTES=0", out
