"""resident_pg.ep.all_to_all_device_splits inside a rank (the cases of test_ep.py's jobs).

Random counts (zeros, the capacity, a rank's own rows), int32 and int64, that the receiver is
given, learns first with an all_to_all_single, or gets with the rows (``counts_out``), also as
counts per (peer, part); rows of 12 bytes and of 8 KiB (several 64 KiB rounds per peer); rows
past the counts keep their contents.  A graph captured once with static count tensors is
replayed with fresh counts; on CUDA, counts_out's bound of 2 KiB of counts per peer.  Each case
returns its problems (empty: passed).

Also the pieces every EP case of a rank uses: ``dev`` (numpy to a tensor on the device),
``capture`` (a step captured in a CUDA graph; on CPU the step itself) and ``catch``.
"""

from __future__ import annotations

import numpy as np

import cuda_harness as C
import dist_harness as H
from ep_reference import to_dtype
from ep_scenarios import split_counts, split_rows

SENTINEL = -77.5  # exact in every payload dtype


def dev(a, dtype, device):
    import torch

    return torch.as_tensor(np.ascontiguousarray(a)).to(dtype=dtype, device=device)


def catch(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return [C.exc_text(e)]


def capture(step, device):
    """``step`` captured in a CUDA graph, as a replay callable; on CPU, ``step`` itself."""
    import torch

    if device == "cpu":
        return step
    side = torch.cuda.Stream()  # once more on a side stream before capturing, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return C.capture_replay(step)


def splits_case(rank, ws, device, key, cap, row_elems, dtype_name, count_dtype, counts,
                group=None, per_peer=0):
    """One device-splits all_to_all, checked; returns problems.  ``counts``: how the receiver
    has its recv_rows -- ``given`` (computed here), ``exchanged`` (an all_to_all_single of the
    send counts first) or ``with_rows`` (``counts_out``: written by the op itself, checked).
    ``per_peer`` > 0: the counts are [W, per_peer], each peer's entries adding up to its rows."""
    import torch
    import torch.distributed as dist

    from resident_pg.ep import all_to_all_device_splits

    dtype = H.tdtype(dtype_name)
    cdt = getattr(torch, count_dtype)
    c = split_counts(key, ws, cap)
    send = dev(to_dtype(split_rows(key, rank, ws, cap, row_elems), dtype_name), dtype, device)
    out = torch.full((ws, cap, row_elems), SENTINEL, dtype=dtype, device=device)
    send_rows = dev(c[rank], cdt, device)
    def parts_of(src):
        return H.count_parts(H.rng_for(f"{key}/parts", src), c[src], per_peer)

    if per_peer:
        send_rows = dev(parts_of(rank), cdt, device)
    if counts == "exchanged":  # the receiver learns its counts from the senders first
        recv_rows = torch.empty_like(send_rows)
        dist.all_to_all_single(recv_rows, send_rows, group=group)
    elif counts == "with_rows":
        recv_rows = torch.full_like(send_rows, -9)
    else:
        recv_rows = dev(c[:, rank], cdt, device)
    all_to_all_device_splits(out, send, send_rows, recv_rows, group=group,
                             counts_out=counts == "with_rows")
    errs = _check_splits(out, c, key, rank, ws, cap, row_elems, dtype_name, key)
    if counts == "with_rows":  # the peers' counts for this rank, as each sent them
        want = np.stack([parts_of(src)[rank] for src in range(ws)]) if per_peer else c[:, rank]
        if not np.array_equal(recv_rows.cpu().numpy(), want):
            errs.append(f"{key}: recv_rows {recv_rows.cpu().tolist()} but the peers sent "
                        f"{want.tolist()}")
    return errs


def _check_splits(out, c, key, rank, ws, cap, row_elems, dtype_name, label):
    got = out.double().cpu().numpy()
    errs = []
    for src in range(ws):
        n = int(c[src, rank])
        want = to_dtype(split_rows(key, src, ws, cap, row_elems), dtype_name)[rank, :n]
        if not np.array_equal(got[src, :n], want):
            bad = np.argwhere(got[src, :n] != want)[0].tolist()
            errs.append(f"{label}: rows from rank {src} differ first at [row, col] {bad}")
        if not (got[src, n:] == SENTINEL).all():
            errs.append(f"{label}: rows from rank {src} past its count {n} were written")
    return errs


def splits_graph_case(rank, ws, device, key, cap, row_elems, replays):
    """Captured once with static count tensors, replayed with fresh counts and rows."""
    import torch

    from resident_pg.ep import all_to_all_device_splits

    send = torch.zeros((ws, cap, row_elems), dtype=torch.float32, device=device)
    out = torch.empty_like(send)
    send_rows = torch.zeros(ws, dtype=torch.int32, device=device)
    recv_rows = torch.zeros(ws, dtype=torch.int32, device=device)

    def step():
        all_to_all_device_splits(out, send, send_rows, recv_rows)

    def fill(k):
        c = split_counts(k, ws, cap)
        send.copy_(dev(to_dtype(split_rows(k, rank, ws, cap, row_elems), "float32"),
                       torch.float32, device))
        send_rows.copy_(dev(c[rank], torch.int32, device))
        recv_rows.copy_(dev(c[:, rank], torch.int32, device))
        out.fill_(SENTINEL)
        return c

    errs = []
    c = fill(f"{key}/warm")
    step()
    errs += _check_splits(out, c, f"{key}/warm", rank, ws, cap, row_elems, "float32", "warm-up")
    replay = capture(step, device)
    for i in range(replays):
        k = f"{key}/replay{i}"
        c = fill(k)
        replay()
        errs += _check_splits(out, c, k, rank, ws, cap, row_elems, "float32", f"replay {i}")
    return errs


SPLIT_SHAPES = {  # label: (capacity rows, row elements, dtype)
    "small": (7, 3, "float32"),
    "bf16": (5, 6, "bfloat16"),
    "rounds": (40, 2048, "float32"),  # 8 KiB rows: up to 320 KiB per peer, several rounds
}


def split_cases(rank, ws, device):
    """Every device-splits case of a job but the graph and the CUDA bound: {case id: problems}."""
    out = {}
    for label, (cap, n, dt) in SPLIT_SHAPES.items():
        for cdt in ("int32", "int64"):
            for counts in ("given", "exchanged", "with_rows"):
                cid = f"splits[{label}-{cdt}-{counts}]"
                out[cid] = catch(splits_case, rank, ws, device, f"{cid}", cap, n, dt, cdt,
                                 counts)
    # counts per (peer, part), summed per peer, as EP passes its per-(peer, expert) counts
    for label in ("small", "rounds"):
        cap, n, dt = SPLIT_SHAPES[label]
        for cdt in ("int32", "int64"):
            for counts in ("exchanged", "with_rows"):
                cid = f"splits[{label}-{cdt}-per-part-{counts}]"
                out[cid] = catch(splits_case, rank, ws, device, cid, cap, n, dt, cdt, counts,
                                 per_peer=5)
    return out


def counts_bound_cases(rank, ws):
    """counts_out on CUDA carries at most 2 KiB of counts per peer (one part's payload): 512
    int32 counts per peer go with the rows and are checked; 513 are refused with a ValueError
    before the op starts on any rank, and the group works on after it."""
    import torch

    from resident_pg.ep import all_to_all_device_splits

    out = {}
    cap, n, dt = SPLIT_SHAPES["small"]
    out["splits[counts-2KiB-with_rows]"] = catch(splits_case, rank, ws, "cuda", "bound512",
                                                 cap, n, dt, "int32", "with_rows",
                                                 per_peer=512)

    def refused():
        errs = {}
        send = torch.zeros(ws, cap, n, device="cuda")
        rows = torch.zeros(ws, 513, dtype=torch.int32, device="cuda")
        H.expect_error(errs, "refused", lambda: all_to_all_device_splits(
            send.clone(), send, rows, rows.clone(), counts_out=True),
            "counts_out takes at most 2048 bytes of counts per peer")
        problems = [f"513 int32 counts per peer: {v}" for v in errs.values() if v != "ok"]
        return problems + splits_case(rank, ws, "cuda", "bound-after", cap, n, dt, "int32",
                                      "with_rows", per_peer=5)

    out["splits[counts-over-2KiB-refused]"] = catch(refused)
    return out
