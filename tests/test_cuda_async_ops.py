"""Async ops and their completion on CUDA tensors, both paths: barrier (blocking and
async_op=True, a late rank), ops of six kinds in flight at once and waited in reverse order, an
async all_reduce polled with is_completed() (then a kernel on the same stream), async ops issued
back to back across the one-round kernel's limits, and the functional collectives
(wait_tensor) at every size.

These cases take no dtype, so they run in every job of the collectives suite's matrix
(cuda_harness.COLLECTIVE_JOB_KEYS and COLLECTIVE_VARIANT_KEYS: 2, 4, 8 and 9 ranks, the knob
variants): one spawned job per (world size, RESIDENT_PATH), each case its own pytest item (see
cuda_harness.GpuJobCache). Inputs, references and comparisons as in test_cuda_collectives.py.
"""

from __future__ import annotations

import time

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import dev, host, inputs_for, kind_for, reduce_op, sentinel, sizes_for
from dist_harness import (
    a2a_split,
    compare_exact,
    compare_reduction,
    digest,
    make_input,
    reference_reduce,
)

pytestmark = C.module_marks()

CASES = H.CaseRegistry()


def _barrier(rank, ws):
    import torch.distributed as dist

    errs = []
    for i in range(10):
        w = dist.barrier(async_op=(i % 2 == 1))
        if i % 2 == 1:
            if w is None:
                errs.append("barrier(async_op=True) returned None instead of a Work")
            else:
                w.wait()
    if rank == ws - 1:
        time.sleep(0.5)  # the last rank arrives late: nobody may leave before it
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    if rank != ws - 1 and waited < 0.3:
        errs.append(f"barrier returned after {waited:.3f}s although rank {ws - 1} arrived 0.5s late")
    return errs, {}


def _async_in_flight(rank, ws):
    """Seven async ops of different kinds issued before any wait; waited in reverse order."""
    import torch
    import torch.distributed as dist

    errs = []
    big = C.n_elems("large", "bfloat16")
    a_in = inputs_for("cuda/fl/a", ws, big, "bfloat16")
    b_in = inputs_for("cuda/fl/b", ws, 1031, "int64")
    c_in = inputs_for("cuda/fl/c", ws, ws * 4099, "float32")
    e_key, root = "cuda/fl/e", ws - 1
    m = 37
    splits = [[a2a_split(s, d, m, "uneven") for d in range(ws)] for s in range(ws)]
    f_in = [make_input("cuda/fl/f", s, sum(splits[s]), "float16") for s in range(ws)]
    right, left = (rank + 1) % ws, (rank - 1) % ws

    a, b_src, c_src = dev(a_in[rank]), dev(b_in[rank]), dev(c_in[rank])
    b_out, c_out = sentinel(ws * 1031, "int64"), sentinel(4099, "float32")
    e = dev(make_input(e_key, rank, 5000, "uint8"))
    f_out = sentinel(sum(splits[s][rank] for s in range(ws)), "float16")
    g_buf = sentinel(777, "float64")
    works = [
        dist.all_reduce(a, async_op=True),
        dist.all_gather_into_tensor(b_out, b_src, async_op=True),
        dist.reduce_scatter_tensor(c_out, c_src, op=dist.ReduceOp.MAX, async_op=True),
        dist.broadcast(e, src=root, async_op=True),
        dist.all_to_all_single(f_out, dev(f_in[rank]), output_split_sizes=[splits[s][rank] for s in range(ws)],
                               input_split_sizes=splits[rank], async_op=True),
        dist.irecv(g_buf, src=left, tag=77),
        dist.isend(dev(make_input("cuda/fl/g", rank, 777, "float64")), dst=right, tag=77),
    ]
    for w in reversed(works):
        w.wait()
    errs += compare_reduction(host(a), reference_reduce(a_in, "SUM", "bfloat16"), a_in, "SUM",
                              "bfloat16", "all_reduce")
    errs += compare_exact(host(b_out), torch.cat(b_in), "all_gather_into_tensor")
    chunks = [x[rank * 4099:(rank + 1) * 4099] for x in c_in]
    errs += compare_exact(host(c_out), reference_reduce(chunks, "MAX", "float32"), "reduce_scatter MAX")
    errs += compare_exact(host(e), make_input(e_key, root, 5000, "uint8"), "broadcast")
    ref = torch.cat([f_in[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])] for s in range(ws)])
    errs += compare_exact(host(f_out), ref, "all_to_all_single uneven")
    errs += compare_exact(host(g_buf), make_input("cuda/fl/g", left, 777, "float64"), "irecv")
    return errs, {}


