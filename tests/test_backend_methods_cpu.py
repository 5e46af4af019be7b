"""The c10d::Backend methods beyond the common collectives, on CPU tensors (docs/ops.md):
all_gather_coalesced, gather_single, recv from any source (the sender comes back), and
monitored_barrier (passing, and naming the ranks that did not arrive); what a call with asyncOp
off returns (no Work: synchronous_calls.py); coalesced calls with a bad pair, refused before any
op starts; plus the clear error of a method resident does not serve.

All cases of one world size run in one spawned job (dist_harness.JobCache). Every rank
regenerates every other rank's input from a seed, so results are checked bitwise against the
inputs themselves, never against another collective.
"""

from __future__ import annotations

import pytest

import dist_harness as H
from dist_harness import compare_exact, make_input, tdtype

WORLD_SIZES = (2, 3)
MiB = 1 << 20

CASES = H.CaseRegistry()
case = CASES.case


def _agc_check(rank, ws, dtype_name, sizes, async_op):
    import torch
    import torch.distributed as dist

    errs = []
    key = f"agc/{dtype_name}/{sizes}/{async_op}"
    inputs = {r: [make_input(f"{key}/{i}", r, n, dtype_name) for i, n in enumerate(sizes)]
              for r in range(ws)}
    mine = [t.clone() for t in inputs[rank]]
    outs = [[torch.full((n,), 0, dtype=tdtype(dtype_name)) for n in sizes] for _ in range(ws)]
    handle = dist.all_gather_coalesced(outs, mine, async_op=async_op)
    if async_op:
        value = handle.wait()  # torch hands back the Work's future for this op
        if not isinstance(value, list) or len(value) != ws * len(sizes):
            errs.append(f"future value: {type(value).__name__} of "
                        f"{len(value) if isinstance(value, list) else '?'} tensors, "
                        f"expected a list of {ws * len(sizes)}")
    for r in range(ws):
        for i, n in enumerate(sizes):
            errs += compare_exact(outs[r][i], inputs[r][i], f"{dtype_name} rank {r} tensor {i} (n={n})")
    for i in range(len(sizes)):
        errs += compare_exact(mine[i], inputs[rank][i], f"input {i} modified")
    return errs


@case("all_gather_coalesced[mixed-sizes]", identical=False)
def _agc_mixed(rank, ws):
    errs = []
    for dt in ("float32", "int64", "bfloat16", "uint8"):
        errs += _agc_check(rank, ws, dt, (13, 1, 1031), async_op=False)
    return errs, {}


