"""Collectives and point-to-point on CUDA tensors: every op x dtype x size, both paths.

One spawned job per (world size, RESIDENT_PATH) runs every selected case and
returns per-case problem lists (see cuda_harness.GpuJobCache); each case is its
own pytest item.  World sizes 2 and 4 run the whole matrix; 8 and 9 ranks (an odd size,
larger than one host's GPUs) run only the cases of float32 / bfloat16 / int64 (and the
dtype-free sanity case), on both paths.

Sizes per op x dtype: 8 B, 4 KiB, 64 KiB and 1 MiB + 3 elements, measured as the
tensor each rank contributes (all_reduce, broadcast, reduce, all_gather, gather,
send), the chunk each rank receives (scatter), or each rank's whole input, split
among the peers (reduce_scatter: chunks of size // world size, at least one
element; all_to_all).  all_reduce runs the full
dtype x reduce-op matrix at all four sizes; the other reductions every dtype
with SUM plus a few other ops.  async_op alternates over (dtype, size, op) so that
every op x dtype runs both ways (async: work.wait(), then check).

Inputs: every rank regenerates every rank's input from seeds (make_input) and
computes an independent numpy reference; integers and data movement compare
bitwise, reductions must be bitwise identical on all ranks (digests).
After the jobs, no /dev/shm entry named resident* may be left.
Barrier, ops in flight, polled completion and the functional collectives (the same
job keys, dtype-free): test_cuda_async_ops.py.
"""

from __future__ import annotations

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import (
    ALL_DTYPES,
    call,
    dev,
    host,
    inputs_for,
    is_async,
    kind_for,
    reduce_op,
    sentinel,
    sizes_for,
)
from dist_harness import (
    a2a_split,
    FLOAT_DTYPE_NAMES,
    INT_DTYPE_NAMES,
    compare_exact,
    compare_reduction,
    digest,
    make_input,
    reference_reduce,
)

pytestmark = C.module_marks()

FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INT_OPS = FLOAT_OPS + ("BAND", "BOR", "BXOR")

CASES = H.CaseRegistry()
CASE_DTYPE = {}  # cid -> dtype name (None: dtype-free, runs at every world size)


def add(cid, fn, dtype_name=None, identical=False):
    CASES.add(cid, fn, identical=identical)
    CASE_DTYPE[cid] = dtype_name


def _dt_index(dtype_name):
    if dtype_name in ALL_DTYPES:
        return ALL_DTYPES.index(dtype_name)
    return len(ALL_DTYPES) + (MAPPED_DTYPES + ("int8",)).index(dtype_name)


def _mode(a):
    return "async" if a else "sync"


# ---- sanity -----------------------------------------------------------------


def _sanity(rank, ws):
    import os

    import torch
    import torch.distributed as dist

    import resident_pg

    errs = []
    cls = type(dist.group.WORLD._get_backend(torch.device(C.DEVICE))).__name__
    if "Resident" not in cls:
        errs.append(f"the world group's {C.DEVICE} backend is {cls}, expected ProcessGroupResident")
    if C.ON_GPU and torch.cuda.current_device() != rank % torch.cuda.device_count():
        errs.append(f"current device {torch.cuda.current_device()}")
    want = os.environ.get("RESIDENT_PATH")
    info = resident_pg.describe(device=C.DEVICE)
    paths = {p: v["path"] for p, v in info["peers"].items() if p != rank}
    if set(paths.values()) != {want}:
        errs.append(f"RESIDENT_PATH={want} but describe(device={C.DEVICE!r}) reports paths {paths}")
    return errs, {}


add("sanity[backend-device-and-path]", _sanity)


# ---- all_reduce: full dtype x op matrix at every size ------------------------


