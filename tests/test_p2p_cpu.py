"""Point-to-point semantics (send/recv, isend/irecv, tags) on CPU tensors.

All cases of one world size run in one spawned job (see dist_harness.JobCache).
Ranks >= 2 stay idle in the two-party cases, so every case runs at ws 2 and 3.
"""

from __future__ import annotations

import pytest

import dist_harness as H
from dist_harness import compare_exact, itemsize, make_input, tdtype

WORLD_SIZES = (2, 3)
MiB = 1 << 20

CASES = H.CaseRegistry()
case = CASES.case


def _empty_like_input(n, dtype_name):
    import torch

    return torch.full((n,), 0, dtype=tdtype(dtype_name))


@case("send_recv_blocking_with_tags", identical=False)
def _blocking(rank, ws):
    """0 -> 1 on tag 5, then 1 -> 0 on tag 6; several dtypes and sizes."""
    import torch.distributed as dist

    errs = []
    for dt in ("float32", "bfloat16", "int64", "uint8", "float64"):
        for n in (1, 1031, (64 * 1024) // itemsize(dt)):
            k = f"p2p/blk/{dt}/{n}"
            if rank == 0:
                dist.send(make_input(k, 0, n, dt), dst=1, tag=5)
                buf = _empty_like_input(n, dt)
                dist.recv(buf, src=1, tag=6)
                errs += compare_exact(buf, make_input(k, 1, n, dt), f"{dt} n={n} 1->0")
            elif rank == 1:
                buf = _empty_like_input(n, dt)
                dist.recv(buf, src=0, tag=5)
                errs += compare_exact(buf, make_input(k, 0, n, dt), f"{dt} n={n} 0->1")
                dist.send(make_input(k, 1, n, dt), dst=0, tag=6)
    return errs, {}


@case("send_recv_default_tag_large", identical=False)
def _blocking_large(rank, ws):
    import torch.distributed as dist

    errs = []
    n = 2 * MiB // 4 + 5
    k = "p2p/blkL"
    if rank == 0:
        dist.send(make_input(k, 0, n, "float32"), dst=1)
    elif rank == 1:
        buf = _empty_like_input(n, "float32")
        src = dist.recv(buf, src=0)
        if src != 0:
            errs.append(f"recv returned sender {src}, expected 0")
        errs += compare_exact(buf, make_input(k, 0, n, "float32"), "2 MiB 0->1")
    return errs, {}


def _tag_swap(rank, sender_blocking, n):
    """Rank 0 sends tag 1 then tag 2; rank 1 posts irecv(tag 2) before irecv(tag 1)."""
    import torch.distributed as dist

    errs = []
    k = f"p2p/tags/{sender_blocking}/{n}"
    a, b = make_input(k + "/a", 0, n, "float32"), make_input(k + "/b", 0, n, "float32")
    if rank == 0:
        if sender_blocking:
            dist.send(a, dst=1, tag=1)
            dist.send(b, dst=1, tag=2)
        else:
            w1 = dist.isend(a, dst=1, tag=1)
            w2 = dist.isend(b, dst=1, tag=2)
            w2.wait()
            w1.wait()
    elif rank == 1:
        buf_b = _empty_like_input(n, "float32")
        buf_a = _empty_like_input(n, "float32")
        wb = dist.irecv(buf_b, src=0, tag=2)
        wa = dist.irecv(buf_a, src=0, tag=1)
        wb.wait()
        errs += compare_exact(buf_b, b, f"tag 2 message (n={n}, blocking sender={sender_blocking})")
        wa.wait()
        errs += compare_exact(buf_a, a, f"tag 1 message (n={n}, blocking sender={sender_blocking})")
    return errs


@case("irecv_tags_received_in_opposite_order", identical=False)
def _tags_opposite(rank, ws):
    errs = []
    for n in (1, 1031, 2 * MiB // 4 + 1):
        errs += _tag_swap(rank, False, n)
    return errs, {}


@case("irecv_tags_opposite_order_blocking_sender", identical=False)
def _tags_opposite_blocking(rank, ws):
    errs = []
    for n in (7, 4099):
        errs += _tag_swap(rank, True, n)
    return errs, {}


def _crossing(rank, n, order):
    import torch.distributed as dist

    errs = []
    if rank > 1:
        return errs
    peer = 1 - rank
    k = f"p2p/cross/{n}/{order}"
    mine = make_input(k, rank, n, "float32")
    buf = _empty_like_input(n, "float32")
    if order == "both_send_first" or (order == "mixed" and rank == 0):
        ws_ = dist.isend(mine, dst=peer, tag=9)
        wr = dist.irecv(buf, src=peer, tag=9)
    else:
        wr = dist.irecv(buf, src=peer, tag=9)
        ws_ = dist.isend(mine, dst=peer, tag=9)
    wr.wait()
    ws_.wait()
    errs += compare_exact(buf, make_input(k, peer, n, "float32"), f"{order} n={n} from {peer}")
    return errs


@case("isend_irecv_crossing_2MiB", identical=False)
def _crossing_large(rank, ws):
    errs = []
    n = 2 * MiB // 4
    for order in ("both_send_first", "mixed", "both_recv_first"):
        errs += _crossing(rank, n, order)
        errs += _crossing(rank, n + 3, order)
    return errs, {}


@case("isend_irecv_crossing_small", identical=False)
def _crossing_small(rank, ws):
    errs = []
    for n in (1, 333):
        for order in ("both_send_first", "mixed"):
            errs += _crossing(rank, n, order)
    return errs, {}


@case("same_tag_messages_arrive_in_order", identical=False)
def _fifo(rank, ws):
    import torch.distributed as dist

    errs = []
    m = 5
    sizes = [1, 4099, 2 * MiB // 4 + 1, 3, 1031]  # mixed small and large, same tag
    if rank == 0:
        works = [dist.isend(make_input(f"p2p/fifo/{i}", 0, sizes[i], "float32"), dst=1, tag=3)
                 for i in range(m)]
        for w in works:
            w.wait()
    elif rank == 1:
        bufs = [_empty_like_input(sizes[i], "float32") for i in range(m)]
        works = [dist.irecv(bufs[i], src=0, tag=3) for i in range(m)]
        for i, w in enumerate(works):
            w.wait()
            errs += compare_exact(bufs[i], make_input(f"p2p/fifo/{i}", 0, sizes[i], "float32"),
                                  f"message #{i}")
    return errs, {}


@case("ring_exchange", identical=False, min_ws=3)
def _ring(rank, ws):
    import torch.distributed as dist

    errs = []
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for dt, n in (("float32", 1), ("int64", 1031), ("bfloat16", 64 * 512), ("float32", 2 * MiB // 4 + 1)):
        k = f"p2p/ring/{dt}/{n}"
        buf = _empty_like_input(n, dt)
        wr = dist.irecv(buf, src=left, tag=11)
        wsend = dist.isend(make_input(k, rank, n, dt), dst=right, tag=11)
        wsend.wait()
        wr.wait()
        errs += compare_exact(buf, make_input(k, left, n, dt), f"{dt} n={n} from {left}")
    return errs, {}


@case("all_pairs_tags_reverse_posting", identical=False, min_ws=3)
def _all_pairs(rank, ws):
    """Every rank sends to every other rank (tag = 100*src + dst) and posts its
    receives in reverse rank order; messages must match by (source, tag)."""
    import torch.distributed as dist

    errs = []
    n = 517
    sends = [dist.isend(make_input(f"p2p/pairs/{rank}->{d}", rank, n, "int32"), dst=d,
                        tag=100 * rank + d)
             for d in range(ws) if d != rank]
    bufs = {}
    recvs = []
    for s in reversed(range(ws)):
        if s == rank:
            continue
        bufs[s] = _empty_like_input(n, "int32")
        recvs.append(dist.irecv(bufs[s], src=s, tag=100 * s + rank))
    for w in recvs + sends:
        w.wait()
    for s, b in bufs.items():
        errs += compare_exact(b, make_input(f"p2p/pairs/{s}->{rank}", s, n, "int32"), f"from {s}")
    return errs, {}


@case("p2p_then_collective", identical=True)
def _p2p_then_collective(rank, ws):
    """p2p traffic interleaved with collectives on the same group."""
    import torch.distributed as dist

    from dist_harness import compare_reduction, digest, reference_reduce

    errs, digs = [], {}
    for it in range(3):
        k = f"p2p/mix/{it}"
        if rank == 0:
            w = dist.isend(make_input(k + "/p", 0, 100, "float64"), dst=1, tag=it)
        elif rank == 1:
            buf = _empty_like_input(100, "float64")
            w = dist.irecv(buf, src=0, tag=it)
        inputs = [make_input(k, r, 1031, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                  "float32", f"iteration {it}")
        digs[str(it)] = digest(t)
        if rank in (0, 1):
            w.wait()
        if rank == 1:
            errs += compare_exact(buf, make_input(k + "/p", 0, 100, "float64"), f"p2p iteration {it}")
    return errs, digs


def p2p_job(rank, ws, ids):
    return H.execute_cases(CASES, ids, rank, ws)


JOBS = H.JobCache(CASES, p2p_job, "test_p2p", timeout_s=180)


@pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("cid", list(CASES))
def test_p2p(cid, ws, request):
    JOBS.check(cid, ws, request.session)
