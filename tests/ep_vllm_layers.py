"""MoE layers run by the installed vLLM's FusedMoEKernel over resident_pg.ep_vllm's
prepare/finalize, in ranks on vLLM's CPU platform (test_ep_vllm_installed.py).

vLLM's FusedMoEKernelModularImpl runs post_init_setup, prepare_async, workspace allocation, the
experts and finalize_async, with batched experts written here: unquantized linear experts, and
block-FP8 experts (vLLM's fp8_w8a8 config with 128x128 blocks, fp8 weights, SiLU-and-mul; FP8
dispatch with float32 scales, and with UE8M0 scales chosen by post_init_setup for experts that
report taking them); each layer's output against numpy.  ``vllm_job`` runs these and every case
of ep_vllm_cases.py through the class derived from vLLM's own
``FusedMoEPrepareAndFinalizeModular`` and vLLM's own ``FusedMoEQuantConfig`` objects.  Importing
this module needs no vLLM; its functions do.
"""

from __future__ import annotations

import numpy as np

import dist_harness as H
from ep_reference import fp8_codes, fp8_dequantize, fp8_quantize, fp8_values, to_dtype
from ep_vllm_cases import all_cases, catch, dequantized, to_torch
from ep_vllm_scenarios import QUANT_KINDS, WS, quant_args, routing, tokens, weights

# the block-FP8 layers run by vLLM's FusedMoEKernel: activation dtype, UE8M0 scales
FP8_KERNELS = (("bfloat16", False), ("float32", True))


def vllm_quant_configs():
    """kind -> vLLM's own FusedMoEQuantConfig."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    out = {}
    for kind in QUANT_KINDS:
        qd, block, per_token, a1_scale = quant_args(kind)
        out[kind] = FusedMoEQuantConfig.make(qd, per_act_token_quant=per_token,
                                             block_shape=block, a1_scale=a1_scale)
    return out


def _linear_experts_class():
    """Batched experts for vLLM's modular kernel: local expert l computes x @ w1[l]^T @ w2[l]^T
    on its first expert_num_tokens[l] rows (float32 accumulation), leaving the weighting and
    reduction to the prepare/finalize."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
    )

    class LinearBatchedExperts(mk.FusedMoEExpertsModular):
        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.BatchedExperts

        @staticmethod
        def _supports_current_device():
            return True

        @staticmethod
        def _supports_no_act_and_mul():
            return True

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key):
            return weight_key is None and activation_key is None

        @staticmethod
        def _supports_activation(activation):
            return True

        @staticmethod
        def _supports_parallel_config(moe_parallel_config):
            return True

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceDelegate()

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                             expert_tokens_meta, activation):
            shape = (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)
            return shape, (0,), shape

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                  workspace2, expert_tokens_meta, apply_router_weight_on_input):
            counts = expert_tokens_meta.expert_num_tokens.tolist()
            output.zero_()
            for l, n in enumerate(counts):
                h = hidden_states[l, :n].float() @ w1[l].float().t()
                output[l, :n] = (h @ w2[l].float().t()).to(output.dtype)

    return LinearBatchedExperts


def _moe_kernel(pf, experts_class, quant, **experts_attrs):
    """vLLM's FusedMoEKernel over ``pf`` and ``experts_class(moe, quant, ...)``, the experts given
    ``experts_attrs`` before the kernel calls ``pf.post_init_setup(experts)``."""
    import types

    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    # the experts read only these fields of the MoE config (activation settings, parallelism)
    moe = types.SimpleNamespace(swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None,
                                activation_situ_beta=None, activation_situ_linear_beta=None,
                                moe_parallel_config=FusedMoEParallelConfig.make_no_parallel())
    experts = experts_class(moe, quant, max_num_tokens=pf.max_num_tokens_per_rank(),
                            num_dispatchers=pf.num_dispatchers())
    for name, value in experts_attrs.items():
        setattr(experts, name, value)
    return mk.FusedMoEKernel(pf, experts)


