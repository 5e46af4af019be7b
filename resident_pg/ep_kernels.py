"""Callers of the EP dispatch/combine kernels (kernels/ep_kernels.cu) for
:class:`resident_pg.moe.MoEDispatcher` on CUDA tensors.

Each function launches one kernel on ``stream`` (the ``cuda_stream`` of the caller's current
stream on the tensors' device; capturable in a CUDA graph) and touches only the rows in use: the
routed pairs on the sender, the received rows on the expert side, the filled slots on the way
back.  The caller owns the buffers and their
layout (resident_pg/moe.py); rows are moved as opaque bytes, so any payload dtype and the FP8
rows of :mod:`resident_pg.ep_fp8` go through the same kernels.  The weighted combine reduces
float32, float16 and bfloat16 payloads (:data:`REDUCE_DTYPES`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["REDUCE_DTYPES", "available", "combine_pack", "combine_reduce", "route", "unpack"]

# payload / output dtypes of combine_reduce and their codes in kernels/ep_args.hpp (Dtype)
REDUCE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available(device: torch.device) -> bool:
    """True when ``device`` is a CUDA device and this build has the kernels."""
    if device.type != "cuda":
        return False
    from resident_pg import _C

    return bool(_C.ep_kernels_built())


def _row_bytes(t: torch.Tensor) -> int:
    return t.shape[-1] * t.element_size()


def route(topk_idx: torch.Tensor, x: torch.Tensor, send_x: torch.Tensor,
          send_counts: torch.Tensor, pair_slot: torch.Tensor, dropped: torch.Tensor,
          experts: int, ranks: int, slots: int, stream: int,
          fp8: Optional[Tuple[bool, bool]] = None) -> None:
    """Dispatch, sender side: ``topk_idx [T, K]`` (contiguous int32/int64), token rows ``x
    [T, R]`` (unit stride in the last dimension), ``send_x [>= W*C, R]``; writes
    ``send_counts [W, L]``, ``pair_slot [T*K]`` and ``dropped []`` (int64).  ``fp8``:
    ``(round_scale, use_ue8m0)`` -- ``x [T, hidden]`` holds activations (a dtype of
    :data:`REDUCE_DTYPES`) and each placed row is cast to the FP8 row of
    :mod:`resident_pg.ep_fp8` (``send_x`` rows of ``row_bytes(hidden, use_ue8m0)``)."""
    from resident_pg import _C

    T, K = topk_idx.shape
    cast, x_dtype, round_scale, hidden = 0, 0, False, 0
    if fp8 is not None:
        round_scale, use_ue8m0 = fp8
        cast, x_dtype, hidden = (2 if use_ue8m0 else 1), REDUCE_DTYPES[x.dtype], x.shape[1]
    _C.ep_route(topk_idx.data_ptr(), topk_idx.element_size(), T, K, experts, ranks, slots,
                x.data_ptr(), x.stride(0) * x.element_size(), send_x.data_ptr(),
                _row_bytes(send_x), send_counts.data_ptr(), pair_slot.data_ptr(),
                dropped.data_ptr(), stream, cast, x_dtype, bool(round_scale), hidden)


def unpack(recv_counts: torch.Tensor, recv_x: torch.Tensor, expert_x: torch.Tensor,
           expert_counts: torch.Tensor, zero_from: torch.Tensor, back_index: torch.Tensor,
           slots: int, stream: int, tail_out: Optional[torch.Tensor] = None) -> None:
    """Dispatch, receiver side: ``expert_x [L, S, R']`` from ``recv_x [>= W*C, R]`` by
    ``recv_counts [W, L]``; writes ``expert_counts [L]`` (int32) and ``back_index`` of the
    filled slots; ``zero_from [L]`` (int32) is the kernel's own state (zeros at first).  ``R'``
    bytes < ``R``: each row is split, its first ``R'`` bytes to ``expert_x`` and the rest, as
    4-byte words, to ``tail_out [L, (R - R') / 4, S]`` (column-major per expert)."""
    from resident_pg import _C

    W, L = recv_counts.shape
    _C.ep_unpack(recv_counts.data_ptr(), W, L, slots, expert_x.shape[1], recv_x.data_ptr(),
                 expert_x.data_ptr(), _row_bytes(recv_x), _row_bytes(expert_x),
                 0 if tail_out is None else tail_out.data_ptr(), expert_counts.data_ptr(),
                 zero_from.data_ptr(), back_index.data_ptr(), stream)


def combine_pack(filled: torch.Tensor, back_index: torch.Tensor, expert_y: torch.Tensor,
                 comb_send: torch.Tensor, slots: int, stream: int) -> None:
    """Combine, expert side: ``comb_send[slot] = expert_y[back_index[slot]]`` for the filled
    first slots of each source: ``filled`` int64 ``[W, L]``, the dispatch's counts per source
    and expert, summed per source; ``expert_y [L*S, H]`` contiguous."""
    from resident_pg import _C

    W, L = filled.shape
    _C.ep_combine_pack(filled.data_ptr(), W, L, slots,
                       back_index.data_ptr(), expert_y.data_ptr(), comb_send.data_ptr(),
                       _row_bytes(comb_send), stream)


def combine_reduce(comb_recv: torch.Tensor, pair_slot: torch.Tensor, weights: torch.Tensor,
                   out: torch.Tensor, no_slot: int, stream: int) -> None:
    """Combine, token side: ``out[t] = sum_k weights[t, k] * comb_recv[pair_slot[t*K+k]]`` in
    float32 (``weights`` float32 ``[T, K]``, ``out [T, H]``, both contiguous; slot ``no_slot``
    adds nothing)."""
    from resident_pg import _C

    T, K = weights.shape
    _C.ep_combine_reduce(comb_recv.data_ptr(), pair_slot.data_ptr(), weights.data_ptr(),
                         out.data_ptr(), T, K, out.shape[1], no_slot,
                         REDUCE_DTYPES[comb_recv.dtype], REDUCE_DTYPES[out.dtype], stream)
