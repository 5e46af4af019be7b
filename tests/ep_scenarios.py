"""The seeded scenarios of the resident_pg.ep tests (test_ep.py) and what each rank must get.

Device-splits counts and rows; EP scenarios (payload dtype, local experts, hidden size, max
tokens, top-k, tokens per rank per round, routing mode) with their routings, tokens and weights;
FP8 scenarios (the same plus round_scale and use_ue8m0).  Every rank regenerates every rank's
inputs from seeds and computes the reference itself, in numpy (ep_reference.py): no code of
resident_pg.moe / resident_pg.ep.
"""

from __future__ import annotations

import numpy as np

import dist_harness as H
from ep_reference import (
    combine_reference,
    dispatch_reference,
    expert_scale,
    fp8_dequantize,
    fp8_quantize,
    fp8_tokens,
    to_dtype,
)


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
