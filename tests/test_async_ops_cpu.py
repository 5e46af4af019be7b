"""Waiting for collectives on CPU tensors, world sizes 2, 3 and 4: barrier (nobody leaves
before the last rank arrives), six async ops issued before any wait and waited in reverse
order, Work.is_completed() polled without wait(), get_future().wait(), and the functional
collectives (wait_tensor).

As in test_collectives_cpu.py: all cases of one world size run in one spawned job, each case is
its own pytest item, and every rank regenerates every rank's input from a seed and computes an
independent numpy / float64 reference.
"""

from __future__ import annotations

import time

import pytest

import dist_harness as H
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce

WORLD_SIZES = (2, 3, 4)
MiB = 1 << 20

CASES = H.CaseRegistry()
case = CASES.case


@case("barrier", identical=False)
def _barrier(rank, ws):
    import torch.distributed as dist

    errs = []
    for _ in range(20):
        dist.barrier()
    # the last rank arrives 0.6 s late: nobody may leave before it arrives
    if rank == ws - 1:
        time.sleep(0.6)
    t0 = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - t0
    if rank != ws - 1 and waited < 0.4:
        errs.append(f"barrier returned after {waited:.3f}s although rank {ws - 1} arrived 0.6s late")
    return errs, {}


@case("functional_collectives", identical=False)
def _funcol(rank, ws):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    errs = []
    g = dist.group.WORLD
    n = 1031
    # all_reduce
    inputs = [make_input("fc/ar", r, n, "float32") for r in range(ws)]
    out = funcol.wait_tensor(funcol.all_reduce(inputs[rank].clone(), "sum", g))
    errs += compare_reduction(out, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                              "float32", "funcol.all_reduce sum")
    inputs = [make_input("fc/armax", r, n, "int64") for r in range(ws)]
    out = funcol.wait_tensor(funcol.all_reduce(inputs[rank].clone(), "max", g))
    errs += compare_exact(out, reference_reduce(inputs, "MAX", "int64"), "funcol.all_reduce max")
    # all_gather_tensor, 2-D, gather_dim 0
    inputs = [make_input("fc/ag", r, 6 * 7, "bfloat16").reshape(6, 7) for r in range(ws)]
    out = funcol.wait_tensor(funcol.all_gather_tensor(inputs[rank].clone(), 0, g))
    errs += compare_exact(out, torch.cat(inputs, 0), "funcol.all_gather_tensor")
    # reduce_scatter_tensor
    inputs = [make_input("fc/rs", r, ws * 257, "float32") for r in range(ws)]
    out = funcol.wait_tensor(funcol.reduce_scatter_tensor(inputs[rank].clone(), "sum", 0, g))
    chunks = [x[rank * 257:(rank + 1) * 257] for x in inputs]
    errs += compare_reduction(out, reference_reduce(chunks, "SUM", "float32"), chunks, "SUM",
                              "float32", "funcol.reduce_scatter_tensor")
    # all_to_all_single, uneven
    splits = [[H.a2a_split(s, d, 3, "uneven") for d in range(ws)] for s in range(ws)]
    inputs = [make_input("fc/a2a", s, sum(splits[s]), "int32") for s in range(ws)]
    out = funcol.wait_tensor(funcol.all_to_all_single(
        inputs[rank].clone(), [splits[s][rank] for s in range(ws)], splits[rank], g))
    ref = torch.cat([inputs[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])] for s in range(ws)])
    errs += compare_exact(out, ref, "funcol.all_to_all_single")
    # broadcast from the last rank
    src = ws - 1
    mine = make_input("fc/bc", rank, 999, "float64")
    out = funcol.wait_tensor(funcol.broadcast(mine.clone(), src, g))
    errs += compare_exact(out, make_input("fc/bc", src, 999, "float64"), "funcol.broadcast")
    return errs, {}