def _make_all_reduce_case(op, dt):
    ops = FLOAT_OPS if dt in FLOAT_DTYPE_NAMES else INT_OPS

    def fn(rank, ws):
        import torch.distributed as dist

        errs, digs = [], {}
        runs = [(lab, n, kind_for(op, dt)) for lab, n in sizes_for(dt)]
        if op == "PRODUCT" and dt in INT_DTYPE_NAMES:
            runs.append(("4KiB", C.n_elems("4KiB", dt), "near1"))  # small exact factors too
        for si, (lab, n, kind) in enumerate(runs):
            a = is_async(_dt_index(dt), si, ops.index(op))
            inputs = inputs_for(f"cuda/ar/{op}/{dt}/{lab}/{kind}", ws, n, dt, kind)
            t = dev(inputs[rank])
            label = f"{lab} n={n} {kind} {_mode(a)}"
            errs += call(lambda ao: dist.all_reduce(t, op=reduce_op(op), async_op=ao), a, label)
            got = host(t)
            errs += compare_reduction(got, reference_reduce(inputs, op, dt), inputs, op, dt, label)
            digs[f"{lab}/{kind}"] = digest(got)
        return errs, digs

    return fn


for _dt in ALL_DTYPES:
    for _op in (FLOAT_OPS if _dt in FLOAT_DTYPE_NAMES else INT_OPS):
        add(f"all_reduce[{_op}-{_dt}]", _make_all_reduce_case(_op, _dt), _dt, identical=True)


# ---- reduce_scatter (tensor and list), reduce --------------------------------


