"""Seeded random op mixes on CPU tensors (tests/op_mix.py): 2, 3 and 4 ranks, every mode a user
can turn on for CPU tensors (op_mix.MODE_AXES: the default, RESIDENT_PATH=proxy,
RESIDENT_TRANSPORT=tcp, which on one host runs tcp between the ranks).

One spawned job per world size runs every selected (mode, seed): per mode it sets the mode's
environment, creates the default group, runs each seed's sequence (subgroups, ~40 steps of
sync ops, async ops and batches of async ops waited in random orders, then the graph phase run
eagerly: warm-up and replays with fresh data) and destroys the group. Each (world size, mode,
seed) is one pytest item; a failure names the seed, step, op, dtype, size, group and rank and
how to rerun the seed. ``RESIDENT_OPMIX_SEEDS`` (e.g. ``1-200``) runs other seeds (a soak),
``RESIDENT_OPMIX_STEPS`` longer sequences.

The other tests here check the generator itself (determinism, coverage), that each op's check
can fail (a corrupted output is reported), and that no op kind the backend serves is left out.
"""

from __future__ import annotations

import pytest

import dist_harness as H
import op_mix
import op_mix_plan
from op_mix_run import Hooks, OpMixJobs, problems_of, run_modes

WORLD_SIZES = (2, 3, 4)
SEEDS = op_mix.seeds_from_env(default=(1, 2, 3))
MODE_IDS = [m for m, _env in op_mix.modes()]
GROUP_TIMEOUT_S = 30


def op_mix_job(rank, ws, job):
    return run_modes(rank, ws, job, Hooks())


JOBS = OpMixJobs(op_mix_job, "test_op_mix", "tests/test_op_mix.py", "cpu", per_mode=False,
                 timeout_s=lambda runs: 120 + 90 * runs, group_timeout_s=GROUP_TIMEOUT_S)

PARAMS = [pytest.param(ws, mode, seed, id=f"ws{ws}-{mode}-seed{seed}")
          for ws in WORLD_SIZES for mode in MODE_IDS for seed in SEEDS]


@pytest.mark.parametrize("ws,mode,seed", PARAMS)
def test_op_mix(ws, mode, seed, request):
    JOBS.check(ws, mode, seed, request.session)


# torch's debug levels, each over a mix in the default mode: DETAIL wraps every group in torch's
# ProcessGroupWrapper, which checks each collective's fingerprint (sequence number, op, shapes)
# across the ranks before the backend runs it. A mode axis of their own rather than a factor of
# MODE_AXES: three times every mode would triple the test's time for little more coverage.
DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")
DEBUG_MODES = op_mix.modes([("debug", {lvl: {"TORCH_DISTRIBUTED_DEBUG": lvl} for lvl in DEBUG_LEVELS})])
DEBUG_SEEDS = op_mix.seeds_from_env(default=(4,))
DEBUG_JOBS = OpMixJobs(op_mix_job, "test_op_mix_debug_levels", "tests/test_op_mix.py", "cpu",
                       per_mode=False, timeout_s=lambda runs: 120 + 120 * runs,
                       group_timeout_s=GROUP_TIMEOUT_S, modes=DEBUG_MODES)


@pytest.mark.parametrize("ws,mode,seed", [
    pytest.param(ws, lvl, seed, id=f"ws{ws}-{lvl}-seed{seed}")
    for ws in (2, 3) for lvl in DEBUG_LEVELS for seed in DEBUG_SEEDS])
def test_op_mix_debug_levels(ws, mode, seed, request):
    DEBUG_JOBS.check(ws, mode, seed, request.session)
    per_rank, _err, _wall = DEBUG_JOBS.get((ws,), request.session)
    want = "_ProcessGroupWrapper(ProcessGroupResident)" if mode == "DETAIL" else "ProcessGroupResident"
    if H.IS_RESIDENT:
        assert [r.get(f"{mode}/backend") for r in per_rank] == [want] * ws


# --------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------


def _kinds(plan):
    return {op.kind for s in plan.steps for op in s.ops}


def test_every_kind_has_an_op_and_the_left_out_ones_are_named():
    from op_mix_ep import EP_OPS
    from op_mix_objects import OBJECT_OPS
    from op_mix_ops import OPS

    tables = [set(OPS), set(OBJECT_OPS), set(EP_OPS)]
    assert set.union(*tables) == set(op_mix_plan.KINDS)
    assert sum(len(t) for t in tables) == len(op_mix_plan.KINDS)  # no kind in two tables
    assert not set(op_mix_plan.UNSUPPORTED) & set(op_mix_plan.KINDS)


