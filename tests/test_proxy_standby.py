"""A group's proxy on a host with fewer cores than callers and proxies stands by while no op of
the group is in flight, but not while triggers wait for it: the credits of a receive that
finished in a pass nobody followed (the proxy's own pass, or a caller's is_completed()) must
still reach the sender. Otherwise a sender whose next message needs those credits blocks, and a
receiver that meanwhile waits on that sender in another group never lets it go: a deadlock
until the group's timeout (the CPU op mixes with subgroups reach it in proxy mode).

Each rank is restricted to at most two CPUs, so that the proxy stands by on any host (two
ranks, two threads each, outnumber the cores), with 2 slots of 64 bytes per ring so that one
message uses every credit. CPU tensors, proxy path and tcp, random integer data checked bitwise.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import dist_harness as H

pytestmark = pytest.mark.skipif(H.BACKEND != "resident", reason="resident-only")

MODES = {"proxy": {"RESIDENT_PATH": "proxy"}, "tcp": {"RESIDENT_TRANSPORT": "tcp"}}
ENV = {"RESIDENT_SLOTS": "2", "RESIDENT_SLOT_BYTES": "64"}
TIMEOUT_S = 10


def _data(tag, n):
    return torch.randint(-2**62, 2**62, (n,), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(tag))


def _job(rank, ws, how):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, cpus)  # before the group: the communicator counts usable cpus
    H.init_pg(timeout_s=TIMEOUT_S)
    other = dist.new_group([0, 1])
    first, second, third = _data(1, 64), _data(2, 8), _data(3, 8)  # 8 chunks, then 1, then 1
    errs = []
    if rank == 1:
        dist.send(first, 0)
        dist.send(second, 0)  # needs the credits of the first message's last chunks
        dist.send(third, 0, group=other)
    else:
        got = [torch.zeros_like(t) for t in (first, second, third)]
        work = dist.irecv(got[0], 1)
        if how == "is_completed":  # the caller's own test() finishes the receive
            while not work.is_completed():
                pass
        else:  # the proxy thread finishes it while the caller is elsewhere
            deadline = time.monotonic() + TIMEOUT_S
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
        dist.recv(got[2], 1, group=other)  # waits on rank 1 in the other group only
        dist.recv(got[1], 1)
        work.wait()
        for name, g, want in zip(("first", "second", "third"), got, (first, second, third)):
            if not torch.equal(g, want):
                errs.append(f"{name} message: wrong data")
    dist.barrier()
    return errs


@pytest.mark.parametrize("how", ["is_completed", "proxy_pass"])
@pytest.mark.parametrize("mode", list(MODES))
def test_credits_of_a_finished_receive_reach_the_sender(mode, how):
    results = H.run_ranks(_job, 2, args=(how,), env={**ENV, **MODES[mode]}, init=False,
                          timeout_s=60)
    for rank, errs in enumerate(results):
        assert errs == [], (rank, errs)
