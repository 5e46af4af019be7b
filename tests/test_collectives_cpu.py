"""Collective semantics on CPU tensors, world sizes 2, 3 and 4.

All checks for one world size run inside ONE spawned job (spawning ranks is the
expensive part); the job returns, per case and per rank, the list of mismatches
and digests of the outputs that must be bitwise identical on every rank.  Each
case is then reported as its own pytest item.

Every rank regenerates every other rank's input from a seed and computes an
independent numpy / float64 reference (never with another collective).
Barrier, async ops (Work, futures) and the functional collectives: test_async_ops_cpu.py.
"""

from __future__ import annotations

import pytest

import dist_harness as H
from dist_harness import (
    BOOL_OPS,
    FLOAT_DTYPE_NAMES,
    INT_DTYPE_NAMES,
    compare_exact,
    compare_reduction,
    digest,
    itemsize,
    make_input,
    reference_reduce,
    tdtype,
)

WORLD_SIZES = (2, 3, 4)
FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INT_OPS = FLOAT_OPS + ("BAND", "BOR", "BXOR")
MiB = 1 << 20


def small_sizes(dtype_name):
    """1 element, odd sizes, and a 64 KiB ("decode"-sized) tensor."""
    return (1, 13, 1031, (64 * 1024) // itemsize(dtype_name))


def large_size(dtype_name):
    """An odd element count of a little more than 2 MiB (chunked path)."""
    return (2 * MiB) // itemsize(dtype_name) + 3


def kind_for(op, dtype_name):
    if op == "PRODUCT" and dtype_name in FLOAT_DTYPE_NAMES:
        return "near1"
    if op == "AVG" and dtype_name not in FLOAT_DTYPE_NAMES:
        return "avg"
    return "normal"


def reduce_op(name):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, name)


# --------------------------------------------------------------------------
# Case registry
# --------------------------------------------------------------------------


CASES = H.CaseRegistry()
case = CASES.case
add_case = CASES.add


# ---- sanity: the backend under test is really the one in use ---------------