def test_plan_is_a_function_of_its_seed():
    a = op_mix.make_plan(11, 4, op_mix_plan.CPU_CAPS)
    b = op_mix.make_plan(11, 4, op_mix_plan.CPU_CAPS)
    c = op_mix.make_plan(12, 4, op_mix_plan.CPU_CAPS)
    assert a.text() == b.text()
    assert a.text() != c.text()


@pytest.mark.parametrize("caps", [op_mix_plan.CPU_CAPS, op_mix_plan.CUDA_CAPS], ids=["cpu", "cuda"])
def test_plans_cover_every_kind_dtype_op_and_group_shape(caps):
    expected = {k for k, v in op_mix_plan.KINDS.items() if not v.needs or getattr(caps, v.needs)}
    reductions, moved, modes, shapes, waits = set(), set(), set(), set(), 0
    # all_to_all_device_splits: one count per peer, or k per peer; recv_rows given or written
    split_counts = set()
    for ws in (2, 3, 4, 8):
        for seed in range(1, 9):
            plan = op_mix.make_plan(seed, ws, caps)
            missing = expected - _kinds(plan)
            assert not missing, f"seed {seed} ws {ws}: kinds {missing} not drawn"
            assert any(op.kind == "all_reduce" and op.group == 0 and op.n for op, _a in plan.graph)
            assert all(op_mix_plan.KINDS[op.kind].capturable for op, _a in plan.graph)
            if ws >= 3:
                sub = plan.groups[1].ranks
                assert sub[-1] - sub[0] + 1 != len(sub), f"{sub} is contiguous"
            shapes |= {len(g.ranks) for g in plan.groups}
            for s in plan.steps:
                modes.add(s.mode)
                waits += s.mode == "batch"
                for op in s.ops:
                    if op.kind == "all_to_all_device_splits":
                        flags = op.variant.split(",")
                        split_counts.add("parts" if flags[0].startswith("parts=") else "one")
                        split_counts.add("counts_out" if "out" in flags else "counts_in")
                    if op.redop and op.dtype:
                        reductions.add((op.redop, op.dtype))
                    elif op.dtype:
                        moved.add(op.dtype)
                    assert not (s.mode != "sync" and not op_mix_plan.KINDS[op.kind].batchable)
                    if caps.device == "cuda" and op.dtypes:
                        assert len(set(op.dtypes)) == 1, "CUDA coalesced ops take one dtype"
    valid = {(o, d) for d in caps.reduce_dtypes for o in op_mix_plan.reduce_ops_for([d])}
    assert reductions == valid, f"never drawn: {sorted(valid - reductions)}"
    assert moved == set(op_mix_plan.MOVE_DTYPES)
    assert modes == {"sync", "async", "batch"} and waits > 50
    assert {1, 2, 3, 4, 8} <= shapes
    if caps.resident_ops:
        assert split_counts == {"one", "parts", "counts_in", "counts_out"}


def test_plans_cover_the_ep_buffer_modes():
    """ep_dispatch_combine draws every option of resident_pg.ep.Buffer a user can turn on, the
    routing edges, subgroups, reused Buffers and graph ops."""
    calls, reused, in_graph, on_subgroup = [], 0, 0, 0
    for ws in (2, 3, 4, 8):
        for seed in range(1, 17):
            plan = op_mix.make_plan(seed, ws, op_mix_plan.CPU_CAPS)
            ops = [op for s in plan.steps for op in s.ops] + [op for op, _a in plan.graph]
            ep = [op for op in ops if op.kind == "ep_dispatch_combine"]
            calls += [op.ep for op in ep]
            shapes = [(op.group, op.ep.shape) for op in ep]
            reused += len(shapes) - len(set(shapes))
            in_graph += sum(op.kind == "ep_dispatch_combine" for op, _a in plan.graph)
            on_subgroup += sum(op.group != 0 for op in ep)
    assert reused > 5 and in_graph > 3 and on_subgroup > 5
    assert {c.fp8 for c in calls} == set(op_mix_plan.EP_FP8)
    assert {c.shape.dtype for c in calls} == set(op_mix_plan.EP_DTYPES)
    assert {c.shape.transport for c in calls} == set(op_mix_plan.EP_TRANSPORTS)
    assert {c.routing for c in calls} == set(op_mix_plan.EP_ROUTINGS)
    flags = [c.async_finish + c.recv_hook + (c.stats, c.out) for c in calls]
    assert all({f[i] for f in flags} == {False, True} for i in range(6))
    for c in calls:
        E = c.shape.local_experts * len(c.tokens)
        assert 1 <= c.top_k <= min(E, 8) and all(0 <= t <= c.shape.max_tokens for t in c.tokens)
        if c.fp8:
            assert c.shape.hidden % (512 if c.fp8 == "fp8_ue8m0" else 128) == 0
        assert (c.routing == "hot") == bool(c.hot) and len(set(c.hot)) == len(c.hot)
    tokens = [t for c in calls for t in c.tokens]
    assert 0 in tokens and any(t == c.shape.max_tokens for c in calls for t in c.tokens)
    assert {c.top_k for c in calls} >= set(range(1, 9))
    assert any(c.shape.hidden % 128 for c in calls)


