"""resident_pg.ep_vllm: the vLLM prepare/finalize over resident_pg.ep.Buffer, checked against an
independent numpy reference in 2 ranks on CPU tensors, and on CUDA tensors on the GPU machine.

Every rank regenerates every rank's tokens, routings and weights from seeds and computes in
numpy (no code of resident_pg) what ``prepare`` must hand the experts -- the batched
``[local experts, W * max tokens, hidden]`` rows (source rank order, then token order) and the
per-expert counts -- bitwise, and what ``finalize`` must write into ``output`` -- the weighted sum
of the experts' outputs -- within the payload dtype's rounding.  Routings are random (no expert
twice in a row, ``-1`` entries, rows of only ``-1``, a rank without tokens, an expert nobody
picks); scenarios cover bf16 and float32, top-1 with ``apply_router_weight_on_input`` (the
weights applied to the tokens before the dispatch, as vLLM's DeepEP-LL adapter does) and
``global_to_physical`` expert ids, and FP8 dispatch (``use_fp8_dispatch``): for block-FP8
experts (``quant_dtype=float8_e4m3fn``, ``block_shape=[128, 128]``) the fp8 bytes and the
per-128-channel scales (float32, and packed UE8M0 once ``post_init_setup`` sees experts that take
them), with their column-major layout, compare bitwise with a numpy quantization of the routed
rows (tests/ep_reference.py); for unquantized experts the dequantized rows compare bitwise.
Each scenario runs over the resident group (the device-splits exchange) and a gloo group (the
padded all_to_all_single), through ``prepare``/``finalize`` and ``prepare_async``/
``finalize_async`` in alternate rounds.  The refused quantization configs (per-tensor and
per-token FP8, other block widths, static scales, e4m3fnuz, int8, nvfp4, block FP8 without
``use_fp8_dispatch``) raise NotImplementedError naming the config, before communicating.

* Without vLLM (CI): the class is made from stand-ins of vLLM's names (an abstract base with
  vLLM's abstract methods, ``ExpertTokensMetadata``, ``TopKWeightAndReduceDelegate``).
* On the GPU machine (``gpu`` marker; skipped without CUDA): the same stand-in scenarios on CUDA
  tensors, 2 ranks on cuda:0, the resident group's exchange being the CUDA device-splits kernel
  (``python -m pytest -q tests/test_ep_vllm.py -m gpu``).
* With vLLM 0.33.0 installed (skipped otherwise; docs/vllm.md): the same cases through the class
  derived from vLLM's own ``FusedMoEPrepareAndFinalizeModular`` and vLLM's own
  ``FusedMoEQuantConfig`` objects, and layers run by vLLM's ``FusedMoEKernel`` (its
  ``FusedMoEKernelModularImpl``: post_init_setup, prepare_async, workspace allocation, experts,
  finalize_async) on vLLM's CPU platform, with batched experts written here: unquantized linear
  experts, and block-FP8 layers (vLLM's fp8_w8a8 config with 128x128 blocks, fp8 weights, SiLU-
  and-mul; FP8 dispatch with float32 scales, and with UE8M0 scales chosen by post_init_setup for
  experts that report taking them).  vLLM's own batched experts do not run on CPU here:
  BatchedTritonExperts and BatchedDeepGemmExperts need a GPU, and NaiveBatchedExperts calls
  ``torch.ops._C.silu_and_mul`` (not registered for CPU tensors by vLLM's CUDA wheel) and asks
  ``torch.accelerator.current_stream()`` whether it is capturing, which initializes CUDA with
  torch's CUDA build and fails without a driver.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import cuda_harness as C
import dist_harness as H
from ep_reference import (combine_reference, dispatch_reference, fp8_codes, fp8_dequantize,
                          fp8_quantize, fp8_tokens, fp8_values, to_dtype, ue8m0_packed)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see docs/vllm.md: "
                                "a separate environment with vllm==0.33.0)")
WS = 2
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1"}

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
# the block-FP8 layers run by vLLM's FusedMoEKernel: activation dtype, UE8M0 scales
FP8_KERNELS = (("bfloat16", False), ("float32", True))

# ---------------------------------------------------------------- data and reference


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


# ---------------------------------------------------------------- stand-ins of vLLM's names


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


def _quant_args(kind):
    import torch

    qd, block, per_token, static = QUANT_KINDS[kind]
    if qd is not None and hasattr(torch, qd):
        qd = getattr(torch, qd)
    return qd, block, per_token, (torch.ones(1) if static else None)


def standin_quant_configs():
    """kind -> a stand-in with the fields of vLLM's FusedMoEQuantConfig the adapter reads."""
    import types

    out = {}
    for kind in QUANT_KINDS:
        qd, block, per_token, a1_scale = _quant_args(kind)
        out[kind] = types.SimpleNamespace(quant_dtype=qd, block_shape=block,
                                          per_act_token_quant=per_token, a1_scale=a1_scale,
                                          a1_gscale=None)
    return out


