"""resident_pg.ep: the all_to_all with counts read on the device, and the DeepEP-low-latency-
shaped Buffer, checked against independent numpy references.

Every rank regenerates every rank's inputs from seeds and computes the reference itself in numpy
(no code of resident_pg.moe / resident_pg.ep): moved rows and received layouts compare bitwise,
combined outputs within the payload dtype's rounding.

CPU (in CI; 2 and 4 ranks, the resident backend on CPU tensors):

* ``splits``: all_to_all_device_splits with random counts (zeros, the capacity, a rank's own
  rows), int32 and int64 counts, rows of 12 bytes and of 8 KiB (several 64 KiB rounds per peer),
  counts given directly and exchanged first with all_to_all_single; rows past the counts keep
  their contents.
* ``ep``: Buffer.low_latency_dispatch / low_latency_combine over the device-splits exchange
  (transport ``splits``), the padded all_to_all_single (``padded``) and a gloo group (the
  fallback, ``auto``): random routings with an expert nobody picks, ``-1`` entries, a rank with
  no tokens, and every token to the same experts (the capacity edge).
* ``fp8``: FP8 dispatch (``use_fp8``; with ``round_scale``; with ``use_ue8m0``) over the same
  three exchanges: the received fp8 bytes and scales compare bitwise with a numpy quantization of
  the routed rows (an fp8 e4m3fn encoder written from the format's definition), the scales'
  column-major layout, dequantized values within fp8 rounding of the inputs, combine of the
  dequantized experts' outputs, and an activation-dtype dispatch on the same Buffer afterwards.
  Tokens have groups of 128 channels at magnitudes from 2**-24 (below the amax floor) to 2**9,
  and an all-zero group.
* ``errors``: bad calls raise ValueError (NotImplementedError for what is not implemented)
  before communicating.

GPU (``gpu`` marker; skipped without CUDA): the same cases on CUDA tensors plus graph replays
with fresh counts / routings (activation and FP8 dispatch), per world size
(RESIDENT_GPU_TESTS_WS, default 2,4,8) and path (direct, proxy, proxy+tcp; at 2 ranks each also
with round numbers that wrap)::

    python -m pytest -q tests/test_ep.py -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest

import cuda_harness as C
import dist_harness as H
from ep_reference import (
    combine_reference,
    dispatch_reference,
    expert_scale,
    fp8_codes,
    fp8_dequantize,
    fp8_quantize,
    fp8_tokens,
    fp8_values,
    to_dtype,
    ue8m0_packed,
)

CPU_WORLD_SIZES = (2, 4)
SENTINEL = -77.5  # exact in every payload dtype
GPU_PATHS = ("direct", "proxy", "proxy+tcp")

# ---------------------------------------------------------------- data (any rank, any process)


def split_counts(key, ws, cap):
    """[src, dst] rows: random in [0, cap], with zeros and full rows in every matrix."""
    rng = H.rng_for(key + "/counts", 0)
    c = rng.integers(0, cap + 1, size=(ws, ws))
    c[0, ws - 1] = 0
    c[ws - 1, 0] = cap
    c[1 % ws, 1 % ws] = cap  # a rank's own rows at the capacity
    return c


def split_rows(key, src, ws, cap, row_elems):
    return H.rng_for(key + "/rows", src).standard_normal((ws, cap, row_elems))


# EP scenarios: dtype, local experts, hidden, max tokens, top-k, tokens per rank per round
# (rank r takes entry r % len), routing mode.
EP_SCENARIOS = {
    "random_bf16": ("bfloat16", 4, 40, 6, 3, [[6, 3, 0, 5], [2, 6, 6, 1]], "random"),
    "masked_f32": ("float32", 3, 24, 5, 4, [[5, 1, 4]], "masked"),
    "hot_f32": ("float32", 2, 16, 5, 2, [[5]], "hot"),
    # 2 KiB rows, 32 slots per peer (64 KiB): between resident_pg.ep's counts-with-rows bounds,
    # so that CUDA dispatch sends the counts with the rows within a host and first over tcp
    "mid_bf16": ("bfloat16", 4, 1024, 8, 4, [[8, 5]], "random"),
    # 8 KiB rows, 32 slots per peer (256 KiB): past both bounds, so that CUDA dispatch exchanges
    # the counts first (the first three scenarios send them with the rows on every path)
    "wide_bf16": ("bfloat16", 4, 4096, 8, 4, [[8, 3]], "random"),
}


def ep_params(name, ws):
    dt, L, Hd, M, K, rounds, mode = EP_SCENARIOS[name]
    return dt, L, L * ws, Hd, M, K, [[r[i % len(r)] for i in range(ws)] for r in rounds], mode


def ep_routing(key, rank, T, E, K, mode):
    """[T, K] int64 experts: ``random``: skewed, expert E//2+1 never picked, 20% -1;
    ``masked``: 60% -1 (rows of only -1 included); ``hot``: every token to experts 0..K-1."""
    rng = H.rng_for(key + "/route", rank)
    if T == 0:
        return np.zeros((0, K), dtype=np.int64)
    if mode == "hot":
        return np.tile(np.arange(K, dtype=np.int64), (T, 1))
    p = 1.0 / (1.0 + np.arange(E)) ** 1.2
    if mode == "random":
        p[E // 2 + 1] = 0.0
    p /= p.sum()
    idx = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(T)])
    idx[rng.random((T, K)) < (0.2 if mode == "random" else 0.6)] = -1
    if mode == "masked":
        idx[0] = -1
    return idx.astype(np.int64)


def ep_tokens(key, rank, T, Hd, dt):
    return to_dtype(H.rng_for(key + "/x", rank).standard_normal((T, Hd)), dt)


def ep_weights(key, rank, T, K):
    return H.rng_for(key + "/w", rank).uniform(0.1, 1.0, (T, K)).astype(np.float32)


def ep_reference(name, ws, rank, rnd, key, Ts=None):
    """(recv_x [L, ws*M, H], recv_count [L], y [T, H], tol [T, H]) of ``rank`` for one round
    (``Ts``: tokens per rank instead of the scenario's)."""
    dt, L, E, Hd, M, K, rounds, mode = ep_params(name, ws)
    Ts = rounds[rnd] if Ts is None else Ts
    idx = [ep_routing(key, src, Ts[src], E, K, mode) for src in range(ws)]
    x = [ep_tokens(key, src, Ts[src], Hd, dt) for src in range(ws)]
    recv_x, count = dispatch_reference(idx, x, rank, L, ws * M)
    w = ep_weights(key, rank, Ts[rank], K).astype(np.float64)
    y, tol = combine_reference(x[rank], idx[rank], w, dt, expert_scale)
    return recv_x, count, y, tol


# FP8 scenarios: activation dtype, local experts, hidden, max tokens, top-k, tokens per rank
# (rank r takes entry r % len), routing mode, round_scale, use_ue8m0.
EP_FP8_SCENARIOS = {
    "fp8_random_bf16": ("bfloat16", 3, 256, 6, 3, [6, 2, 0, 5], "random", False, False),
    "fp8_round_masked_f32": ("float32", 2, 384, 5, 4, [5, 1, 4], "masked", True, False),
    "fp8_ue8m0_hot_bf16": ("bfloat16", 2, 512, 4, 2, [4, 3], "hot", True, True),
}


def fp8_params(name, ws):
    dt, L, Hd, M, K, Ts, mode, rs, ue = EP_FP8_SCENARIOS[name]
    return dt, L, L * ws, Hd, M, K, [Ts[i % len(Ts)] for i in range(ws)], mode, rs, ue


def ep_fp8_reference(name, ws, rank, key, Ts=None):
    """For ``rank``: received codes [L, S, H] uint8, scales [L, S, G] float32, counts [L], the
    input rows behind them [L, S, H], and the combined output of the stand-in experts applied
    to the dequantized rows (y [T, H], tol [T, H])."""
    dt, L, E, Hd, M, K, Ts0, mode, rs, _ = fp8_params(name, ws)
    Ts = Ts0 if Ts is None else Ts
    idx = [ep_routing(key, src, Ts[src], E, K, mode) for src in range(ws)]
    x = [fp8_tokens(key, src, Ts[src], Hd, dt) for src in range(ws)]
    q = [fp8_quantize(xs, rs) for xs in x]
    S = ws * M
    codes, count = dispatch_reference(idx, [c for c, _ in q], rank, L, S)
    scales, _ = dispatch_reference(idx, [s for _, s in q], rank, L, S)
    rows, _ = dispatch_reference(idx, x, rank, L, S)
    deq = fp8_dequantize(*q[rank])  # float32, as the device
    w = ep_weights(key, rank, Ts[rank], K).astype(np.float64)
    y, tol = combine_reference(deq, idx[rank], w, dt, lambda e: np.float32(expert_scale(e)))
    return codes, scales, count, rows, y, tol


# ---------------------------------------------------------------- inside a rank


def _dev(a, dtype, device):
    import torch

    return torch.as_tensor(np.ascontiguousarray(a)).to(dtype=dtype, device=device)


def _splits_case(rank, ws, device, key, cap, row_elems, dtype_name, count_dtype, counts,
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
    send = _dev(to_dtype(split_rows(key, rank, ws, cap, row_elems), dtype_name), dtype, device)
    out = torch.full((ws, cap, row_elems), SENTINEL, dtype=dtype, device=device)
    send_rows = _dev(c[rank], cdt, device)
    def parts_of(src):
        return H.count_parts(H.rng_for(f"{key}/parts", src), c[src], per_peer)

    if per_peer:
        send_rows = _dev(parts_of(rank), cdt, device)
    if counts == "exchanged":  # the receiver learns its counts from the senders first
        recv_rows = torch.empty_like(send_rows)
        dist.all_to_all_single(recv_rows, send_rows, group=group)
    elif counts == "with_rows":
        recv_rows = torch.full_like(send_rows, -9)
    else:
        recv_rows = _dev(c[:, rank], cdt, device)
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


def _splits_graph_case(rank, ws, device, key, cap, row_elems, replays):
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
        send.copy_(_dev(to_dtype(split_rows(k, rank, ws, cap, row_elems), "float32"),
                        torch.float32, device))
        send_rows.copy_(_dev(c[rank], torch.int32, device))
        recv_rows.copy_(_dev(c[:, rank], torch.int32, device))
        out.fill_(SENTINEL)
        return c

    errs = []
    c = fill(f"{key}/warm")
    step()
    errs += _check_splits(out, c, f"{key}/warm", rank, ws, cap, row_elems, "float32", "warm-up")
    replay = _capture(step, device)
    for i in range(replays):
        k = f"{key}/replay{i}"
        c = fill(k)
        replay()
        errs += _check_splits(out, c, k, rank, ws, cap, row_elems, "float32", f"replay {i}")
    return errs


def _capture(step, device):
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


_SCALES: dict = {}


def _expert_scales(device, rank, L):
    """[L, 1, 1] float32: expert_scale of each local expert's global id, made on the first call
    (eager, before any capture: a graph cannot copy from pageable host memory) and reused."""
    import torch

    key = (str(device), rank, L)
    if key not in _SCALES:
        _SCALES[key] = torch.tensor([expert_scale(rank * L + l) for l in range(L)],
                                    dtype=torch.float32, device=device).view(L, 1, 1)
    return _SCALES[key]


def _graph_replays(fill, step, check, device, replays, key, label):
    """A graph program: ``fill(key)`` the static inputs, ``step()`` once eagerly and checked,
    captured, then replayed ``replays`` times with fresh inputs, each checked; the errors."""
    fill(f"{key}/warm")
    step()
    errs = check(f"{key}/warm", f"{label}graph warm-up")
    replay = _capture(step, device)
    for i in range(replays):
        fill(f"{key}/{i}")
        replay()
        errs += check(f"{key}/{i}", f"{label}replay {i}")
    return errs


def _expert(recv_x, rank, L):
    """A stand-in expert: local expert l scales its rows by expert_scale(its global id)."""
    return (recv_x.float() * _expert_scales(recv_x.device, rank, L)).to(recv_x.dtype)


def _check_combined(y, ref_y, tol, label):
    """The combined output against its reference, within ``tol`` (per element)."""
    got_y = y.double().cpu().numpy()
    if got_y.shape != ref_y.shape:
        return [f"{label}: combined shape {got_y.shape} != {ref_y.shape}"]
    if (np.abs(got_y - ref_y) > tol).any():
        i = np.unravel_index(np.argmax(np.abs(got_y - ref_y) - tol), tol.shape)
        return [f"{label}: combined[{i}] = {got_y[i]!r}, reference {ref_y[i]!r}"]
    return []


def _check_ep(name, ws, rank, rnd, key, recv_x, recv_count, y, label, Ts=None):
    import torch

    ref_x, ref_count, ref_y, tol = ep_reference(name, ws, rank, rnd, key, Ts)
    errs = []
    got_count = recv_count.cpu().numpy()
    if recv_count.dtype != torch.int32 or not np.array_equal(got_count, ref_count):
        errs.append(f"{label}: recv_count {got_count.tolist()} ({recv_count.dtype}) != "
                    f"{ref_count.tolist()}")
    got_x = recv_x.double().cpu().numpy()
    if got_x.shape != ref_x.shape or not np.array_equal(got_x, ref_x):
        where = np.argwhere(got_x != ref_x)[0].tolist() if got_x.shape == ref_x.shape else None
        errs.append(f"{label}: recv_x {got_x.shape} differs from the reference {ref_x.shape} "
                    f"(first at [expert, row, col] {where})")
    return errs + _check_combined(y, ref_y, tol, label)


def _ep_case(rank, ws, device, name, transport, group=None):
    import torch

    from resident_pg.ep import Buffer, EventOverlap

    dt, L, E, Hd, M, K, rounds, mode = ep_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(group, M, Hd, E, dtype, device, transport=transport)
    want = "padded" if transport == "auto" else transport
    errs = [] if buf.transport == want else [f"transport {buf.transport!r}, expected {want!r}"]
    for rnd, Ts in enumerate(rounds):
        key = f"ep/{name}/{rnd}"
        T = Ts[rank]
        x = _dev(ep_tokens(key, rank, T, Hd, dt), dtype, device)
        idx = _dev(ep_routing(key, rank, T, E, K, mode), torch.int64, device)
        w = _dev(ep_weights(key, rank, T, K), torch.float32, device)
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            x, idx, M, E, async_finish=True, return_recv_hook=True)
        if rnd == 0 and buf.transport == "splits":
            errs += _counts_with_rows_errors(buf, K, device)
        if not isinstance(event, EventOverlap) or not callable(hook):
            errs.append(f"round {rnd}: dispatch returned event {event!r}, hook {hook!r}")
        event.current_stream_wait()
        hook()
        got_x, got_count = recv_x.clone(), recv_count.clone()
        y, event, hook = buf.low_latency_combine(_expert(recv_x, rank, L), idx, w, handle)
        if hook is not None:
            errs.append(f"round {rnd}: combine without return_recv_hook returned a hook")
        errs += _check_ep(name, ws, rank, rnd, key, got_x, got_count, y,
                          f"{transport} round {rnd}")
    return errs


def _counts_with_rows_errors(buf, K, device):
    """Dispatch sends its counts with its rows on CUDA where a peer's capacity is at most the
    bound of the job's path: over tcp the network's, else the one-host bound."""
    import os

    from resident_pg import ep

    d = buf._dispatchers[(K, "activations")]
    cap = d.slots_per_rank * d.dispatch_row_bytes()
    tcp = os.environ.get("RESIDENT_TRANSPORT") == "tcp"
    bound = ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK if tcp else ep.COUNTS_WITH_ROWS_MAX_BYTES
    want = device == "cuda" and cap <= bound
    got = d.exchange_with_counts is not None
    if got == want:
        return []
    return [f"capacity {cap} B per peer{' over tcp' if tcp else ''}: counts with the rows "
            f"{got}, expected {want}"]


def test_counts_with_rows_bound_follows_the_farthest_transport():
    """A group with any peer over a network transport takes the network bound."""
    from resident_pg import ep

    assert ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK < ep.COUNTS_WITH_ROWS_MAX_BYTES
    assert ep.counts_with_rows_max_bytes(["self", "shm", "shm"]) == ep.COUNTS_WITH_ROWS_MAX_BYTES
    for far in ("tcp", "ib"):
        assert ep.counts_with_rows_max_bytes(["shm", "self", far]) == \
            ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK


def _ep_graph_case(rank, ws, device, replays):
    """Dispatch + experts + combine captured once, replayed with fresh routings."""
    import torch

    from resident_pg.ep import Buffer

    name = "random_bf16"
    dt, L, E, Hd, M, K, _, mode = ep_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(None, M, Hd, E, dtype, device, num_topk=K)
    x = torch.zeros(M, Hd, dtype=dtype, device=device)
    idx = torch.zeros(M, K, dtype=torch.int64, device=device)
    w = torch.zeros(M, K, dtype=torch.float32, device=device)
    res = {}

    def step():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E)
        res["x"], res["count"] = recv_x, recv_count
        res["y"] = buf.low_latency_combine(_expert(recv_x, rank, L), idx, w, handle)[0]

    def fill(key):
        x.copy_(_dev(ep_tokens(key, rank, M, Hd, dt), dtype, device))
        idx.copy_(_dev(ep_routing(key, rank, M, E, K, mode), torch.int64, device))
        w.copy_(_dev(ep_weights(key, rank, M, K), torch.float32, device))

    def check(key, label):  # M tokens on every rank
        return _check_ep(name, ws, rank, 0, key, res["x"], res["count"], res["y"], label,
                         [M] * ws)

    return _graph_replays(fill, step, check, device, replays, "ep/graph", "")