def _one_round_boundary(rank, ws):
    """Sizes around the one-round kernel's limits (kernels/one_round_kernel.cu: one 2 KiB part
    per block, one round of 64 KiB per peer), issued back to back without a wait, so that ops of
    the one-round and the general kernel take turns on the same slots; odd byte counts,
    unaligned tails and uneven all_to_all (credit lines) included."""
    import torch
    import torch.distributed as dist

    errs, pending = [], []
    # (dtype, elements): 1 element, odd bytes, just under / at / just over 2 KiB (one part),
    # several parts, just under / at / just over one 64 KiB round.
    reduce_sizes = [("int64", 1), ("float16", 3), ("float16", 1023), ("int64", 256),
                    ("float16", 1025), ("int64", 257), ("uint8", 2047), ("uint8", 2049),
                    ("bfloat16", 5), ("int32", 512), ("int32", 513), ("float32", 4097),
                    ("int64", 8191), ("int64", 8192), ("int64", 8193)]
    for i, (dt, n) in enumerate(reduce_sizes):
        op = "SUM" if dt != "uint8" else "MAX"
        inputs = inputs_for(f"cuda/orb/ar/{i}", ws, n, dt, kind_for(op, dt))
        t = dev(inputs[rank])
        pending.append((dist.all_reduce(t, op=reduce_op(op), async_op=True), "reduce", t, inputs, op,
                        dt, f"all_reduce {op} {dt} n={n}"))
    # Per peer: 255 / 256 / 257 / 1500 int64 (2040 / 2048 / 2056 / 12000 B).
    for n in (255, 256, 257, 1500):
        inputs = inputs_for(f"cuda/orb/ag/{n}", ws, n, "int64")
        out = sentinel(ws * n, "int64")
        pending.append((dist.all_gather_into_tensor(out, dev(inputs[rank]), async_op=True), "exact",
                        out, torch.cat(inputs), None, None, f"all_gather n={n}"))
        for variant in ("even", "uneven"):
            splits = [[a2a_split(s, d, n, variant) for d in range(ws)] for s in range(ws)]
            a2a_in = [make_input(f"cuda/orb/a2a/{variant}/{n}", s, sum(splits[s]), "int64")
                      for s in range(ws)]
            out2 = sentinel(sum(splits[s][rank] for s in range(ws)), "int64")
            ref = torch.cat([a2a_in[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])]
                             for s in range(ws)])
            work = dist.all_to_all_single(out2, dev(a2a_in[rank]),
                                          output_split_sizes=[splits[s][rank] for s in range(ws)],
                                          input_split_sizes=splits[rank], async_op=True)
            pending.append((work, "exact", out2, ref, None, None, f"all_to_all_single {variant} n={n}"))
    for work, kind, got, ref, op, dt, label in pending:
        work.wait()
        if kind == "reduce":
            errs += compare_reduction(host(got), reference_reduce(ref, op, dt), ref, op, dt, label)
        else:
            errs += compare_exact(host(got), ref, label)
    return errs, {}


def _polled_async(rank, ws):
    """An async all_reduce polled with is_completed() until True (a deadline fails instead of
    hanging), then a torch kernel on the same stream: polling an op still running must not
    leave a CUDA error behind for the next launch ("device not ready")."""
    import torch.distributed as dist

    ins = inputs_for("cuda/poll/ar", ws, 70001, "float32")
    t = dev(ins[rank])
    w = dist.all_reduce(t, async_op=True)
    deadline, polls = time.monotonic() + 60.0, 0
    while not w.is_completed():
        polls += 1
        if time.monotonic() > deadline:
            return [f"is_completed() still False after 60 s ({polls} polls)"], {}
        time.sleep(0.0002)
    w.wait()
    after = dev(ins[rank]) * 2  # kernels launched after the polls
    errs = compare_reduction(host(t), reference_reduce(ins, "SUM", "float32"), ins, "SUM",
                             "float32", f"all_reduce polled ({polls} polls)")
    errs += compare_exact(host(after), ins[rank] * 2, "a kernel launched after the polls")
    return errs, {}


