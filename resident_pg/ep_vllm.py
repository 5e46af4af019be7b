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
    pf = ResidentLLPrepareAndFinalize(buf)
    kernel = mk.FusedMoEKernel(pf, BatchedTritonExperts(moe, quant_config,
                               max_num_tokens=pf.max_num_tokens_per_rank(),
                               num_dispatchers=pf.num_dispatchers()))

Supported: unquantized activations (the Buffer's payload dtype), experts that leave the weighting
and reduction to the prepare/finalize (``TopKWeightAndReduceDelegate``), the expert layout of
``Buffer`` (rank ``r`` hosts experts ``r*L .. r*L+L-1``; an ``expert_map`` that says otherwise is
refused), ``apply_router_weight_on_input`` for top-1 (as vLLM's DeepEP-LL), ``global_to_physical``
expert ids.  Refused with a clear error: quantized activations (``quant_config.quant_dtype``),
``defer_input_quant``, dual-batch overlap (the Buffer's receive tensors are single-buffered).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from resident_pg.ep import Buffer

__all__ = ["ResidentLLPrepareAndFinalize", "VllmInterface", "make_prepare_finalize_class",
           "vllm_interface", "TESTED_VLLM_VERSION"]

TESTED_VLLM_VERSION = "0.33.0"


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
                     global_to_physical: Optional[torch.Tensor] = None):
            super().__init__()
            if not isinstance(buffer, Buffer):
                raise TypeError(f"ResidentLLPrepareAndFinalize: buffer must be a "
                                f"resident_pg.ep.Buffer, got {type(buffer).__name__}")
            self.buffer = buffer
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

        @staticmethod
        def _check_quant(quant_config) -> None:
            qd = getattr(quant_config, "quant_dtype", None)
            if qd is not None:
                raise NotImplementedError(
                    f"ResidentLLPrepareAndFinalize dispatches unquantized activations only; "
                    f"the experts ask for quant_dtype={qd!r}: choose experts that take "
                    f"unquantized activations")
            if getattr(quant_config, "a1_scale", None) is not None:
                raise NotImplementedError("ResidentLLPrepareAndFinalize: activation scales "
                                          "(quant_config.a1_scale) are not supported")

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
            self._check_quant(quant_config)
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
            recv_x, recv_count, handle, _, hook = b.low_latency_dispatch(
                a1, self._physical_ids(topk_ids), b.num_max_dispatch_tokens_per_rank,
                num_experts, return_recv_hook=True)
            self._handle = handle
            meta = iface.expert_tokens_metadata(expert_num_tokens=recv_count,
                                                expert_num_tokens_cpu=None)
            return hook, (lambda: (recv_x, None, meta, None, None))

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
            return f"ResidentLLPrepareAndFinalize({self.buffer!r})"

    return ResidentLLPrepareAndFinalize


def __getattr__(name: str):
    # the vLLM-derived class is made on first access, so that importing this module (and
    # resident_pg) never imports vLLM
    if name == "ResidentLLPrepareAndFinalize":
        cls = make_prepare_finalize_class(vllm_interface())
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