def _expert_fp8(recv_x, rank, L, dtype):
    """The stand-in expert on FP8 rows: dequantize (float32), scale by expert_scale, round to
    the activation dtype."""
    from resident_pg.ep_fp8 import dequantize

    x, scales = recv_x
    return (dequantize(x, scales) * _expert_scales(x.device, rank, L)).to(dtype)


def _check_ep_fp8(name, ws, rank, key, recv_x, recv_count, y, label, Ts=None):
    import torch

    dt, L, E, Hd, M, K, _, _, _, ue = fp8_params(name, ws)
    codes, scales, ref_count, rows, ref_y, tol = ep_fp8_reference(name, ws, rank, key, Ts)
    S, G = ws * M, Hd // 128
    errs = []
    if not isinstance(recv_x, tuple) or len(recv_x) != 2:
        return [f"{label}: recv_x is {type(recv_x).__name__}, expected (x_fp8, scales)"]
    x8, sc = recv_x
    want_sc = (torch.int32, (L, S, G // 4)) if ue else (torch.float32, (L, S, G))
    if x8.dtype != torch.float8_e4m3fn or tuple(x8.shape) != (L, S, Hd):
        return [f"{label}: x_fp8 is {x8.dtype}{tuple(x8.shape)}, expected float8_e4m3fn"
                f"{(L, S, Hd)}"]
    if (sc.dtype, tuple(sc.shape)) != want_sc:
        return [f"{label}: scales are {sc.dtype}{tuple(sc.shape)}, expected {want_sc}"]
    if sc.stride() != (want_sc[1][2] * S, 1, S):
        errs.append(f"{label}: scales strides {sc.stride()}: not column-major in the last two "
                    "dimensions")
    got_count = recv_count.cpu().numpy()
    if not np.array_equal(got_count, ref_count):
        errs.append(f"{label}: recv_count {got_count.tolist()} != {ref_count.tolist()}")
    got_codes = x8.view(torch.uint8).cpu().numpy()
    if not np.array_equal(got_codes, codes):
        errs.append(f"{label}: fp8 bytes differ from the reference first at [expert, row, col] "
                    f"{np.argwhere(got_codes != codes)[0].tolist()}")
    if ue:
        got_sc, want = sc.cpu().numpy().view(np.uint32), ue8m0_packed(scales)
    else:
        got_sc, want = sc.cpu().numpy().view(np.uint32), scales.view(np.uint32)
    if not np.array_equal(got_sc, want):
        errs.append(f"{label}: scales differ from the reference first at [expert, row, group] "
                    f"{np.argwhere(got_sc != want)[0].tolist()}")
    # the received values are the inputs within fp8 rounding (relative 2**-4, or half the
    # subnormal step 2**-10 times the scale)
    if not errs:
        for l in range(L):
            n = int(ref_count[l])
            s_full = np.repeat(scales[l, :n].astype(np.float64), 128, axis=1)
            deq = fp8_values(got_codes[l, :n]) * s_full
            bound = np.abs(rows[l, :n]) * 2.0 ** -4 * (1 + 2.0 ** -20) + s_full * 2.0 ** -10
            if (np.abs(deq - rows[l, :n]) > bound).any():
                i = np.unravel_index(np.argmax(np.abs(deq - rows[l, :n]) - bound), bound.shape)
                errs.append(f"{label}: expert {l} row {i}: dequantized {deq[i]!r} is not within "
                            f"fp8 rounding of the input {rows[l, :n][i]!r}")
                break
    return errs + _check_combined(y, ref_y, tol, label)


def _ep_fp8_case(rank, ws, device, name, transport, group=None):
    """FP8 dispatch + combine, then an activation-dtype dispatch of the same tokens on the same
    Buffer (both formats side by side)."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, E, Hd, M, K, Ts, mode, rs, ue = fp8_params(name, ws)
    dtype = H.tdtype(dt)
    key = f"ep/{name}"
    buf = Buffer(group, M, Hd, E, dtype, device, transport=transport)
    T = Ts[rank]
    x = _dev(fp8_tokens(key, rank, T, Hd, dt), dtype, device)
    idx = _dev(ep_routing(key, rank, T, E, K, mode), torch.int64, device)
    w = _dev(ep_weights(key, rank, T, K), torch.float32, device)
    recv_x, recv_count, handle, event, _ = buf.low_latency_dispatch(
        x, idx, M, E, use_fp8=True, round_scale=rs, use_ue8m0=ue, async_finish=True)
    event.current_stream_wait()
    got = (recv_x[0].clone(), recv_x[1].clone()) if isinstance(recv_x, tuple) else recv_x
    y, _, _ = buf.low_latency_combine(_expert_fp8(recv_x, rank, L, dtype), idx, w, handle)
    errs = _check_ep_fp8(name, ws, rank, key, got, recv_count.clone(), y, f"{transport} fp8")
    # the same tokens in the activation dtype: the rows arrive unchanged
    plain_x, plain_count, _, _, _ = buf.low_latency_dispatch(x, idx, M, E)
    _, _, ref_count, rows, _, _ = ep_fp8_reference(name, ws, rank, key)
    if not (np.array_equal(plain_x.double().cpu().numpy(), rows) and
            np.array_equal(plain_count.cpu().numpy(), ref_count)):
        errs.append(f"{transport}: activation dispatch after FP8 dispatch differs from the "
                    "reference rows")
    return errs


def _ep_fp8_graph_case(rank, ws, device, name, replays):
    """FP8 dispatch + experts + combine captured once, replayed with fresh tokens / routings."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, E, Hd, M, K, _, mode, rs, ue = fp8_params(name, ws)
    dtype = H.tdtype(dt)
    buf = Buffer(None, M, Hd, E, dtype, device, num_topk=K, use_fp8=True, use_ue8m0=ue)
    x = torch.zeros(M, Hd, dtype=dtype, device=device)
    idx = torch.zeros(M, K, dtype=torch.int64, device=device)
    w = torch.zeros(M, K, dtype=torch.float32, device=device)
    res = {}

    def step():
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(
            x, idx, M, E, use_fp8=True, round_scale=rs, use_ue8m0=ue)
        res["x"], res["count"] = recv_x, recv_count
        y = _expert_fp8(recv_x, rank, L, dtype)
        res["y"] = buf.low_latency_combine(y, idx, w, handle)[0]

    def fill(key):
        x.copy_(_dev(fp8_tokens(key, rank, M, Hd, dt), dtype, device))
        idx.copy_(_dev(ep_routing(key, rank, M, E, K, mode), torch.int64, device))
        w.copy_(_dev(ep_weights(key, rank, M, K), torch.float32, device))

    def check(key, label):  # M tokens on every rank
        return _check_ep_fp8(name, ws, rank, key, res["x"], res["count"], res["y"], label,
                             [M] * ws)

    return _graph_replays(fill, step, check, device, replays, f"ep/{name}/graph", "fp8 ")


def _error_cases(rank, ws):
    import torch
    import torch.distributed as dist

    from resident_pg.ep import Buffer, all_to_all_device_splits, resident_backend

    res = {}

    def expect(label, fn, fragment, exc=ValueError):
        H.expect_error(res, label, fn, fragment, exc)

    buf3 = torch.zeros(ws, 3, 4)
    rows = torch.zeros(ws, dtype=torch.int64)
    a2a = all_to_all_device_splits
    expect("shape", lambda: a2a(torch.zeros(ws + 1, 3, 4), torch.zeros(ws + 1, 3, 4), rows, rows),
           "shape")
    expect("1d", lambda: a2a(torch.zeros(ws), torch.zeros(ws), rows, rows), "shape")
    expect("out_shape", lambda: a2a(torch.zeros(ws, 2, 4), buf3, rows, rows), "output has shape")
    expect("out_dtype", lambda: a2a(buf3.double(), buf3, rows, rows), "dtype")
    expect("rows_float", lambda: a2a(buf3.clone(), buf3, rows.float(), rows.float()), "int32")
    expect("rows_len", lambda: a2a(buf3.clone(), buf3, rows[:-1], rows[:-1]),
           "one count per rank")
    expect("rows_3d", lambda: a2a(buf3.clone(), buf3, rows.view(ws, 1, 1), rows.view(ws, 1, 1)),
           "[ws, n]".replace("ws", str(ws)))
    none = torch.zeros(ws, 0, dtype=torch.int64)
    expect("rows_no_parts", lambda: a2a(buf3.clone(), buf3, none, none), "summed")
    parts2, parts3 = torch.zeros(ws, 2, dtype=torch.int64), torch.zeros(ws, 3, dtype=torch.int64)
    expect("rows_shape_mix", lambda: a2a(buf3.clone(), buf3, parts2, parts3), "one shape")
    expect("rows_strided", lambda: a2a(buf3.clone(), buf3, parts2.t().contiguous().t(), parts2),
           "contiguous")
    expect("rows_mix", lambda: a2a(buf3.clone(), buf3, rows, rows.int()), "one dtype")
    expect("not_tensor", lambda: a2a(buf3.clone(), buf3, [0] * ws, rows), "tensor")
    backend = resident_backend(None, "cpu")
    expect("counts_out_cpu", lambda: backend.all_to_all_device_splits(
        buf3.clone(), buf3, rows, rows.clone(), False, True), "counts_out needs CUDA")
    gloo = dist.new_group(backend="gloo")
    expect("gloo", lambda: a2a(buf3.clone(), buf3, rows, rows, group=gloo), "resident")
    expect("transport", lambda: Buffer(None, 4, 8, 2 * ws, transport="fast"), "transport")
    expect("splits_on_gloo", lambda: Buffer(gloo, 4, 8, 2 * ws, device="cpu",
                                            transport="splits"), "resident")
    expect("experts", lambda: Buffer(None, 4, 8, 2 * ws + 1, device="cpu"), "multiple")
    buf = Buffer(None, 4, 8, 2 * ws, torch.float32, "cpu")
    x, idx = torch.zeros(2, 8), torch.tensor([[0, 1], [-1, 2 * ws - 1]])
    expect("fp8_hidden", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws, use_fp8=True),
           "multiple of 128")
    expect("round_scale_without_fp8", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws,
                                                                       round_scale=True),
           "use_fp8")
    buf8 = Buffer(None, 4, 256, 2 * ws, torch.bfloat16, "cpu")
    x8 = torch.zeros(2, 256, dtype=torch.bfloat16)
    expect("ue8m0_without_round", lambda: buf8.low_latency_dispatch(
        x8, idx, 4, 2 * ws, use_fp8=True, use_ue8m0=True), "round_scale")
    expect("ue8m0_hidden", lambda: buf8.low_latency_dispatch(
        x8, idx, 4, 2 * ws, use_fp8=True, round_scale=True, use_ue8m0=True), "multiple of 512")
    expect("fp8_x_dtype", lambda: buf8.low_latency_dispatch(x8.float(), idx, 4, 2 * ws,
                                                            use_fp8=True), "dtype")
    expect("fp8_x_hidden", lambda: buf8.low_latency_dispatch(x8[:, :128], idx, 4, 2 * ws,
                                                             use_fp8=True), "[T, 256]")
    expect("fp8_too_many", lambda: buf8.low_latency_dispatch(
        torch.zeros(5, 256, dtype=torch.bfloat16), torch.zeros(5, 2, dtype=torch.int64), 4,
        2 * ws, use_fp8=True), "num_max_dispatch_tokens_per_rank")
    expect("fp8_int_dtype", lambda: Buffer(None, 4, 256, 2 * ws, torch.int32, "cpu",
                                           num_topk=2, use_fp8=True), "activations")
    expect("max_tokens", lambda: buf.low_latency_dispatch(x, idx, 5, 2 * ws), "num_max")
    expect("num_experts", lambda: buf.low_latency_dispatch(x, idx, 4, 2 * ws + 2), "num_experts")
    expect("too_many", lambda: buf.low_latency_dispatch(torch.zeros(5, 8),
                                                        torch.zeros(5, 2, dtype=torch.int64),
                                                        4, 2 * ws), "max_tokens")
    # a valid round trip afterwards: nothing above communicated
    rx, rc, h, _, _ = buf.low_latency_dispatch(x, idx, 4, 2 * ws)
    expect("combine_idx", lambda: buf.low_latency_combine(rx, idx[:1], torch.ones(2, 2), h),
           "topk_idx")
    expect("combine_handle", lambda: buf.low_latency_combine(rx, idx, torch.ones(2, 2), None),
           "handle")
    expect("logfmt", lambda: buf.low_latency_combine(rx, idx, torch.ones(2, 2), h,
                                                     use_logfmt=True), "logfmt",
           NotImplementedError)
    y = buf.low_latency_combine(rx, idx, torch.ones(2, 2), h)[0]
    res["valid_after_errors"] = "ok" if tuple(y.shape) == (2, 8) else f"shape {tuple(y.shape)}"
    return res