def vllm_quant_configs():
    """kind -> vLLM's own FusedMoEQuantConfig."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig

    out = {}
    for kind in QUANT_KINDS:
        qd, block, per_token, a1_scale = _quant_args(kind)
        out[kind] = FusedMoEQuantConfig.make(qd, per_act_token_quant=per_token,
                                             block_shape=block, a1_scale=a1_scale)
    return out


# the error cases of _error_cases without the stand-in's dual-batch switch: 12, and each refused
# kind through an FP8 and an unquantized dispatch
N_ERROR_CASES = 12 + 2 * len(REFUSED_KINDS)


class _ExpertsTakingUe8m0:
    """What post_init_setup asks of the experts: packed UE8M0 activation scales or not."""

    def __init__(self, takes):
        self.takes = takes

    def supports_packed_ue8m0_act_scales(self):
        return self.takes


# ---------------------------------------------------------------- inside a rank


def _t(a, dtype, device="cpu"):
    import torch

    return torch.as_tensor(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def _experts(bx, rank, L):
    """Stand-in experts on the batched layout: local expert l scales its rows by
    expert_scale(its physical id)."""
    import torch

    s = torch.tensor([expert_scale(rank * L + l) for l in range(L)], dtype=torch.float32,
                     device=bx.device)
    return (bx.float() * s.view(L, 1, 1)).to(bx.dtype)


def _dequantized(x_fp8, scales):
    """The test's float32 values of FP8 rows: each code's value times its group's scale
    (float32 scales, or UE8M0 bytes packed four per int32, group 4j+b in byte b: 2**(byte-127))."""
    import torch

    if scales.dtype == torch.int32:
        exps = torch.stack([(scales >> (8 * b)) & 0xFF for b in range(4)], dim=-1).flatten(-2)
        scales = (exps << 23).view(torch.float32)
    return x_fp8.float() * scales.repeat_interleave(128, dim=-1)


def _experts_fp8(x_fp8, scales, rank, L, dtype):
    """Stand-in block-FP8 experts: dequantize (float32), scale by expert_scale, round to the
    activation dtype."""
    import torch

    s = torch.tensor([expert_scale(rank * L + l) for l in range(L)], dtype=torch.float32,
                     device=x_fp8.device)
    return (_dequantized(x_fp8, scales) * s.view(L, 1, 1)).to(dtype)


def _check_fp8_rows(label, fmt, a1q, a1q_scale, ref, shape):
    """(x_fp8, scales) against the reference: dtypes, shapes, the scales' column-major layout,
    the bytes and the scales bitwise."""
    import torch

    L, S, Hd = shape
    G = Hd // 128
    errs = []
    if a1q.dtype != torch.float8_e4m3fn or tuple(a1q.shape) != shape:
        return [f"{label}: a1q is {a1q.dtype}{tuple(a1q.shape)}, expected float8_e4m3fn{shape}"]
    want = (torch.int32, (L, S, G // 4)) if fmt == "ue8m0" else (torch.float32, (L, S, G))
    if not isinstance(a1q_scale, torch.Tensor) or \
            (a1q_scale.dtype, tuple(a1q_scale.shape)) != want:
        got = None if a1q_scale is None else (a1q_scale.dtype, tuple(a1q_scale.shape))
        return [f"{label}: a1q_scale is {got}, expected {want}"]
    if a1q_scale.stride() != (want[1][2] * S, 1, S):
        errs.append(f"{label}: a1q_scale strides {a1q_scale.stride()}: not column-major in the "
                    "last two dimensions")
    got_codes = a1q.view(torch.uint8).cpu().numpy()
    if not np.array_equal(got_codes, ref["codes"]):
        errs.append(f"{label}: fp8 bytes differ from the reference first at [expert, row, col] "
                    f"{np.argwhere(got_codes != ref['codes'])[0].tolist()}")
    got_sc = a1q_scale.cpu().numpy().view(np.uint32)
    want_sc = ue8m0_packed(ref["scales"]) if fmt == "ue8m0" else ref["scales"].view(np.uint32)
    if not np.array_equal(got_sc, want_sc):
        errs.append(f"{label}: scales differ from the reference first at [expert, row, group] "
                    f"{np.argwhere(got_sc != want_sc)[0].tolist()}")
    return errs


def _adapter_case(rank, cls, iface, quants, name, group, device):
    """All rounds of a scenario through ``cls`` on ``device``'s tensors; returns problems."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, Hd, M, K, rounds, on_input, g2p, fmt = SCENARIOS[name]
    E, dtype = L * WS, H.tdtype(dt)
    buf = Buffer(group, M, Hd, E, dtype, device, num_topk=K)
    perm = physical_of(E)
    pf = cls(buf, global_to_physical=_t(perm, torch.int64, device) if g2p else None,
             use_fp8_dispatch=fmt in FP8_FORMATS)
    pf.post_init_setup(_ExpertsTakingUe8m0(fmt == "ue8m0"))
    quant = quants["fp8_block128" if fmt in ("fp8", "ue8m0") else "none"]
    errs = []
    # the resident group moves the rows with the device-splits exchange, gloo the padded buffers
    if buf.transport != ("splits" if group is None else "padded"):
        errs.append(f"{name}: Buffer transport {buf.transport!r} on {buf.device}")
    facts = (pf.activation_format, pf.max_num_tokens_per_rank(), pf.num_dispatchers(),
             pf.topk_indices_dtype(), pf.output_is_reduced(), pf.supports_async(),
             pf.use_ue8m0_dispatch)
    if facts != (iface.batched_format, M, WS, torch.int64, True, True, fmt == "ue8m0"):
        errs.append(f"{name}: properties {facts}")
    for rnd, Ts in enumerate(rounds):
        key, T = f"ep_vllm/{name}/{rnd}", Ts[rank]
        x = _t(tokens(key, rank, T, Hd, dt, fmt), dtype, device)
        x_before = x.clone()
        idx = _t(routing(key, rank, T, E, K), torch.int64, device)
        w = _t(weights(key, rank, T, K), torch.float32, device)
        use_async = rnd % 2 == 1
        args = (x, w, idx, E, None, on_input, quant)
        if use_async:
            hook, receiver = pf.prepare_async(*args)
            hook()
            bx, scales, meta, ids, tw = receiver()
        else:
            bx, scales, meta, ids, tw = pf.prepare(*args, defer_input_quant=False)
        label = f"{name} round {rnd} ({'async' if use_async else 'sync'}, {buf.transport})"
        ref = reference(name, rank, rnd, key)
        counts = meta.expert_num_tokens
        if (ids, tw, meta.expert_num_tokens_cpu) != (None, None, None):
            errs.append(f"{label}: prepare returned ids/weights {ids, tw}")
        if counts.dtype != torch.int32 or counts.tolist() != ref["count"].tolist():
            errs.append(f"{label}: counts {counts.tolist()} ({counts.dtype}) != "
                        f"{ref['count'].tolist()}")
        if fmt in ("fp8", "ue8m0"):
            errs += _check_fp8_rows(label, fmt, bx, scales, ref, (L, WS * M, Hd))
            fused = _experts_fp8(bx, scales, rank, L, dtype)
        else:
            if scales is not None:
                errs.append(f"{label}: prepare returned scales {scales}")
            got_x = bx.double().cpu().numpy()
            if bx.dtype != dtype or got_x.shape != ref["x"].shape or \
                    not np.array_equal(got_x, ref["x"]):
                errs.append(f"{label}: batched x {bx.dtype}{got_x.shape} differs from the "
                            "reference")
            fused = _experts(bx, rank, L)
        if not torch.equal(x, x_before):
            errs.append(f"{label}: prepare modified a1")
        out = torch.full((T, Hd), -5.0, dtype=dtype, device=device)
        fargs = (out, fused, w, idx, on_input, iface.delegate())
        if use_async:
            hook, receiver = pf.finalize_async(*fargs)
            hook()
            receiver()
        else:
            pf.finalize(*fargs)
        got_y, ref_y, tol = out.double().cpu().numpy(), ref["y"], ref["tol"]
        if (np.abs(got_y - ref_y) > tol).any():
            i = np.unravel_index(np.argmax(np.abs(got_y - ref_y) - tol), tol.shape)
            errs.append(f"{label}: output[{i}] = {got_y[i]!r}, reference {ref_y[i]!r}")
    return errs