def _make_rs_case(op, dt, as_list):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        kind = kind_for(op, dt)
        for si, (lab, total) in enumerate(sizes_for(dt)):
            n = max(1, total // ws)  # the size is each rank's whole input; n: the chunk
            a = is_async(_dt_index(dt), si)
            label = f"{lab} chunk={n} {_mode(a)}"
            key = f"cuda/rs/{as_list}/{op}/{dt}/{lab}"
            out = sentinel(n, dt)
            if as_list:
                inputs = [[make_input(f"{key}/{d}", r, n, dt, kind) for d in range(ws)]
                          for r in range(ws)]
                src = [dev(x) for x in inputs[rank]]
                errs += call(lambda ao: dist.reduce_scatter(out, src, op=reduce_op(op), async_op=ao),
                             a, label)
                chunks = [inputs[r][rank] for r in range(ws)]
                for d in range(ws):
                    errs += compare_exact(host(src[d]), inputs[rank][d], f"{label} input[{d}] modified")
            else:
                inputs = inputs_for(key, ws, ws * n, dt, kind)
                src = dev(inputs[rank])
                errs += call(lambda ao: dist.reduce_scatter_tensor(out, src, op=reduce_op(op),
                                                                   async_op=ao), a, label)
                chunks = [x[rank * n:(rank + 1) * n] for x in inputs]
                errs += compare_exact(host(src), inputs[rank], f"{label} input modified")
            errs += compare_reduction(host(out), reference_reduce(chunks, op, dt), chunks, op, dt, label)
        return errs, {}

    return fn


def _make_reduce_case(op, dt):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        kind = kind_for(op, dt)
        for si, (lab, n) in enumerate(sizes_for(dt)):
            root = (si + 1) % ws
            a = is_async(_dt_index(dt), si)
            label = f"{lab} n={n} root={root} {_mode(a)}"
            inputs = inputs_for(f"cuda/red/{op}/{dt}/{lab}", ws, n, dt, kind)
            t = dev(inputs[rank])
            errs += call(lambda ao: dist.reduce(t, dst=root, op=reduce_op(op), async_op=ao), a, label)
            got = host(t)
            if rank == root:
                errs += compare_reduction(got, reference_reduce(inputs, op, dt), inputs, op, dt, label)
        return errs, {}

    return fn


EXTRA_REDUCE_OPS = (("AVG", "float32"), ("MAX", "bfloat16"), ("MIN", "int32"),
                    ("PRODUCT", "float64"), ("AVG", "int64"), ("BXOR", "uint8"))
for _dt in ALL_DTYPES:
    add(f"reduce_scatter_tensor[SUM-{_dt}]", _make_rs_case("SUM", _dt, False), _dt)
    add(f"reduce_scatter[SUM-{_dt}]", _make_rs_case("SUM", _dt, True), _dt)
    add(f"reduce[SUM-{_dt}]", _make_reduce_case("SUM", _dt), _dt)
for _op, _dt in EXTRA_REDUCE_OPS:
    add(f"reduce_scatter_tensor[{_op}-{_dt}]", _make_rs_case(_op, _dt, False), _dt)
for _op, _dt in (("MAX", "int64"), ("AVG", "bfloat16"), ("BOR", "int32")):
    add(f"reduce_scatter[{_op}-{_dt}]", _make_rs_case(_op, _dt, True), _dt)
for _op, _dt in (("MIN", "float16"), ("PRODUCT", "bfloat16"), ("BAND", "int64"), ("AVG", "uint8")):
    add(f"reduce[{_op}-{_dt}]", _make_reduce_case(_op, _dt), _dt)


# ---- bool and complex: the kernels above reduce them as uint8 / float pairs ----
# bool: SUM and MAX a logical or, PRODUCT and MIN an and, BXOR an xor; complex: SUM and AVG of
# the real and imaginary parts (dist.reduce and reduce_scatter hand complex tensors to the backend).
MAPPED_DTYPES = ("bool", "complex64", "complex128")
for _op in ("SUM", "PRODUCT", "BXOR"):
    add(f"all_reduce[{_op}-bool]", _make_all_reduce_case(_op, "bool"), "bool", identical=True)
add("reduce_scatter_tensor[MIN-bool]", _make_rs_case("MIN", "bool", False), "bool")
add("reduce_scatter_tensor[SUM-complex64]", _make_rs_case("SUM", "complex64", False), "complex64")
add("reduce_scatter[AVG-complex128]", _make_rs_case("AVG", "complex128", True), "complex128")
add("reduce[SUM-complex64]", _make_reduce_case("SUM", "complex64"), "complex64")
add("reduce[MAX-bool]", _make_reduce_case("MAX", "bool"), "bool")


# ---- int8: its own lanes in the kernels (8 per line, accumulated in int64) ----
for _op in INT_OPS:
    add(f"all_reduce[{_op}-int8]", _make_all_reduce_case(_op, "int8"), "int8", identical=True)
add("reduce_scatter_tensor[SUM-int8]", _make_rs_case("SUM", "int8", False), "int8")
add("reduce_scatter[AVG-int8]", _make_rs_case("AVG", "int8", True), "int8")
add("reduce[MIN-int8]", _make_reduce_case("MIN", "int8"), "int8")


# ---- data movement: all_gather, gather, scatter, broadcast ------------------


def _make_all_gather_case(dt, as_list):
    def fn(rank, ws):
        import torch
        import torch.distributed as dist

        errs, digs = [], {}
        for si, (lab, n) in enumerate(sizes_for(dt)):
            a = is_async(_dt_index(dt), si)
            label = f"{lab} n={n} {_mode(a)}"
            inputs = inputs_for(f"cuda/ag/{as_list}/{dt}/{lab}", ws, n, dt)
            src = dev(inputs[rank])
            if as_list:
                outs = [sentinel(n, dt) for _ in range(ws)]
                errs += call(lambda ao: dist.all_gather(outs, src, async_op=ao), a, label)
                got = torch.cat([host(o) for o in outs])
            else:
                out = sentinel(ws * n, dt)
                errs += call(lambda ao: dist.all_gather_into_tensor(out, src, async_op=ao), a, label)
                got = host(out)
            errs += compare_exact(got, torch.cat(inputs), label)
            errs += compare_exact(host(src), inputs[rank], f"{label} input modified")
            digs[lab] = digest(got)
        return errs, digs

    return fn


def _make_gather_case(dt):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        for si, (lab, n) in enumerate(sizes_for(dt)):
            root = (si + 1) % ws
            a = is_async(_dt_index(dt), si)
            label = f"{lab} n={n} root={root} {_mode(a)}"
            inputs = inputs_for(f"cuda/ga/{dt}/{lab}", ws, n, dt)
            outs = [sentinel(n, dt) for _ in range(ws)] if rank == root else None
            src = dev(inputs[rank])
            errs += call(lambda ao: dist.gather(src, gather_list=outs, dst=root, async_op=ao), a, label)
            if rank == root:
                for r in range(ws):
                    errs += compare_exact(host(outs[r]), inputs[r], f"{label} slot {r}")
        return errs, {}

    return fn


def _make_scatter_case(dt):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        for si, (lab, n) in enumerate(sizes_for(dt)):
            root = (si + 1) % ws
            a = is_async(_dt_index(dt), si)
            label = f"{lab} n={n} root={root} {_mode(a)}"
            chunks = [make_input(f"cuda/sc/{dt}/{lab}/{d}", root, n, dt) for d in range(ws)]
            out = sentinel(n, dt)
            lst = [dev(c) for c in chunks] if rank == root else None
            errs += call(lambda ao: dist.scatter(out, scatter_list=lst, src=root, async_op=ao), a, label)
            errs += compare_exact(host(out), chunks[rank], label)
        return errs, {}

    return fn


def _make_broadcast_case(dt):
    def fn(rank, ws):
        import torch.distributed as dist

        errs, digs = [], {}
        for si, (lab, n) in enumerate(sizes_for(dt)):
            root = (si + 1) % ws
            a = is_async(_dt_index(dt), si)
            label = f"{lab} n={n} root={root} {_mode(a)}"
            key = f"cuda/bc/{dt}/{lab}"
            t = dev(make_input(key, rank, n, dt))
            errs += call(lambda ao: dist.broadcast(t, src=root, async_op=ao), a, label)
            got = host(t)
            errs += compare_exact(got, make_input(key, root, n, dt), label)
            digs[lab] = digest(got)
        return errs, digs

    return fn


# ---- all_to_all_single (even, uneven with zeros), all_to_all (list) ----------


def _a2a_single(rank, ws, dt, lab, n, variant, a):
    import torch
    import torch.distributed as dist

    m = max(1, n // ws) if variant == "even" else max(1, n // (4 * ws))
    splits = [[a2a_split(s, d, m, variant) for d in range(ws)] for s in range(ws)]
    inputs = [make_input(f"cuda/a2a/{dt}/{lab}/{variant}", s, sum(splits[s]), dt) for s in range(ws)]
    in_splits = splits[rank]
    out_splits = [splits[s][rank] for s in range(ws)]
    out = sentinel(sum(out_splits), dt)
    src = dev(inputs[rank])
    label = f"{variant} {lab} m={m} {_mode(a)}"
    if variant == "even":
        errs = call(lambda ao: dist.all_to_all_single(out, src, async_op=ao), a, label)
    else:
        errs = call(lambda ao: dist.all_to_all_single(out, src, output_split_sizes=out_splits,
                                                      input_split_sizes=in_splits, async_op=ao),
                    a, label)
    ref = torch.cat([inputs[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])] for s in range(ws)])
    errs += compare_exact(host(out), ref, label)
    errs += compare_exact(host(src), inputs[rank], f"{label} input modified")
    return errs


