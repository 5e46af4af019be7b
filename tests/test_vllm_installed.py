"""resident_pg.vllm_plugin inside the installed vLLM (0.33.0): its real GroupCoordinator,
CudaCommunicator, plugin loader, ``tensor_model_parallel_all_reduce`` and
``torch.ops.vllm.all_reduce``, in CPU processes.

Skipped where vLLM is not importable (CI's default environment, the GPU machine, which has no
package index): docs/vllm.md gives the commands of the separate environment that runs it.

Each case spawns ranks that set vLLM's CPU platform (``VLLM_TARGET_DEVICE=cpu``, pynccl off),
load the plugins through ``vllm.plugins.load_general_plugins`` with ``RESIDENT_VLLM=1``,
initialize vLLM's distributed environment on gloo and its TP groups, then all-reduce random
data (float32, bfloat16, int32) of decode and prefill size and a strided one. A spy on
``torch.distributed.all_reduce`` records which backend each call reached; the results are
checked against sums computed independently (integers bitwise). The cases cover the policy:
vLLM's CPU communicator (no resident group), ``CudaCommunicator`` on a platform that is not
CUDA (none either), ``CudaCommunicator`` with the platform reported as CUDA and no fast path
(resident), with an active FlashInfer path (vLLM's order stands) unless the group spans hosts or
``RESIDENT_VLLM_ROUTE=resident``, and ``RESIDENT_VLLM_ROUTE=vllm``. Every case also runs a sleep-mode cycle
(``suspend_device_comms`` / ``resume_device_comms``) and ``destroy_model_parallel``, after which
no resident group may remain.

Not run here: ``VLLM_DISTRIBUTED_USE_SPLIT_GROUP=1``. torch's ``split_group`` needs a default
group bound to an accelerator (``init_process_group`` refuses ``device_id=cpu``), vLLM binds one
only on GPUs, and the GPU machine cannot install vLLM.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import dist_harness as H

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (see docs/vllm.md: a separate environment with vllm==0.33.0)")

SMALL = 64          # elements: decode size
LARGE = 64 * 1024   # float32 elements: 256 KiB, above RESIDENT_VLLM_MAX_BYTES
CUDA_COMM = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"


class _ActiveFlashInfer:
    """Stands in for vLLM's FlashInferAllReduce as an active intra-node fast path (the real one
    disables itself without a GPU); it reduces over vLLM's gloo CPU group and counts calls."""

    calls = 0

    def __init__(self, group, device):
        self.group = group
        self.disabled = False

    def should_use_fi_ar(self, input_):
        return input_.numel() * input_.element_size() <= 64 * 1024

    def all_reduce(self, input_):
        import torch.distributed as dist

        type(self).calls += 1
        out = input_.clone()
        _ORIGINAL_ALL_REDUCE[0](out, group=self.group)
        dist.barrier(group=self.group)
        return out

    def destroy(self):
        pass


_ORIGINAL_ALL_REDUCE = []


def _values(key, rank, n, dtype):
    rng = H.rng_for(f"vllm-installed/{key}", rank)
    if dtype == "int32":
        return rng.integers(-1000, 1000, n).astype(np.int32)
    return rng.standard_normal(n).astype(np.float32)


def _tensor(key, rank, n, dtype):
    import torch

    t = torch.from_numpy(_values(key, rank, n, dtype))
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def _reference(key, ranks, n, dtype):
    import torch

    if dtype == "int32":
        return np.sum([_values(key, r, n, dtype).astype(np.int64) for r in ranks], axis=0)
    parts = [_tensor(key, r, n, dtype).to(torch.float64).numpy() for r in ranks]
    return np.sum(parts, axis=0)