def _kernel_case(rank, cls, group, rounds):
    """vLLM's FusedMoEKernel(prepare/finalize, LinearBatchedExperts).apply on random routings,
    against y[t] = sum_k w[t,k] * x[t] @ w1[e]^T @ w2[e]^T over all experts in numpy."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from resident_pg.ep import Buffer

    L, Hd, N, M, K = 3, 16, 12, 4, 2
    E = L * WS
    rng = H.rng_for("ep_vllm/kernel/weights", 0)
    w1_all = rng.standard_normal((E, N, Hd)) / 4
    w2_all = rng.standard_normal((E, Hd, N)) / 4
    buf = Buffer(group, M, Hd, E, torch.float32, "cpu", num_topk=K)
    pf = cls(buf)
    kernel = _moe_kernel(pf, _linear_experts_class(), FUSED_MOE_UNQUANTIZED_CONFIG)
    w1 = to_torch(w1_all[rank * L:(rank + 1) * L], torch.float32)
    w2 = to_torch(w2_all[rank * L:(rank + 1) * L], torch.float32)
    errs = []
    for rnd, T in enumerate(rounds):
        key = f"ep_vllm/kernel/{rnd}"
        x = tokens(key, rank, T[rank], Hd, "float32")
        idx = routing(key, rank, T[rank], E, K)
        w = weights(key, rank, T[rank], K).astype(np.float64)
        y = kernel.apply(to_torch(x, torch.float32), w1, w2, to_torch(w, torch.float32),
                         to_torch(idx, torch.int64), MoEActivation.SILU, E, None, False)
        want = np.zeros_like(x)
        for t in range(len(x)):
            for k in range(K):
                if idx[t, k] >= 0:
                    want[t] += w[t, k] * (w2_all[idx[t, k]] @ (w1_all[idx[t, k]] @ x[t]))
        got = y.double().numpy()
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            errs.append(f"kernel round {rnd} ({buf.transport}): max |diff| "
                        f"{np.abs(got - want).max() if got.shape == want.shape else got.shape}")
    return errs


def _block_fp8_experts_class():
    """Batched block-FP8 experts for vLLM's modular kernel: they take the dispatched FP8 rows
    with their per-128-channel scales (float32, or packed UE8M0 when made with
    ``takes_ue8m0=True``, which they report to post_init_setup as vLLM's DeepGEMM experts do on
    Blackwell) and fp8 weights with 128x128 block scales (the quant config's w1_scale /
    w2_scale); local expert l computes W2 silu_mul(W1 x) on its first expert_num_tokens[l] rows
    in float32 (silu(gate) * up, gate first, as vLLM's SiluAndMul)."""
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    def blocks(w, scales):  # [L, R, C] fp8, [L, R/128, C/128] -> float32 values
        full = scales.float().repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
        return w.float() * full

    class BlockFp8BatchedExperts(_linear_experts_class()):
        takes_ue8m0 = False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key):
            return True

        def supports_packed_ue8m0_act_scales(self):
            return self.takes_ue8m0

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                  workspace2, expert_tokens_meta, apply_router_weight_on_input):
            want = torch.int32 if self.takes_ue8m0 else torch.float32
            if hidden_states.dtype != torch.float8_e4m3fn or a1q_scale is None or \
                    a1q_scale.dtype != want or activation != MoEActivation.SILU:
                raise ValueError(f"expected float8_e4m3fn rows with {want} scales and SiLU, got "
                                 f"{hidden_states.dtype} rows, scales "
                                 f"{None if a1q_scale is None else a1q_scale.dtype}, "
                                 f"{activation}")
            x = dequantized(hidden_states, a1q_scale)
            w1f = blocks(w1, self.quant_config.w1_scale)
            w2f = blocks(w2, self.quant_config.w2_scale)
            output.zero_()
            for l, n in enumerate(expert_tokens_meta.expert_num_tokens.tolist()):
                h = x[l, :n] @ w1f[l].t()
                d = h.shape[-1] // 2
                output[l, :n] = ((F.silu(h[:, :d]) * h[:, d:]) @ w2f[l].t()).to(output.dtype)

    return BlockFp8BatchedExperts


