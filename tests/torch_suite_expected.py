"""Expected outcomes of torch's distributed suite (DistributedTest._DistTestBase, torch 2.14) on
resident, CPU tensors, world sizes 2 and 3 (tests/torch_suite_driver.py; docs/conformance.md).

Every test not named here must pass, or skip for one of SKIP_REASONS (reasons that hold for
gloo on the same machine too: no GPU, another backend's feature, disabled upstream). A test
listed as "fail" must fail: when it starts passing the driver says so, and the entry goes.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Expect:
    status: str  # "fail": the test must fail
    reason: str
    world_sizes: tuple = (2, 3)


BACKEND_NAME_CUSTOM = (
    "DDP's logging data records ProcessGroup::getBackendName(), which torch 2.14 reports as "
    "'custom' for every backend registered through Backend.register_backend (gloo is built in); "
    "the test expects the registered name 'resident'. A torch limitation, not resident's")
SPARSE = (
    "resident serves dense tensors only; an all_reduce of a sparse tensor (a gloo-only feature "
    "in torch) raises ValueError naming the sparse layout")

EXPECTED: dict = {
    "test_ddp_logging_data_cpu": Expect("fail", BACKEND_NAME_CUSTOM),
    "test_sparse_all_reduce_sum": Expect("fail", SPARSE),
}

# Skips that are no statement about resident: the same tests skip for gloo on this machine.
SKIP_REASONS: list = [
    (r"Need at least \d+ CUDA devices|CUDA is not available|multi-gpu",
     "needs GPUs; this job runs on CPU (the GPU suite, tests/test_cuda_*.py, covers CUDA tensors)"),
    (r"Only (Nccl|NCCL|MPI) supports|(NCCL|Nccl) (Batch )?Send Recv Only|requires backend \w+ to "
     r"be one of \{'nccl'\}|Only NCCL backend supports|tests with NCCL only",
     "tests a feature of NCCL or MPI, not of a CPU backend"),
    (r"Skipped due to small world size|requires (an exact )?world size of \d+",
     "needs another world size (this job runs 2 and 3 ranks)"),
    (r"github\.com/pytorch/pytorch/(issues|pull)/\d+|Skipped due to flakiness",
     "disabled in torch's own suite (the skip names the upstream issue)"),
    (r"no torchvision", "needs torchvision, which the CI image does not install"),
]


def expected_for(name, backend, world_size):
    """The expectation for a test, or None (it must pass, or skip for a SKIP_REASONS reason)."""
    e = EXPECTED.get(name)
    if backend != "resident" or e is None or world_size not in e.world_sizes:
        return None
    return e


def skip_is_expected(message):
    return any(re.search(pattern, message) for pattern, _ in SKIP_REASONS)