def _error_cases(rank, cls, iface, dbo, quants):
    import torch

    from resident_pg.ep import Buffer

    res = {}

    def expect(label, fn, fragment, exc):
        H.expect_error(res, label, fn, fragment, exc)

    L, E = 2, 2 * WS
    none = quants["none"]
    buf = Buffer(None, 4, 8, E, torch.float32, "cpu", num_topk=2)
    pf = cls(buf)
    x, w = torch.ones(3, 8), torch.full((3, 2), 0.5)
    idx = torch.tensor([[0, E - 1], [1, -1], [2, 3]])
    args = (x, w, idx, E, None, False)
    expect("buffer", lambda: cls(object()), "resident_pg.ep.Buffer", TypeError)
    expect("g2p", lambda: cls(buf, global_to_physical=torch.zeros(E)), "global_to_physical",
           ValueError)
    expect("defer", lambda: pf.prepare(*args, none, True), "defer_input_quant",
           NotImplementedError)
    expect("on_input_topk2", lambda: pf.prepare(x, w, idx, E, None, True, none, False),
           "top-1", ValueError)
    expect("finalize_first", lambda: pf.finalize(torch.empty(3, 8), torch.empty(L, 4 * WS, 8),
                                                 w, idx, False, iface.delegate()),
           "without a prepare", RuntimeError)
    wrong_map = torch.arange(E, dtype=torch.int32)  # every expert local: not Buffer's layout
    expect("expert_map", lambda: pf.prepare(x, w, idx, E, wrong_map, False, none, False),
           "expert_map", ValueError)
    if dbo is not None:  # the stand-in's switch; vLLM's own needs its ubatch threads
        dbo["on"] = True
        expect("dbo", lambda: pf.prepare(*args, none, False), "dual-batch",
               NotImplementedError)
        dbo["on"] = False
    # FP8 dispatch: the Buffer's rows must be quantizable, UE8M0 packs four groups per int32,
    # and only block-FP8 with 128-channel blocks and dynamic scales (or unquantized experts)
    # is served
    expect("fp8_hidden", lambda: cls(buf, use_fp8_dispatch=True), "multiple of 128",
           ValueError)
    buf8 = Buffer(None, 4, 256, E, torch.bfloat16, "cpu", num_topk=2)
    pf8 = cls(buf8, use_fp8_dispatch=True)
    expect("ue8m0_hidden", lambda: pf8.post_init_setup(_ExpertsTakingUe8m0(True)),
           "multiple of 512", ValueError)
    x8 = torch.ones(3, 256, dtype=torch.bfloat16)
    for kind, fragment in REFUSED_KINDS.items():
        expect(f"fp8_dispatch_{kind}", lambda q=quants[kind]: pf8.prepare(
            x8, w, idx, E, None, False, q, False), fragment, NotImplementedError)
        expect(f"unquantized_dispatch_{kind}", lambda q=quants[kind]: pf.prepare(
            *args, q, False), fragment, NotImplementedError)
    expect("fp8_block128_without_fp8_dispatch", lambda: pf.prepare(
        *args, quants["fp8_block128"], False), "use_fp8_dispatch=True", NotImplementedError)
    # valid round trips afterwards (nothing above communicated), with a matching expert map
    right_map = torch.full((E,), -1, dtype=torch.int32)
    right_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    bx, _, meta, _, _ = pf.prepare(x, w, idx, E, right_map, False, none, False)
    expect("reduce_impl", lambda: pf.finalize(torch.empty(3, 8), bx.clone(), w, idx, False,
                                              object()), "TopKWeightAndReduceDelegate",
           ValueError)
    out = torch.zeros(3, 8)
    pf.finalize(out, bx.clone(), w, idx, False, iface.delegate())
    # every token's routed experts return it unchanged: output = sum of its routed weights
    want = torch.tensor([1.0, 0.5, 1.0]).view(3, 1).expand(3, 8)
    res["valid_after_errors"] = "ok" if torch.equal(out, want) else f"output {out[:, 0]}"
    # the same through FP8 dispatch: ones quantize exactly (scale 1/448, code 448)
    x8q, s8, _, _, _ = pf8.prepare(x8, w, idx, E, right_map, False, quants["fp8_block128"],
                                   False)
    out8 = torch.zeros(3, 256, dtype=torch.bfloat16)
    pf8.finalize(out8, _dequantized(x8q, s8).to(torch.bfloat16), w, idx, False,
                 iface.delegate())
    want8 = want[:, :1].expand(3, 256).to(torch.bfloat16)
    res["valid_fp8_after_errors"] = "ok" if torch.equal(out8, want8) else f"output {out8[:, 0]}"
    return res


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        return [f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"]


def _scenario_cases(rank, cls, iface, quants, device):
    """Every scenario over the resident group and a gloo group, on ``device``'s tensors."""
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    res = {}
    for name in SCENARIOS:
        for label, group in (("resident", None), ("gloo", gloo)):
            res[f"{name}-{label}"] = _catch(_adapter_case, rank, cls, iface, quants, name,
                                            group, device)
    return res


def _all_cases(rank, cls, iface, dbo, quants):
    return (_scenario_cases(rank, cls, iface, quants, "cpu"),
            _error_cases(rank, cls, iface, dbo, quants))


def standin_job(rank, ws):
    from resident_pg.ep_vllm import make_prepare_finalize_class

    iface, dbo = standin_interface()
    cls = make_prepare_finalize_class(iface)
    cases, errors = _all_cases(rank, cls, iface, dbo, standin_quant_configs())
    return {"cases": cases, "errors": errors}


def standin_cuda_job(rank, ws):
    """The scenarios of standin_job on CUDA tensors (cuda_harness.DEVICE: the CPU in the dry
    run), every rank on cuda:0 of the GPU machine (under MPS)."""
    from resident_pg.ep_vllm import make_prepare_finalize_class

    C.setup_rank(rank, ws, timeout_s=60)
    iface, _ = standin_interface()
    cls = make_prepare_finalize_class(iface)
    return {"cases": _scenario_cases(rank, cls, iface, standin_quant_configs(), C.DEVICE)}


# ---------------------------------------------------------------- with the installed vLLM


def _linear_experts_class():
    """Batched experts for vLLM's modular kernel: local expert l computes x @ w1[l]^T @ w2[l]^T
    on its first expert_num_tokens[l] rows (float32 accumulation), leaving the weighting and
    reduction to the prepare/finalize."""
    import torch
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
    w1 = _t(w1_all[rank * L:(rank + 1) * L], torch.float32)
    w2 = _t(w2_all[rank * L:(rank + 1) * L], torch.float32)
    errs = []
    for rnd, T in enumerate(rounds):
        key = f"ep_vllm/kernel/{rnd}"
        x = tokens(key, rank, T[rank], Hd, "float32")
        idx = routing(key, rank, T[rank], E, K)
        w = weights(key, rank, T[rank], K).astype(np.float64)
        y = kernel.apply(_t(x, torch.float32), w1, w2, _t(w, torch.float32),
                         _t(idx, torch.int64), MoEActivation.SILU, E, None, False)
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
            x = _dequantized(hidden_states, a1q_scale)
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
    quant = fp8_w8a8_moe_quant_config(w1_scale=_t(w1s[mine], torch.float32),
                                      w2_scale=_t(w2s[mine], torch.float32),
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
        y = kernel.apply(_t(x, dtype), w1, w2, _t(w, torch.float32), _t(idx, torch.int64),
                         MoEActivation.SILU, E, None, False)
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
        cases, errors = _all_cases(rank, cls, iface, None, vllm_quant_configs())
        gloo = dist.new_group(backend="gloo")
        rounds = [[4, 3], [0, 4], [2, 2]]
        for label, group in (("resident", None), ("gloo", gloo)):
            cases[f"kernel-{label}"] = _catch(_kernel_case, rank, cls, group, rounds)
            for dt, ue8m0 in FP8_KERNELS:
                cases[f"fp8-kernel-{dt}{'-ue8m0' if ue8m0 else ''}-{label}"] = _catch(
                    _fp8_kernel_case, rank, cls, group, dt, ue8m0, rounds)
    out["cases"], out["errors"] = cases, errors
    return out


# ---------------------------------------------------------------- parent side


def _problems(per_rank):
    return [f"rank {r}: {cid}: {p}" for r, v in enumerate(per_rank)
            for cid, ps in v["cases"].items() for p in ps]


def _error_problems(per_rank, n):
    bad = [f"rank {r} {label}: {v}" for r, v in enumerate(per_rank)
           for label, v in v["errors"].items() if v != "ok"]
    if len(per_rank[0]["errors"]) != n:
        bad.append(f"{len(per_rank[0]['errors'])} error cases, expected {n}")
    return bad


@pytest.mark.resident_only
def test_ep_vllm_adapter_standins():
    per_rank = H.run_ranks(standin_job, WS, timeout_s=240, init_timeout_s=60)
    assert len(per_rank[0]["cases"]) == 2 * len(SCENARIOS)
    problems = _problems(per_rank) + _error_problems(per_rank, N_ERROR_CASES + 1)
    assert not problems, "\n".join(problems[:20])


def cuda_marks(fn):
    """The marks of a CUDA test (cuda_harness.module_marks): gpu (except in the dry run,
    RESIDENT_GPU_TESTS_DEVICE=cpu) and resident_only."""
    for mark in C.module_marks():
        fn = mark(fn)
    return fn


@cuda_marks
@pytest.mark.parametrize("path", ("direct", "proxy", "proxy+tcp"))
def test_ep_vllm_adapter_standins_cuda(path):
    """The scenarios of test_ep_vllm_adapter_standins on CUDA tensors, 2 ranks on cuda:0, on each
    path of the CUDA exchange (direct stores, the proxy over shm, the proxy over tcp): the
    resident group's dispatch and combine run the CUDA device-splits exchange (counts read by
    the kernel), the gloo group's the padded all_to_all_single, which gloo stages through pinned
    host memory for CUDA tensors (ProcessGroupGloo::alltoall_base).  The refused options and
    quantization configs are checked by the CPU test only: they are refused before any exchange,
    whatever the device."""
    if WS not in C.WORLD_SIZES:
        pytest.skip(f"RESIDENT_GPU_TESTS_WS={','.join(map(str, C.WORLD_SIZES))} leaves out "
                    f"{WS} ranks")
    per_rank = H.run_ranks(standin_cuda_job, WS, env=C.path_env(path), init=False,
                           timeout_s=240 * C.TIME_SCALE, init_timeout_s=60)
    assert len(per_rank[0]["cases"]) == 2 * len(SCENARIOS)
    problems = _problems(per_rank)
    assert not problems, "\n".join(problems[:20])


def test_ep_vllm_reference_sees_the_edges():
    """The scenarios reach their edges: an idle expert, -1 entries and all--1 rows, a rank
    without tokens, top-1 with weights on the input, a non-identity physical id map, FP8 scales
    from the amax floor up."""
    counts = [reference("random_bf16", r, 0, "ep_vllm/random_bf16/0")["count"]
              for r in range(WS)]
    assert min(c.min() for c in counts) == 0 and max(c.max() for c in counts) > 1
    assert SCENARIOS["random_bf16"][5][1][0] == 0
    idx = routing("k", 0, 5, 6, 3)
    assert (idx[0] == -1).all() and (idx >= 0).any()
    assert (physical_of(4) != np.arange(4)).any()
    assert SCENARIOS["top1_weight_on_input_bf16"][4] == 1
    # FP8 dispatch: routed groups at the amax floor (the smallest scale) and far above it;
    # UE8M0's scales are powers of two
    floor = np.float32(1e-4) * np.float32(1 / 448)
    for name, (_, _, _, _, _, rounds, _, _, fmt) in SCENARIOS.items():
        if fmt not in FP8_FORMATS:
            continue
        live = np.concatenate([ref["scales"][l, :n].ravel()
                               for r in range(WS) for rnd in range(len(rounds))
                               for ref in [reference(name, r, rnd, f"ep_vllm/{name}/{rnd}")]
                               for l, n in enumerate(ref["count"])])
        assert (live <= 2 * floor).any() and live.max() > 2 ** 12 * floor, name
        if fmt == "ue8m0":
            assert ((live.view(np.uint32) & 0x7FFFFF) == 0).all()


def test_importing_the_module_does_not_import_vllm():
    """``import resident_pg.ep_vllm`` leaves vLLM alone; the class needs it and says so."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import resident_pg, resident_pg.ep_vllm as m\n"
            "try:\n"
            "    m.ResidentLLPrepareAndFinalize\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n")
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "IMPORTERROR" in p.stdout and "needs vLLM" in p.stdout, p.stdout
    p = subprocess.run([sys.executable, "-c", "import sys, resident_pg.ep_vllm; "
                        "print('vllm' in sys.modules)"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", (p.stdout, p.stderr)


@needs_vllm
@pytest.mark.resident_only
def test_ep_vllm_adapter_in_installed_vllm():
    per_rank = H.run_ranks(vllm_job, WS, timeout_s=300, init_timeout_s=60, env=VLLM_ENV)
    for r, v in enumerate(per_rank):
        assert v["subclass"] and v["cpu_platform"], (r, v)
    assert len(per_rank[0]["cases"]) == 2 * (len(SCENARIOS) + 1 + len(FP8_KERNELS))
    problems = _problems(per_rank) + _error_problems(per_rank, N_ERROR_CASES)
    assert not problems, "\n".join(problems[:20])