def fp8_block_weights(key, E, rows, cols):
    """Block-FP8 expert weights as vLLM keeps them: codes [E, rows, cols] (fp8 of N(0, 4)),
    float32 scales [E, rows/128, cols/128] at 2**-6 .. 2**-2, and their float32 values."""
    rng = H.rng_for(key, 0)
    codes = fp8_codes(np.clip(rng.standard_normal((E, rows, cols)) * 2, -448, 448))
    scales = (2.0 ** rng.uniform(-6, -2, (E, rows // 128, cols // 128))).astype(np.float32)
    full = np.repeat(np.repeat(scales, 128, axis=1), 128, axis=2)
    return codes, scales, fp8_values(codes).astype(np.float32) * full


def layer_tokens(key, rank, T, Hd, dt):
    """Rows whose groups of 128 channels sit at magnitudes 2**-3 .. 2**3."""
    rng = H.rng_for(key + "/layer", rank)
    mag = 2.0 ** rng.uniform(-3, 3, (T, Hd // 128))
    return to_dtype(rng.standard_normal((T, Hd)) * np.repeat(mag, 128, axis=1), dt)


def _fp8_kernel_case(rank, cls, group, dt, ue8m0, rounds):
    """A block-FP8 MoE layer through vLLM's FusedMoEKernel(prepare/finalize with FP8 dispatch,
    BlockFp8BatchedExperts): fp8 weights with 128x128 block scales in vLLM's fp8_w8a8 config,
    SiLU-and-mul, random routings; against y[t] = sum_k w[t,k] * W2_e silu_mul(W1_e xq[t]) in
    numpy (xq: the numpy FP8 quantization of x[t], dequantized; W: the dequantized weights)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    from resident_pg.ep import Buffer

    L, Hd, N, M, K = 2, 512, 128, 4, 2
    E, dtype = L * WS, H.tdtype(dt)
    w1c, w1s, w1v = fp8_block_weights("ep_vllm/fp8_kernel/w1", E, 2 * N, Hd)
    w2c, w2s, w2v = fp8_block_weights("ep_vllm/fp8_kernel/w2", E, Hd, N)
    mine = slice(rank * L, (rank + 1) * L)
    buf = Buffer(group, M, Hd, E, dtype, "cpu", num_topk=K, use_fp8=True, use_ue8m0=ue8m0)
    pf = cls(buf, use_fp8_dispatch=True)
    quant = fp8_w8a8_moe_quant_config(w1_scale=to_torch(w1s[mine], torch.float32),
                                      w2_scale=to_torch(w2s[mine], torch.float32),
                                      block_shape=[128, 128])
    kernel = _moe_kernel(pf, _block_fp8_experts_class(), quant, takes_ue8m0=ue8m0)
    errs = []
    if pf.use_ue8m0_dispatch != ue8m0:
        errs.append(f"after FusedMoEKernel: use_ue8m0_dispatch={pf.use_ue8m0_dispatch}")
    w1 = torch.from_numpy(np.ascontiguousarray(w1c[mine])).view(torch.float8_e4m3fn)
    w2 = torch.from_numpy(np.ascontiguousarray(w2c[mine])).view(torch.float8_e4m3fn)
    rounding = 2.0 ** -8 if dt == "bfloat16" else 0.0  # each expert's output, the result
    for rnd, Ts in enumerate(rounds):
        key, T = f"ep_vllm/fp8_kernel/{dt}/{rnd}", Ts[rank]
        x = layer_tokens(key, rank, T, Hd, dt)
        idx = routing(key, rank, T, E, K)
        w = weights(key, rank, T, K).astype(np.float64)
        y = kernel.apply(to_torch(x, dtype), w1, w2, to_torch(w, torch.float32),
                         to_torch(idx, torch.int64), MoEActivation.SILU, E, None, False)
        q, s = fp8_quantize(x, ue8m0)
        xq = fp8_dequantize(q, s)
        want, sums, outs = np.zeros((T, Hd)), np.zeros((T, Hd)), np.zeros((T, Hd))
        for t in range(T):
            for k in range(K):
                e = idx[t, k]
                if e < 0:
                    continue
                h = w1v[e].astype(np.float64) @ xq[t]
                g, u = h[:N], h[N:]
                act = g / (1 + np.exp(-g)) * u
                out = w2v[e] @ act
                want[t] += w[t, k] * out
                outs[t] += w[t, k] * np.abs(out)
                # float32 sums: h's error scales with |W1| |x|, silu_mul's with |u| dg + |g| du,
                # the output's with |W2| |act|
                hm = np.abs(w1v[e]) @ np.abs(xq[t])
                amag = 1.1 * np.abs(u) * hm[:N] + np.abs(g) * hm[N:] + np.abs(act)
                sums[t] += w[t, k] * (np.abs(w2v[e]) @ amag)
        got = y.double().numpy()
        label = f"fp8 kernel {dt}{' ue8m0' if ue8m0 else ''} round {rnd} ({buf.transport})"
        if got.shape != want.shape:
            errs.append(f"{label}: output shape {got.shape}, expected {want.shape}")
            continue
        tol = 2.0 ** -15 * sums + rounding * (outs + np.abs(want)) + 1e-6
        if (np.abs(got - want) > tol).any():
            i = np.unravel_index(np.argmax(np.abs(got - want) - tol), tol.shape)
            errs.append(f"{label}: output[{i}] = {got[i]!r}, reference {want[i]!r}")
    return errs


def vllm_job(rank, ws):
    import torch.distributed as dist
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.platforms import current_platform

    from resident_pg import ep_vllm

    iface = ep_vllm.vllm_interface()
    cls = ep_vllm.ResidentLLPrepareAndFinalize
    out = {"subclass": issubclass(cls, mk.FusedMoEPrepareAndFinalizeModular),
           "cpu_platform": current_platform.is_cpu()}
    with set_current_vllm_config(VllmConfig()):
        cases, errors = all_cases(rank, cls, iface, None, vllm_quant_configs())
        gloo = dist.new_group(backend="gloo")
        rounds = [[4, 3], [0, 4], [2, 2]]
        for label, group in (("resident", None), ("gloo", gloo)):
            cases[f"kernel-{label}"] = catch(_kernel_case, rank, cls, group, rounds)
            for dt, ue8m0 in FP8_KERNELS:
                cases[f"fp8-kernel-{dt}{'-ue8m0' if ue8m0 else ''}-{label}"] = catch(
                    _fp8_kernel_case, rank, cls, group, dt, ue8m0, rounds)
    out["cases"], out["errors"] = cases, errors
    return out
