"""Expert-parallel decode dispatch/combine in the shape of DeepEP's low-latency API, moving only
the routed tokens (docs/ep.md).

Two pieces:

* :func:`all_to_all_device_splits` -- an all_to_all of capacity buffers ``[W, max_rows, ...]``
  that moves only ``send_rows[p]`` rows to peer ``p`` and ``recv_rows[p]`` rows from it, the
  counts being tensors: on CUDA the kernel reads them when it runs (graph-capturable, stream-
  ordered, no host synchronisation); on CPU they are read at the call.  Resident backend only.
* :class:`Buffer` -- ``low_latency_dispatch`` / ``low_latency_combine`` with DeepEP's argument
  names and return tuples.  Built on :class:`resident_pg.moe.MoEDispatcher` (routing metadata,
  expert-major layout, float32 weighted combine): the payload moves through
  :func:`all_to_all_device_splits` (only the filled slots of each peer), in both directions;
  dispatch's per-(peer, local expert) counts go ahead of the rows in the same exchange on CUDA
  where a peer's capacity is at most :func:`counts_with_rows_max_bytes` of the group's transports,
  else first, in a small fixed-size ``all_to_all_single``.  On
  a group whose backend for the tensors' device is not resident, the same API runs over
  ``all_to_all_single`` of the padded buffers.  ``use_fp8=True`` dispatches each token as
  float8_e4m3fn values with one float32 scale per 128 channels (DeepEP's low-latency format,
  :mod:`resident_pg.ep_fp8`), moved as one byte row per (token, expert) pair (on CUDA the
  routing kernel casts each row it places); combine stays in the activation dtype.

::

    from resident_pg.ep import Buffer
    buf = Buffer(group, num_max_dispatch_tokens_per_rank=128, hidden=7168, num_experts=256)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, 128, 256)                 # recv_x [L, W*128, H]; recv_count [L] int32
    y = experts(recv_x, recv_count)            # same shape as recv_x
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)   # [T, H]
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from resident_pg.ep_fp8 import Fp8Rows, check_fp8_options, row_bytes
from resident_pg.moe import DispatchHandle, MoEDispatcher, check_token_rows, resolve_device

__all__ = ["COUNTS_WITH_ROWS_MAX_BYTES", "COUNTS_WITH_ROWS_MAX_BYTES_NETWORK", "Buffer",
           "EventOverlap", "LowLatencyHandle", "all_to_all_device_splits",
           "counts_with_rows_max_bytes", "resident_backend"]

_TRANSPORTS = ("auto", "splits", "padded")
# A peer's dispatch capacity up to which its counts travel with its rows (docs/ep.md): the
# counts-in-header exchange saves an exchange but moves LL lines only, in rounds of half a chunk,
# twice the bytes of the payload-and-flags protocol of larger messages, and bytes cost more over
# a network. On one H200 (docs/decisions.md) the counts with the rows were as fast or faster up
# to 128 KiB within a host (direct or proxied over shm), and over tcp 13-15% faster at 32 KiB,
# even at 64 KiB, slower from 112 KiB.
COUNTS_WITH_ROWS_MAX_BYTES = 128 * 1024  # every peer over shm (this host)
COUNTS_WITH_ROWS_MAX_BYTES_NETWORK = 32 * 1024  # a peer over tcp or ib


def counts_with_rows_max_bytes(transports) -> int:
    """The capacity per peer up to which a group's dispatch sends its counts with its rows, for
    the transports its peers are reached over (the backend's ``transport_for`` names: ``shm``,
    ``tcp``, ``ib``; ``self`` ignored): :data:`COUNTS_WITH_ROWS_MAX_BYTES` when every peer is
    over shm, else :data:`COUNTS_WITH_ROWS_MAX_BYTES_NETWORK` (ib takes the network bound
    unmeasured: no RDMA device has run it).  Every rank of a group gets the same answer: a
    group that spans hosts gives every rank a peer on another host, and RESIDENT_TRANSPORT must
    agree across ranks."""
    if all(t in ("shm", "self") for t in transports):
        return COUNTS_WITH_ROWS_MAX_BYTES
    return COUNTS_WITH_ROWS_MAX_BYTES_NETWORK


# what a dispatch moves per (token, expert) pair: the activation rows, or FP8 rows whose scales
# are float32 or UE8M0 bytes
_ACTIVATIONS, _FP8, _FP8_UE8M0 = "activations", "fp8", "fp8_ue8m0"


def resident_backend(group=None, device="cpu"):
    """The group's resident backend object for ``device``'s type, or None when the group's
    backend for that device is another one."""
    from resident_pg import _C

    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(torch.device(torch.device(device).type))
    except (RuntimeError, ValueError):
        return None
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps each backend (its collectives are checked across the
    # ranks first); an op of resident's own, outside c10d, goes to the backend inside
    backend = getattr(backend, "wrapped_pg", backend)
    return backend if isinstance(backend, _C.ProcessGroupResident) else None


def all_to_all_device_splits(output: torch.Tensor, input: torch.Tensor,
                             send_rows: torch.Tensor, recv_rows: torch.Tensor, group=None,
                             async_op: bool = False, counts_out: bool = False):
    """all_to_all of ``input`` / ``output`` (equal shapes ``[W, max_rows, ...]``) moving only
    ``send_rows[p]`` rows of ``input[p]`` to peer ``p``, into the first ``recv_rows[q]`` rows of
    ``output[q]`` from peer ``q``.

    ``send_rows`` / ``recv_rows``: contiguous int32 or int64 tensors of shape ``[W]``, or
    ``[W, n]`` whose ``n`` entries per peer are summed (e.g. per-expert counts; negative entries
    count as 0), the same dtype and shape, on the buffers' device; a peer's rows are clamped to
    ``[0, max_rows]``.  Rows of ``output`` past the counts keep their contents.  The counts of
    a pair must agree (``send_rows[q]`` on rank ``p`` equals ``recv_rows[p]`` on rank ``q``; a
    rank's own entry is taken from ``send_rows``): on CUDA both sides derive their lockstep
    rounds from them, and a mismatch ends in the group's device-side timeout.  Typically ``recv_rows`` is the result of an
    ``all_to_all_single`` of ``send_rows``.

    Resident backend only (ValueError otherwise).  CUDA: one kernel on the current stream
    (``async_op``: the group's side stream, as the other collectives), capturable in a CUDA
    graph; each replay reads the counts tensors afresh.  Returns a Work when ``async_op``,
    else None.

    ``counts_out=True``: ``recv_rows`` is written instead of read -- ``recv_rows[q]`` becomes
    peer ``q``'s ``send_rows`` entry for this rank.  On CUDA each message carries its counts
    ahead of its rows, so the op is one exchange where counts, then rows, take two (at most 2 KiB
    of counts per peer; the rows go as LL lines); on CPU an ``all_to_all_single`` of the counts
    runs first.
    """
    for name, t in (("output", output), ("input", input), ("send_rows", send_rows),
                    ("recv_rows", recv_rows)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"all_to_all_device_splits: {name} must be a tensor, got "
                             f"{type(t).__name__}")
    backend = resident_backend(group, input.device)
    if backend is None:
        raise ValueError(f"all_to_all_device_splits needs the resident backend for "
                         f"{input.device.type} tensors on this group (it is a resident-only "
                         "op); use resident_pg.ep.Buffer, which falls back to all_to_all_single")
    if counts_out and input.device.type != "cuda":
        dist.all_to_all_single(recv_rows, send_rows, group=group)
        counts_out = False
    work = backend.all_to_all_device_splits(output, input, send_rows, recv_rows, async_op,
                                            counts_out)
    if async_op:
        return work
    # A synchronous call returns no Work (done on return on the CPU; ordered on the current
    # stream on CUDA), as torch's synchronous collectives expect of a backend.
    if work is not None:
        work.wait()
    return None


class EventOverlap:
    """DeepEP's EventOverlap: ``event`` is a CUDA event recorded after the op when the call
    had ``async_finish=True`` (else None); ``current_stream_wait()`` makes the current stream
    wait for it.  The ops here are already ordered on the current stream."""

    def __init__(self, event=None):
        self.event = event

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


@dataclasses.dataclass
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from one ``low_latency_dispatch``."""

    dispatch: DispatchHandle
    num_tokens: int
    num_topk: int
    row_format: str = _ACTIVATIONS


def _no_op_hook() -> None:
    """The receive hook: the receive finished inside the dispatch/combine call (stream-ordered),
    so there is nothing left to do."""


class Buffer:
    """DeepEP-low-latency-shaped EP dispatch/combine for decode (see the module doc).

    ``group``: the expert-parallel group (``W`` ranks; rank ``r`` hosts experts ``r*L ..
    r*L+L-1``, ``L = num_experts / W``).  Static buffers sized for ``num_max_dispatch_tokens_
    per_rank`` tokens are made per top-k width and dispatch format on first use (pass
    ``num_topk``, and ``use_fp8`` / ``use_ue8m0`` for the FP8 format, to make them here, before
    a CUDA graph capture).  ``transport``: ``"splits"`` (the resident device-splits
    all_to_all), ``"padded"`` (``all_to_all_single`` of the padded buffers, any backend) or
    ``"auto"`` (splits when the group's backend for ``device`` is resident).
    """

    def __init__(self, group, num_max_dispatch_tokens_per_rank: int, hidden: int,
                 num_experts: int, dtype: torch.dtype = torch.bfloat16, device=None, *,
                 num_topk: Optional[int] = None, transport: str = "auto",
                 check: Optional[bool] = None, use_fp8: bool = False, use_ue8m0: bool = False):
        if transport not in _TRANSPORTS:
            raise ValueError(f"Buffer: transport must be one of {_TRANSPORTS}, got {transport!r}")
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_experts", num_experts)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Buffer: {name} must be a positive int, got {v!r}")
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"Buffer: num_experts ({num_experts}) must be a multiple of the "
                             f"group size ({self.num_ranks})")
        self.device = resolve_device(device)
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden, self.num_experts, self.dtype = hidden, num_experts, dtype
        self.num_local_experts = num_experts // self.num_ranks
        self.check = check
        # looked up once: the splits exchange calls it directly, twice per dispatch + combine
        self._resident = resident_backend(group, self.device)
        # Where dispatch's counts ride with its rows (counts_with_rows_max_bytes): 0 without
        # the resident backend (no device-splits exchange).
        self._counts_with_rows_max = 0 if self._resident is None else counts_with_rows_max_bytes(
            self._resident.transport_for(p) for p in range(self.num_ranks))
        if transport == "auto":
            transport = "splits" if self._resident is not None else "padded"
        elif transport == "splits" and self._resident is None:
            raise ValueError(f"Buffer: transport 'splits' needs the resident backend for "
                             f"{self.device.type} tensors on this group")
        self.transport = transport
        self._dispatchers: Dict[Tuple[int, str], MoEDispatcher] = {}
        self._fp8_rows: Dict[Tuple[int, str], Fp8Rows] = {}
        self._unit_weights: Dict[int, torch.Tensor] = {}
        if num_topk is not None:
            if use_fp8:  # round_scale is per call; UE8M0 implies it
                check_fp8_options("Buffer", hidden, dtype, use_ue8m0, use_ue8m0)
            self._dispatcher(num_topk, self._row_format(use_fp8, use_ue8m0))

    def __repr__(self) -> str:
        return (f"Buffer(ranks={self.num_ranks}, experts={self.num_experts} "
                f"({self.num_local_experts}/rank), hidden={self.hidden}, max_tokens="
                f"{self.num_max_dispatch_tokens_per_rank}, dtype={self.dtype}, "
                f"transport={self.transport!r}, device={self.device})")

    def _exchange(self, output, input, send_rows, recv_rows, counts_out=False):
        # all_to_all_device_splits on the Buffer's own tensors, without its per-call lookup
        work = self._resident.all_to_all_device_splits(output, input, send_rows, recv_rows,
                                                       False, counts_out)
        if work is not None:  # none from a synchronous call (see all_to_all_device_splits)
            work.wait()

    def _exchange_counts_with_rows(self, output, input, send_rows, recv_rows):
        self._exchange(output, input, send_rows, recv_rows, counts_out=True)

    def _counts_with_rows(self, d: MoEDispatcher) -> bool:
        """Whether CUDA dispatch sends each peer its counts ahead of its rows (one exchange;
        ``all_to_all_device_splits(counts_out=True)``) rather than in an exchange of their own
        first: where a peer's capacity (``d``'s slots per peer times its row) is at most
        :func:`counts_with_rows_max_bytes` of the group's transports.  The same on every rank
        (the group's transports and the Buffer's geometry)."""
        return self.device.type == "cuda" and \
            d.slots_per_rank * d.dispatch_row_bytes() <= self._counts_with_rows_max

    @staticmethod
    def _row_format(use_fp8: bool, use_ue8m0: bool) -> str:
        if not use_fp8:
            return _ACTIVATIONS
        return _FP8_UE8M0 if use_ue8m0 else _FP8

    def _dispatcher(self, num_topk: int, row_format: str = _ACTIVATIONS) -> MoEDispatcher:
        key = (num_topk, row_format)
        d = self._dispatchers.get(key)
        if d is None:
            M = self.num_max_dispatch_tokens_per_rank
            rows = {}
            if row_format != _ACTIVATIONS:  # dispatch moves uint8 rows, combine activations
                # received straight into DeepEP's (values, scales) where the EP kernels run;
                # W*M: the dispatcher's max_slots with its default (lossless) slots
                fp8 = Fp8Rows(self.hidden, M, self.num_local_experts, self.num_ranks * M,
                              row_format == _FP8_UE8M0, self.device)
                self._fp8_rows[key] = fp8
                rows = dict(dispatch_dtype=torch.uint8,
                            dispatch_hidden=row_bytes(self.hidden, row_format == _FP8_UE8M0),
                            unpack_into=fp8.unpack_into)
            splits = self.transport == "splits"
            d = MoEDispatcher(self.group, self.num_experts, self.hidden, M, num_topk,
                              self.dtype, self.device, check=self.check,
                              payload_exchange=self._exchange if splits else None, **rows)
            if splits and self._counts_with_rows(d):
                d.exchange_with_counts = self._exchange_counts_with_rows
            self._dispatchers[key] = d
            if num_topk not in self._unit_weights:
                self._unit_weights[num_topk] = torch.ones(M, num_topk, dtype=torch.float32,
                                                          device=self.device)
        return d

    def dispatcher(self, num_topk: int, use_fp8: bool = False,
                   use_ue8m0: bool = False) -> MoEDispatcher:
        """The MoEDispatcher serving top-``num_topk`` routings in the given dispatch format
        (made on first use)."""
        if use_fp8:
            check_fp8_options("Buffer.dispatcher", self.hidden, self.dtype, use_ue8m0,
                              use_ue8m0)
        return self._dispatcher(num_topk, self._row_format(use_fp8, use_ue8m0))

    @staticmethod
    def _finish(async_finish: bool, return_recv_hook: bool, device):
        event = None
        if async_finish and device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return EventOverlap(event), (_no_op_hook if return_recv_hook else None)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = False, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each token of ``x [T, hidden]`` to its experts ``topk_idx [T, K]`` (-1: none).

        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x [L, W *
        num_max_dispatch_tokens_per_rank, hidden]`` (local expert ``l``'s tokens in rows
        ``0 .. recv_count[l]-1``, source rank order then token order; zero rows after); with
        ``use_fp8``, the tuple ``(x float8_e4m3fn [L, W*M, hidden], scales)`` -- ``scales``
        float32 ``[L, W*M, hidden/128]`` (``use_ue8m0``: int32 ``[L, W*M, hidden/512]``, four
        UE8M0 bytes each), column-major in the last two dimensions as DeepEP's; ``round_scale``:
        power-of-two scales (:mod:`resident_pg.ep_fp8`),
        ``recv_count [L]`` int32, the handle for ``low_latency_combine``, an
        :class:`EventOverlap` and, with ``return_recv_hook``, a hook to call (a no-op: the data
        has arrived when the stream reaches the end of this call).  ``recv_x`` and
        ``recv_count`` are the buffer's own, overwritten by the next dispatch.
        """
        if not use_fp8 and (round_scale or use_ue8m0):
            raise ValueError("low_latency_dispatch: round_scale and use_ue8m0 shape the FP8 "
                             "scales; they need use_fp8=True")
        if use_fp8:
            check_fp8_options("low_latency_dispatch", self.hidden, self.dtype, round_scale,
                              use_ue8m0)
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("low_latency_dispatch: dispatch_wait_recv_cost_stats is not "
                                      "implemented (docs/ep.md)")
        if num_max_dispatch_tokens_per_rank != self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"low_latency_dispatch: num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank} but the Buffer was made for "
                             f"{self.num_max_dispatch_tokens_per_rank}")
        if num_experts != self.num_experts:
            raise ValueError(f"low_latency_dispatch: num_experts={num_experts} but the Buffer "
                             f"was made for {self.num_experts}")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ValueError("low_latency_dispatch: topk_idx must be a [num_tokens, num_topk] "
                             "tensor")
        K = topk_idx.shape[1]
        if not 1 <= K <= self.num_experts:
            raise ValueError(f"low_latency_dispatch: num_topk must be in 1..{self.num_experts}, "
                             f"got {K}")
        stats = cumulative_local_expert_recv_stats
        if stats is not None and (not isinstance(stats, torch.Tensor) or
                                  tuple(stats.shape) != (self.num_local_experts,) or
                                  stats.device != self.device or stats.dtype != torch.int32):
            raise ValueError(f"low_latency_dispatch: cumulative_local_expert_recv_stats must be an "
                             f"int32 [{self.num_local_experts}] tensor on {self.device}")
        row_format = self._row_format(use_fp8, use_ue8m0)
        d = self._dispatcher(K, row_format)
        T = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        weights = self._unit_weights[K][:T]
        if row_format == _ACTIVATIONS:
            recv_x, recv_count, h = d.dispatch(x, topk_idx, weights)
        else:
            check_token_rows("low_latency_dispatch", x, self.hidden, self.dtype, self.device,
                             "num_max_dispatch_tokens_per_rank",
                             self.num_max_dispatch_tokens_per_rank)
            fp8 = self._fp8_rows[(K, row_format)]
            if d.fuses_fp8:  # CUDA: the routing kernel casts the rows it places
                rows, recv_count, h = d.dispatch(x, topk_idx, weights,
                                                 fp8_cast=(round_scale, row_format == _FP8_UE8M0))
            else:
                rows, recv_count, h = d.dispatch(fp8.pack(x, round_scale), topk_idx, weights)
            recv_x = (fp8.x, fp8.scales) if d.unpacks_into else fp8.unpack(rows)
        if stats is not None:
            stats.add_(recv_count)
        event, hook = self._finish(async_finish, return_recv_hook, self.device)
        return recv_x, recv_count, LowLatencyHandle(h, h.num_tokens, K, row_format), event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None):
        """Return ``(combined_x [T, hidden], event, hook)``: ``combined_x[t] = sum_k
        topk_weights[t, k] * x[row of (t, k)]`` over the routed ``k``, accumulated in float32 and
        rounded once to the payload dtype (or ``out``'s).  ``x``: the experts' outputs, shaped
        like ``recv_x``.  ``topk_idx`` must be the dispatch's (only its shape is checked: the
        routing is the handle's)."""
        if use_logfmt:
            raise NotImplementedError("low_latency_combine: use_logfmt is not implemented "
                                      "(docs/ep.md)")
        if zero_copy:
            raise NotImplementedError("low_latency_combine: zero_copy is not implemented; pass "
                                      "the experts' output as x (docs/ep.md)")
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"low_latency_combine: handle must come from low_latency_dispatch, "
                             f"got {type(handle).__name__}")
        shape = (handle.num_tokens, handle.num_topk)
        if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != shape:
            raise ValueError(f"low_latency_combine: topk_idx must have the dispatch's shape "
                             f"{shape}, got "
                             f"{tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
        if not isinstance(topk_weights, torch.Tensor):
            raise ValueError("low_latency_combine: topk_weights must be a tensor")
        d = self._dispatchers[(handle.num_topk, handle.row_format)]
        y = d.combine(x, handle.dispatch, topk_weights=topk_weights, out=out)
        event, hook = self._finish(async_finish, return_recv_hook, self.device)
        return y, event, hook

