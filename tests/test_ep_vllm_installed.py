"""resident_pg.ep_vllm inside vLLM 0.33.0 (skipped where vLLM is not installed; docs/vllm.md).

In 2 ranks on vLLM's CPU platform: the cases of test_ep_vllm.py through the class derived from
vLLM's own ``FusedMoEPrepareAndFinalizeModular`` and vLLM's own ``FusedMoEQuantConfig`` objects,
and layers run by vLLM's ``FusedMoEKernel`` (its ``FusedMoEKernelModularImpl``: post_init_setup,
prepare_async, workspace allocation, experts, finalize_async) with batched experts written in
ep_vllm_layers.py: unquantized linear experts, and block-FP8 layers (vLLM's fp8_w8a8 config with
128x128 blocks, fp8 weights, SiLU-and-mul; FP8 dispatch with float32 scales, and with UE8M0
scales chosen by post_init_setup for experts that report taking them).  vLLM's own batched
experts do not run on CPU here: BatchedTritonExperts and BatchedDeepGemmExperts need a GPU, and
NaiveBatchedExperts calls ``torch.ops._C.silu_and_mul`` (not registered for CPU tensors by
vLLM's CUDA wheel) and asks ``torch.accelerator.current_stream()`` whether it is capturing,
which initializes CUDA with torch's CUDA build and fails without a driver.
"""

from __future__ import annotations

import importlib.util

import pytest

import dist_harness as H
from ep_vllm_cases import N_ERROR_CASES, case_problems, error_problems
from ep_vllm_layers import FP8_KERNELS, vllm_job
from ep_vllm_scenarios import SCENARIOS, WS

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see docs/vllm.md: "
                                "a separate environment with vllm==0.33.0)")
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1"}


@needs_vllm
@pytest.mark.resident_only
def test_ep_vllm_adapter_in_installed_vllm():
    per_rank = H.run_ranks(vllm_job, WS, timeout_s=300, init_timeout_s=60, env=VLLM_ENV)
    for r, v in enumerate(per_rank):
        assert v["subclass"] and v["cpu_platform"], (r, v)
    assert len(per_rank[0]["cases"]) == 2 * (len(SCENARIOS) + 1 + len(FP8_KERNELS))
    problems = case_problems(per_rank) + error_problems(per_rank, N_ERROR_CASES)
    assert not problems, "\n".join(problems[:20])
