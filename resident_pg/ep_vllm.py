"""vLLM's modular-kernel prepare/finalize (vLLM 0.33.0) on :class:`resident_pg.ep.Buffer`
(docs/vllm.md, section 2).

:class:`ResidentLLPrepareAndFinalize` is a ``FusedMoEPrepareAndFinalizeModular`` in the shape of
vLLM's ``DeepEPLLPrepareAndFinalize``: ``prepare`` dispatches each token to its experts with
``Buffer.low_latency_dispatch`` and hands the experts the batched layout
(``FusedMoEActivationFormat.BatchedExperts``: ``[local experts, W * max tokens, hidden]`` plus
the per-expert token counts); ``finalize`` returns the experts' unweighted outputs with
``Buffer.low_latency_combine``, which weights and reduces them (float32) into ``output``.

Importing ``resident_pg`` or this module does not import vLLM; the first access to
``ResidentLLPrepareAndFinalize`` does, and raises ImportError naming vLLM where it is absent.
The class body is made by :func:`make_prepare_finalize_class` from a :class:`VllmInterface`
(the few vLLM names it uses), so that its logic also runs against stand-ins
(tests/test_ep_vllm.py)::

    from resident_pg.ep import Buffer
    from resident_pg.ep_vllm import ResidentLLPrepareAndFinalize
    buf = Buffer(ep_group, num_max_dispatch_tokens_per_rank=moe.max_num_tokens,
                 hidden=moe.hidden_dim, num_experts=moe.num_experts, dtype=moe.in_dtype,
                 num_topk=moe.experts_per_token)
    # FP8 dispatch where vLLM's DeepEP-LL would use it (fp8 w8a8, 128x128 blocks)
    use_fp8 = (quant_config.quant_dtype == torch.float8_e4m3fn and
               quant_config.block_shape == [128, 128])
    pf = ResidentLLPrepareAndFinalize(buf, use_fp8_dispatch=use_fp8)
    kernel = mk.FusedMoEKernel(pf, BatchedTritonExperts(moe, quant_config,
                               max_num_tokens=pf.max_num_tokens_per_rank(),
                               num_dispatchers=pf.num_dispatchers()))

Dispatch formats, as vLLM's DeepEP-LL (``use_fp8_dispatch`` is its constructor flag; vLLM sets it
for ``quant_dtype=float8_e4m3fn`` with ``block_shape=[128, 128]``):

* unquantized (``use_fp8_dispatch=False``, ``quant_config.quant_dtype=None``): the experts get
  the Buffer's activation-dtype rows, ``a1q_scale=None``;
* FP8 (``use_fp8_dispatch=True``, ``quant_dtype=torch.float8_e4m3fn``, ``block_shape[1] == 128``,
  dynamic activation scales): the experts get ``Buffer.low_latency_dispatch(use_fp8=True)``'s
  ``(x_fp8 [L, W*M, hidden], scales)`` as ``a1q`` / ``a1q_scale`` -- float32 ``[L, W*M,
  hidden/128]`` scales, column-major in the last two dimensions; when the experts report
  ``supports_packed_ue8m0_act_scales()`` (``post_init_setup``, called by ``FusedMoEKernel``),
  power-of-two scales packed as UE8M0, int32 ``[L, W*M, hidden/512]``;
* FP8 dispatch to experts that take unquantized activations (``use_fp8_dispatch=True``,
  ``quant_dtype=None``): the received rows dequantized (float32 products) to the activation
  dtype, ``a1q_scale=None``.

Refused with ``NotImplementedError`` naming the config: any other activation quantization
(per-tensor or per-token FP8, other block widths, static ``a1_scale``, int8, nvfp4/mx formats,
``float8_e4m3fnuz``), which vLLM's DeepEP-LL serves by quantizing the received rows with its own
kernels; ``defer_input_quant``; dual-batch overlap (the Buffer's receive tensors are
single-buffered).  Also supported: experts that leave the weighting and reduction to the
prepare/finalize (``TopKWeightAndReduceDelegate``), the expert layout of ``Buffer`` (rank ``r``
hosts experts ``r*L .. r*L+L-1``; an ``expert_map`` that says otherwise is refused),
``apply_router_weight_on_input`` for top-1 (as vLLM's DeepEP-LL), ``global_to_physical`` expert
ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from resident_pg.ep import Buffer
from resident_pg.ep_fp8 import GROUP, UE8M0_PER_INT32, check_fp8_options, dequantize

__all__ = ["ResidentLLPrepareAndFinalize", "VllmInterface", "make_prepare_finalize_class",
           "vllm_interface", "TESTED_VLLM_VERSION"]

TESTED_VLLM_VERSION = "0.33.0"

# what prepare hands the experts
_ACTIVATIONS = "activations"        # the Buffer's activation-dtype rows, no scales
_FP8_BLOCKS = "fp8 blocks"           # (x_fp8, per-128-channel scales) as DeepEP returns them
_FP8_DEQUANTIZED = "fp8 dequantized"  # FP8 on the wire, activation-dtype rows to the experts


def _describe_quant(quant_config) -> str:
    """The activation-quantization fields of a FusedMoEQuantConfig, for error messages."""
    fields = []
    for name in ("quant_dtype", "block_shape", "per_act_token_quant"):
        fields.append(f"{name}={getattr(quant_config, name, None)!r}")
    for name in ("a1_scale", "a1_gscale"):
        v = getattr(quant_config, name, None)
        fields.append(f"{name}={'None' if v is None else 'a tensor'}")
    return ", ".join(fields)


def _dispatch_format(quant_config, use_fp8_dispatch: bool) -> str:
    """What prepare dispatches and returns for ``quant_config`` (see the module doc), or
    NotImplementedError naming the config."""
    qd = getattr(quant_config, "quant_dtype", None)
    block = getattr(quant_config, "block_shape", None)
    static = (getattr(quant_config, "a1_scale", None) is not None or
              getattr(quant_config, "a1_gscale", None) is not None)
    if qd is None and not static:
        return _FP8_DEQUANTIZED if use_fp8_dispatch else _ACTIVATIONS
    fp8_blocks = (qd == torch.float8_e4m3fn and block is not None and len(block) == 2 and
                  block[1] == GROUP and not getattr(quant_config, "per_act_token_quant", False)
                  and not static)
    if fp8_blocks and use_fp8_dispatch:
        return _FP8_BLOCKS
    if fp8_blocks:
        raise NotImplementedError(
            f"ResidentLLPrepareAndFinalize(use_fp8_dispatch=False) cannot serve experts that "
            f"take FP8 activations ({_describe_quant(quant_config)}): it does not quantize "
            f"after the dispatch; make it with use_fp8_dispatch=True (as vLLM's DeepEP-LL does "
            f"for this config) to dispatch them in FP8")
    raise NotImplementedError(
        f"ResidentLLPrepareAndFinalize serves unquantized activations and FP8 with dynamic "
        f"per-token scales per {GROUP}-channel block (quant_dtype=torch.float8_e4m3fn, "
        f"block_shape=[*, {GROUP}], no a1_scale, with use_fp8_dispatch=True); the experts ask "
        f"for {_describe_quant(quant_config)}: choose experts for one of those")


@dataclasses.dataclass(frozen=True)
class VllmInterface:
    """The vLLM names the adapter is built from."""

    base: type                      # modular_kernel.FusedMoEPrepareAndFinalizeModular
    batched_format: Any             # modular_kernel.FusedMoEActivationFormat.BatchedExperts
    expert_tokens_metadata: type    # modular_kernel.ExpertTokensMetadata
    delegate: type                  # topk_weight_and_reduce.TopKWeightAndReduceDelegate
    dbo_enabled: Callable[[], bool]  # v1.worker.ubatching.dbo_enabled


def vllm_interface() -> VllmInterface:
    """The interface from the installed vLLM; ImportError naming vLLM when it is absent."""
    try:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceDelegate,
        )
        from vllm.v1.worker.ubatching import dbo_enabled
    except ImportError as e:
        raise ImportError(
            f"resident_pg.ep_vllm.ResidentLLPrepareAndFinalize needs vLLM (its modular MoE "
            f"kernel; tested with vllm=={TESTED_VLLM_VERSION}), which could not be imported: "
            f"{e}. resident_pg.ep.Buffer itself works without vLLM.") from e
    return VllmInterface(base=mk.FusedMoEPrepareAndFinalizeModular,
                         batched_format=mk.FusedMoEActivationFormat.BatchedExperts,
                         expert_tokens_metadata=mk.ExpertTokensMetadata,
                         delegate=TopKWeightAndReduceDelegate, dbo_enabled=dbo_enabled)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def make_prepare_finalize_class(iface: VllmInterface) -> type:
    """The prepare/finalize class derived from ``iface.base`` (see the module doc)."""

    class ResidentLLPrepareAndFinalize(iface.base):
        """Prepare/finalize through ``resident_pg.ep.Buffer`` (DeepEP-low-latency shape)."""

        interface = iface

        def __init__(self, buffer: Buffer,
                     global_to_physical: Optional[torch.Tensor] = None,
                     use_fp8_dispatch: bool = False):
            super().__init__()
            if not isinstance(buffer, Buffer):
                raise TypeError(f"ResidentLLPrepareAndFinalize: buffer must be a "
                                f"resident_pg.ep.Buffer, got {type(buffer).__name__}")
            self.buffer = buffer
            self.use_fp8_dispatch = bool(use_fp8_dispatch)
            if self.use_fp8_dispatch:
                check_fp8_options("ResidentLLPrepareAndFinalize(use_fp8_dispatch=True)",
                                  buffer.hidden, buffer.dtype, False, False)
            # packed UE8M0 scales (with power-of-two rounding) when the experts take them:
            # decided in post_init_setup, as vLLM's DeepEP-LL
            self.use_ue8m0_dispatch = False
            if global_to_physical is not None:
                if (not isinstance(global_to_physical, torch.Tensor) or
                        global_to_physical.dim() != 1 or
                        global_to_physical.dtype.is_floating_point):
                    raise ValueError("ResidentLLPrepareAndFinalize: global_to_physical must be "
                                     "a 1-D integer tensor (physical id of each global expert)")
                global_to_physical = global_to_physical.to(device=buffer.device,
                                                           dtype=torch.int64)
            self.global_to_physical = global_to_physical
            self._handle = None
            self._maps_checked: set = set()

        # ------------------------------------------------------------ properties for vLLM

        @property
        def activation_format(self):
            return iface.batched_format

        def max_num_tokens_per_rank(self) -> int:
            return self.buffer.num_max_dispatch_tokens_per_rank

        def topk_indices_dtype(self) -> torch.dtype:
            return torch.int64

        def num_dispatchers(self) -> int:
            return self.buffer.num_ranks

        def output_is_reduced(self) -> bool:
            return True

        def supports_async(self) -> bool:
            return True

        def supports_dbo(self) -> bool:
            return False

        def post_init_setup(self, fused_experts) -> None:
            """Called by vLLM's FusedMoEKernel with its experts: FP8 dispatch sends packed
            UE8M0 scales to experts that take them (``supports_packed_ue8m0_act_scales()``)."""
            takes_ue8m0 = getattr(fused_experts, "supports_packed_ue8m0_act_scales", None)
            if not self.use_fp8_dispatch or takes_ue8m0 is None or not takes_ue8m0():
                self.use_ue8m0_dispatch = False
                return
            b = self.buffer
            if b.hidden % (GROUP * UE8M0_PER_INT32):
                raise ValueError(
                    f"ResidentLLPrepareAndFinalize: {type(fused_experts).__name__} takes packed "
                    f"UE8M0 activation scales, {UE8M0_PER_INT32} per int32, which needs hidden "
                    f"to be a multiple of {GROUP * UE8M0_PER_INT32}; the Buffer's hidden is "
                    f"{b.hidden}")
            self.use_ue8m0_dispatch = True

        # ------------------------------------------------------------ helpers

        def _physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
            ids = topk_ids.to(torch.int64)
            if self.global_to_physical is None:
                return ids
            # -1 (not routed) stays -1
            mapped = self.global_to_physical[ids.clamp(min=0)]
            return torch.where(ids < 0, ids, mapped)

        def _check_expert_map(self, expert_map: Optional[torch.Tensor]) -> None:
            """An expert map must place experts as the Buffer does (contiguous blocks per
            rank); checked once per map tensor, outside graph capture (it reads the map)."""
            if expert_map is None or _capturing(expert_map.device):
                return
            key = (expert_map.data_ptr(), tuple(expert_map.shape), expert_map._version)
            if key in self._maps_checked:
                return
            b = self.buffer
            L, r = b.num_local_experts, b.rank
            want = torch.full((b.num_experts,), -1, dtype=torch.int64)
            want[r * L:(r + 1) * L] = torch.arange(L)
            got = expert_map.detach().to("cpu", torch.int64)
            if tuple(got.shape) != (b.num_experts,) or not torch.equal(got, want):
                raise ValueError(
                    f"ResidentLLPrepareAndFinalize: expert_map places experts differently from "
                    f"resident_pg.ep.Buffer (rank {r} of {b.num_ranks} hosts experts "
                    f"{r * L}..{(r + 1) * L - 1} as local 0..{L - 1}); use vLLM's linear "
                    f"expert placement")
            self._maps_checked.add(key)

        # ------------------------------------------------------------ prepare

        def prepare_async(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                          apply_router_weight_on_input, quant_config,
                          defer_input_quant: bool = False):
            if defer_input_quant:
                raise NotImplementedError(
                    "ResidentLLPrepareAndFinalize does not support defer_input_quant=True: "
                    "select MoE experts that take the dispatched activations as they are")
            if iface.dbo_enabled():
                raise NotImplementedError(
                    "ResidentLLPrepareAndFinalize does not run under dual-batch overlap (DBO): "
                    "the Buffer's receive tensors are single-buffered")
            fmt = _dispatch_format(quant_config, self.use_fp8_dispatch)
            if not isinstance(a1, torch.Tensor) or a1.dim() != 2:
                raise ValueError("ResidentLLPrepareAndFinalize.prepare: a1 must be a "
                                 "[num_tokens, hidden] tensor")
            if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or
                    topk_ids.shape[0] != a1.shape[0] or
                    tuple(topk_weights.shape) != tuple(topk_ids.shape)):
                raise ValueError("ResidentLLPrepareAndFinalize.prepare: topk_ids and "
                                 "topk_weights must both be [num_tokens, topk] with a1's "
                                 "num_tokens")
            if apply_router_weight_on_input:
                if topk_ids.shape[1] != 1:
                    raise ValueError(
                        f"ResidentLLPrepareAndFinalize: apply_router_weight_on_input needs "
                        f"top-1 routing (each token is sent once and scaled once), got "
                        f"topk={topk_ids.shape[1]}")
                a1 = a1 * topk_weights.to(a1.dtype)
            self._check_expert_map(expert_map)
            b = self.buffer
            fp8 = fmt != _ACTIVATIONS
            ue8m0 = fp8 and self.use_ue8m0_dispatch
            recv_x, recv_count, handle, _, hook = b.low_latency_dispatch(
                a1, self._physical_ids(topk_ids), b.num_max_dispatch_tokens_per_rank,
                num_experts, use_fp8=fp8, round_scale=ue8m0, use_ue8m0=ue8m0,
                return_recv_hook=True)
            self._handle = handle
            meta = iface.expert_tokens_metadata(expert_num_tokens=recv_count,
                                                expert_num_tokens_cpu=None)
            a1_dtype = a1.dtype

            def receiver():
                if fmt == _ACTIVATIONS:
                    return recv_x, None, meta, None, None
                x_fp8, scales = recv_x
                if fmt == _FP8_BLOCKS:
                    return x_fp8, scales, meta, None, None
                return dequantize(x_fp8, scales).to(a1_dtype), None, meta, None, None

            return hook, receiver

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config, defer_input_quant: bool = False):
            hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts,
                                                expert_map, apply_router_weight_on_input,
                                                quant_config, defer_input_quant)
            hook()
            return receiver()

        # ------------------------------------------------------------ finalize

        def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                           apply_router_weight_on_input, weight_and_reduce_impl):
            if not isinstance(weight_and_reduce_impl, iface.delegate):
                raise ValueError(
                    f"ResidentLLPrepareAndFinalize weights and reduces in the combine: the "
                    f"experts must leave it to the prepare/finalize (TopKWeightAndReduceDelegate"
                    f"), got {type(weight_and_reduce_impl).__name__}")
            handle, self._handle = self._handle, None
            if handle is None:
                raise RuntimeError("ResidentLLPrepareAndFinalize.finalize without a prepare "
                                   "before it")
            weights = (torch.ones_like(topk_weights) if apply_router_weight_on_input
                       else topk_weights)
            _, _, hook = self.buffer.low_latency_combine(
                fused_expert_output, topk_ids, weights, handle, return_recv_hook=True,
                out=output)
            return hook, (lambda: None)

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                     apply_router_weight_on_input, weight_and_reduce_impl):
            hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights,
                                                 topk_ids, apply_router_weight_on_input,
                                                 weight_and_reduce_impl)
            hook()
            receiver()

        def __repr__(self) -> str:
            fmt = ", fp8" + (" ue8m0" if self.use_ue8m0_dispatch else "") \
                if self.use_fp8_dispatch else ""
            return f"ResidentLLPrepareAndFinalize({self.buffer!r}{fmt})"

    return ResidentLLPrepareAndFinalize


def __getattr__(name: str):
    # the vLLM-derived class is made on first access, so that importing this module (and
    # resident_pg) never imports vLLM
    if name == "ResidentLLPrepareAndFinalize":
        cls = make_prepare_finalize_class(vllm_interface())
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