@case("async_ops_in_flight", identical=False)
def _async(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    n = 4099
    a_in = [make_input("as/a", r, n, "float32") for r in range(ws)]
    b_in = [make_input("as/b", r, n, "int64") for r in range(ws)]
    c_in = [make_input("as/c", r, 77, "bfloat16") for r in range(ws)]
    d_in = [make_input("as/d", r, ws * 100, "float64") for r in range(ws)]
    bc_root = 1 % ws
    e_mine = make_input("as/e", rank, 500, "uint8")
    big_in = [make_input("as/big", r, MiB // 4 + 7, "float32") for r in range(ws)]

    a = a_in[rank].clone()
    b = b_in[rank].clone()
    c_out = torch.empty(ws * 77, dtype=torch.bfloat16)
    d_out = torch.empty(100, dtype=torch.float64)
    e = e_mine.clone()
    big = big_in[rank].clone()
    works = [
        dist.all_reduce(a, async_op=True),
        dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True),
        dist.all_gather_into_tensor(c_out, c_in[rank].clone(), async_op=True),
        dist.reduce_scatter_tensor(d_out, d_in[rank].clone(), async_op=True),
        dist.broadcast(e, src=bc_root, async_op=True),
        dist.all_reduce(big, async_op=True),
    ]
    for w in reversed(works):  # wait in the opposite order of issue
        w.wait()
    errs += compare_reduction(a, reference_reduce(a_in, "SUM", "float32"), a_in, "SUM", "float32", "async a")
    errs += compare_exact(b, reference_reduce(b_in, "MAX", "int64"), "async b")
    errs += compare_exact(c_out, torch.cat(c_in), "async c")
    chunks = [x[rank * 100:(rank + 1) * 100] for x in d_in]
    errs += compare_reduction(d_out, reference_reduce(chunks, "SUM", "float64"), chunks, "SUM",
                              "float64", "async d")
    errs += compare_exact(e, make_input("as/e", bc_root, 500, "uint8"), "async e")
    errs += compare_reduction(big, reference_reduce(big_in, "SUM", "float32"), big_in, "SUM",
                              "float32", "async big")
    deadline = time.monotonic() + 5
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i, w in enumerate(works):
        if not w.is_completed():
            errs.append(f"work {i}: is_completed() still False 5 s after wait() returned")

    # is_completed() eventually becomes True without calling wait()
    f_in = [make_input("as/f", r, 1031, "float32") for r in range(ws)]
    f = f_in[rank].clone()
    w = dist.all_reduce(f, async_op=True)
    deadline = time.monotonic() + 15
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not w.is_completed():
        errs.append("is_completed() still False 15 s after an async all_reduce was issued")
    else:
        errs += compare_reduction(f, reference_reduce(f_in, "SUM", "float32"), f_in, "SUM",
                                  "float32", "polled work")
    w.wait()

    # get_future().wait()
    g_in = [make_input("as/g", r, 333, "int32") for r in range(ws)]
    g = g_in[rank].clone()
    fut = dist.all_reduce(g, op=dist.ReduceOp.BXOR, async_op=True).get_future()
    val = fut.wait()
    ref = reference_reduce(g_in, "BXOR", "int32")
    errs += compare_exact(g, ref, "future: tensor in place")
    if isinstance(val, (list, tuple)) and len(val) == 1 and torch.is_tensor(val[0]):
        errs += compare_exact(val[0], ref, "future value")
    else:
        errs.append(f"get_future().wait() returned {type(val).__name__} "
                    f"(expected a list holding the reduced tensor)")
    if not fut.done():
        errs.append("future.done() is False after wait()")
    return errs, {}


# --------------------------------------------------------------------------
# The job and the per-case tests
# --------------------------------------------------------------------------


def async_ops_job(rank, ws, case_ids):
    return H.execute_cases(CASES, case_ids, rank, ws)


# Named as the collectives suite's test (items test_collective[CASE-wsN]): one matrix in two
# modules, each job cache running the cases of its own registry.
JOBS = H.JobCache(CASES, async_ops_job, "test_collective")


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("cid", list(CASES))
def test_collective(cid, ws, request):
    JOBS.check(cid, ws, request.session)