@case("sanity[backend-under-test]", identical=False)
def _sanity(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    if dist.get_backend() != H.BACKEND:
        errs.append(f"dist.get_backend() = {dist.get_backend()!r}, expected {H.BACKEND!r}")
    cls = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    expected = "ProcessGroupResident" if H.IS_RESIDENT else None
    if expected and cls != expected:
        errs.append(f"the world group's CPU backend is {cls}, expected {expected}")
    if dist.get_rank() != rank or dist.get_world_size() != ws:
        errs.append(f"rank/world size {dist.get_rank()}/{dist.get_world_size()}")
    return errs, {}


# ---- all_reduce -----------------------------------------------------------


def _all_reduce_check(rank, ws, key, op, dtype_name, sizes, kind=None):
    import torch.distributed as dist

    errs, digs = [], {}
    kind = kind or kind_for(op, dtype_name)
    for n in sizes:
        k = f"{key}/n{n}/{kind}"
        inputs = [make_input(k, r, n, dtype_name, kind) for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t, op=reduce_op(op))
        ref = reference_reduce(inputs, op, dtype_name)
        errs += compare_reduction(t, ref, inputs, op, dtype_name, f"n={n} kind={kind}")
        digs[f"n{n}/{kind}"] = digest(t)
    return errs, digs


def _make_all_reduce_case(op, dtype_name):
    def fn(rank, ws):
        key = f"ar/{op}/{dtype_name}"
        errs, digs = _all_reduce_check(rank, ws, key, op, dtype_name, small_sizes(dtype_name))
        if op == "PRODUCT" and dtype_name in INT_DTYPE_NAMES:
            # also small factors (exact, no wrap) besides full-range wrapping values
            e2, d2 = _all_reduce_check(rank, ws, key, op, dtype_name, (1031,), kind="near1")
            errs += e2
            digs.update(d2)
        return errs, digs

    return fn


# int AVG is not supported by gloo at all; the resident backend promises it.
for _dt in FLOAT_DTYPE_NAMES:
    for _op in FLOAT_OPS:
        add_case(f"all_reduce[{_op}-{_dt}]", _make_all_reduce_case(_op, _dt))
for _dt in INT_DTYPE_NAMES:
    for _op in INT_OPS:
        add_case(f"all_reduce[{_op}-{_dt}]", _make_all_reduce_case(_op, _dt),
                 resident_only=(_op == "AVG"))

# one > 1 MiB tensor per op
LARGE_ALL_REDUCE = (
    ("SUM", "float32"),
    ("AVG", "bfloat16"),
    ("MIN", "float64"),
    ("MAX", "float16"),
    ("PRODUCT", "float32"),
    ("SUM", "int64"),
    ("BAND", "int32"),
    ("BOR", "int64"),
    ("BXOR", "uint8"),
)


def _make_large_all_reduce_case(op, dtype_name):
    def fn(rank, ws):
        return _all_reduce_check(rank, ws, f"arL/{op}/{dtype_name}", op, dtype_name,
                                 (large_size(dtype_name),))

    return fn


for _op, _dt in LARGE_ALL_REDUCE:
    add_case(f"all_reduce[{_op}-{_dt}-large]", _make_large_all_reduce_case(_op, _dt))


@case("all_reduce[avg-int-truncation-negative]", resident_only=True)
def _ar_avg_trunc(rank, ws):
    """Hand-made values whose sums are not multiples of N, negative included."""
    import torch
    import torch.distributed as dist

    errs, digs = [], {}
    sums = [-7, 7, -1, 1, -5, 5, -(ws + 1), ws + 1, 0, -2 * ws - 1, -ws, 2 * ws - 1, -3 * ws + 1]
    for dt in ("int32", "int64"):
        others = [[(r * 3 - 5) * (i + 1) for i in range(len(sums))] for r in range(1, ws)]
        first = [s - sum(o[i] for o in others) for i, s in enumerate(sums)]
        vals = [torch.tensor(v, dtype=tdtype(dt)) for v in [first] + others]
        t = vals[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        ref = reference_reduce(vals, "AVG", dt)
        # independent of reference_reduce: python integer truncation toward zero
        manual = torch.tensor([int(s / ws) for s in sums], dtype=tdtype(dt))
        errs += compare_exact(ref, manual, f"{dt} (self-check of the reference)")
        errs += compare_reduction(t, ref, vals, "AVG", dt, f"{dt} hand-made")
        digs[dt] = digest(t)
    return errs, digs


def _crafted_inputs(ws, n, dtype_name, seed_key):
    """Inputs whose SUM depends on the order / precision of accumulation.

    float32/float64: per element, a random rank holds +B and another -B (B so large
    that adding 1 to it is lost), the others hold 1: only rank order 0..N-1 gives
    the reference bit pattern.  float16/bfloat16: one rank holds a value whose ulp
    is 2 and the others hold 1: float32 accumulation + one rounding differs from
    accumulating in the short type.
    """
    import numpy as np
    import torch

    rng = H.rng_for(seed_key, 0)
    big = {"float32": 2.0 ** 25, "float64": 2.0 ** 54, "float16": 2048.0, "bfloat16": 256.0}[dtype_name]
    vals = np.ones((ws, n))
    pos = rng.integers(0, ws, size=n)
    if dtype_name in ("float32", "float64"):
        neg = (pos + rng.integers(1, ws, size=n)) % ws
        vals[pos, np.arange(n)] = big
        vals[neg, np.arange(n)] = -big
    else:
        vals[pos, np.arange(n)] = big
        sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
        vals = vals * sign
    return [torch.from_numpy(vals[r].copy()).to(tdtype(dtype_name)) for r in range(ws)]


@case("all_reduce[SUM-rank-order-and-accumulation-precision]")
def _ar_order(rank, ws):
    """Bitwise: reduction in rank order, float32/float64 accumulated in their own dtype,
    float16/bfloat16 accumulated in float32 and rounded once."""
    import torch.distributed as dist

    errs, digs = [], {}
    for dt in ("float32", "float64", "float16", "bfloat16"):
        for n in (1, 1031, large_size(dt)):
            inputs = _crafted_inputs(ws, n, dt, f"order/{dt}/{n}")
            t = inputs[rank].clone()
            dist.all_reduce(t)
            errs += compare_exact(t, reference_reduce(inputs, "SUM", dt), f"{dt} n={n}")
            digs[f"{dt}/{n}"] = digest(t)
    return errs, digs


@case("all_reduce[3d-shape-and-offset-view]")
def _ar_shapes(rank, ws):
    import torch.distributed as dist

    errs, digs = [], {}
    # a 3-D contiguous tensor
    inputs = [make_input("ar3d", r, 3 * 5 * 7, "float32").reshape(3, 5, 7) for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    ref = reference_reduce([x.reshape(-1) for x in inputs], "SUM", "float32").reshape(3, 5, 7)
    errs += compare_reduction(t.reshape(-1), ref.reshape(-1), [x.reshape(-1) for x in inputs],
                              "SUM", "float32", "3-D")
    digs["3d"] = digest(t)
    # a contiguous view with a storage offset: only the view may change
    bases = [make_input("arview", r, 1000, "int64") for r in range(ws)]
    base = bases[rank].clone()
    view = base[101:858]
    assert view.is_contiguous() and view.storage_offset() == 101
    dist.all_reduce(view, op=dist.ReduceOp.BXOR)
    ref = reference_reduce([b[101:858] for b in bases], "BXOR", "int64")
    errs += compare_exact(view, ref, "offset view")
    errs += compare_exact(base[:101], bases[rank][:101], "bytes before the view")
    errs += compare_exact(base[858:], bases[rank][858:], "bytes after the view")
    digs["view"] = digest(view)
    return errs, digs


# ---- bool and complex reductions (int8 is one of INT_DTYPE_NAMES) ---------
# bool reduces as a logical or (SUM, MAX, BOR), and (PRODUCT, MIN, BAND) or xor (BXOR); complex
# as its real and imaginary parts, SUM and AVG. torch's all_reduce hands complex tensors to the
# backend as floats; reduce and reduce_scatter hand them over as complex.
for _op in BOOL_OPS:
    add_case(f"all_reduce[{_op}-bool]", _make_all_reduce_case(_op, "bool"))
for _op, _dt in (("SUM", "complex64"), ("AVG", "complex128")):
    add_case(f"all_reduce[{_op}-{_dt}]", _make_all_reduce_case(_op, _dt))


# ---- all_to_all_single -----------------------------------------------------


def _a2a_check(rank, ws, dtype_name, m, variant, label):
    import torch
    import torch.distributed as dist

    key = f"a2a/{dtype_name}/{m}/{variant}"
    splits = [[H.a2a_split(s, d, m, variant) for d in range(ws)] for s in range(ws)]
    inputs = [make_input(key, s, sum(splits[s]), dtype_name) for s in range(ws)]
    in_splits = splits[rank]
    out_splits = [splits[s][rank] for s in range(ws)]
    out = torch.empty(sum(out_splits), dtype=tdtype(dtype_name))
    if variant == "even":
        dist.all_to_all_single(out, inputs[rank].clone())
    else:
        dist.all_to_all_single(out, inputs[rank].clone(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits)
    pieces = []
    for s in range(ws):
        off = sum(splits[s][:rank])
        pieces.append(inputs[s][off:off + splits[s][rank]])
    ref = torch.cat(pieces)
    return compare_exact(out, ref, label)


def _make_a2a_case(variant, dtype_name, ms):
    def fn(rank, ws):
        errs = []
        for m in ms:
            errs += _a2a_check(rank, ws, dtype_name, m, variant, f"{variant} m={m}")
        return errs, {}

    return fn


for _dt in ("float32", "bfloat16", "int64", "uint8"):
    add_case(f"all_to_all_single[even-{_dt}]", _make_a2a_case("even", _dt, (1, 17, 4099)),
             identical=False)
    add_case(f"all_to_all_single[uneven-{_dt}]", _make_a2a_case("uneven", _dt, (1, 37)),
             identical=False)
add_case("all_to_all_single[uneven-rank0-sends-nothing]",
         _make_a2a_case("rank0_sends_nothing", "float32", (5,)), identical=False)
add_case("all_to_all_single[even-float32-large]",
         _make_a2a_case("even", "float32", (MiB // 4 + 1,)), identical=False)
add_case("all_to_all_single[uneven-float32-large]",
         _make_a2a_case("uneven", "float32", (40_001,)), identical=False)


# ---- all_gather ------------------------------------------------------------


def _make_agit_case(dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs, digs = [], {}
        for n in sizes:
            key = f"agit/{dtype_name}/{n}"
            inputs = [make_input(key, r, n, dtype_name) for r in range(ws)]
            out = torch.empty(ws * n, dtype=tdtype(dtype_name))
            src = inputs[rank].clone()
            dist.all_gather_into_tensor(out, src)
            errs += compare_exact(out, torch.cat(inputs), f"n={n}")
            errs += compare_exact(src, inputs[rank], f"n={n} input modified")
            digs[str(n)] = digest(out)
        return errs, digs

    return fn


for _dt in ("float32", "float16", "int32", "uint8"):
    add_case(f"all_gather_into_tensor[{_dt}]", _make_agit_case(_dt, (1, 13, 4099)))
add_case("all_gather_into_tensor[float32-large]", _make_agit_case("float32", (300_001,)))


def _make_ag_list_case(dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs, digs = [], {}
        for n in sizes:
            key = f"ag/{dtype_name}/{n}"
            inputs = [make_input(key, r, n, dtype_name) for r in range(ws)]
            outs = [torch.empty(n, dtype=tdtype(dtype_name)) for _ in range(ws)]
            dist.all_gather(outs, inputs[rank].clone())
            for r in range(ws):
                errs += compare_exact(outs[r], inputs[r], f"n={n} slot {r}")
            digs[str(n)] = digest(torch.cat(outs))
        return errs, digs

    return fn


for _dt in ("float64", "int64", "bfloat16"):
    add_case(f"all_gather[{_dt}]", _make_ag_list_case(_dt, (1, 1031)))
add_case("all_gather[float64-large]", _make_ag_list_case("float64", (150_001,)))


# ---- reduce_scatter --------------------------------------------------------


def _make_rs_tensor_case(op, dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs = []
        kind = kind_for(op, dtype_name)
        for n in sizes:
            key = f"rs/{op}/{dtype_name}/{n}"
            inputs = [make_input(key, r, ws * n, dtype_name, kind) for r in range(ws)]
            out = torch.empty(n, dtype=tdtype(dtype_name))
            dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=reduce_op(op))
            chunks = [x[rank * n:(rank + 1) * n] for x in inputs]
            ref = reference_reduce(chunks, op, dtype_name)
            errs += compare_reduction(out, ref, chunks, op, dtype_name, f"n={n}")
        return errs, {}

    return fn


for _op in ("SUM", "AVG", "MAX"):
    for _dt in ("float32", "bfloat16", "float16", "int64"):
        add_case(f"reduce_scatter_tensor[{_op}-{_dt}]",
                 _make_rs_tensor_case(_op, _dt, (1, 13, 4099)),
                 resident_only=(_op == "AVG" and _dt == "int64"), identical=False)
add_case("reduce_scatter_tensor[MIN-uint8]", _make_rs_tensor_case("MIN", "uint8", (1, 13, 4099)),
         identical=False)
add_case("reduce_scatter_tensor[PRODUCT-float64]",
         _make_rs_tensor_case("PRODUCT", "float64", (1, 13, 4099)), identical=False)
for _op, _dt in (("SUM", "float32"), ("AVG", "bfloat16"), ("MAX", "int64")):
    add_case(f"reduce_scatter_tensor[{_op}-{_dt}-large]",
             _make_rs_tensor_case(_op, _dt, (MiB // itemsize(_dt) + 1,)), identical=False)


def _make_rs_list_case(op, dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs = []
        kind = kind_for(op, dtype_name)
        for n in sizes:
            key = f"rsl/{op}/{dtype_name}/{n}"
            inputs = [[make_input(f"{key}/{d}", r, n, dtype_name, kind) for d in range(ws)]
                      for r in range(ws)]
            out = torch.empty(n, dtype=tdtype(dtype_name))
            dist.reduce_scatter(out, [x.clone() for x in inputs[rank]], op=reduce_op(op))
            chunks = [inputs[r][rank] for r in range(ws)]
            ref = reference_reduce(chunks, op, dtype_name)
            errs += compare_reduction(out, ref, chunks, op, dtype_name, f"n={n}")
        return errs, {}

    return fn


add_case("reduce_scatter[SUM-float32]", _make_rs_list_case("SUM", "float32", (1, 1031)), identical=False)
add_case("reduce_scatter[MIN-int32]", _make_rs_list_case("MIN", "int32", (1, 1031)), identical=False)
for _op, _dt in (("SUM", "bool"), ("BXOR", "bool"), ("MIN", "int8"), ("AVG", "int8"),
                 ("SUM", "complex64"), ("AVG", "complex128")):
    add_case(f"reduce_scatter_tensor[{_op}-{_dt}]", _make_rs_tensor_case(_op, _dt, (1, 13, 4099)),
             resident_only=(_op == "AVG" and _dt == "int8"), identical=False)
for _op, _dt in (("PRODUCT", "bool"), ("MAX", "int8"), ("SUM", "complex128")):
    add_case(f"reduce_scatter[{_op}-{_dt}]", _make_rs_list_case(_op, _dt, (1, 1031)),
             identical=False)


# ---- broadcast / reduce / gather / scatter (every root) --------------------


def _make_bcast_case(dtype_name, sizes):
    def fn(rank, ws):
        import torch.distributed as dist

        errs, digs = [], {}
        for n in sizes:
            for root in range(ws):
                key = f"bc/{dtype_name}/{n}/{root}"
                mine = make_input(key, rank, n, dtype_name)
                t = mine.clone()
                dist.broadcast(t, src=root)
                errs += compare_exact(t, make_input(key, root, n, dtype_name), f"n={n} root={root}")
                digs[f"{n}/{root}"] = digest(t)
        return errs, digs

    return fn


for _dt in ("float32", "bfloat16", "int64", "uint8"):
    add_case(f"broadcast[{_dt}]", _make_bcast_case(_dt, (1, 1031)))
add_case("broadcast[float32-large]", _make_bcast_case("float32", (large_size("float32"),)))


def _make_reduce_case(op, dtype_name, sizes):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        kind = kind_for(op, dtype_name)
        for n in sizes:
            for root in range(ws):
                key = f"red/{op}/{dtype_name}/{n}/{root}"
                inputs = [make_input(key, r, n, dtype_name, kind) for r in range(ws)]
                t = inputs[rank].clone()
                dist.reduce(t, dst=root, op=reduce_op(op))
                if rank == root:
                    ref = reference_reduce(inputs, op, dtype_name)
                    errs += compare_reduction(t, ref, inputs, op, dtype_name, f"n={n} root={root}")
        return errs, {}

    return fn


add_case("reduce[SUM-float32]", _make_reduce_case("SUM", "float32", (13, 4099)), identical=False)
add_case("reduce[MAX-int32]", _make_reduce_case("MAX", "int32", (13, 4099)), identical=False)
add_case("reduce[PRODUCT-float64]", _make_reduce_case("PRODUCT", "float64", (13,)), identical=False)
add_case("reduce[SUM-bfloat16]", _make_reduce_case("SUM", "bfloat16", (13,)), identical=False)
for _op, _dt in (("MAX", "bool"), ("BAND", "int8"), ("SUM", "complex64"), ("AVG", "complex64")):
    add_case(f"reduce[{_op}-{_dt}]", _make_reduce_case(_op, _dt, (13, 4099)), identical=False)
add_case("reduce[SUM-float32-large]", _make_reduce_case("SUM", "float32", (MiB // 4 + 1,)),
         identical=False)


def _make_gather_case(dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs = []
        for n in sizes:
            for root in range(ws):
                key = f"ga/{dtype_name}/{n}/{root}"
                inputs = [make_input(key, r, n, dtype_name) for r in range(ws)]
                outs = [torch.empty(n, dtype=tdtype(dtype_name)) for _ in range(ws)] if rank == root else None
                dist.gather(inputs[rank].clone(), gather_list=outs, dst=root)
                if rank == root:
                    for r in range(ws):
                        errs += compare_exact(outs[r], inputs[r], f"n={n} root={root} slot {r}")
        return errs, {}

    return fn


add_case("gather[float32]", _make_gather_case("float32", (1, 1031)), identical=False)
add_case("gather[int64]", _make_gather_case("int64", (1, 1031)), identical=False)
add_case("gather[float32-large]", _make_gather_case("float32", (300_001,)), identical=False)


def _make_scatter_case(dtype_name, sizes):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs = []
        for n in sizes:
            for root in range(ws):
                key = f"sc/{dtype_name}/{n}/{root}"
                chunks = [make_input(f"{key}/{d}", root, n, dtype_name) for d in range(ws)]
                out = torch.empty(n, dtype=tdtype(dtype_name))
                dist.scatter(out, scatter_list=[c.clone() for c in chunks] if rank == root else None,
                             src=root)
                errs += compare_exact(out, chunks[rank], f"n={n} root={root}")
        return errs, {}

    return fn


add_case("scatter[float32]", _make_scatter_case("float32", (1, 1031)), identical=False)
add_case("scatter[int32]", _make_scatter_case("int32", (1, 1031)), identical=False)
add_case("scatter[float32-large]", _make_scatter_case("float32", (300_001,)), identical=False)


# --------------------------------------------------------------------------
# The job and the per-case tests
# --------------------------------------------------------------------------


def collectives_job(rank, ws, case_ids):
    return H.execute_cases(CASES, case_ids, rank, ws)


JOBS = H.JobCache(CASES, collectives_job, "test_collective")


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("cid", list(CASES))
def test_collective(cid, ws, request):
    JOBS.check(cid, ws, request.session)


def test_case_registry_is_sane():
    assert len(CASES) > 60
    for op in INT_OPS:
        assert any(c.startswith(f"all_reduce[{op}-") and c.endswith("-large]") for c in CASES), op
