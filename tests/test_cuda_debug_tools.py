"""torch's debugging tools on the resident backend, CUDA tensors (the CPU side:
test_debug_tools.py, whose jobs these run with the tensors on the GPU).

Profilers: every op kind in profiling sessions of both profilers, sync and async, results
checked; the events on the host as on CPU (``resident:<op>``, async, input shapes); with the
device traced (torch.profiler, CUDA activity), each collective's event also shows on the GPU,
annotating the kernels launched inside it, as ProcessGroupNCCL's events do.
TORCH_DISTRIBUTED_DEBUG=DETAIL: every op on CUDA tensors through torch's ProcessGroupWrapper on
the default group and a subgroup, sequence numbers equal across ranks, torch's own error for
mismatched collectives.

Dry run on a machine without a GPU: ``RESIDENT_GPU_TESTS_DEVICE=cpu`` (see cuda_harness.py).
"""

from __future__ import annotations

import pytest

import cuda_harness as C
import dist_harness as H
from test_debug_tools import debug_job, profiled_sessions_job

pytestmark = C.module_marks()


def _fail_on_errors(per_rank):
    problems = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems)


def _profiled_job(rank, ws):
    C.setup_rank(rank, ws)
    return profiled_sessions_job(rank, ws, 2, device=C.DEVICE, cuda_activity=C.ON_GPU)


@pytest.mark.parametrize("ws", [2, 3])
def test_cuda_profiler_events(ws):
    _fail_on_errors(H.run_ranks(_profiled_job, ws, init=False, timeout_s=300 * C.TIME_SCALE,
                                env={"PYTHONMALLOC": "malloc"}))


def _detail_job(rank, ws):
    C.setup_rank(rank, ws)
    return debug_job(rank, ws, "DETAIL", device=C.DEVICE)


@pytest.mark.parametrize("ws", [2, 3])
def test_cuda_detail_mode(ws):
    _fail_on_errors(H.run_ranks(_detail_job, ws, init=False, timeout_s=240 * C.TIME_SCALE,
                                env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}))