@case("all_gather_coalesced[streamed-and-async]", identical=False)
def _agc_large(rank, ws):
    # 2 MiB + 3 elements: far beyond one 64 KiB slot, so the message is streamed through the ring.
    errs = _agc_check(rank, ws, "float32", (7, (2 * MiB) // 4 + 3), async_op=True)
    errs += _agc_check(rank, ws, "int32", (4099,), async_op=True)
    return errs, {}


@case("all_gather_coalesced[size-mismatch-is-ValueError]", identical=False)
def _agc_bad(rank, ws):
    import torch
    import torch.distributed as dist

    outs = [[torch.empty(3)] for _ in range(ws)]
    try:
        dist.all_gather_coalesced(outs, [torch.ones(4)])
    except ValueError as e:
        if "all_gather_coalesced" not in str(e) or "size mismatch" not in str(e):
            return [f"the error does not name the op and the problem: {e}"], {}
        return [], {}
    return ["a 3-element output for a 4-element input was accepted"], {}


@case("tensor_coalesced[a-bad-pair-starts-nothing]", identical=False)
def _tensor_coalesced_bad_pair(rank, ws):
    # A size mismatch in the second pair is raised before the first pair's op starts: its
    # output stays as it was, and the group's next op is the first to run.
    import torch
    import torch.distributed as dist

    errs = []
    pg = dist.group.WORLD
    calls = (
        ("allgather_into_tensor_coalesced", "all_gather_into_tensor",
         [torch.zeros(2 * ws), torch.zeros(2 * ws + 1)], [torch.ones(2), torch.ones(2)]),
        ("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor",
         [torch.zeros(2), torch.zeros(3)], [torch.ones(2 * ws), torch.ones(2 * ws)]),
    )
    for method, op, outputs, inputs in calls:
        try:
            getattr(pg, method)(outputs, inputs)
            errs.append(f"{method}: a mismatched second pair was accepted")
        except ValueError as e:
            if op not in str(e) or "size mismatch" not in str(e):
                errs.append(f"{method}: the error does not name the op and the problem: {e}")
        # A started op would have finished by the end of the next one.
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        errs += compare_exact(t, torch.full((3,), float(ws * (ws + 1) // 2)),
                              f"the all_reduce after {method}")
        if bool(outputs[0].any()):
            errs.append(f"{method}: the first pair's op ran although the second pair was wrong")
    return errs, {}


@case("gather_single[every-root]", identical=False)
def _gather_single(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    for dt, n in (("float64", 1031), ("int32", 1), ("uint8", 300_001)):
        for root in range(ws):
            key = f"gs/{dt}/{n}/{root}"
            inputs = [make_input(key, r, n, dt) for r in range(ws)]
            out = torch.full((ws * n,), 0, dtype=tdtype(dt)) if rank == root else None
            dist.gather_single(inputs[rank].clone(), out, dst=root)
            if rank == root:
                errs += compare_exact(out, torch.cat(inputs), f"{dt} n={n} root={root}")
    return errs, {}


def _empty(n, dtype_name):
    import torch

    return torch.full((n,), 0, dtype=tdtype(dtype_name))


def _collect_any(ws, n, dtype_name, key, tag, count_per_peer=1, delay_s=0.0, use_irecv=False):
    """Rank 0 receives count_per_peer messages from every other rank without naming the source;
    returns errors. Messages of one peer must come in the order it sent them."""
    import time

    import torch.distributed as dist

    errs = []
    if delay_s:
        time.sleep(delay_s)  # the messages are already here (stashed) when the recvs are posted
    next_index = {r: 0 for r in range(1, ws)}
    for _ in range((ws - 1) * count_per_peer):
        buf = _empty(n, dtype_name)
        if use_irecv:
            work = dist.irecv(buf, tag=tag)
            work.wait()
            src = work._source_rank()
        else:
            src = dist.recv(buf, tag=tag)
        if src not in next_index:
            errs.append(f"recv returned sender {src}, not one of the senders {sorted(next_index)}")
            continue
        i = next_index[src]
        next_index[src] += 1
        if i >= count_per_peer:
            errs.append(f"more than {count_per_peer} messages reported from rank {src}")
            continue
        errs += compare_exact(buf, make_input(f"{key}/{src}/{i}", src, n, dtype_name),
                              f"message {i} of rank {src} ({dtype_name} n={n}, tag {tag})")
    for r, k in next_index.items():
        if k != count_per_peer:
            errs.append(f"{k} messages reported from rank {r}, expected {count_per_peer}")
    return errs


def _send_to_zero(rank, n, dtype_name, key, tag, count=1):
    import torch.distributed as dist

    works = [dist.isend(make_input(f"{key}/{rank}/{i}", rank, n, dtype_name), dst=0, tag=tag)
             for i in range(count)]
    for w in works:
        w.wait()


@case("recv_any_source[sender-returned]", identical=False)
def _any_basic(rank, ws):
    import torch.distributed as dist

    errs = []
    for dt, n, tag in (("float32", 5, 0), ("int64", 1031, 3), ("bfloat16", 1, 12)):
        key = f"any/basic/{dt}/{n}"
        if rank == 0:
            errs += _collect_any(ws, n, dt, key, tag)
        else:
            _send_to_zero(rank, n, dt, key, tag)
        dist.barrier()
    return errs, {}


@case("recv_any_source[posted-after-arrival-and-large]", identical=False)
def _any_stashed(rank, ws):
    import torch.distributed as dist

    errs = []
    # Small messages that are complete before the recv is posted, then 2 MiB messages that are
    # streamed (only part of one fits the ring before the recv drains it).
    for n, delay in ((33, 0.3), ((2 * MiB) // 4 + 1, 0.3), ((2 * MiB) // 4 + 1, 0.0)):
        key = f"any/stash/{n}/{delay}"
        if rank == 0:
            errs += _collect_any(ws, n, "float32", key, 4, delay_s=delay)
        else:
            _send_to_zero(rank, n, "float32", key, 4)
        dist.barrier()
    return errs, {}


@case("recv_any_source[per-sender-order-and-irecv]", identical=False)
def _any_order(rank, ws):
    import torch.distributed as dist

    errs = []
    for use_irecv in (False, True):
        key = f"any/order/{use_irecv}"
        if rank == 0:
            errs += _collect_any(ws, 517, "int32", key, 9, count_per_peer=3, use_irecv=use_irecv)
        else:
            _send_to_zero(rank, 517, "int32", key, 9, count=3)
        dist.barrier()
    return errs, {}


@case("recv_any_source[tags-and-named-recvs-keep-their-messages]", identical=False)
def _any_tags(rank, ws):
    """Rank 1 sends tag 21 then tag 20; rank 0 first posts a recv from rank 1 with tag 21, then
    receives tag 20 from any source: each recv gets the message of its own tag."""
    import torch.distributed as dist

    errs = []
    key = "any/tags"
    if rank == 1:
        dist.send(make_input(f"{key}/21", 1, 64, "float32"), dst=0, tag=21)
        dist.send(make_input(f"{key}/20", 1, 64, "float32"), dst=0, tag=20)
    elif rank == 0:
        named = _empty(64, "float32")
        w = dist.irecv(named, src=1, tag=21)
        anyb = _empty(64, "float32")
        src = dist.recv(anyb, tag=20)
        w.wait()
        if src != 1:
            errs.append(f"recv from any source with tag 20 returned sender {src}, expected 1")
        errs += compare_exact(anyb, make_input(f"{key}/20", 1, 64, "float32"), "tag 20 message")
        errs += compare_exact(named, make_input(f"{key}/21", 1, 64, "float32"), "tag 21 message")
    dist.barrier()
    return errs, {}


@case("recv_any_source[subgroup-returns-global-rank]", identical=False, min_ws=3)
def _any_subgroup(rank, ws):
    import torch.distributed as dist

    errs = []
    g = dist.new_group([0, 2])
    key = "any/sub"
    if rank == 2:
        dist.send(make_input(key, 2, 10, "int64"), dst=0, group=g, tag=1)
    elif rank == 0:
        buf = _empty(10, "int64")
        src = dist.recv(buf, group=g, tag=1)
        if src != 2:
            errs.append(f"recv on the subgroup [0, 2] returned {src}, expected global rank 2")
        errs += compare_exact(buf, make_input(key, 2, 10, "int64"), "subgroup message")
    dist.barrier()
    dist.destroy_process_group(g)
    return errs, {}


def _expect_error(fn, pattern, what):
    import re

    try:
        fn()
    except RuntimeError as e:
        if not re.search(pattern, str(e)):
            return [f"{what}: error {str(e)[:300]!r} does not match {pattern!r}"]
        return []
    return [f"{what}: no error (expected one matching {pattern!r})"]


@case("monitored_barrier[passes]", identical=False)
def _mb_pass(rank, ws):
    import datetime

    import torch
    import torch.distributed as dist

    errs = []
    for wait_all in (False, True, False):
        t = torch.ones(10) * rank
        dist.all_reduce(t)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=wait_all)
    return errs, {}


@case("monitored_barrier[names-missing-ranks]", identical=False)
def _mb_fail(rank, ws):
    """On a group of its own (3 s timeout): the last rank does not call; rank 0 names it (the
    first missing rank, or all of them), another waiting rank says rank 0 failed."""
    import datetime

    import torch.distributed as dist

    errs = []
    short = datetime.timedelta(seconds=1)
    for wait_all in (False, True):
        g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=3))
        missing = ws - 1
        if rank == 0:
            pattern = f"{'Ranks' if wait_all else 'Rank'} {missing} failed to pass monitoredBarrier"
            errs += _expect_error(lambda: dist.monitored_barrier(g, timeout=short, wait_all_ranks=wait_all),
                                  pattern, f"rank 0, wait_all_ranks={wait_all}")
        elif rank != missing:
            errs += _expect_error(lambda: dist.monitored_barrier(g, timeout=short, wait_all_ranks=wait_all),
                                  f"Rank {rank} successfully reached monitoredBarrier, but received "
                                  f"errors while waiting for send/recv from rank 0",
                                  f"rank {rank}, wait_all_ranks={wait_all}")
        dist.barrier()  # on the default group: every rank leaves this case together
        dist.destroy_process_group(g)
    if ws >= 3:
        g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=3))
        if rank == 0:
            listed = ", ".join(str(r) for r in range(1, ws))
            errs += _expect_error(lambda: dist.monitored_barrier(g, timeout=short, wait_all_ranks=True),
                                  f"Ranks {listed} failed to pass monitoredBarrier",
                                  "rank 0, nobody else arrives")
        dist.barrier()
        dist.destroy_process_group(g)
    g0 = dist.new_group([0])  # every rank takes part in creating a group
    if rank == 0:
        dist.monitored_barrier(g0, timeout=datetime.timedelta(seconds=0))  # alone: passes at once
        dist.destroy_process_group(g0)
    return errs, {}


@case("monitored_barrier[rank-0-timeout-zero]", identical=False)
def _mb_zero(rank, ws):
    import datetime

    import torch.distributed as dist

    errs = []
    g = dist.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        errs += _expect_error(lambda: dist.monitored_barrier(g, timeout=datetime.timedelta(seconds=0)),
                              "Rank 0 timed out in monitoredBarrier", "timeout 0")
    dist.barrier()
    dist.destroy_process_group(g)
    return errs, {}


@case("unsupported_method[sparse-all_reduce-names-the-op]", identical=False)
def _sparse(rank, ws):
    import torch
    import torch.distributed as dist

    t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,))
    try:
        dist.all_reduce(t)
    except (RuntimeError, ValueError) as e:
        if "resident" not in str(e) or "sparse" not in str(e):
            return [f"the error does not name the backend and the op: {str(e)[:300]!r}"], {}
        return [], {}
    return ["all_reduce of a sparse tensor did not raise"], {}