def _rank_job(rank, world, case):
    import os

    import torch
    import torch.distributed as dist

    for k, v in case["env"].items():
        os.environ[k] = v
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import communication_op, parallel_state
    from vllm.platforms import current_platform

    from resident_pg import vllm_plugin

    if case["communicator"] == "cuda":
        type(current_platform).get_device_communicator_cls = classmethod(lambda cls: CUDA_COMM)
    if case["platform"] == "cuda":
        vllm_plugin.platform_name = lambda: "cuda"
    if case["fast_path"]:
        from vllm.distributed.device_communicators import flashinfer_all_reduce

        flashinfer_all_reduce.FlashInferAllReduce = _ActiveFlashInfer
    if case["spans_hosts"]:
        # rank 0's peers report another host, as vLLM's shared-memory test would across hosts
        parallel_state.in_the_same_node_as = lambda pg, source_rank=0: [
            i == 0 for i in range(dist.get_world_size(pg))]

    import logging

    import vllm.plugins

    decisions = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "TP group" in record.getMessage():
                decisions.append(record.getMessage())

    plugin_log = logging.getLogger("vllm.plugins.resident")
    plugin_log.setLevel(logging.INFO)  # as vLLM's engine configures its "vllm" logger tree
    plugin_log.addHandler(Collect())
    vllm.plugins.load_general_plugins()
    calls = []
    _ORIGINAL_ALL_REDUCE.append(dist.all_reduce)

    def spy(tensor, *args, group=None, **kwargs):
        calls.append(dist.get_backend(group) if group is not None else "world")
        return _ORIGINAL_ALL_REDUCE[0](tensor, *args, group=group, **kwargs)

    problems = []
    init_method = f"tcp://127.0.0.1:{H.CTX.rdzv_port}"
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=world, rank=rank, local_rank=rank, backend="gloo",
            distributed_init_method=init_method)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=case["tp"])
        tp = parallel_state.get_tp_group()
        comm = tp.device_communicator
        resident = comm.__dict__.get("resident_group")
        out = {"communicator": type(comm).__name__,
               "resident": resident is not None and dist.get_backend(resident) == "resident",
               "patched": getattr(type(tp), "_resident_patched", False),
               "rank_in_group": tp.rank_in_group, "decisions": list(decisions)}
        dist.all_reduce = spy

        def check(key, n, dtype, via, expect, strided=False):
            x = _tensor(key, rank, 2 * n if strided else n, dtype)
            x = x[::2] if strided else x
            before, fi_before = len(calls), _ActiveFlashInfer.calls
            y = (communication_op.tensor_model_parallel_all_reduce(x) if via == "tp"
                 else torch.ops.vllm.all_reduce(x, group_name=tp.unique_name))
            if strided:
                want = _reference(key, tp.ranks, 2 * n, dtype)[::2]
            else:
                want = _reference(key, tp.ranks, n, dtype)
            got = y.to(torch.float64).numpy() if dtype == "bfloat16" else y.numpy()
            if dtype == "int32":
                ok = np.array_equal(got.astype(np.int64), want)
            else:
                tol = 2e-2 if dtype == "bfloat16" else 1e-5
                ok = np.allclose(got, want, rtol=tol, atol=tol)
            if not ok:
                problems.append(f"{key}/{dtype}/{via}: wrong sum")
            went = ("fast" if _ActiveFlashInfer.calls > fi_before
                    else "resident" if "resident" in calls[before:] else "vllm")
            if went != expect:
                problems.append(f"{key}/{dtype}/{via}: went to {went}, expected {expect}")

        small = case["small_goes_to"]
        for round_ in ("before-sleep", "after-sleep"):
            for dtype in ("float32", "bfloat16", "int32"):
                for via in ("tp", "op"):
                    check(f"small/{round_}", SMALL, dtype, via, small)
            check(f"large/{round_}", LARGE, "float32", "tp", "vllm")
            if case["communicator"] == "cuda":
                check(f"strided/{round_}", SMALL, "float32", "op",
                      "fast" if case["fast_path"] else "vllm", strided=True)
            if round_ == "before-sleep":
                parallel_state.suspend_device_comms()
                parallel_state.resume_device_comms()
        dist.all_reduce = _ORIGINAL_ALL_REDUCE[0]
        parallel_state.destroy_model_parallel()
        out["resident_left"] = [b for b in (dist.get_backend(g) for g in
                                            list(dist.distributed_c10d._world.pg_map))
                                if b == "resident"]
        out["comm_has_group"] = "resident_group" in comm.__dict__
        parallel_state.destroy_distributed_environment()
    out["problems"] = problems
    return out


BASE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1", "RESIDENT_VLLM": "1",
            "VLLM_PLUGINS": "resident", "RESIDENT_VLLM_ROUTE": "auto"}

CASES = {
    # name: (communicator, platform reported, active fast path, spans hosts, env, small goes to)
    "cpu_communicator": ("cpu", "cpu", False, False, {}, "vllm"),
    "cuda_communicator_cpu_platform": ("cuda", "cpu", False, False, {}, "vllm"),
    "no_fast_path": ("cuda", "cuda", False, False, {}, "resident"),
    "fast_path_active": ("cuda", "cuda", True, False, {}, "fast"),
    "fast_path_active_spans_hosts": ("cuda", "cuda", True, True, {}, "resident"),
    "forced_resident": ("cuda", "cuda", True, False, {"RESIDENT_VLLM_ROUTE": "resident"},
                        "resident"),
    "forced_vllm": ("cuda", "cuda", False, False, {"RESIDENT_VLLM_ROUTE": "vllm"}, "vllm"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plugin_in_installed_vllm(name):
    communicator, platform, fast_path, spans, env, small = CASES[name]
    world, tp = (4, 2) if name == "no_fast_path" else (2, 2)
    case = {"communicator": communicator, "platform": platform, "fast_path": fast_path,
            "spans_hosts": spans, "env": {**BASE_ENV, **env}, "small_goes_to": small, "tp": tp}
    per_rank = H.run_ranks(_rank_job, world, args=(case,), init=False, rendezvous="tcp",
                           timeout_s=240, env=case["env"])
    for rank, r in enumerate(per_rank):
        assert r["patched"], (rank, "the plugin was not loaded by vLLM's plugin loader")
        assert r["problems"] == [], (rank, r["problems"])
        want_comm = "CudaCommunicator" if communicator == "cuda" else "CpuCommunicator"
        assert r["communicator"] == want_comm, (rank, r)
        assert r["resident"] == (small == "resident"), (rank, r)
        assert r["resident_left"] == [] and not r["comm_has_group"], (rank, r)
        # the decision is logged once per group, by its first rank, with its reason
        if communicator == "cuda":
            want_logs = 1 if r["rank_in_group"] == 0 else 0
            assert len(r["decisions"]) == want_logs, (rank, r["decisions"])
            verdict = "go to resident" if small == "resident" else "keep vLLM's path"
            assert all(verdict in d for d in r["decisions"]), (rank, r["decisions"])


def test_patched_symbols_match_installed_vllm():
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from resident_pg import vllm_plugin

    assert vllm_plugin.check_vllm_api(parallel_state, CudaCommunicator) == []


def test_api_check_names_a_changed_symbol():
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from resident_pg import vllm_plugin

    class Changed(CudaCommunicator):
        def all_reduce(self, input_, out=None):
            return input_

        def suspend(self, level):
            pass

    problems = vllm_plugin.check_vllm_api(parallel_state, Changed)
    assert any("all_reduce takes" in p for p in problems), problems
    assert any("CudaCommunicator.suspend" in p for p in problems), problems
