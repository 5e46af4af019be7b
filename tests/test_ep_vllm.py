"""resident_pg.ep_vllm: the vLLM prepare/finalize over resident_pg.ep.Buffer, made from
stand-ins of vLLM's names, checked against an independent numpy reference in 2 ranks on CPU
tensors, and on CUDA tensors on the GPU machine.

Every rank regenerates every rank's tokens, routings and weights from seeds and computes in
numpy (ep_vllm_scenarios.py; no code of resident_pg) what ``prepare`` must hand the experts --
the batched ``[local experts, W * max tokens, hidden]`` rows (source rank order, then token
order) and the per-expert counts -- bitwise, and what ``finalize`` must write into ``output`` --
the weighted sum of the experts' outputs -- within the payload dtype's rounding.  Routings are
random (no expert twice in a row, ``-1`` entries, rows of only ``-1``, a rank without tokens, an
expert nobody picks); scenarios cover bf16 and float32, top-1 with
``apply_router_weight_on_input`` (the weights applied to the tokens before the dispatch, as
vLLM's DeepEP-LL adapter does) and ``global_to_physical`` expert ids, and FP8 dispatch
(``use_fp8_dispatch``): for block-FP8 experts (``quant_dtype=float8_e4m3fn``,
``block_shape=[128, 128]``) the fp8 bytes and the per-128-channel scales (float32, and packed
UE8M0 once ``post_init_setup`` sees experts that take them), with their column-major layout,
compare bitwise with a numpy quantization of the routed rows (tests/ep_reference.py); for
unquantized experts the dequantized rows compare bitwise.  Each scenario runs over the resident
group (the device-splits exchange) and a gloo group (the padded all_to_all_single), through
``prepare``/``finalize`` and ``prepare_async``/``finalize_async`` in alternate rounds
(ep_vllm_cases.py).  The refused quantization configs (per-tensor and per-token FP8, other block
widths, static scales, e4m3fnuz, int8, nvfp4, block FP8 without ``use_fp8_dispatch``) raise
NotImplementedError naming the config, before communicating.

* Without vLLM (CI): the class is made from stand-ins of vLLM's names (ep_vllm_standins.py: an
  abstract base with vLLM's abstract methods, ``ExpertTokensMetadata``,
  ``TopKWeightAndReduceDelegate``).
* On the GPU machine (``gpu`` marker; skipped without CUDA): the same stand-in scenarios on CUDA
  tensors, 2 ranks on cuda:0, the resident group's exchange being the CUDA device-splits kernel
  (``python -m pytest -q tests/test_ep_vllm.py -m gpu``).

The same cases through vLLM's own classes, with vLLM installed: test_ep_vllm_installed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import cuda_harness as C
import dist_harness as H
from ep_vllm_cases import (
    N_ERROR_CASES,
    case_problems,
    error_problems,
    standin_cuda_job,
    standin_job,
)
from ep_vllm_scenarios import FP8_FORMATS, SCENARIOS, WS, physical_of, reference, routing


@pytest.mark.resident_only
def test_ep_vllm_adapter_standins():
    per_rank = H.run_ranks(standin_job, WS, timeout_s=240, init_timeout_s=60)
    assert len(per_rank[0]["cases"]) == 2 * len(SCENARIOS)
    problems = case_problems(per_rank) + error_problems(per_rank, N_ERROR_CASES + 1)
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
    problems = case_problems(per_rank)
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
