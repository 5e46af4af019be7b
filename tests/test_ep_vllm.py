"""resident_pg.ep_vllm: the vLLM prepare/finalize over resident_pg.ep.Buffer, checked against an
independent numpy reference in 2 CPU ranks.

Every rank regenerates every rank's tokens, routings and weights from seeds and computes in
numpy (no code of resident_pg) what ``prepare`` must hand the experts -- the batched
``[local experts, W * max tokens, hidden]`` rows (source rank order, then token order) and the
per-expert counts -- bitwise, and what ``finalize`` must write into ``output`` -- the weighted sum
of the experts' outputs -- within the payload dtype's rounding.  Routings are random (no expert
twice in a row, ``-1`` entries, rows of only ``-1``, a rank without tokens, an expert nobody
picks); scenarios cover bf16 and float32, top-1 with ``apply_router_weight_on_input`` (the
weights applied to the tokens before the dispatch, as vLLM's DeepEP-LL adapter does) and
``global_to_physical`` expert ids.  Each scenario runs over the resident group (the device-splits
exchange) and a gloo group (the padded all_to_all_single), through ``prepare``/``finalize`` and
``prepare_async``/``finalize_async`` in alternate rounds.

* Without vLLM (CI): the class is made from stand-ins of vLLM's names (an abstract base with
  vLLM's abstract methods, ``ExpertTokensMetadata``, ``TopKWeightAndReduceDelegate``).
* With vLLM 0.33.0 installed (skipped otherwise; docs/vllm.md): the same cases through the class
  derived from vLLM's own ``FusedMoEPrepareAndFinalizeModular``, and the layer run by vLLM's
  ``FusedMoEKernel`` (its ``FusedMoEKernelModularImpl``: prepare_async, workspace allocation,
  experts, finalize_async) with batched linear experts written here, on vLLM's CPU platform.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import dist_harness as H
from ep_reference import combine_reference, to_dtype

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see docs/vllm.md: "
                                "a separate environment with vllm==0.33.0)")
WS = 2
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1"}

# name: dtype, local experts, hidden, max tokens per rank, top-k, tokens per rank per round,
# apply_router_weight_on_input, global_to_physical
SCENARIOS = {
    "random_bf16": ("bfloat16", 3, 24, 5, 3, [[5, 2], [0, 5], [4, 4]], False, False),
    "top1_weight_on_input_bf16": ("bfloat16", 2, 16, 4, 1, [[4, 3], [1, 0]], True, False),
    "physical_ids_f32": ("float32", 2, 8, 4, 2, [[4, 4], [2, 3]], False, True),
}

# ---------------------------------------------------------------- data and reference


def tokens(key, rank, T, Hd, dt):
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
    """(batched x [L, WS*M, H], counts [L], combined [T, H], tol [T, H]) of ``rank``."""
    dt, L, Hd, M, K, rounds, on_input, g2p = SCENARIOS[name]
    E = L * WS
    perm = physical_of(E) if g2p else np.arange(E)

    def sent(src):  # what src dispatches: (tokens as sent, physical expert per pair)
        T = rounds[rnd][src]
        x, idx = tokens(key, src, T, Hd, dt), routing(key, src, T, E, K)
        if on_input:  # x * w, with w rounded to the payload dtype first
            x = to_dtype(x * to_dtype(weights(key, src, T, K).astype(np.float64), dt), dt)
        phys = np.where(idx >= 0, perm[np.maximum(idx, 0)], -1)
        return x, phys

    bx = np.zeros((L, WS * M, Hd))
    count = np.zeros(L, dtype=np.int32)
    for src in range(WS):
        x, phys = sent(src)
        for t in range(len(x)):
            for e in phys[t]:
                if e >= 0 and e // L == rank:
                    bx[e % L, count[e % L]] = x[t]
                    count[e % L] += 1
    x, phys = sent(rank)
    w = np.ones_like(phys, dtype=np.float64) if on_input else \
        weights(key, rank, len(x), K).astype(np.float64)
    y, tol = combine_reference(x, phys, w, dt, expert_scale)
    return bx, count, y, tol


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


class _Unquantized:
    quant_dtype = None
    a1_scale = None


class _Fp8:
    quant_dtype = "fp8"
    a1_scale = None


# ---------------------------------------------------------------- inside a rank


def _t(a, dtype):
    import torch

    return torch.as_tensor(np.ascontiguousarray(a)).to(dtype)


def _experts(bx, rank, L):
    """Stand-in experts on the batched layout: local expert l scales its rows by
    expert_scale(its physical id)."""
    import torch

    s = torch.tensor([expert_scale(rank * L + l) for l in range(L)], dtype=torch.float32)
    return (bx.float() * s.view(L, 1, 1)).to(bx.dtype)


def _adapter_case(rank, cls, iface, quant, name, group):
    """All rounds of a scenario through ``cls``; returns problems."""
    import torch

    from resident_pg.ep import Buffer

    dt, L, Hd, M, K, rounds, on_input, g2p = SCENARIOS[name]
    E, dtype = L * WS, H.tdtype(dt)
    buf = Buffer(group, M, Hd, E, dtype, "cpu", num_topk=K)
    perm = physical_of(E)
    pf = cls(buf, global_to_physical=_t(perm, torch.int64) if g2p else None)
    errs = []
    facts = (pf.activation_format, pf.max_num_tokens_per_rank(), pf.num_dispatchers(),
             pf.topk_indices_dtype(), pf.output_is_reduced(), pf.supports_async())
    if facts != (iface.batched_format, M, WS, torch.int64, True, True):
        errs.append(f"{name}: properties {facts}")
    for rnd, Ts in enumerate(rounds):
        key, T = f"ep_vllm/{name}/{rnd}", Ts[rank]
        x = _t(tokens(key, rank, T, Hd, dt), dtype)
        x_before = x.clone()
        idx = _t(routing(key, rank, T, E, K), torch.int64)
        w = _t(weights(key, rank, T, K), torch.float32)
        use_async = rnd % 2 == 1
        args = (x, w, idx, E, None, on_input, quant)
        if use_async:
            hook, receiver = pf.prepare_async(*args)
            hook()
            bx, scales, meta, ids, tw = receiver()
        else:
            bx, scales, meta, ids, tw = pf.prepare(*args, defer_input_quant=False)
        label = f"{name} round {rnd} ({'async' if use_async else 'sync'}, {buf.transport})"
        ref_x, ref_count, ref_y, tol = reference(name, rank, rnd, key)
        counts = meta.expert_num_tokens
        if (scales, ids, tw, meta.expert_num_tokens_cpu) != (None, None, None, None):
            errs.append(f"{label}: prepare returned scales/ids/weights {scales, ids, tw}")
        if counts.dtype != torch.int32 or counts.tolist() != ref_count.tolist():
            errs.append(f"{label}: counts {counts.tolist()} ({counts.dtype}) != "
                        f"{ref_count.tolist()}")
        got_x = bx.double().numpy()
        if got_x.shape != ref_x.shape or not np.array_equal(got_x, ref_x):
            errs.append(f"{label}: batched x {got_x.shape} differs from the reference")
        if not torch.equal(x, x_before):
            errs.append(f"{label}: prepare modified a1")
        out = torch.full((T, Hd), -5.0, dtype=dtype)
        fused = _experts(bx, rank, L)
        fargs = (out, fused, w, idx, on_input, iface.delegate())
        if use_async:
            hook, receiver = pf.finalize_async(*fargs)
            hook()
            receiver()
        else:
            pf.finalize(*fargs)
        got_y = out.double().numpy()
        if (np.abs(got_y - ref_y) > tol).any():
            i = np.unravel_index(np.argmax(np.abs(got_y - ref_y) - tol), tol.shape)
            errs.append(f"{label}: output[{i}] = {got_y[i]!r}, reference {ref_y[i]!r}")
    return errs


def _error_cases(rank, cls, iface, dbo, quant):
    import torch

    from resident_pg.ep import Buffer

    res = {}

    def expect(label, fn, fragment, exc):
        H.expect_error(res, label, fn, fragment, exc)

    L, E = 2, 2 * WS
    buf = Buffer(None, 4, 8, E, torch.float32, "cpu", num_topk=2)
    pf = cls(buf)
    x, w = torch.ones(3, 8), torch.full((3, 2), 0.5)
    idx = torch.tensor([[0, E - 1], [1, -1], [2, 3]])
    args = (x, w, idx, E, None, False)
    expect("buffer", lambda: cls(object()), "resident_pg.ep.Buffer", TypeError)
    expect("g2p", lambda: cls(buf, global_to_physical=torch.zeros(E)), "global_to_physical",
           ValueError)
    expect("quantized", lambda: pf.prepare(*args, _Fp8(), False), "quant_dtype",
           NotImplementedError)
    expect("defer", lambda: pf.prepare(*args, quant, True), "defer_input_quant",
           NotImplementedError)
    expect("on_input_topk2", lambda: pf.prepare(x, w, idx, E, None, True, quant, False),
           "top-1", ValueError)
    expect("finalize_first", lambda: pf.finalize(torch.empty(3, 8), torch.empty(L, 4 * WS, 8),
                                                 w, idx, False, iface.delegate()),
           "without a prepare", RuntimeError)
    wrong_map = torch.arange(E, dtype=torch.int32)  # every expert local: not Buffer's layout
    expect("expert_map", lambda: pf.prepare(x, w, idx, E, wrong_map, False, quant, False),
           "expert_map", ValueError)
    if dbo is not None:  # the stand-in's switch; vLLM's own needs its ubatch threads
        dbo["on"] = True
        expect("dbo", lambda: pf.prepare(*args, quant, False), "dual-batch",
               NotImplementedError)
        dbo["on"] = False
    # a valid round trip afterwards (nothing above communicated), with a matching expert map
    right_map = torch.full((E,), -1, dtype=torch.int32)
    right_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    bx, _, meta, _, _ = pf.prepare(x, w, idx, E, right_map, False, quant, False)
    expect("reduce_impl", lambda: pf.finalize(torch.empty(3, 8), bx.clone(), w, idx, False,
                                              object()), "TopKWeightAndReduceDelegate",
           ValueError)
    out = torch.zeros(3, 8)
    pf.finalize(out, bx.clone(), w, idx, False, iface.delegate())
    # every token's routed experts return it unchanged: output = sum of its routed weights
    want = torch.tensor([1.0, 0.5, 1.0]).view(3, 1).expand(3, 8)
    res["valid_after_errors"] = "ok" if torch.equal(out, want) else f"output {out[:, 0]}"
    return res


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        return [f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"]


def _all_cases(rank, cls, iface, dbo, quant):
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    res = {}
    for name in SCENARIOS:
        for label, group in (("resident", None), ("gloo", gloo)):
            res[f"{name}-{label}"] = _catch(_adapter_case, rank, cls, iface, quant, name, group)
    return res, _error_cases(rank, cls, iface, dbo, quant)


def standin_job(rank, ws):
    from resident_pg.ep_vllm import make_prepare_finalize_class

    iface, dbo = standin_interface()
    cls = make_prepare_finalize_class(iface)
    cases, errors = _all_cases(rank, cls, iface, dbo, _Unquantized())
    return {"cases": cases, "errors": errors}


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


def _kernel_case(rank, cls, group, rounds):
    """vLLM's FusedMoEKernel(prepare/finalize, LinearBatchedExperts).apply on random routings,
    against y[t] = sum_k w[t,k] * x[t] @ w1[e]^T @ w2[e]^T over all experts in numpy."""
    import types

    import torch
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEParallelConfig,
    )

    from resident_pg.ep import Buffer

    L, Hd, N, M, K = 3, 16, 12, 4, 2
    E = L * WS
    rng = H.rng_for("ep_vllm/kernel/weights", 0)
    w1_all = rng.standard_normal((E, N, Hd)) / 4
    w2_all = rng.standard_normal((E, Hd, N)) / 4
    buf = Buffer(group, M, Hd, E, torch.float32, "cpu", num_topk=K)
    pf = cls(buf)
    # the experts read only these fields of the MoE config (activation settings, parallelism)
    moe = types.SimpleNamespace(swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None,
                                activation_situ_beta=None, activation_situ_linear_beta=None,
                                moe_parallel_config=FusedMoEParallelConfig.make_no_parallel())
    experts = _linear_experts_class()(moe, FUSED_MOE_UNQUANTIZED_CONFIG,
                                      max_num_tokens=pf.max_num_tokens_per_rank(),
                                      num_dispatchers=pf.num_dispatchers())
    kernel = mk.FusedMoEKernel(pf, experts)
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


def vllm_job(rank, ws):
    import torch.distributed as dist
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.platforms import current_platform

    from resident_pg import ep_vllm

    iface = ep_vllm.vllm_interface()
    cls = ep_vllm.ResidentLLPrepareAndFinalize
    out = {"subclass": issubclass(cls, mk.FusedMoEPrepareAndFinalizeModular),
           "cpu_platform": current_platform.is_cpu()}
    with set_current_vllm_config(VllmConfig()):
        cases, errors = _all_cases(rank, cls, iface, None, FUSED_MOE_UNQUANTIZED_CONFIG)
        gloo = dist.new_group(backend="gloo")
        rounds = [[4, 3], [0, 4], [2, 2]]
        for label, group in (("resident", None), ("gloo", gloo)):
            cases[f"kernel-{label}"] = _catch(_kernel_case, rank, cls, group, rounds)
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
    problems = _problems(per_rank) + _error_problems(per_rank, 10)
    assert not problems, "\n".join(problems[:20])


def test_ep_vllm_reference_sees_the_edges():
    """The scenarios reach their edges: an idle expert, -1 entries and all--1 rows, a rank
    without tokens, top-1 with weights on the input, a non-identity physical id map."""
    counts = [reference("random_bf16", r, 0, "ep_vllm/random_bf16/0")[1] for r in range(WS)]
    assert min(c.min() for c in counts) == 0 and max(c.max() for c in counts) > 1
    assert SCENARIOS["random_bf16"][5][1][0] == 0
    idx = routing("k", 0, 5, 6, 3)
    assert (idx[0] == -1).all() and (idx >= 0).any()
    assert (physical_of(4) != np.arange(4)).any()
    assert SCENARIOS["top1_weight_on_input_bf16"][4] == 1


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
    assert len(per_rank[0]["cases"]) == 2 * len(SCENARIOS) + 2
    problems = _problems(per_rank) + _error_problems(per_rank, 9)
    assert not problems, "\n".join(problems[:20])
