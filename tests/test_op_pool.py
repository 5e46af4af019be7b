"""The op pool (RESIDENT_MAX_INFLIGHT) under async work on CPU tensors: a finished op goes back
to the pool once its work has seen it finish, whether or not the caller still holds the work,
so that more async ops than the pool holds never wait on ops that are done. Each mode a user
can turn on for CPU tensors (shm, the proxy path, tcp), with a pool of 4 ops; random integer
data checked bitwise against a reference computed here."""

import pytest
import torch
import torch.distributed as dist

import dist_harness as H

pytestmark = pytest.mark.skipif(H.BACKEND != "resident", reason="resident-only")

POOL = 4
ROUNDS = 5 * POOL  # far more async ops than the pool holds
MODES = {"shm": {}, "proxy": {"RESIDENT_PATH": "proxy"}, "tcp": {"RESIDENT_TRANSPORT": "tcp"}}


def _inputs(tag, ws, n=257):
    return [torch.randint(-2**40, 2**40, (n,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(tag * 1000 + r))
            for r in range(ws)]


def _message(sender, k):
    return torch.arange(64, dtype=torch.int64) + sender * 1_000_000 + k * 1000


def _pool_job(rank, ws):
    errs = []
    # 1. Async all_reduces whose works are dropped at once, then a synchronous op: the dropped
    # works' ops are given back while the next op waits for a free one.
    tensors, refs = [], []
    for i in range(ROUNDS):
        ins = _inputs(i, ws)
        t = ins[rank].clone()
        dist.all_reduce(t, async_op=True)  # the work is dropped here
        tensors.append(t)
        refs.append(sum(ins))
    dist.barrier()
    for i, (t, ref) in enumerate(zip(tensors, refs)):
        if not torch.equal(t, ref):
            errs.append(f"dropped work {i}: wrong result")
    # 2. Async all_reduces whose works are all held, waited in reverse order afterwards.
    works, tensors, refs = [], [], []
    for i in range(ROUNDS):
        ins = _inputs(100 + i, ws)
        t = ins[rank].clone()
        works.append(dist.all_reduce(t, async_op=True))
        tensors.append(t)
        refs.append(sum(ins))
    for w in reversed(works):
        w.wait()
    for i, (w, t, ref) in enumerate(zip(works, tensors, refs)):
        if not w.is_completed():
            errs.append(f"held work {i}: is_completed() False after wait()")
        if not torch.equal(t, ref):
            errs.append(f"held work {i}: wrong result")
    # A held work's future, asked for after its ops went back to the pool.
    fut = works[0].get_future()
    if not fut.done() or not torch.equal(fut.wait()[0], refs[0]):
        errs.append("future of a finished held work: not done or wrong value")
    # 3. Receives from any source, held until every send has been issued: each recv's sender is
    # still known after its op went back to the pool.
    if rank == 0:
        bufs = [torch.empty(64, dtype=torch.int64) for _ in range(ROUNDS * (ws - 1))]
        recvs = [dist.irecv(b) for b in bufs]
        for w in recvs:
            w.wait()
        seen = set()
        for i, (w, b) in enumerate(zip(recvs, bufs)):
            src, k = int(b[0]) // 1_000_000, int(b[0]) % 1_000_000 // 1000
            if w._source_rank() != src or not torch.equal(b, _message(src, k)):
                errs.append(f"recv {i}: source rank {w._source_rank()}, payload of {src}/{k}")
            seen.add((src, k))
        if seen != {(s, k) for s in range(1, ws) for k in range(ROUNDS)}:
            errs.append("the receives did not take every message once")
    else:
        sends = [dist.isend(_message(rank, k), 0) for k in range(ROUNDS)]
        for w in sends:
            w.wait()
    dist.barrier()
    return errs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("ws", [2, 3])
def test_more_async_ops_than_the_pool(ws, mode):
    env = {"RESIDENT_MAX_INFLIGHT": str(POOL), **MODES[mode]}
    results = H.run_ranks(_pool_job, ws, env=env, timeout_s=180)
    for rank, errs in enumerate(results):
        assert errs == [], (rank, errs)
