"""Stand-ins of the vLLM names that resident_pg.ep_vllm builds on, for the tests without vLLM.

A VllmInterface whose abstract base declares vLLM 0.33's abstract methods (a class that misses
one cannot be instantiated), with ``ExpertTokensMetadata``, the batched activation format,
``TopKWeightAndReduceDelegate`` and a dual-batch switch; objects with the fields of vLLM's
``FusedMoEQuantConfig`` that the adapter reads; and experts that answer post_init_setup's
question about packed UE8M0 scales.
"""

from __future__ import annotations

from ep_vllm_scenarios import QUANT_KINDS, quant_args


def standin_interface():
    """A VllmInterface over stand-ins: the abstract base declares vLLM 0.33's abstract methods,
    so a class that misses one cannot be instantiated."""
    import abc
    import dataclasses
    import enum

    from resident_pg.ep_vllm import VllmInterface

    class Format(enum.Enum):
        Standard = "standard"
        BatchedExperts = "batched_experts"

    @dataclasses.dataclass
    class ExpertTokensMetadata:
        expert_num_tokens: object
        expert_num_tokens_cpu: object
        psum_recv_per_rank: object = None

    class Base(abc.ABC):
        @property
        @abc.abstractmethod
        def activation_format(self): ...

        @abc.abstractmethod
        def topk_indices_dtype(self): ...

        @abc.abstractmethod
        def max_num_tokens_per_rank(self): ...

        @abc.abstractmethod
        def num_dispatchers(self): ...

        @abc.abstractmethod
        def output_is_reduced(self): ...

        @abc.abstractmethod
        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config, defer_input_quant): ...

        @abc.abstractmethod
        def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                     apply_router_weight_on_input, weight_and_reduce_impl): ...

    class Delegate:
        pass

    dbo = {"on": False}
    iface = VllmInterface(base=Base, batched_format=Format.BatchedExperts,
                          expert_tokens_metadata=ExpertTokensMetadata, delegate=Delegate,
                          dbo_enabled=lambda: dbo["on"])
    return iface, dbo


def standin_quant_configs():
    """kind -> a stand-in with the fields of vLLM's FusedMoEQuantConfig the adapter reads."""
    import types

    out = {}
    for kind in QUANT_KINDS:
        qd, block, per_token, a1_scale = quant_args(kind)
        out[kind] = types.SimpleNamespace(quant_dtype=qd, block_shape=block,
                                          per_act_token_quant=per_token, a1_scale=a1_scale,
                                          a1_gscale=None)
    return out


class ExpertsTakingUe8m0:
    """What post_init_setup asks of the experts: packed UE8M0 activation scales or not."""

    def __init__(self, takes):
        self.takes = takes

    def supports_packed_ue8m0_act_scales(self):
        return self.takes
