"""The scenarios of the resident_pg.ep_vllm tests (test_ep_vllm.py, test_ep_vllm_installed.py)
and what each rank's prepare and finalize must give, computed in numpy (no code of resident_pg).

Every rank regenerates every rank's tokens, routings and weights from seeds; ``reference`` gives
the batched ``[local experts, W * max tokens, hidden]`` rows (source rank order, then token
order) and per-expert counts that ``prepare`` must hand the experts -- for FP8 dispatch the fp8
bytes and scales of ep_reference.fp8_quantize -- and the weighted sum of the stand-in experts'
outputs that ``finalize`` must write.  Also the activation-quantization configs the cases pass
(QUANT_KINDS), and those the adapter refuses with a fragment of each refusal (REFUSED_KINDS).
"""

from __future__ import annotations

import numpy as np

import dist_harness as H
from ep_reference import (
    combine_reference,
    dispatch_reference,
    fp8_dequantize,
    fp8_quantize,
    fp8_tokens,
    to_dtype,
)

WS = 2  # ranks of every job

# name: dtype, local experts, hidden, max tokens per rank, top-k, tokens per rank per round,
# apply_router_weight_on_input, global_to_physical, what prepare hands the experts:
#   "act"     unquantized dispatch, unquantized experts
#   "fp8"     FP8 dispatch, block-FP8 experts: (x_fp8, float32 scales)
#   "ue8m0"   the same, experts that take packed UE8M0 scales (post_init_setup)
#   "fp8_deq" FP8 dispatch, unquantized experts: the dequantized rows
SCENARIOS = {
    "random_bf16": ("bfloat16", 3, 24, 5, 3, [[5, 2], [0, 5], [4, 4]], False, False, "act"),
    "top1_weight_on_input_bf16": ("bfloat16", 2, 16, 4, 1, [[4, 3], [1, 0]], True, False,
                                  "act"),
    "physical_ids_f32": ("float32", 2, 8, 4, 2, [[4, 4], [2, 3]], False, True, "act"),
    "fp8_blocks_bf16": ("bfloat16", 3, 256, 4, 3, [[4, 2], [0, 4], [3, 3]], False, False, "fp8"),
    "fp8_ue8m0_physical_ids_bf16": ("bfloat16", 2, 512, 3, 2, [[3, 3], [2, 1]], False, True,
                                    "ue8m0"),
    "fp8_dequantized_top1_on_input_f32": ("float32", 2, 384, 4, 1, [[4, 1], [2, 4]], True,
                                          False, "fp8_deq"),
}
FP8_FORMATS = ("fp8", "ue8m0", "fp8_deq")


def tokens(key, rank, T, Hd, dt, fmt="act"):
    """Activation rows; for FP8 dispatch, groups of 128 channels at magnitudes 2**-24 .. 2**9
    and an all-zero group (ep_reference.fp8_tokens)."""
    if fmt in FP8_FORMATS:
        return fp8_tokens(key, rank, T, Hd, dt)
    return to_dtype(H.rng_for(key + "/x", rank).standard_normal((T, Hd)), dt)


def routing(key, rank, T, E, K):
    """[T, K] global experts: distinct per row, expert E-1 never picked, 25% -1, the first row
    all -1 when there are several rows."""
    rng = H.rng_for(key + "/route", rank)
    idx = np.stack([rng.choice(E - 1, size=K, replace=False) for _ in range(T)]) if T else \
        np.zeros((0, K), dtype=np.int64)
    idx[rng.random((T, K)) < 0.25] = -1
    if T > 1:
        idx[0] = -1
    return idx.astype(np.int64)


def weights(key, rank, T, K):
    return H.rng_for(key + "/w", rank).uniform(0.1, 1.0, (T, K)).astype(np.float32)


def physical_of(E):
    """A fixed permutation of the expert ids (global -> physical)."""
    return H.rng_for("ep_vllm/g2p", 0).permutation(E).astype(np.int64)


def expert_scale(e):
    return 1.0 + (e % 5) / 4.0  # exact in every payload dtype


