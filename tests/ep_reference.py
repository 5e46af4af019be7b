"""Reference computations shared by the EP tests (test_ep.py, test_ep_fp8.py, test_ep_vllm*.py
and their ep_*.py modules; the op mixes' op_mix_ep.py), in numpy: rounding to a payload dtype,
where dispatch puts each routed row, DeepEP's FP8 cast (an fp8 e4m3fn encoder written from the
format's definition) with test tokens that reach its edges, and the output of a combine of
scaled stand-in experts.  Nothing here calls resident_pg."""

from __future__ import annotations

import numpy as np

import dist_harness as H


def to_dtype(a, dtype_name):
    """float64 values -> the payload dtype's values, back as float64 (torch does the rounding)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(
        H.tdtype(dtype_name)).double().numpy()


def expert_scale(e):
    """The stand-in expert ``e``'s factor: its output is its input times this."""
    return 1.0 + (e % 7) / 8.0  # exact in every payload dtype


def dispatch_reference(idx_of, rows_of, rank, L, S):
    """What ``rank``'s local experts receive: ``(recv [L, S, *row], count [L] int32)``, expert
    ``l``'s rows in source rank order, then token order, zeros after.  ``idx_of[src]`` is
    ``[T, K]`` (global experts, ``-1``: none; rank ``r`` hosts ``r*L .. r*L+L-1``),
    ``rows_of[src]`` the ``[T, *row]`` payload of its tokens (any dtype; the result keeps it)."""
    first = np.asarray(rows_of[0])
    recv = np.zeros((L, S) + first.shape[1:], dtype=first.dtype)
    count = np.zeros(L, dtype=np.int32)
    for idx, rows in zip(idx_of, rows_of):
        for t in range(len(idx)):
            for e in idx[t]:
                if e >= 0 and e // L == rank:
                    recv[e % L, count[e % L]] = rows[t]
                    count[e % L] += 1
    return recv, count


_COMBINE_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def combine_reference(x, idx, w, dtype_name, scale_of):
    """``y[t] = sum_k w[t, k] * round(x[t] * scale_of(idx[t, k]))`` over the routed pairs
    (``idx >= 0``; each expert's output rounded to the payload dtype, as the stand-in experts
    give it; the product is taken in ``x``'s numpy dtype), and a per-element tolerance for the
    combine's float32 sum in another order rounded once to the payload dtype."""
    y = np.zeros(x.shape)
    mag = np.zeros(x.shape)
    for t in range(len(x)):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            if e >= 0:
                out = to_dtype(x[t] * scale_of(e), dtype_name)
                y[t] += w[t, k] * out
                mag[t] += np.abs(w[t, k] * out)
    ulp = _COMBINE_ULP.get(dtype_name, 2.0 ** -23)
    return y, np.abs(y) * ulp + mag * 2.0 ** -20 + 1e-7


# ---------------------------------------------------------------- FP8 (DeepEP's low-latency cast)


def fp8_tokens(key, rank, T, Hd, dt):
    """Groups of 128 channels at magnitudes 2**-24 .. 2**9; token 0's first group is zero."""
    rng = H.rng_for(key + "/x8", rank)
    mag = 2.0 ** rng.uniform(-24, 9, (T, Hd // 128))
    if T:
        mag[0, 0] = 0.0
    return to_dtype(rng.standard_normal((T, Hd)) * np.repeat(mag, 128, axis=1), dt)


def fp8_codes(y):
    """float32 values in [-448, 448] -> float8_e4m3fn bit patterns (uint8), rounded to nearest
    even; from the format's definition (exponent bias 7, 3 mantissa bits, subnormal step 2**-9)."""
    y = np.asarray(y, dtype=np.float32)
    a = np.abs(y).astype(np.float64)
    assert (a <= 448).all()
    m, e = np.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    normal = (e - 1 + 7) * 8 + np.rint((2 * m - 1) * 8)  # a mantissa carry bumps the exponent
    code = np.where(a >= 2.0 ** -6, normal, np.rint(a / 2.0 ** -9)).astype(np.int64)
    return (code | (np.signbit(y).astype(np.int64) << 7)).astype(np.uint8)


def fp8_values(codes):
    """float8_e4m3fn bit patterns -> float64 values (finite codes only)."""
    c = np.asarray(codes).astype(np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e > 0, (1 + m / 8.0) * 2.0 ** (e - 7), m * 2.0 ** -9)
    return np.where(c & 0x80, -mag, mag)


def fp8_quantize(x, round_scale):
    """DeepEP's per-token, per-128-channel cast in float32: (codes [T, H], scale_inv [T, G])."""
    T, Hd = x.shape
    xf = np.asarray(x, dtype=np.float32).reshape(T, Hd // 128, 128)
    amax = np.maximum(np.abs(xf).max(axis=-1, initial=0.0), np.float32(1e-4))
    v = amax * np.float32(1 / 448)
    if round_scale:
        bits = v.view(np.uint32).astype(np.int64)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
        scale_inv = np.ldexp(np.float32(1), e).astype(np.float32)
        scale = np.ldexp(np.float32(1), -e).astype(np.float32)
    else:
        scale_inv, scale = v, np.float32(448) / amax
    y = np.clip(xf * scale[..., None], np.float32(-448), np.float32(448))
    return fp8_codes(y).reshape(T, Hd), scale_inv.astype(np.float32)


def fp8_dequantize(codes, scale_inv):
    """float32 values of fp8 rows ``[T, H]`` with their scales ``[T, H/128]`` (as a receiver
    computes them in float32)."""
    return fp8_values(codes).astype(np.float32) * np.repeat(scale_inv, 128, axis=-1)


def ue8m0_packed(scales):
    """float32 power-of-two scales [..., G] -> DeepEP's packed UE8M0 [..., G/4] as uint32:
    group 4j+b's exponent byte in bits 8b..8b+7 of word j."""
    b = (scales.view(np.uint32) >> 23) & 0xFF
    b = b.reshape(*scales.shape[:-1], -1, 4).astype(np.uint64)
    return (b << (8 * np.arange(4, dtype=np.uint64))).sum(-1).astype(np.uint32)