def test_sizes_span_empty_to_100k_with_odd_and_boundary_sizes():
    sizes = [op.n for seed in range(1, 11)
             for s in op_mix.make_plan(seed, 3, op_mix_plan.CPU_CAPS).steps
             for op in s.ops if op.kind in ("all_reduce", "broadcast", "p2p_ring")]
    assert 0 in sizes and 1 in sizes and max(sizes) > 50_000 and max(sizes) <= op_mix.MAX_ELEMS
    assert sum(n % 2 for n in sizes) > len(sizes) // 3


def test_modes_are_the_product_of_the_axes():
    axes = op_mix.MODE_AXES + [("debug", {"OFF": {"TORCH_DISTRIBUTED_DEBUG": "OFF"},
                                          "DETAIL": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}})]
    got = dict(op_mix.modes(axes))
    assert got["proxy-DETAIL"] == {"RESIDENT_PATH": "proxy", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert len(got) == 2 * len(op_mix.modes())
    assert [m for m, _ in op_mix.modes()] == ["default", "proxy", "tcp"]


def test_seed_lists_from_the_environment(monkeypatch):
    monkeypatch.setenv("RESIDENT_OPMIX_SEEDS", "3, 10-12,7")
    assert op_mix.seeds_from_env((1,)) == [3, 10, 11, 12, 7]
    monkeypatch.setenv("RESIDENT_OPMIX_SEEDS", ",")
    with pytest.raises(ValueError, match="RESIDENT_OPMIX_SEEDS"):
        op_mix.seeds_from_env((1,))
    monkeypatch.delenv("RESIDENT_OPMIX_SEEDS")
    assert op_mix.seeds_from_env((1, 2)) == [1, 2]


def test_problems_of_reports_fatal_first_and_digests_that_differ():
    ok = {"problems": [], "fatal": None, "plan": "p", "ops": 3,
          "digests": {"s1/o0/all_reduce": "A"}}
    other = dict(ok, digests={"s1/o0/all_reduce": "B"})
    assert problems_of([{"m/1": ok}, {"m/1": ok}], "m/1") == []
    assert "must be bitwise alike" in problems_of([{"m/1": ok}, {"m/1": other}], "m/1")[0]
    bad = dict(ok, fatal="step 3: raised DistBackendError", problems=["x"])
    got = problems_of([{"m/1": ok}, {"m/1": bad}, {"m/1": {"not_run": "no"}}, {}], "m/1")
    assert got[0].startswith("rank 1: step 3") and "rank 2: no" in got
    assert "rank 3: the run did not happen" in got
    assert "different plans" in problems_of([{"m/1": ok}, {"m/1": dict(ok, plan="q")}], "m/1")[-1]
    assert problems_of([{"m/1": ok}, {"m/1": dict(ok, ops=0)}], "m/1") == ["rank 1: ran no op"]


# --------------------------------------------------------------------------
# The checks can fail; no kind is left out
# --------------------------------------------------------------------------


def _spec_with_data(gen, kind, groups):
    """An op of ``kind`` on the 2-rank world whose data is not empty."""
    for _ in range(100):
        spec = op_mix_plan.OpSpec(kind, 0)
        getattr(gen, "_" + kind)(spec, 2)
        if kind == "all_to_all_single" and spec.variant != "even":
            if any(spec.splits[s][d] for s in range(2) for d in range(2) if s != d):
                return spec
        elif kind == "all_to_all":
            if any(spec.splits[s][d] for s in range(2) for d in range(2) if s != d):
                return spec
        elif kind == "p2p_tagged":
            if all(spec.sizes):
                return spec
        elif kind == "ep_dispatch_combine":
            if all(spec.ep.tokens) and spec.ep.routing != "masked":
                return spec
        elif (spec.n > 0 or spec.sizes) and all(spec.sizes):
            return spec
    raise AssertionError(kind)


def _corrupt(op):
    """Change what the op received (or reduced in place) on this rank."""
    import torch

    objects = [getattr(op, name) for name in ("lst", "got") if hasattr(op, name)]
    if objects:
        objects[0][-1] = "corrupted"
        return
    names = op.outputs or [n for n in op.buf if n.startswith("x")]
    for name in names:
        t = op.buf[name].view(-1)
        if t.numel() == 0:
            continue
        if t.dtype == torch.bool:
            t[0] = ~t[0]
        elif t.is_floating_point():
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
            mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23,
                    torch.float64: 52}[t.dtype]
            t.view(bits)[0] ^= 1 << (mant - 1)
        else:
            t[0] ^= 1


