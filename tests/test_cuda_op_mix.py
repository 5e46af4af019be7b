"""Seeded random op mixes on CUDA tensors (tests/op_mix.py with the CUDA plans): 2, 4 and 8
ranks (8 marked slow), every mode a user can turn on (op_mix.MODE_AXES: the default,
RESIDENT_PATH=proxy, RESIDENT_TRANSPORT=tcp), each also with round numbers that wrap mid-sequence.

The sequences, their data and their checks are the CPU test's (op_mix_run.run_modes, run by
test_op_mix.py on CPU tensors); what differs is the device and the graph phase: the plan's
graph ops are run once eagerly on a side stream (the warm-up), captured into one CUDA graph
(async ops waited inside the capture), the ranks agree through the parent's store that every
capture succeeded, and the graph is replayed several times with fresh inputs copied into the
captured buffers, every replay checked. CUDA plans post p2p receives in the order of the
peer's sends (CUDA ignores tags) and coalesce tensors of one dtype per call.

One spawned job per (world size, mode), the mode's environment set at spawn; each (world size,
mode, seed) is one pytest item; a failure names the seed, step, op, dtype, size, group and rank
and how to rerun the seed. ``RESIDENT_OPMIX_SEEDS`` runs other seeds, ``RESIDENT_GPU_TESTS_WS``
limits the world sizes (cuda_harness). Dry run (``RESIDENT_GPU_TESTS_DEVICE=cpu``): the CUDA
plans on CPU tensors, the "graph" being its step run again on each replay.
"""

from __future__ import annotations

import contextlib

import pytest

import cuda_harness as C
import op_mix
from op_mix_run import Hooks, OpMixJobs, run_modes

pytestmark = C.module_marks()

SEEDS = op_mix.seeds_from_env(default=(1, 2))
# Each mode also with round numbers that wrap two dozen rounds into the sequence (the CUDA path's
# RESIDENT_GPU_FIRST_ROUND; cuda_harness.PATH_KNOBS["wrap"] starts at the wrap itself): the wrap
# then meets slots that earlier ops of the mix left in every state.
WRAP_FIRST_ROUND = str(2**32 - 24)
MODES = op_mix.modes() + [(f"{m}-wrap", {**env, "RESIDENT_GPU_FIRST_ROUND": WRAP_FIRST_ROUND})
                          for m, env in op_mix.modes()]
MODE_IDS = [m for m, _env in MODES]
GROUP_TIMEOUT_S = 30


class CudaHooks(Hooks):
    """Warm-up on a side stream, capture into a CUDA graph (kept until the sequence ends),
    agreement through the parent's store, synchronize at the end of a sequence."""

    def __init__(self):
        import torch

        self.side = torch.cuda.Stream() if C.ON_GPU else None
        self.graphs = []

    def warm(self, fn):
        import torch

        if self.side is None:
            fn()
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            fn()
        torch.cuda.current_stream().wait_stream(self.side)

    def capture(self, fn):
        replay = C.capture_replay(fn)
        self.graphs.append(replay)
        return replay

    def agree(self, tag, rank, ws, ok):
        return C.store_agree(tag, rank, ws, ok, timeout_s=GROUP_TIMEOUT_S * 2)

    def finish(self):
        import torch

        if C.ON_GPU:
            torch.cuda.synchronize()
        self.graphs.clear()  # before the sequence's subgroups are destroyed


def cuda_op_mix_job(rank, ws, job):
    C.setup_rank(rank, ws, init=False)
    hooks = CudaHooks()
    try:
        return run_modes(rank, ws, job, hooks)
    finally:
        with contextlib.suppress(Exception):
            hooks.finish()


JOBS = OpMixJobs(cuda_op_mix_job, "test_cuda_op_mix", "tests/test_cuda_op_mix.py", C.DEVICE,
                 caps="cuda", per_mode=True, group_timeout_s=GROUP_TIMEOUT_S,
                 timeout_s=lambda runs: (120 + 90 * runs) * C.TIME_SCALE,
                 spawn_env=lambda env: env, modes=MODES)


def _params():
    out = []
    for ws in C.WORLD_SIZES:
        marks = [pytest.mark.slow] if ws >= 8 else []
        for mode in MODE_IDS:
            for seed in SEEDS:
                out.append(pytest.param(ws, mode, seed, id=f"ws{ws}-{mode}-seed{seed}", marks=marks))
    return out


@pytest.mark.parametrize("ws,mode,seed", _params())
def test_cuda_op_mix(ws, mode, seed, request):
    JOBS.check(ws, mode, seed, request.session)
