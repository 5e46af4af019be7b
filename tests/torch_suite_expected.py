"""Expected outcomes of torch's distributed suite (DistributedTest._DistTestBase, torch 2.14) on
resident, CPU tensors, world sizes 2 and 3 (tests/torch_suite_driver.py; docs/conformance.md).

Every test not named here must pass, or skip for one of SKIP_REASONS (reasons that hold for
gloo on the same machine too: no GPU, another backend's feature, disabled upstream). A test
listed as "fail" must fail: when it starts passing the driver says so, and the entry goes. A test
listed as "unstable" may pass or fail (only for a memory corruption that hits at random).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Expect:
    # "fail": must fail; "unstable": passes or fails from run to run (a known memory corruption)
    status: str
    reason: str
    world_sizes: tuple = (2, 3)


# Reasons, each shared by several tests.
PROFILER_EVENTS = (
    "resident's Work does not yet record the profiler event torch's suite looks for (an event "
    "named 'resident:<op>' that ends when the op completes, with the op's input shapes, as "
    "gloo's): issue 40 point 2 (open)")
PROFILER_CORRUPTION = (
    "memory corruption under torch.autograd.profiler.profile(record_shapes=True): the Work's "
    "record function is started and never finished, and a later profiler session overwrites "
    "tensor metadata (a result comes back with the wrong shape) or crashes the rank: issue 34 "
    "point 1 (open)")
SEQUENCE_NUMBERS = (
    "resident has no group sequence numbers yet (getSequenceNumberForGroup): all_gather_object "
    "on a subgroup asks for one; issue 40 point 1 (open)")
BACKEND_NAME_CUSTOM = (
    "DDP's logging data records ProcessGroup::getBackendName(), which torch 2.14 reports as "
    "'custom' for every backend registered through Backend.register_backend (gloo is built in); "
    "the test expects the registered name 'resident'. A torch limitation, not resident's")
SPARSE = (
    "resident serves dense tensors only; an all_reduce of a sparse tensor (a gloo-only feature "
    "in torch) raises ValueError naming the sparse layout")

_PROFILED_OPS = [
    "test_all_gather", "test_all_gather_complex", "test_all_gather_full_group",
    "test_all_gather_coalesced_simple", "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group", "test_all_gather_coalesced_with_empty",
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_all_reduce_max", "test_all_reduce_min", "test_all_reduce_product",
    "test_all_reduce_full_group_sum", "test_all_reduce_full_group_max",
    "test_all_reduce_full_group_min", "test_all_reduce_full_group_product",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_full_group_sum", "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_full_group_min", "test_all_reduce_coalesced_full_group_product",
    "test_reduce_sum", "test_reduce_max", "test_reduce_min", "test_reduce_product",
    "test_reduce_sum_twice", "test_reduce_full_group_sum", "test_reduce_full_group_max",
    "test_reduce_full_group_min", "test_reduce_full_group_product",
    "test_isend_autograd_profiler", "test_isend_torch_profiler",
    "test_send_recv_autograd_profiler", "test_send_recv_torch_profiler",
    "test_send_recv_with_tag_autograd_profiler", "test_send_recv_with_tag_torch_profiler",
    "test_send_recv_any_source_autograd_profiler", "test_send_recv_any_source_torch_profiler",
]

EXPECTED: dict = {name: Expect("fail", PROFILER_EVENTS) for name in _PROFILED_OPS}
# The other tests that run ops under torch.autograd.profiler.profile(record_shapes=True) (the
# suite's call_dist_op): they pass unless the corruption hits them, which varies from run to run
# (seen: test_gather_full_group's result with a wrong shape, a rank of test_broadcast_full_group
# dying with SIGSEGV).
_PROFILED_NO_EVENT_CHECK = [
    "test_broadcast", "test_broadcast_full_group", "test_broadcast_group",
    "test_gather", "test_gather_full_group", "test_gather_group",
    "test_scatter", "test_scatter_complex", "test_scatter_full_group", "test_scatter_group",
    "test_all_gather_group", "test_all_gather_coalesced_group",
    "test_all_reduce_group_sum", "test_all_reduce_group_max", "test_all_reduce_group_min",
    "test_all_reduce_group_product", "test_all_reduce_coalesced_group_sum",
    "test_all_reduce_coalesced_group_max", "test_all_reduce_coalesced_group_min",
    "test_all_reduce_coalesced_group_product", "test_reduce_group_sum", "test_reduce_group_max",
    "test_reduce_group_min", "test_reduce_group_product",
    "test_all_to_all_single_equal_split", "test_all_to_all_single_equal_split_complex",
    "test_all_to_all_single_equal_split_full_group", "test_all_to_all_single_equal_split_group",
    "test_ddp_profiling_autograd_profiler", "test_ddp_profiling_torch_profiler",
    "test_ddp_profiling_execution_trace",
]
EXPECTED.update({name: Expect("unstable", PROFILER_CORRUPTION) for name in _PROFILED_NO_EVENT_CHECK})
EXPECTED.update({
    "test_all_gather_object_subgroup": Expect("fail", SEQUENCE_NUMBERS),
    "test_ddp_logging_data_cpu": Expect("fail", BACKEND_NAME_CUSTOM),
    "test_sparse_all_reduce_sum": Expect("fail", SPARSE),
})

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
