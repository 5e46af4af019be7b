"""A slot's leftover bytes never read as a later round's lines (CUDA tensors, 2 ranks).

A channel slot holds LL lines (and the simple protocol's flags) in its first half and the simple
protocol's payload in its second (kernels/simple_device.cuh). A reader takes an LL line as
written once both its flag words equal the round's flag, so the payload an earlier simple op
left in the second half would read as lines of any later round whose lines reach it, before the
writer's own lines land there. Each iteration here leaves such payload in both slots (two
all_to_all_single of 64 KiB per peer, a simple op on every path, whose int32 words put a flag
value in both flag positions of every 16-byte line, the values cycling so that every round
number of the run is among them), then runs the op whose LL lines are longest: the device-splits
all_to_all with the counts ahead of the rows (``counts_out=True``), 60 KiB of rows per peer, one
rank starting late. Every received row is checked bitwise against what the peer sent.

Over tcp the receiving proxy fills the inbox a few KiB at a time while the kernel polls every
line at once, so the late lines of a message are where leftover payload would be read.
GPU only (the CPU path of ``counts_out`` exchanges the counts first and has no slots).
"""

from __future__ import annotations

import pytest

import cuda_harness as C
import dist_harness as H

pytestmark = C.module_marks()

PATHS = ("direct", "proxy", "proxy+tcp")
ITERS = 24
ROW_INTS = 256  # 1 KiB rows
MAX_ROWS = 64
ROWS = 60  # 60 KiB of rows per peer: lines to 120 KiB of a 128 KiB slot without the rule
A2A_INTS = 65536 // 4  # 64 KiB per peer
FLAG_CYCLE = 512  # round numbers the leftover lines carry: 1 .. FLAG_CYCLE


def _leftover_pattern(ws, seed):
    """int32 [ws * A2A_INTS]: 16-byte lines (random, f, random, f), f cycling 1..FLAG_CYCLE."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lines = torch.randint(-2**31, 2**31 - 1, (ws * A2A_INTS // 4, 4), generator=g,
                          dtype=torch.int64)
    flags = 1 + torch.arange(lines.shape[0]) % FLAG_CYCLE
    lines[:, 1] = flags
    lines[:, 3] = flags
    return lines.to(torch.int32).reshape(-1)


def _rows(rank, it):
    """int32 [2, MAX_ROWS, ROW_INTS]: what `rank` sends to each peer in iteration `it`."""
    import torch

    g = torch.Generator().manual_seed(1000 * rank + it)
    return torch.randint(-2**31, 2**31 - 1, (2, MAX_ROWS, ROW_INTS), generator=g,
                         dtype=torch.int64).to(torch.int32)


def stale_slot_job(rank, ws):
    import torch
    import torch.distributed as dist

    from resident_pg.ep import all_to_all_device_splits

    C.setup_rank(rank, ws, timeout_s=60)
    peer = 1 - rank
    bad = []
    for it in range(ITERS):
        left = _leftover_pattern(ws, it).cuda()
        sink = torch.empty_like(left)
        for _ in range(2):  # one simple round per slot
            dist.all_to_all_single(sink, left)
        rows = _rows(rank, it).cuda()
        out = torch.full_like(rows, -77)
        send_rows = torch.full((ws,), ROWS, dtype=torch.int64, device="cuda")
        recv_rows = torch.zeros_like(send_rows)
        if rank == 1:
            torch.cuda._sleep(2_000_000 * (1 + it % 4))  # ~1-4 ms late: rank 0 polls first
        all_to_all_device_splits(out, rows, send_rows, recv_rows, counts_out=True)
        torch.cuda.synchronize()
        want = _rows(peer, it)[rank, :ROWS]
        got = out[peer, :ROWS].cpu()
        if recv_rows.tolist() != [ROWS, ROWS]:
            bad.append(f"iteration {it}: recv_rows {recv_rows.tolist()}, want {[ROWS, ROWS]}")
        if not torch.equal(got, want):
            wrong = (got != want).any(dim=1).nonzero().flatten().tolist()
            bad.append(f"iteration {it}: rows from rank {peer} differ at {wrong[:8]} "
                       f"({len(wrong)} of {ROWS})")
        if not torch.equal(out[rank, :ROWS].cpu(), _rows(rank, it)[rank, :ROWS]):
            bad.append(f"iteration {it}: this rank's own rows differ")
    return bad


@pytest.mark.parametrize("path", PATHS)
def test_cuda_stale_slot(path):
    if C.DRY_RUN:
        pytest.skip("slots and LL lines exist on the CUDA path only")
    per_rank = H.run_ranks(stale_slot_job, 2, env=C.path_env(path), init=False,
                           timeout_s=240 * C.TIME_SCALE, init_timeout_s=60)
    problems = [f"rank {r}: {p}" for r, bad in enumerate(per_rank) for p in bad]
    assert not problems, "\n".join(problems[:20])
