"""DistributedDataParallel on resident with CUDA tensors gives gloo's results on the same GPU
(gloo reduces CUDA tensors through host memory): the configurations and the tolerances of
tests/ddp_equivalence.py, 2 ranks on one GPU. Deterministic cuBLAS, so that the two runs'
gradients differ only by the reduction."""

from __future__ import annotations


import cuda_harness as C
import dist_harness as H
import ddp_equivalence as E

pytestmark = C.module_marks()

WS = 2


def cuda_ddp_job(rank, ws, configs):
    import torch

    torch.use_deterministic_algorithms(True)
    C.setup_rank(rank, ws)  # the device, then the group
    device = f"cuda:{torch.cuda.current_device()}" if C.ON_GPU else "cpu"
    return E.job(rank, ws, configs, device)


def test_cuda_ddp_matches_gloo():
    results = {}
    for backend in ("resident", "gloo"):
        results[backend] = H.run_ranks(cuda_ddp_job, WS, args=(E.CONFIGS,), backend=backend,
                                       init=False, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                                       timeout_s=240 * C.TIME_SCALE, init_timeout_s=60)
    for config, (n, rel) in E.differences(results["resident"], results["gloo"]).items():
        print(f"{config}: {n} parameters differ from gloo's, max relative difference {rel:.3g}")
    problems = E.problems(results["resident"], results["gloo"], WS)
    assert not problems, "\n".join(problems)
