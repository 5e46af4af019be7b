"""FP8 rows of the EP dispatch in DeepEP's low-latency format (docs/ep.md, "FP8 dispatch").

Each token row ``x [hidden]`` is cast to ``float8_e4m3fn`` with one scale per group of
``GROUP = 128`` channels, computed in float32 exactly as DeepEP's low-latency dispatch kernel
does (so the bytes match it)::

    amax      = max(max |x[g*128 : (g+1)*128]|, 1e-4)          # the floor keeps scales finite
    scale_inv = amax * (1/448)            scale = 448 / amax      # round_scale=False
    scale_inv = 2**ceil(log2(amax * (1/448)))   scale = 1/scale_inv   # round_scale=True
    q         = e4m3fn(clamp(x * scale, -448, 448))             # round to nearest even
    x        ~= float(q) * scale_inv

``log2`` is taken from the float32 bits (exponent, plus one when the mantissa is not zero), so
the rounded scales are exact powers of two.  With ``use_ue8m0`` (needs ``round_scale``) each
scale travels as its exponent byte (UE8M0) and the receiver packs four of them into an int32
(group ``4j + b`` in byte ``b``, little-endian), as DeepEP returns them for DeepGEMM.

On the wire a (token, expert) pair is one uint8 row: the ``hidden`` fp8 bytes, then the
``hidden / 128`` scales (float32, 4 bytes each; UE8M0: 1 byte each) -- ``hidden * 1.03125``
bytes (UE8M0: ``* 1.0078``) instead of ``hidden * 2`` for bfloat16.

Inputs must be finite (as for DeepEP: an infinite or NaN group has no meaningful scale).
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["GROUP", "Fp8Rows", "check_fp8_options", "dequantize", "quantize", "row_bytes",
           "ue8m0_bytes"]

GROUP = 128           # channels per scale
UE8M0_PER_INT32 = 4   # UE8M0 scales packed per int32 of the received scales
FP8_MAX = 448.0       # largest finite float8_e4m3fn
FP8_MAX_INV = 1.0 / 448.0   # rounds to float32 where it multiplies (as DeepEP's 1 / 448.0f)
AMAX_FLOOR = 1e-4     # DeepEP's kFP8Margin: the smallest amax a group is scaled from

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_options(where: str, hidden: int, dtype: torch.dtype, round_scale: bool,
                      use_ue8m0: bool) -> None:
    """ValueError naming ``where`` when FP8 dispatch cannot serve these rows / options."""
    if dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"{where}: FP8 dispatch quantizes bfloat16, float16 or float32 "
                         f"activations; this Buffer's dtype is {dtype}")
    if hidden % GROUP:
        raise ValueError(f"{where}: FP8 dispatch needs hidden to be a multiple of {GROUP} (one "
                         f"scale per {GROUP} channels), got hidden={hidden}")
    if use_ue8m0 and not round_scale:
        raise ValueError(f"{where}: use_ue8m0 needs round_scale=True (UE8M0 holds powers of two "
                         "only), as in DeepEP")
    if use_ue8m0 and hidden % (GROUP * UE8M0_PER_INT32):
        raise ValueError(f"{where}: use_ue8m0 packs {UE8M0_PER_INT32} scales per int32, so "
                         f"hidden must be a multiple of {GROUP * UE8M0_PER_INT32}, got "
                         f"hidden={hidden}")


def row_bytes(hidden: int, use_ue8m0: bool) -> int:
    """Bytes of one dispatched (token, expert) row: the fp8 values, then the scales."""
    return hidden + (hidden // GROUP) * (1 if use_ue8m0 else 4)


def quantize(x: torch.Tensor, round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [T, hidden]`` -> ``(q float8_e4m3fn [T, hidden], scale_inv float32 [T, hidden/128])``
    (see the module doc).  Device ops only, static shapes: capturable in a CUDA graph."""
    T, H = x.shape
    xf = x.float().reshape(T, H // GROUP, GROUP)
    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)            # [T, G] float32
    if round_scale:
        bits = (amax * FP8_MAX_INV).view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale_inv = ((exp + 127) << 23).view(torch.float32)
        scale = ((127 - exp) << 23).view(torch.float32)
    else:
        scale_inv = amax * FP8_MAX_INV
        # a true division, as DeepEP's kernel (Tensor.__rtruediv__ would multiply by a reciprocal)
        scale = torch.div(amax.new_full((), FP8_MAX), amax)
    q = (xf * scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(T, H), scale_inv


def ue8m0_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """The UE8M0 byte (the float32 exponent field) of power-of-two scales, as uint8."""
    return ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of dispatched FP8 rows: ``x_fp8 [..., hidden]`` times its scales
    (``[..., hidden/128]`` float32, or UE8M0 packed ``[..., hidden/512]`` int32)."""
    if scales.dtype == torch.int32:
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=scales.device)
        exps = ((scales.unsqueeze(-1) >> shifts) & 0xFF).flatten(-2)  # byte b: group 4j+b
        scales = (exps << 23).view(torch.float32)
    values = x_fp8.float().unflatten(-1, (x_fp8.shape[-1] // GROUP, GROUP))
    return (values * scales.unsqueeze(-1)).flatten(-2)


class Fp8Rows:
    """Static buffers that turn activations into FP8 dispatch rows (``pack``) and received rows
    into DeepEP's ``(x_fp8, scales)`` (``unpack``), for one Buffer geometry.

    ``x``: ``[L, S, hidden]`` float8_e4m3fn; ``scales``: ``[L, S, hidden/128]`` float32 (UE8M0:
    ``[L, S, hidden/512]`` int32), column-major in its last two dimensions (a transposed view of
    ``[L, G, S]`` storage: the layout DeepEP returns for TMA loads).
    """

    def __init__(self, hidden: int, max_tokens: int, num_local_experts: int, max_slots: int,
                 use_ue8m0: bool, device):
        self.hidden, self.use_ue8m0 = hidden, use_ue8m0
        self.row_bytes = row_bytes(hidden, use_ue8m0)
        L, S, G = num_local_experts, max_slots, hidden // GROUP
        self._rows = torch.zeros(max_tokens, self.row_bytes, dtype=torch.uint8, device=device)
        self.x = torch.zeros(L, S, hidden, dtype=torch.float8_e4m3fn, device=device)
        if use_ue8m0:
            store = torch.zeros(L, G // UE8M0_PER_INT32, S, dtype=torch.int32, device=device)
        else:
            store = torch.zeros(L, G, S, dtype=torch.float32, device=device)
        self.scales = store.transpose(1, 2)
        # where a dispatcher that splits received rows (MoEDispatcher's unpack_into) puts them:
        # the fp8 bytes, and the scales' 4-byte words in their column-major storage
        self.unpack_into = (self.x.view(torch.uint8), store.view(torch.int32))

    def pack(self, x: torch.Tensor, round_scale: bool) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, row_bytes]`` uint8 rows (a view of the static buffer)."""
        T, H = x.shape
        rows = self._rows[:T]
        if T == 0:  # nothing to pack (and torch cannot view an empty [0, 1] as bytes)
            return rows
        q, scale_inv = quantize(x, round_scale)
        rows[:, :H].copy_(q.view(torch.uint8))
        rows[:, H:].copy_(ue8m0_bytes(scale_inv) if self.use_ue8m0
                          else scale_inv.view(torch.uint8))
        return rows

    def unpack(self, expert_rows: torch.Tensor):
        """Received rows ``[L, S, row_bytes]`` -> ``(x, scales)`` (the static buffers)."""
        H = self.hidden
        self.x.view(torch.uint8).copy_(expert_rows[..., :H])
        tail = expert_rows[..., H:]
        self.scales.copy_(tail.view(torch.int32 if self.use_ue8m0 else torch.float32))
        return self.x, self.scales