def _funcol(rank, ws):
    """torch.distributed._functional_collectives on DEVICE tensors, every size."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    errs, digs = [], {}
    g = dist.group.WORLD
    for dt, op in (("float32", "sum"), ("bfloat16", "sum"), ("int64", "max")):
        for lab, n in sizes_for(dt):
            k = f"cuda/fc/{dt}/{lab}"
            inputs = inputs_for(k + "/ar", ws, n, dt)
            src = dev(inputs[rank])
            got = host(funcol.wait_tensor(funcol.all_reduce(src, op, g)))
            errs += compare_reduction(got, reference_reduce(inputs, op.upper(), dt), inputs,
                                      op.upper(), dt, f"all_reduce {op} {dt} {lab}")
            errs += compare_exact(host(src), inputs[rank], f"all_reduce {dt} {lab}: input modified")
            digs[f"ar/{dt}/{lab}"] = digest(got)
            inputs = inputs_for(k + "/ag", ws, n, dt)
            got = host(funcol.wait_tensor(funcol.all_gather_tensor(dev(inputs[rank]), 0, g)))
            errs += compare_exact(got, torch.cat(inputs), f"all_gather_tensor {dt} {lab}")
            c = max(1, n // ws)
            inputs = inputs_for(k + "/rs", ws, ws * c, dt)
            got = host(funcol.wait_tensor(funcol.reduce_scatter_tensor(dev(inputs[rank]), op, 0, g)))
            chunks = [x[rank * c:(rank + 1) * c] for x in inputs]
            errs += compare_reduction(got, reference_reduce(chunks, op.upper(), dt), chunks,
                                      op.upper(), dt, f"reduce_scatter_tensor {dt} {lab}")
            m = max(1, n // (4 * ws))
            splits = [[a2a_split(s, d, m, "uneven") for d in range(ws)] for s in range(ws)]
            inputs = [make_input(k + "/a2a", s, sum(splits[s]), dt) for s in range(ws)]
            got = host(funcol.wait_tensor(funcol.all_to_all_single(
                dev(inputs[rank]), [splits[s][rank] for s in range(ws)], splits[rank], g)))
            ref = torch.cat([inputs[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])]
                             for s in range(ws)])
            errs += compare_exact(got, ref, f"all_to_all_single uneven {dt} {lab}")
    # 2-D all_gather along dim 1 (funcol re-arranges the gathered chunks)
    inputs = [make_input("cuda/fc/ag2d", r, 6 * 7, "float16").reshape(6, 7) for r in range(ws)]
    got = host(funcol.wait_tensor(funcol.all_gather_tensor(dev(inputs[rank]), 1, g)))
    errs += compare_exact(got, torch.cat(inputs, 1), "all_gather_tensor gather_dim=1")
    return errs, digs


CASES.add("barrier", _barrier, identical=False)
CASES.add("async_ops_in_flight", _async_in_flight, identical=False)
CASES.add("async_op_polled_is_completed", _polled_async, identical=False)
CASES.add("one_round_boundary", _one_round_boundary, identical=False)
CASES.add("functional_collectives", _funcol)


# --------------------------------------------------------------------------
# The jobs and the per-case tests
# --------------------------------------------------------------------------


def cuda_async_ops_job(rank, ws, case_ids):
    C.setup_rank(rank, ws)
    return H.execute_cases(CASES, case_ids, rank, ws)


# Named as the collectives suite's test (items test_cuda_collective[CASE-wsN-PATH]): one matrix
# in two modules, each job cache running the cases of its own registry.
JOBS = C.GpuJobCache(CASES, cuda_async_ops_job, "test_cuda_collective", timeout_s=120)


def _params(keys=C.COLLECTIVE_JOB_KEYS + C.COLLECTIVE_VARIANT_KEYS):
    return C.collective_params(CASES, keys)


@pytest.mark.parametrize("cid,ws,path", _params())
def test_cuda_collective(cid, ws, path, request):
    JOBS.check(cid, (ws, path), request.session)


@pytest.mark.parametrize("ws,path", C.COLLECTIVE_JOB_KEYS,
                         ids=[f"ws{w}-{p}" for w, p in C.COLLECTIVE_JOB_KEYS])
def test_no_shm_left_after_async_job(ws, path, request):
    """After a normal job of async ops (ranks waited and destroyed their groups), no /dev/shm
    entry named resident* that appeared during the job may remain."""
    left, failed = JOBS.shm_left_after((ws, path), request.session, ["async_ops_in_flight"])
    assert not left, (f"left in /dev/shm after the ws={ws} path={path} CUDA async-ops job "
                      f"({'failed' if failed else 'normal exit'}): {sorted(left)}")