def _make_a2a_single_case(dt):
    def fn(rank, ws):
        errs = []
        for si, (lab, n) in enumerate(sizes_for(dt)):
            for vi, variant in enumerate(("even", "uneven")):
                errs += _a2a_single(rank, ws, dt, lab, n, variant, is_async(_dt_index(dt), si, vi))
        errs += _a2a_single(rank, ws, dt, "4KiB", C.n_elems("4KiB", dt), "rank0_sends_nothing",
                            is_async(_dt_index(dt)))
        return errs, {}

    return fn


def _make_a2a_list_case(dt):
    def fn(rank, ws):
        import torch.distributed as dist

        errs = []
        for si, (lab, n) in enumerate(sizes_for(dt)):
            a = is_async(_dt_index(dt), si)
            m = max(1, n // (4 * ws))
            size = [[((s * 5 + d * 3) % 7 + 1) * m for d in range(ws)] for s in range(ws)]
            key = f"cuda/a2al/{dt}/{lab}"
            ins = [[make_input(f"{key}/{d}", s, size[s][d], dt) for d in range(ws)] for s in range(ws)]
            outs = [sentinel(size[s][rank], dt) for s in range(ws)]
            label = f"{lab} m={m} {_mode(a)}"
            errs += call(lambda ao: dist.all_to_all(outs, [dev(x) for x in ins[rank]], async_op=ao),
                         a, label)
            for s in range(ws):
                errs += compare_exact(host(outs[s]), ins[s][rank], f"{label} from {s}")
        return errs, {}

    return fn


# ---- point to point ---------------------------------------------------------


def _make_p2p_case(dt):
    """Per size: blocking send/recv between pairs (r, r^1), even rank sending first,
    then an isend/irecv ring (irecv posted first on even ranks, isend first on odd)."""

    def fn(rank, ws):
        errs = []
        partner, right, left = rank ^ 1, (rank + 1) % ws, (rank - 1) % ws
        for si, (lab, n) in enumerate(sizes_for(dt)):
            key = f"cuda/p2p/{dt}/{lab}"
            if partner < ws:
                mine = dev(make_input(key + "/pair", rank, n, dt))
                buf = sentinel(n, dt)
                C.pair_exchange(rank, partner, mine, buf, si + 1)
                errs += compare_exact(host(buf), make_input(key + "/pair", partner, n, dt),
                                      f"send/recv {lab} n={n} from {partner}")
            mine = dev(make_input(key + "/ring", rank, n, dt))
            buf = sentinel(n, dt)
            wr, wsend = C.ring_post(rank, mine, right, buf, left, 100 + si)
            wr.wait()
            wsend.wait()
            errs += compare_exact(host(buf), make_input(key + "/ring", left, n, dt),
                                  f"isend/irecv {lab} n={n} from {left}")
            errs += compare_exact(host(mine), make_input(key + "/ring", rank, n, dt),
                                  f"isend {lab} buffer modified")
        return errs, {}

    return fn


for _dt in ALL_DTYPES:
    add(f"all_gather_into_tensor[{_dt}]", _make_all_gather_case(_dt, False), _dt, identical=True)
    add(f"all_gather[{_dt}]", _make_all_gather_case(_dt, True), _dt, identical=True)
    add(f"gather[{_dt}]", _make_gather_case(_dt), _dt)
    add(f"scatter[{_dt}]", _make_scatter_case(_dt), _dt)
    add(f"broadcast[{_dt}]", _make_broadcast_case(_dt), _dt, identical=True)
    add(f"all_to_all_single[{_dt}]", _make_a2a_single_case(_dt), _dt)
    add(f"all_to_all[{_dt}]", _make_a2a_list_case(_dt), _dt)
    add(f"send_recv_isend_irecv[{_dt}]", _make_p2p_case(_dt), _dt)


# --------------------------------------------------------------------------
# The jobs and the per-case tests
# --------------------------------------------------------------------------


def cuda_collectives_job(rank, ws, case_ids):
    C.setup_rank(rank, ws)
    return H.execute_cases(CASES, case_ids, rank, ws)


JOBS = C.GpuJobCache(CASES, cuda_collectives_job, "test_cuda_collective", timeout_s=120)


def _params(keys=C.COLLECTIVE_JOB_KEYS + C.COLLECTIVE_VARIANT_KEYS):
    return C.collective_params(CASES, keys, CASE_DTYPE)


@pytest.mark.parametrize("cid,ws,path", _params())
def test_cuda_collective(cid, ws, path, request):
    JOBS.check(cid, (ws, path), request.session)


@pytest.mark.parametrize("ws,path", C.COLLECTIVE_JOB_KEYS,
                         ids=[f"ws{w}-{p}" for w, p in C.COLLECTIVE_JOB_KEYS])
def test_no_shm_left_after_cuda_job(ws, path, request):
    """After a normal CUDA job (ranks returned and destroyed their groups), no /dev/shm
    entry named resident* that appeared during the job may remain."""
    left, failed = JOBS.shm_left_after((ws, path), request.session,
                                       ["sanity[backend-device-and-path]", "all_reduce[SUM-float32]",
                                        "all_to_all_single[bfloat16]", "send_recv_isend_irecv[int64]"])
    assert not left, (f"left in /dev/shm after the ws={ws} path={path} CUDA job "
                      f"({'failed' if failed else 'normal exit'}): {sorted(left)}")


def test_cuda_case_registry_is_sane():
    assert len(CASES) > 90
    for dt in ALL_DTYPES:
        for op in (FLOAT_OPS if dt in FLOAT_DTYPE_NAMES else INT_OPS):
            assert f"all_reduce[{op}-{dt}]" in CASES
    every = _params(C.COLLECTIVE_KEYS)
    ws8 = [p for p in every if p.values[1] == 8]
    assert 2 * 40 < len(ws8) < len(every) // 3, len(ws8)