@case("get_error[success-while-healthy-and-after-peers-leave]", identical=False)
def _get_error(rank, ws):
    """Backend.get_error() is SUCCESS on a working group, after a peer destroyed its group in
    order and after this rank destroyed its own (failures: tests/test_dead_peer.py)."""
    import torch
    import torch.distributed as dist

    errs = []
    g = dist.new_group(list(range(ws)))
    backend = g._get_backend(torch.device("cpu"))

    def expect(what):
        got = backend.get_error()
        if got.name != "SUCCESS":
            errs.append(f"{what}: get_error() is {got}, expected SUCCESS")

    expect("a new group")
    t = torch.ones(5)
    dist.all_reduce(t, group=g)
    expect("after an all_reduce")
    if rank == ws - 1:
        dist.destroy_process_group(g)
    dist.barrier()  # the last rank's group is gone, in order
    if rank != ws - 1:
        expect("after a peer destroyed its group")
        dist.destroy_process_group(g)
    expect("after this rank destroyed the group")
    dist.barrier()
    return errs, {}


@case("synchronous_calls[no-work-result-in-place]", identical=False)
def _synchronous_calls(rank, ws):
    from synchronous_calls import synchronous_call_problems

    return synchronous_call_problems(rank, ws, lambda t: t, lambda t: t, lambda: None), {}


def methods_job(rank, ws, ids):
    return H.execute_cases(CASES, ids, rank, ws)


JOBS = H.JobCache(CASES, methods_job, "test_backend_method", timeout_s=240, init_timeout_s=60)


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("cid", list(CASES))
def test_backend_method(cid, ws, request):
    JOBS.check(cid, ws, request.session)