def _catch(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return [C.exc_text(e)]


SPLIT_SHAPES = {  # label: (capacity rows, row elements, dtype)
    "small": (7, 3, "float32"),
    "bf16": (5, 6, "bfloat16"),
    "rounds": (40, 2048, "float32"),  # 8 KiB rows: up to 320 KiB per peer, several rounds
}


def _split_cases(rank, ws, device):
    out = {}
    for label, (cap, n, dt) in SPLIT_SHAPES.items():
        for cdt in ("int32", "int64"):
            for counts in ("given", "exchanged", "with_rows"):
                cid = f"splits[{label}-{cdt}-{counts}]"
                out[cid] = _catch(_splits_case, rank, ws, device, f"{cid}", cap, n, dt, cdt,
                                  counts)
    # counts per (peer, part), summed per peer, as EP passes its per-(peer, expert) counts
    for label in ("small", "rounds"):
        cap, n, dt = SPLIT_SHAPES[label]
        for cdt in ("int32", "int64"):
            for counts in ("exchanged", "with_rows"):
                cid = f"splits[{label}-{cdt}-per-part-{counts}]"
                out[cid] = _catch(_splits_case, rank, ws, device, cid, cap, n, dt, cdt, counts,
                                  per_peer=5)
    return out


def _fp8_cases(rank, ws, device, gloo=None):
    out = {}
    for name in EP_FP8_SCENARIOS:
        for transport in ("splits", "padded"):
            out[f"fp8[{name}-{transport}]"] = _catch(_ep_fp8_case, rank, ws, device, name,
                                                     transport)
        if gloo is not None:
            out[f"fp8[{name}-gloo]"] = _catch(_ep_fp8_case, rank, ws, device, name, "auto", gloo)
    return out


def cpu_job(rank, ws):
    import torch.distributed as dist

    res = _split_cases(rank, ws, "cpu")
    gloo = dist.new_group(backend="gloo")
    for name in EP_SCENARIOS:
        for transport in ("splits", "padded"):
            res[f"ep[{name}-{transport}]"] = _catch(_ep_case, rank, ws, "cpu", name, transport)
        res[f"ep[{name}-gloo]"] = _catch(_ep_case, rank, ws, "cpu", name, "auto", gloo)
    # the graph programs, called eagerly on CPU (a replay is the step itself)
    res["graph[splits]"] = _catch(_splits_graph_case, rank, ws, "cpu", "g", 6, 5, 3)
    res["graph[ep]"] = _catch(_ep_graph_case, rank, ws, "cpu", 2)
    res.update(_fp8_cases(rank, ws, "cpu", gloo))
    res["graph[ep-fp8]"] = _catch(_ep_fp8_graph_case, rank, ws, "cpu", "fp8_random_bf16", 2)
    return {"cases": res, "errors": _error_cases(rank, ws)}


def gpu_job(rank, ws):
    C.setup_rank(rank, ws, timeout_s=60)
    res = _split_cases(rank, ws, "cuda")
    for name in EP_SCENARIOS:
        for transport in ("splits", "padded"):
            res[f"ep[{name}-{transport}]"] = _catch(_ep_case, rank, ws, "cuda", name, transport)
    res["graph[splits-small]"] = _catch(_splits_graph_case, rank, ws, "cuda", "gs", 6, 5, 4)
    res["graph[splits-rounds]"] = _catch(_splits_graph_case, rank, ws, "cuda", "gr", 40, 2048, 4)
    res["graph[ep]"] = _catch(_ep_graph_case, rank, ws, "cuda", 4)
    res.update(_fp8_cases(rank, ws, "cuda"))
    for name in EP_FP8_SCENARIOS:
        res[f"graph[ep-{name}]"] = _catch(_ep_fp8_graph_case, rank, ws, "cuda", name, 4)
    res.update(_counts_bound_cases(rank, ws))
    return {"cases": res}


def _counts_bound_cases(rank, ws):
    """counts_out on CUDA carries at most 2 KiB of counts per peer (one part's payload): 512
    int32 counts per peer go with the rows and are checked; 513 are refused with a ValueError
    before the op starts on any rank, and the group works on after it."""
    import torch

    from resident_pg.ep import all_to_all_device_splits

    out = {}
    cap, n, dt = SPLIT_SHAPES["small"]
    out["splits[counts-2KiB-with_rows]"] = _catch(_splits_case, rank, ws, "cuda", "bound512",
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
        return problems + _splits_case(rank, ws, "cuda", "bound-after", cap, n, dt, "int32",
                                       "with_rows", per_peer=5)

    out["splits[counts-over-2KiB-refused]"] = _catch(refused)
    return out


# ---------------------------------------------------------------- parent side


def _problems(per_rank, cid):
    return [f"rank {r}: {p}" for r, v in enumerate(per_rank) for p in v["cases"][cid]]


_CPU_JOBS = {}


def _cpu(ws):
    if ws not in _CPU_JOBS:
        _CPU_JOBS[ws] = H.run_ranks(cpu_job, ws, timeout_s=300, init_timeout_s=60)
    return _CPU_JOBS[ws]


@pytest.mark.resident_only
@pytest.mark.parametrize("ws", CPU_WORLD_SIZES)
def test_ep_cpu(ws):
    per_rank = _cpu(ws)
    cases = per_rank[0]["cases"]
    assert len(cases) == 3 * 2 * 3 + 2 * 2 * 2 + 5 * 3 + 2 + 3 * 3 + 1
    problems = [p for cid in cases for p in _problems(per_rank, cid)]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.resident_only
@pytest.mark.parametrize("ws", CPU_WORLD_SIZES)
def test_ep_cpu_value_errors(ws):
    per_rank = _cpu(ws)
    bad = [f"rank {r} {label}: {v}" for r in range(ws)
           for label, v in per_rank[r]["errors"].items() if v != "ok"]
    assert len(per_rank[0]["errors"]) >= 20
    assert not bad, "\n".join(bad)


def test_ep_references_see_the_edges():
    """The scenarios reach what they are there for: an expert with no tokens, -1 entries, a rank
    without tokens, every slot of a peer filled, and split counts of 0 and of the capacity."""
    counts = [ep_reference("random_bf16", 4, r, 0, "ep/random_bf16/0")[1] for r in range(4)]
    assert min(c.min() for c in counts) == 0
    assert ep_params("random_bf16", 4)[6][0][2] == 0
    idx = ep_routing("ep/masked_f32/0", 0, 5, 12, 4, "masked")
    assert (idx == -1).all(axis=1).any() and (idx >= 0).any()
    hot = ep_reference("hot_f32", 2, 0, 0, "ep/hot_f32/0")[1]
    assert hot.tolist() == [2 * 5, 2 * 5]  # every token of both ranks: experts 0 and 1
    c = split_counts("x", 4, 7)
    assert (c == 0).any() and (c == 7).any()


_GPU_JOBS = {}


# Plus, at 2 ranks, every path with round numbers that wrap at the job's first op
# (cuda_harness.PATH_KNOBS["wrap"]): the counts-with-rows exchange's header mark among them.
GPU_KEYS = [(ws, p) for ws in C.WORLD_SIZES for p in GPU_PATHS]
GPU_KEYS += [(2, p) for p in ("direct+wrap", "proxy+wrap", "proxy+wrap+tcp") if 2 in C.WORLD_SIZES]


@pytest.mark.gpu
@pytest.mark.resident_only
@pytest.mark.parametrize("ws,path", GPU_KEYS, ids=[f"{p}-{ws}" for ws, p in GPU_KEYS])
def test_ep_gpu(ws, path):
    if C.DRY_RUN:
        pytest.skip("CUDA graphs and device splits need a GPU")
    key = (ws, path)
    if key not in _GPU_JOBS:
        _GPU_JOBS[key] = H.run_ranks(gpu_job, ws, env=C.path_env(path), init=False,
                                     timeout_s=300 * C.TIME_SCALE, init_timeout_s=60)
    per_rank = _GPU_JOBS[key]
    problems = [p for cid in per_rank[0]["cases"] for p in _problems(per_rank, cid)]
    assert not problems, "\n".join(problems[:20])


def test_fp8_reference_encoder_covers_every_code():
    """The test's numpy fp8 encoder / decoder agree with torch's float8_e4m3fn on every finite
    code, and on rounding random float32 values (ties included)."""
    import torch

    codes = np.arange(256, dtype=np.uint8)
    finite = (codes & 0x7F) != 0x7F
    vals = torch.from_numpy(codes).view(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(fp8_values(codes[finite]), vals[finite])
    assert np.array_equal(fp8_codes(vals[finite].astype(np.float32)), codes[finite])
    rng = np.random.default_rng(7)
    y = (rng.standard_normal(50000) * 2.0 ** rng.uniform(-14, 9, 50000)).astype(np.float32)
    y = np.concatenate([np.clip(y, -448, 448),
                        ((vals[finite][1:] + vals[finite][:-1]) / 2).astype(np.float32)])
    y = y[np.abs(y) <= 448]
    want = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_codes(y), want)


@pytest.mark.parametrize("round_scale", (False, True))
@pytest.mark.parametrize("dt", ("bfloat16", "float16", "float32"))
def test_fp8_quantize_matches_reference(dt, round_scale):
    """resident_pg.ep_fp8.quantize against the numpy cast, bitwise; UE8M0 bytes of rounded
    scales are their exponents; dequantize inverts within fp8 rounding."""
    import torch

    from resident_pg.ep_fp8 import dequantize, quantize, ue8m0_bytes

    x = fp8_tokens(f"quant/{dt}", 0, 40, 512, dt)  # float16: the smallest groups are subnormal
    q, s = quantize(torch.from_numpy(x).to(H.tdtype(dt)), round_scale)
    codes, scales = fp8_quantize(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    assert np.array_equal(s.numpy().view(np.uint32), scales.view(np.uint32))
    if round_scale:
        assert np.array_equal(ue8m0_bytes(s).numpy(), (scales.view(np.uint32) >> 23) & 0xFF)
        packed = torch.from_numpy(ue8m0_packed(scales).view(np.int32))
        assert torch.equal(dequantize(q, packed), dequantize(q, s))
    deq = dequantize(q, s).double().numpy()
    s_full = np.repeat(scales.astype(np.float64), 128, axis=1)
    assert (np.abs(deq - x) <= np.abs(x) * 2.0 ** -4 * (1 + 2.0 ** -20) + s_full * 2.0 ** -10).all()


@pytest.mark.parametrize("hidden,use_ue8m0", [(128, False), (512, False), (512, True)])
def test_fp8_rows_of_a_rank_without_tokens(hidden, use_ue8m0):
    """A rank with no tokens packs no rows, whatever the number of scale groups (one group per
    row gives an empty scale tensor that torch cannot view as bytes)."""
    import torch

    from resident_pg.ep_fp8 import Fp8Rows, row_bytes

    rows = Fp8Rows(hidden, 4, 2, 8, use_ue8m0, "cpu").pack(
        torch.zeros(0, hidden, dtype=torch.bfloat16), round_scale=use_ue8m0)
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (0, row_bytes(hidden, use_ue8m0))


@pytest.mark.gpu
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dt", ("bfloat16", "float16", "float32"))
def test_fp8_route_cast_matches_reference(dt, round_scale, use_ue8m0):
    """The routing kernel's FP8 cast (ep_kernels.route with ``fp8``): every placed (token,
    expert) row holds the token's fp8 codes and scales of the numpy cast, bitwise; one process,
    2 peers' worth of slots (rows go to both halves of the send buffer)."""
    import torch

    from resident_pg import ep_kernels
    from resident_pg.ep_fp8 import row_bytes

    T, K, E, W, Hd = 24, 3, 8, 2, 1024
    x = fp8_tokens(f"route/{dt}", 0, T, Hd, dt)  # float16: the smallest groups are subnormal
    codes, scales = fp8_quantize(x, round_scale)
    rng = np.random.default_rng(11)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    idx[3] = -1                                   # a token routed nowhere
    C, RB = T * K, row_bytes(Hd, use_ue8m0)
    dev = torch.device("cuda", 0)
    send_x = torch.zeros(W * C + 1, RB, dtype=torch.uint8, device=dev)
    send_counts = torch.empty(W, E // W, dtype=torch.int64, device=dev)
    pair_slot = torch.empty(T * K, dtype=torch.int64, device=dev)
    dropped = torch.empty((), dtype=torch.int64, device=dev)
    with torch.cuda.device(dev):
        ep_kernels.route(torch.from_numpy(idx).to(dev), torch.from_numpy(x).to(H.tdtype(dt)).to(dev),
                         send_x, send_counts, pair_slot, dropped, E, W, C,
                         torch.cuda.current_stream(dev).cuda_stream, (round_scale, use_ue8m0))
        torch.cuda.synchronize(dev)
    rows, slots = send_x.cpu().numpy(), pair_slot.cpu().numpy()
    tail = ((scales.view(np.uint32) >> 23) & 0xFF).astype(np.uint8) if use_ue8m0 \
        else scales.view(np.uint8).reshape(T, -1)
    placed = 0
    for p in range(T * K):
        t = p // K
        if idx[t, p % K] < 0:
            assert slots[p] == W * C
            continue
        placed += 1
        assert np.array_equal(rows[slots[p], :Hd], codes[t]), f"fp8 codes of pair {p}"
        assert np.array_equal(rows[slots[p], Hd:], tail[t]), f"scales of pair {p}"
    assert placed == (T - 1) * K and int(dropped) == 0
