"""Expert-parallel (EP) dispatch / combine for MoE decode, in the spirit of DeepEP's
low-latency mode, on top of ``torch.distributed.all_to_all_single``.

It works with any backend that serves ``all_to_all_single`` (resident, gloo, NCCL).  With
``resident`` (or NCCL) on CUDA tensors every call is a fixed sequence of device kernels with
static shapes: no ``.item()``, no host synchronisation, no data-dependent shape, so
``dispatch`` + expert compute + ``combine`` can be captured in one CUDA graph and replayed.

::

    from resident_pg.moe import MoEDispatcher
    moe = MoEDispatcher(group, num_experts=128, hidden=2048, max_tokens_per_rank=64,
                        top_k=8, dtype=torch.bfloat16, device="cuda")
    expert_x, expert_counts, handle = moe.dispatch(x, topk_idx, topk_weights)
    expert_y = my_experts(expert_x, expert_counts)       # [L, max_slots, H] -> same shape
    y = moe.combine(expert_y, handle)                     # [T, H]: sum_k w[t,k] * y_k[t]

Experts: rank ``r`` of a group of ``W`` ranks hosts the ``L = num_experts / W`` experts
``r*L .. r*L+L-1`` (global expert ``e`` lives on rank ``e // L`` as local expert ``e % L``).

Layout (all buffers are allocated ONCE, in ``__init__``; ``C`` = ``slots_per_rank``):

* send / receive payload: ``[W, C, H]`` -- ``C`` token slots per peer.  The default
  ``C = max_tokens_per_rank * min(top_k, L)`` is the worst case (every token of this rank
  sends one copy to each of ``min(top_k, L)`` experts of the same peer), so nothing is ever
  dropped.  Inside peer ``d``'s ``C`` slots, the (token, expert) pairs are ordered by
  local expert, then by token index: the slots of local expert ``l`` are the contiguous
  range ``[start[d, l], start[d, l] + count[d, l])`` with ``start`` the exclusive prefix sum
  of ``count[d, :]``.
* counts: ``[W, L]`` int64, exchanged first with a fixed-size ``all_to_all_single``; with
  them every receiver knows where each local expert's tokens sit in every peer's slots.
* ``expert_x``: ``[L, max_slots, H]`` with ``max_slots = W * min(max_tokens_per_rank, C)``
  (DeepEP's ``packed_recv_x`` shape when ``C`` is the default).  Row ``j`` of local expert
  ``l``: the tokens from rank 0 first, then rank 1, ..., each in the sender's token order;
  ``expert_counts[l]`` rows are valid, the rest are zero.
* combine sends each valid row back into the slot it came from (``[W, C, H]`` again) and
  the source rank reduces ``y[t] = sum_k w[t, k] * out[t, k]`` in float32, rounded once to
  the payload dtype.

``dispatch_dtype`` / ``dispatch_hidden`` (default: ``dtype`` / ``hidden``): the rows dispatch
moves, when they differ from the rows combine moves back -- ``resident_pg.ep``'s FP8 dispatch
sends each token as one uint8 row of its fp8 values and scales and combines in ``dtype``.
``unpack_into=(head, tail)`` (CUDA tensors, where the EP kernels run; ``unpacks_into`` says
whether it applies): each received row is split, its first bytes into ``head [L, max_slots,
h]`` and the rest, as 4-byte words, into ``tail [L, words, max_slots]`` (column-major per
expert), instead of into ``expert_x``, which is then not made (``dispatch`` returns None for
it) -- ``resident_pg.ep`` receives FP8 rows straight into DeepEP's values and scales.

Messages are the padded buffers, ``C * H * itemsize`` bytes per peer, whatever the routing:
that is the price of static shapes (a graph cannot size a message from device data).  A
smaller ``slots_per_rank`` shrinks every message; pairs that do not fit are then dropped
(expert-major order: the last experts of a peer lose their last tokens first), contribute
nothing to ``combine`` and are counted in ``handle.dropped`` (a device tensor).

Per call: ``dispatch`` = 2 ``all_to_all_single`` (counts, payload), ``combine`` = 1.  With a
``payload_exchange`` (``resident_pg.ep``: the resident all_to_all with counts read on the
device) the two payload exchanges move only the filled slots of each peer.

On CUDA tensors the work around the exchanges is one kernel per step
(:mod:`resident_pg.ep_kernels`: route + pack, unpack, combine's pack, the weighted reduction),
each touching only the rows in use: ``expert_x`` rows past the counts are zeroed only where the
previous dispatch filled them (rows a caller writes there itself stay written).  On CPU the
same steps are torch ops.

Validation: shapes, dtypes, devices and ``T <= max_tokens_per_rank`` always raise
``ValueError`` (host-side metadata only).  Index values (``-1 <= idx < num_experts``, no
expert twice in a token's row) need a look at device data; they are checked when ``check``
is true (default: CPU tensors only, never while a CUDA graph is being captured).  Unchecked,
out-of-range indices and ``-1`` are "not routed" (weight ignored), as in DeepEP.

The buffers returned (``expert_x``, ``expert_counts``) are the dispatcher's own and are
overwritten by the next ``dispatch``; copy them if you need them longer.  All ranks of the
group must call ``dispatch`` / ``combine`` in the same order (they are collectives).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import contextlib

import torch
import torch.distributed as dist

from resident_pg import ep_kernels
from resident_pg.ep_fp8 import check_fp8_options
from resident_pg.ep_fp8 import row_bytes as fp8_row_bytes

__all__ = ["MoEDispatcher", "DispatchHandle"]

_INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8)


def resolve_device(device) -> torch.device:
    """``device`` as a full torch.device: None means the current CUDA device when CUDA is
    available, else the CPU; a CUDA device without an index gets the current one."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_token_rows(where: str, x, hidden: int, dtype: torch.dtype, device: torch.device,
                     limit_name: str, max_tokens: int) -> None:
    """ValueError naming ``where`` unless ``x`` is a ``[T, hidden]`` tensor of ``dtype`` on
    ``device`` with ``T <= max_tokens`` (``limit_name``: the argument that set it)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{where}: x must be a [T, {hidden}] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"{where}: {x.shape[0]} tokens > {limit_name}={max_tokens}")
    if x.dtype != dtype or x.device != device:
        raise ValueError(f"{where}: x has dtype {x.dtype} on {x.device}, expected dtype {dtype} "
                         f"on {device}")


@dataclasses.dataclass
class DispatchHandle:
    """What ``combine`` needs from one ``dispatch`` (device tensors, static shapes)."""

    num_tokens: int               # T of the dispatch
    pair_slot: torch.Tensor       # [T*K] flat slot d*C+pos of each (token, k) pair; W*C: none
    topk_weights: torch.Tensor    # [T, K] as given to dispatch
    back_index: torch.Tensor      # [W*C] row of expert_y (flattened) for each filled slot
    dropped: torch.Tensor         # [] int64: pairs of this rank that did not fit (slots_per_rank)
    seq: int                      # dispatch sequence number (diagnostics)
    # [W, L] int64 slots filled per (peer, its local expert), sent and received: a peer's
    # filled slots are the sum of its row (combine sends back only those)
    send_counts: torch.Tensor
    recv_counts: torch.Tensor


class MoEDispatcher:
    """Static-buffer EP dispatch/combine over ``all_to_all_single`` (see the module doc)."""

    def __init__(self, group, num_experts: int, hidden: int, max_tokens_per_rank: int,
                 top_k: int, dtype: torch.dtype = torch.bfloat16, device=None, *,
                 slots_per_rank: Optional[int] = None, check: Optional[bool] = None,
                 all_to_all=None, payload_exchange=None, exchange_with_counts=None,
                 dispatch_dtype: Optional[torch.dtype] = None,
                 dispatch_hidden: Optional[int] = None,
                 unpack_into: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        self.group = group
        # the exchange, called as all_to_all(output, input, group=group); replaceable, e.g. by
        # a local copy to time the same step without communication (examples/ep_decode.py)
        self.all_to_all = all_to_all or dist.all_to_all_single
        # the payload exchange when only the filled slots should move, called as
        # payload_exchange(output [W, C, H], input [W, C, H], send_counts [W, L],
        # recv_counts [W, L]) with the slots filled per (peer, expert) as device tensors, a
        # peer's rows the sum of its row (resident_pg.ep); None: all_to_all of the whole padded
        # buffers
        self.payload_exchange = payload_exchange
        # dispatch's counts and payload in one exchange (CUDA kernels only), called as
        # exchange_with_counts(output, input, send_counts, recv_counts) like payload_exchange but
        # writing recv_counts from the peers' counts (resident_pg.ep: they travel ahead of the
        # rows); None: the counts go first, in an all_to_all of their own
        self.exchange_with_counts = exchange_with_counts
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        for name, v in (("num_experts", num_experts), ("hidden", hidden),
                        ("max_tokens_per_rank", max_tokens_per_rank), ("top_k", top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEDispatcher: {name} must be a positive int, got {v!r}")
        if num_experts % self.world:
            raise ValueError(f"MoEDispatcher: num_experts ({num_experts}) must be a multiple of "
                             f"the group size ({self.world})")
        if top_k > num_experts:
            raise ValueError(f"MoEDispatcher: top_k ({top_k}) > num_experts ({num_experts})")
        # dispatch may move rows of another format than combine (FP8 dispatch: the bytes of the
        # fp8 values and their scales); by default both move [hidden] rows of ``dtype``
        dispatch_dtype = dtype if dispatch_dtype is None else dispatch_dtype
        dispatch_hidden = hidden if dispatch_hidden is None else dispatch_hidden
        for name, dt in (("payload", dtype), ("dispatch", dispatch_dtype)):
            if not isinstance(dt, torch.dtype) or dt.is_complex or dt == torch.bool:
                raise ValueError(f"MoEDispatcher: unsupported {name} dtype {dt!r}")
        if not isinstance(dispatch_hidden, int) or isinstance(dispatch_hidden, bool) or \
                dispatch_hidden < 1:
            raise ValueError(f"MoEDispatcher: dispatch_hidden must be a positive int, got "
                             f"{dispatch_hidden!r}")
        self.device = resolve_device(device)
        self.num_experts, self.hidden, self.top_k = num_experts, hidden, top_k
        self.max_tokens = max_tokens_per_rank
        self.dtype = dtype
        self.dispatch_dtype, self.dispatch_hidden = dispatch_dtype, dispatch_hidden
        self.local_experts = L = num_experts // self.world
        worst = max_tokens_per_rank * min(top_k, L)
        if slots_per_rank is None:
            slots_per_rank = worst
        if not isinstance(slots_per_rank, int) or slots_per_rank < 1:
            raise ValueError(f"MoEDispatcher: slots_per_rank must be a positive int, "
                             f"got {slots_per_rank!r}")
        self.slots_per_rank = C = slots_per_rank
        self.lossless = C >= worst
        self.max_slots = self.world * min(max_tokens_per_rank, C)
        self.check = (self.device.type == "cpu") if check is None else bool(check)
        self._seq = 0

        W, H, dev = self.world, hidden, self.device
        z = dict(device=dev)
        # payload buffers: one extra row at the end (W*C) = a dump row (send) or a zero row
        # (receive) so that every scatter/gather has a valid static index.
        DH = dispatch_hidden
        self._send_x = torch.zeros(W * C + 1, DH, dtype=dispatch_dtype, **z)
        self._recv_x = torch.zeros(W * C + 1, DH, dtype=dispatch_dtype, **z)
        self._comb_send = torch.zeros(W * C, H, dtype=dtype, **z)
        self._comb_recv = torch.zeros(W * C + 1, H, dtype=dtype, **z)
        self.expert_counts = torch.zeros(L, dtype=torch.int32, **z)
        # CUDA: the steps around the exchanges are one kernel each (resident_pg.ep_kernels)
        # that touches only the rows in use; ``_zero_from[l]``: rows of expert_x[l] known zero
        # from there on (the unpack kernel zeroes only what the previous dispatch filled).
        # Elsewhere torch ops, with these index constants.
        self._kernels = ep_kernels.available(self.device)
        if self._kernels:
            self._zero_from = torch.zeros(L, dtype=torch.int32, **z)
        else:
            self._experts = torch.arange(num_experts, dtype=torch.int64, **z)
            self._slot_grid = torch.arange(self.max_slots, dtype=torch.int64, **z).repeat(L, 1)
            self._c_grid = torch.arange(C, dtype=torch.int64, **z).repeat(W, 1)
        if unpack_into is not None:
            self._unpack_into = self._check_unpack_into(unpack_into)
        self.unpacks_into = self._kernels and unpack_into is not None
        if self.unpacks_into:
            self.expert_x = None
        else:
            self.expert_x = torch.zeros(L, self.max_slots, DH, dtype=dispatch_dtype, **z)

    # ------------------------------------------------------------------ helpers

    def _check_unpack_into(self, unpack_into):
        """``(head, tail)`` checked against this dispatcher's geometry (ValueError)."""
        L, S, RB = self.local_experts, self.max_slots, self.dispatch_row_bytes()
        if not isinstance(unpack_into, tuple) or len(unpack_into) != 2 or \
                not all(isinstance(t, torch.Tensor) for t in unpack_into):
            raise ValueError("MoEDispatcher: unpack_into must be a (head, tail) pair of tensors")
        head, tail = unpack_into
        head_bytes = head.shape[-1] * head.element_size() if head.dim() == 3 else 0
        words = (RB - head_bytes) // 4
        if head.dim() != 3 or tuple(head.shape[:2]) != (L, S) or not 0 < head_bytes < RB or \
                head_bytes % 4 or (RB - head_bytes) % 4 or not head.is_contiguous():
            raise ValueError(f"MoEDispatcher: unpack_into's head must be a contiguous [{L}, {S}, "
                             f"h] tensor of whole 4-byte words under {RB} bytes a row, got "
                             f"{head.dtype}{tuple(head.shape)}")
        if tuple(tail.shape) != (L, words, S) or tail.element_size() != 4 or \
                not tail.is_contiguous():
            raise ValueError(f"MoEDispatcher: unpack_into's tail must be a contiguous [{L}, "
                             f"{words}, {S}] tensor of 4-byte elements, got "
                             f"{tail.dtype}{tuple(tail.shape)}")
        for t in (head, tail):
            if t.device != self.device:
                raise ValueError(f"MoEDispatcher: unpack_into is on {t.device}, the dispatcher "
                                 f"on {self.device}")
        return head, tail

    def message_bytes(self) -> int:
        """Bytes per peer of one padded combine all_to_all (and dispatch's, when it moves rows of
        the same format)."""
        return self.slots_per_rank * self.hidden * self.dtype.itemsize

    def dispatch_row_bytes(self) -> int:
        """Bytes of one dispatched (token, expert) row."""
        return self.dispatch_hidden * self.dispatch_dtype.itemsize

    def __repr__(self) -> str:
        return (f"MoEDispatcher(world={self.world}, experts={self.num_experts} "
                f"({self.local_experts}/rank), hidden={self.hidden}, max_tokens="
                f"{self.max_tokens}, top_k={self.top_k}, dtype={self.dtype}, slots_per_rank="
                f"{self.slots_per_rank}, max_slots={self.max_slots}, device={self.device})")

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _validate(self, x, topk_idx, topk_weights, fp8_cast=None):
        if fp8_cast is None:
            check_token_rows("dispatch", x, self.dispatch_hidden, self.dispatch_dtype,
                             self.device, "max_tokens_per_rank", self.max_tokens)
        else:
            if not self._kernels:
                raise ValueError("dispatch: fp8_cast needs the CUDA EP kernels (a CUDA "
                                 "dispatcher); elsewhere pass FP8 rows (resident_pg.ep_fp8)")
            round_scale, use_ue8m0 = fp8_cast
            check_fp8_options("dispatch", self.hidden, self.dtype, round_scale, use_ue8m0)
            want = fp8_row_bytes(self.hidden, use_ue8m0)
            if self.dispatch_dtype != torch.uint8 or self.dispatch_hidden != want:
                raise ValueError(f"dispatch: fp8_cast needs a dispatcher of uint8 rows of {want} "
                                 f"bytes (dispatch_dtype, dispatch_hidden); this one moves "
                                 f"{self.dispatch_dtype} rows of {self.dispatch_hidden}")
            check_token_rows("dispatch", x, self.hidden, self.dtype, self.device,
                             "max_tokens_per_rank", self.max_tokens)
        T = x.shape[0]
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"dispatch: {name} must be a tensor, got {type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"dispatch: {name} is on {t.device}, the dispatcher on "
                                 f"{self.device}")
        shape = (T, self.top_k)
        if tuple(topk_idx.shape) != shape:
            raise ValueError(f"dispatch: topk_idx must have shape {shape}, got "
                             f"{tuple(topk_idx.shape)}")
        if topk_idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"dispatch: topk_idx must be an integer tensor, got {topk_idx.dtype}")
        if tuple(topk_weights.shape) != shape:
            raise ValueError(f"dispatch: topk_weights must have shape {shape}, got "
                             f"{tuple(topk_weights.shape)}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"dispatch: topk_weights must be floating point, got "
                             f"{topk_weights.dtype}")
        if self.check and T and not self._capturing():
            idx = topk_idx.to(torch.int64)
            bad = (idx < -1) | (idx >= self.num_experts)
            if bool(bad.any()):
                t, k = (int(v) for v in bad.nonzero()[0])
                raise ValueError(f"dispatch: topk_idx[{t}, {k}] = {int(idx[t, k])} is not an "
                                 f"expert (0..{self.num_experts - 1}, or -1 for none)")
            s, _ = idx.sort(dim=1)
            dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
            if bool(dup.any()):
                t = int(dup.nonzero()[0, 0])
                raise ValueError(f"dispatch: token {t} names an expert twice in topk_idx: "
                                 f"{idx[t].tolist()}")

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 fp8_cast: Optional[Tuple[bool, bool]] = None):
        """Send each token to its top-k experts.

        ``x`` [T, dispatch_hidden] (dispatch dtype; by default [T, H] of the payload dtype),
        ``topk_idx`` [T, K] (int; -1 = no expert), ``topk_weights`` [T, K] (float; used by
        ``combine``).  Returns ``(expert_x [L, max_slots, dispatch_hidden], expert_counts [L]
        int32, handle)``; both tensors are the dispatcher's static buffers.

        ``fp8_cast`` = ``(round_scale, use_ue8m0)`` (CUDA kernels only, :attr:`fuses_fp8`): ``x``
        is [T, H] of the payload dtype, and the routing kernel casts each row it places to the
        FP8 row of :mod:`resident_pg.ep_fp8` (the dispatcher's rows must be those: uint8,
        ``row_bytes(H, use_ue8m0)``), bit for bit as ``ep_fp8.quantize``.
        """
        self._validate(x, topk_idx, topk_weights, fp8_cast)
        W, L, C, K = self.world, self.local_experts, self.slots_per_rank, self.top_k
        T = x.shape[0]
        self._seq += 1
        if self._kernels:
            with self._on_device():
                return self._dispatch_kernels(x, topk_idx, topk_weights, fp8_cast)

        # --- routing metadata of this rank's (token, k) pairs, all on the device
        e = topk_idx.reshape(-1).to(torch.int64)                    # [P], P = T*K
        hit = e.unsqueeze(1) == self._experts                       # [P, E]; -1 / >=E: no hit
        valid = hit.any(1)
        e_safe = torch.where(valid, e, torch.zeros_like(e))
        rank_in_e = hit.cumsum(0).gather(1, e_safe.unsqueeze(1)).squeeze(1) - 1
        count = hit.sum(0).view(W, L)                               # pairs per (dest, local expert)
        start = count.cumsum(1) - count                             # expert-major slot start
        pos = start.view(-1).index_select(0, e_safe) + rank_in_e    # slot inside dest's C slots
        placed = valid & (pos < C)
        dest = e_safe // L
        pair_slot = torch.where(placed, dest * C + pos, torch.full_like(pos, W * C))
        dropped = (valid & ~placed).sum()
        # the counts of each dispatch are its own (its handle's, for combine)
        send_counts = torch.minimum(count, (C - start).clamp(min=0))

        # --- payload: token rows into their slots (unplaced pairs go to the dump row W*C)
        tok = torch.arange(T * K, device=self.device) // K
        self._send_x.index_copy_(0, pair_slot, x.index_select(0, tok))

        # --- exchange: counts (fixed size), then payload (fixed size)
        recv_counts = torch.empty_like(send_counts)
        self.all_to_all(recv_counts, send_counts, group=self.group)
        self._exchange_payload(self._recv_x, self._send_x, self.dispatch_hidden, send_counts,
                               recv_counts)

        # --- receiver side: pack each local expert's rows (source rank order, then slot order)
        rc = recv_counts                                            # [W src, L]
        r_incl = rc.cumsum(1)
        r_start = r_incl - rc                                       # slot start in src's block
        e_incl = rc.cumsum(0)                                       # over sources, per expert
        e_off = e_incl - rc                                         # row offset in expert_x
        # expert_x[l, j] <- recv slot of source s, where s = first source with e_incl[s,l] > j
        s = torch.searchsorted(e_incl.t().contiguous(), self._slot_grid, right=True)  # [L, S]
        ok = s < W
        s_safe = torch.where(ok, s, torch.zeros_like(s))
        ls = torch.arange(L, device=self.device).unsqueeze(1)
        c = r_start[s_safe, ls] + (self._slot_grid - e_off[s_safe, ls])
        gather_idx = torch.where(ok, s_safe * C + c, torch.full_like(c, W * C))  # W*C: zero row
        torch.index_select(self._recv_x, 0, gather_idx.view(-1),
                           out=self.expert_x.view(L * self.max_slots, self.dispatch_hidden))
        self.expert_counts.copy_(rc.sum(0).clamp(max=self.max_slots))

        # --- for combine: received slot (s, c) -> row of expert_y it must return
        l_of = torch.searchsorted(r_incl, self._c_grid, right=True)   # [W, C]; L: empty slot
        l_ok = l_of < L
        l_safe = torch.where(l_ok, l_of, torch.zeros_like(l_of))
        ws = torch.arange(W, device=self.device).unsqueeze(1)
        row = e_off[ws, l_safe] + (self._c_grid - r_start[ws, l_safe])
        back_ok = l_ok & (row < self.max_slots)
        back_index = torch.where(back_ok, l_safe * self.max_slots + row, torch.zeros_like(row))

        handle = DispatchHandle(num_tokens=T, pair_slot=pair_slot, topk_weights=topk_weights,
                                back_index=back_index.view(-1), dropped=dropped, seq=self._seq,
                                send_counts=send_counts, recv_counts=recv_counts)
        return self.expert_x, self.expert_counts, handle

    def _on_device(self):
        """The dispatcher's CUDA device made current for the kernels' launches, when it is not."""
        if torch.cuda.current_device() == self.device.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _exchange_payload(self, recv, send, rows_hidden, send_counts, recv_counts,
                          exchange=None):
        """``exchange`` (default: payload_exchange) moves the filled slots; exchange_with_counts
        also writes recv_counts."""
        W, C = self.world, self.slots_per_rank
        exchange = exchange or self.payload_exchange
        if exchange is None:
            self.all_to_all(recv[: W * C], send[: W * C], group=self.group)
        else:  # slots [0, rows) of each peer are filled (expert-major from slot 0)
            exchange(recv[: W * C].view(W, C, rows_hidden), send[: W * C].view(W, C, rows_hidden),
                     send_counts, recv_counts)

    @property
    def fuses_fp8(self) -> bool:
        """Whether ``dispatch`` takes ``fp8_cast`` (the routing kernel casts rows to FP8)."""
        return self._kernels

    def _dispatch_kernels(self, x, topk_idx, topk_weights, fp8_cast=None):
        """dispatch on CUDA: route + pack, the exchanges, unpack (resident_pg.ep_kernels)."""
        W, C, K = self.world, self.slots_per_rank, self.top_k
        T = x.shape[0]
        dev = self.device
        stream = torch.cuda.current_stream(dev).cuda_stream
        if topk_idx.dtype not in (torch.int32, torch.int64):
            topk_idx = topk_idx.to(torch.int64)
        topk_idx = topk_idx.contiguous()
        if T and x.stride(1) != 1:
            x = x.contiguous()
        pair_slot = torch.empty(T * K, dtype=torch.int64, device=dev)
        dropped = torch.empty((), dtype=torch.int64, device=dev)
        counts = torch.empty(2, W, self.local_experts, dtype=torch.int64, device=dev)
        send_counts, recv_counts = counts[0], counts[1]
        ep_kernels.route(topk_idx, x, self._send_x, send_counts, pair_slot, dropped,
                         self.num_experts, W, C, stream, fp8_cast)
        if self.exchange_with_counts is None:
            self.all_to_all(recv_counts, send_counts, group=self.group)
        self._exchange_payload(self._recv_x, self._send_x, self.dispatch_hidden, send_counts,
                               recv_counts, self.exchange_with_counts)
        back_index = torch.empty(W * C, dtype=torch.int64, device=dev)
        head, tail = self._unpack_into if self.unpacks_into else (self.expert_x, None)
        ep_kernels.unpack(recv_counts, self._recv_x, head, self.expert_counts,
                          self._zero_from, back_index, C, stream, tail)
        handle = DispatchHandle(num_tokens=T, pair_slot=pair_slot, topk_weights=topk_weights,
                                back_index=back_index, dropped=dropped, seq=self._seq,
                                send_counts=send_counts, recv_counts=recv_counts)
        return self.expert_x, self.expert_counts, handle

    # ------------------------------------------------------------------ combine

    def combine(self, expert_y: torch.Tensor, handle: DispatchHandle,
                topk_weights: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Return ``y [T, H]``: ``y[t] = sum_k w[t, k] * expert_y[row of (t, k)]``.

        ``expert_y`` is ``[L, max_slots, H]`` of the payload dtype (rows beyond
        ``expert_counts`` are ignored).  ``topk_weights`` overrides the dispatch's weights.
        Accumulates in float32, rounds once to the payload dtype (or ``out``'s dtype).
        """
        shape = (self.local_experts, self.max_slots, self.hidden)
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"combine: handle must come from dispatch, got {type(handle).__name__}")
        if not isinstance(expert_y, torch.Tensor) or tuple(expert_y.shape) != shape:
            raise ValueError(f"combine: expert_y must have shape {shape}, got "
                             f"{tuple(expert_y.shape) if isinstance(expert_y, torch.Tensor) else type(expert_y)}")
        if expert_y.dtype != self.dtype:
            raise ValueError(f"combine: expert_y has dtype {expert_y.dtype}, expected {self.dtype}")
        if expert_y.device != self.device:
            raise ValueError(f"combine: expert_y is on {expert_y.device}, expected {self.device}")
        T, K = handle.num_tokens, self.top_k
        w = handle.topk_weights if topk_weights is None else topk_weights
        if tuple(w.shape) != (T, K) or not w.dtype.is_floating_point or w.device != self.device:
            raise ValueError(f"combine: topk_weights must be a floating [{T}, {K}] tensor on "
                             f"{self.device}, got {w.dtype}{tuple(w.shape)} on {w.device}")
        if out is not None and (tuple(out.shape) != (T, self.hidden) or out.device != self.device):
            raise ValueError(f"combine: out must be [{T}, {self.hidden}] on {self.device}")

        if self._kernels:
            with self._on_device():
                return self._combine_kernels(expert_y, handle, w, out)
        flat_y = expert_y.reshape(-1, self.hidden)
        torch.index_select(flat_y, 0, handle.back_index, out=self._comb_send)
        # back the way the rows came: what a peer sent is what it gets back
        self._exchange_payload(self._comb_recv, self._comb_send, self.hidden, handle.recv_counts,
                               handle.send_counts)
        return self._reduce(handle, w, out)

    def _reduce(self, handle, w, out):
        """The weighted sum of each token's returned rows, in float32 (torch ops)."""
        got = self._comb_recv.index_select(0, handle.pair_slot)
        got = got.view(handle.num_tokens, self.top_k, self.hidden)
        acc = (got.float() * w.float().unsqueeze(-1)).sum(1)
        if out is None:
            return acc.to(self.dtype)
        out.copy_(acc)
        return out

    def _combine_kernels(self, expert_y, handle, w, out):
        """combine on CUDA: pack the filled slots, the exchange, the weighted reduction."""
        T, H, C = handle.num_tokens, self.hidden, self.slots_per_rank
        stream = torch.cuda.current_stream(self.device).cuda_stream
        ep_kernels.combine_pack(handle.recv_counts, handle.back_index,
                                expert_y.contiguous().view(-1, H), self._comb_send, C, stream)
        self._exchange_payload(self._comb_recv, self._comb_send, H, handle.recv_counts,
                               handle.send_counts)
        out_dtype = self.dtype if out is None else out.dtype
        if self.dtype not in ep_kernels.REDUCE_DTYPES or \
                out_dtype not in ep_kernels.REDUCE_DTYPES:
            return self._reduce(handle, w, out)
        target = out if out is not None and out.is_contiguous() else \
            torch.empty(T, H, dtype=out_dtype, device=self.device)
        ep_kernels.combine_reduce(self._comb_recv, handle.pair_slot,
                                  w.to(torch.float32).contiguous(), target, self.world * C,
                                  stream)
        if target is not out and out is not None:
            out.copy_(target)
            return out
        return target