def _corruption_job(rank, ws):
    import numpy as np

    from op_mix_base import Member
    from op_mix_ops import make_op

    out = {"detected": {}}
    world = op_mix_plan.Group(0, tuple(range(ws)))
    plan = op_mix_plan.Plan(5, ws, op_mix_plan.CPU_CAPS, [world], [], [])
    gen = op_mix._Gen(5, ws, op_mix_plan.CPU_CAPS)
    for kind in op_mix_plan.KINDS:
        if kind == "barrier":
            continue
        spec = _spec_with_data(gen, kind, plan.groups)
        local = np.random.default_rng([rank, 3])
        op = make_op(spec, Member(plan, spec, rank, None, "cpu", f"corrupt/{kind}", local))
        op.fill("in")
        for w in op.issue(op_mix_plan.KINDS[kind].batchable):
            w.wait()
        clean = op.check()
        _corrupt(op)
        out["detected"][kind] = (clean, len(op.check()), spec.describe(plan.groups))
    return out


def test_checks_report_a_corrupted_output_and_no_kind_is_left_out():
    per_rank = H.run_ranks(_corruption_job, 2, timeout_s=240, init_timeout_s=GROUP_TIMEOUT_S)
    problems = []
    for kind in op_mix_plan.KINDS:
        if kind == "barrier":
            continue
        for r in range(2):
            clean, _n, desc = per_rank[r]["detected"][kind]
            if clean:
                problems.append(f"{kind} rank {r}: the uncorrupted run has problems: {clean}")
        if not any(per_rank[r]["detected"][kind][1] for r in range(2)):
            problems.append(f"{kind}: a corrupted output passed the check ({desc})")
    # every op kind of torch.distributed the backend serves is in the mix
    assert not op_mix_plan.UNSUPPORTED, op_mix_plan.UNSUPPORTED
    assert not problems, "\n".join(problems)


def _ep_on_gloo_job(rank, ws):
    """ep_dispatch_combine ops of random specs on a gloo group: the Buffer's "auto" transport
    falls back to the padded all_to_all_single there."""
    import numpy as np
    import torch.distributed as dist

    from op_mix_base import Member
    from op_mix_ops import make_op

    gloo = dist.new_group(backend="gloo")
    world = op_mix_plan.Group(0, tuple(range(ws)))
    plan = op_mix_plan.Plan(7, ws, op_mix_plan.CPU_CAPS, [world], [], [])
    gen = op_mix._Gen(7, ws, op_mix_plan.CPU_CAPS)
    cache, problems = {}, []
    for i in range(10):
        spec = op_mix_plan.OpSpec("ep_dispatch_combine", 0)
        gen._ep_dispatch_combine(spec, ws)
        local = np.random.default_rng([rank, i])
        op = make_op(spec, Member(plan, spec, rank, gloo, "cpu", f"gloo/{i}", local, cache))
        op.fill("in")
        for w in op.issue(i % 2 == 1):
            w.wait()
        problems += [f"{spec.describe(plan.groups)}: {e}" for e in op.check()]
    return problems, sorted({(shape.transport, b.transport) for (_g, shape), b in cache.items()})


def test_ep_kind_on_a_gloo_group():
    per_rank = H.run_ranks(_ep_on_gloo_job, 2, timeout_s=120, init_timeout_s=GROUP_TIMEOUT_S)
    for problems, transports in per_rank:
        assert not problems, "\n".join(problems)
        assert {t for _drawn, t in transports} == {"padded"}
        assert {d for d, _t in transports} == set(op_mix_plan.EP_TRANSPORTS)