def reference(name, rank, rnd, key):
    """What ``rank``'s prepare and finalize must give in round ``rnd``: a dict of ``x`` (the
    batched rows [L, WS*M, H] as float64: the activation rows, or for "fp8_deq" the dequantized
    FP8 rows in the activation dtype), ``count`` [L], for FP8 formats ``codes`` [L, WS*M, H]
    uint8 and ``scales`` [L, WS*M, H/128] float32, and the combined ``y`` [T, H] with its
    tolerance ``tol``."""
    dt, L, Hd, M, K, rounds, on_input, g2p, fmt = SCENARIOS[name]
    E, S = L * WS, WS * M
    perm = physical_of(E) if g2p else np.arange(E)

    def sent(src):  # what src dispatches: (tokens as sent, physical expert per pair)
        T = rounds[rnd][src]
        x, idx = tokens(key, src, T, Hd, dt, fmt), routing(key, src, T, E, K)
        if on_input:  # x * w, with w rounded to the payload dtype first
            x = to_dtype(x * to_dtype(weights(key, src, T, K).astype(np.float64), dt), dt)
        phys = np.where(idx >= 0, perm[np.maximum(idx, 0)], -1)
        return x, phys

    xs, phys = zip(*(sent(src) for src in range(WS)))
    w = np.ones_like(phys[rank], dtype=np.float64) if on_input else \
        weights(key, rank, len(xs[rank]), K).astype(np.float64)
    if fmt not in FP8_FORMATS:
        bx, count = dispatch_reference(phys, xs, rank, L, S)
        y, tol = combine_reference(xs[rank], phys[rank], w, dt, expert_scale)
        return dict(x=bx, count=count, y=y, tol=tol)
    q = [fp8_quantize(x, fmt == "ue8m0") for x in xs]
    codes, count = dispatch_reference(phys, [c for c, _ in q], rank, L, S)
    scales, _ = dispatch_reference(phys, [s for _, s in q], rank, L, S)
    out = dict(codes=codes, scales=scales, count=count)
    own = fp8_dequantize(*q[rank])  # float32, as the dequantizing side computes
    if fmt == "fp8_deq":  # the experts get (and scale) the dequantized rows in the payload dtype
        out["x"] = to_dtype(fp8_dequantize(codes, scales), dt)
        own = to_dtype(own, dt).astype(np.float32)
    # the experts scale float32 values in float32, then round to the payload dtype
    out["y"], out["tol"] = combine_reference(own, phys[rank], w, dt,
                                             lambda e: np.float32(expert_scale(e)))
    return out


# the activation-quantization configs the cases use: kind -> FusedMoEQuantConfig.make arguments
# (quant_dtype as a torch dtype name or a string format, block_shape, per_act_token_quant,
# static a1_scale)
QUANT_KINDS = {
    "none": (None, None, False, False),
    "fp8_block128": ("float8_e4m3fn", [128, 128], False, False),
    # refused
    "fp8_per_tensor": ("float8_e4m3fn", None, False, False),
    "fp8_per_token": ("float8_e4m3fn", None, True, False),
    "fp8_block64": ("float8_e4m3fn", [128, 64], False, False),
    "fp8_block128_static": ("float8_e4m3fn", [128, 128], False, True),
    "fp8_fnuz_block128": ("float8_e4m3fnuz", [128, 128], False, False),
    "int8_per_token": ("int8", None, True, False),
    "nvfp4": ("nvfp4", None, False, False),
    "static_scale_unquantized": (None, None, False, True),
}

# kind -> a fragment of the refusal (the config named in it)
REFUSED_KINDS = {
    "fp8_per_tensor": "quant_dtype=torch.float8_e4m3fn, block_shape=None",
    "fp8_per_token": "per_act_token_quant=True",
    "fp8_block64": "block_shape=[128, 64]",
    "fp8_block128_static": "a1_scale=a tensor",
    "fp8_fnuz_block128": "quant_dtype=torch.float8_e4m3fnuz",
    "int8_per_token": "quant_dtype=torch.int8",
    "nvfp4": "quant_dtype='nvfp4'",
    "static_scale_unquantized": "quant_dtype=None",
}


def quant_args(kind):
    """QUANT_KINDS[kind] as the arguments of a quantization config: (quant_dtype,
    block_shape, per_act_token_quant, a1_scale)."""
    import torch

    qd, block, per_token, static = QUANT_KINDS[kind]
    if qd is not None and hasattr(torch, qd):
        qd = getattr(torch, qd)
    return qd, block, per_token, (torch.ones(1) if static else None)
