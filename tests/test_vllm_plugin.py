"""resident_pg.vllm_plugin against stand-ins of vLLM's GroupCoordinator and CudaCommunicator.

These run without vLLM (CI): two small classes with vLLM 0.33's constructor arguments, the
attributes the plugin reads and the methods it patches stand in for it; the platform is reported
as CUDA. tests/test_vllm_installed.py runs the plugin inside the installed vLLM. In 3 spawned ranks (world group gloo, CPU tensors) every
rank builds the TP coordinators of ``group_ranks = [[0, 2], [1]]`` and a PP one; then:

* a small all-reduce on the TP communicator goes to the resident group (and not to vLLM's own
  path), with the sum of the group's random inputs, computed independently from the seeds;
* one above ``max_bytes`` and a non-contiguous one take vLLM's own path (also checked);
* the PP coordinator gets no resident group; patching twice changes nothing;
* ``destroy`` destroys the resident group.

With ``-m gpu`` (2 ranks on the GPU) the same TP communicator on CUDA tensors: small
all-reduces go to the resident backend's own call (``direct_all_reduce``, not
``dist.all_reduce``), eagerly and inside a CUDA graph replayed with fresh inputs, int64 results
bitwise and float32 within rounding of a float64 reference.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import dist_harness as H
from resident_pg import vllm_plugin

MAX_BYTES = 256
TP_GROUPS = [[0, 2], [1]]


class FakeCommunicator:
    """vLLM's CudaCommunicator as the plugin sees it: device, ca_comm, all_reduce(input_)."""

    def __init__(self, device, group):
        self.device = device
        self.group = group
        self.world_size = 1 if group is None else group.size()
        for attr in vllm_plugin._REQUIRED_ATTRS:
            setattr(self, attr, None)
        self.use_aiter_allreduce = False
        self.own_path_calls = 0
        self.destroyed = False

    def destroy(self):
        self.destroyed = True

    def suspend(self):
        pass

    def resume(self):
        pass

    def all_reduce(self, input_):
        import torch.distributed as dist

        self.own_path_calls += 1
        out = input_.clone()
        dist.all_reduce(out, group=self.group)
        return out


class FakeCoordinator:
    """vLLM's GroupCoordinator constructor (the arguments the plugin binds by name)."""

    comm_device = "cpu"  # the device of the communicators it makes

    def __init__(self, group_ranks, local_rank, torch_distributed_backend,
                 use_device_communicator, use_message_queue_broadcaster=False, group_name=None):
        import torch
        import torch.distributed as dist

        self.group_name = group_name
        self.unique_name = f"{group_name}:0"
        self.device_group = None
        for ranks in group_ranks:
            g = dist.new_group(ranks, backend=torch_distributed_backend)
            cpu = dist.new_group(ranks, backend="gloo")
            if dist.get_rank() in ranks:
                self.device_group, self.cpu_group = g, cpu
                self.rank_in_group = ranks.index(dist.get_rank())
        self.device_communicator = (FakeCommunicator(torch.device(self.comm_device), self.device_group)
                                    if use_device_communicator else None)


def _inputs(rank, n, key):
    return H.rng_for(f"vllm/{key}", rank).standard_normal(n).astype(np.float32)


def _plugin_job(rank, ws):
    import torch
    import torch.distributed as dist

    H.init_pg("gloo")
    vllm_plugin.platform_name = lambda: "cuda"
    vllm_plugin.group_spans_hosts = lambda cpu_group: False
    vllm_plugin.patch(FakeCoordinator, FakeCommunicator, max_bytes=MAX_BYTES)
    vllm_plugin.patch(FakeCoordinator, FakeCommunicator, max_bytes=MAX_BYTES)  # idempotent
    tp = FakeCoordinator(TP_GROUPS, rank, "gloo", True, group_name="tp")
    pp = FakeCoordinator([[0, 1, 2]], rank, "gloo", True, group_name="pp")
    comm = tp.device_communicator
    mine = next(g for g in TP_GROUPS if rank in g)
    out = {"resident_backend": dist.get_backend(comm.resident_group),
           "pp_has_resident": hasattr(pp.device_communicator, "resident_group")}
    problems = []
    for key, n, expect_own in (("small", MAX_BYTES // 4, False), ("large", MAX_BYTES // 4 + 1, True)):
        before = comm.own_path_calls
        x = torch.from_numpy(_inputs(rank, n, key))
        got = comm.all_reduce(x).numpy()
        want = np.sum([_inputs(r, n, key).astype(np.float64) for r in mine], axis=0)
        if not np.allclose(got, want, rtol=1e-6, atol=1e-5):
            problems.append(f"{key}: max error {np.max(np.abs(got - want))}")
        if not np.array_equal(x.numpy(), _inputs(rank, n, key)):
            problems.append(f"{key}: the input was modified (vLLM's all_reduce is out of place)")
        if (comm.own_path_calls > before) != expect_own:
            problems.append(f"{key}: went to {'vLLM' if comm.own_path_calls > before else 'resident'}")
    strided = torch.from_numpy(_inputs(rank, 16, "strided"))[::2]
    before = comm.own_path_calls
    comm.all_reduce(strided)
    if comm.own_path_calls == before:
        problems.append("a non-contiguous input went to resident")
    group = comm.resident_group
    comm.destroy()
    if not comm.destroyed or hasattr(comm, "resident_group"):
        problems.append("destroy did not reach vLLM's destroy or left the resident group")
    if group in dist.distributed_c10d._world.pg_map:
        problems.append("the resident group outlived destroy")
    out["problems"] = problems
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_plugin_routes_decode_size_all_reduces_to_resident():
    per_rank = H.run_ranks(_plugin_job, 3, init=False, timeout_s=120)
    for rank, r in enumerate(per_rank):
        assert r["problems"] == [], (rank, r["problems"])
        assert r["resident_backend"] == "resident", (rank, r)
        assert r["pp_has_resident"] is False, (rank, r)


def test_direct_limit_follows_the_handoff():
    off = {"on": False, "crossover_bytes": {"all_reduce": 4096}}
    assert vllm_plugin.direct_limit(off) == float("inf")
    on = {"on": True, "crossover_bytes": {"all_reduce": 4096}}
    assert vllm_plugin.direct_limit(on) == 4096
    on0 = {"on": True, "crossover_bytes": {"all_reduce": 0}}  # not handed off
    assert vllm_plugin.direct_limit(on0) == float("inf")


class _FakeBackend:
    def __init__(self, handoff):
        self._handoff = handoff
        self.calls = []

    def handoff(self):
        return self._handoff

    def allreduce(self, tensors, opts):
        self.calls.append((tensors, opts.reduceOp, opts.asyncOp))


class _FakeGroup:
    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device):
        return self.backend


@pytest.mark.parametrize("handoff,max_bytes,direct", [
    ({"on": False, "crossover_bytes": {"all_reduce": 0}}, float("inf"), True),
    ({"on": False, "crossover_bytes": {"all_reduce": 0}}, 256, True),
    ({"on": True, "crossover_bytes": {"all_reduce": 4096}}, 256, True),
    ({"on": True, "crossover_bytes": {"all_reduce": 256}}, 256, False),
    ({"on": True, "crossover_bytes": {"all_reduce": 100}}, float("inf"), False),
])
def test_direct_call_is_decided_once_per_group(handoff, max_bytes, direct):
    """No direct call where the hand-off would take some of the routed messages; the call is the
    backend's allreduce, SUM with asyncOp off (the device is only named: no GPU needed)."""
    import torch.distributed as dist

    backend = _FakeBackend(handoff)
    call = vllm_plugin.direct_all_reduce(_FakeGroup(backend), "cuda", max_bytes)
    assert (call is not None) is direct
    if call is not None:
        call("t")
        assert backend.calls == [(["t"], dist.ReduceOp.SUM, False)]


def _direct_cpu_job(rank, ws):
    import torch.distributed as dist

    H.init_pg("resident")
    call = vllm_plugin.direct_all_reduce(dist.group.WORLD, "cpu")
    dist.destroy_process_group()
    return call is None


def test_direct_all_reduce_is_cuda_only():
    """CPU ops complete on the host: their Work must be waited on, so no direct call."""
    assert H.run_ranks(_direct_cpu_job, 2, init=False, timeout_s=60) == [True, True]


def _plugin_cuda_job(rank, ws):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    H.init_pg("gloo")
    vllm_plugin.platform_name = lambda: "cuda"
    vllm_plugin.group_spans_hosts = lambda cpu_group: False
    vllm_plugin.patch(FakeCoordinator, FakeCommunicator, max_bytes=MAX_BYTES)
    FakeCoordinator.comm_device = "cuda"
    comm = FakeCoordinator([list(range(ws))], rank, "gloo", True, group_name="tp").device_communicator
    problems = []
    if comm.__dict__.get("resident_direct") is None:
        problems.append("no direct call on a CUDA communicator")
    wrapped = dist.all_reduce
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return wrapped(*args, **kwargs)

    dist.all_reduce = counting

    def inputs(key, dtype, n):
        """Every rank's input (each rank draws all of them, from the same seeds)."""
        gens = [H.rng_for(f"vllm-cuda/{key}", r) for r in range(ws)]
        if dtype == "int64":
            return [g.integers(-2**40, 2**40, n, dtype=np.int64) for g in gens]
        return [g.standard_normal(n).astype(np.float32) for g in gens]

    def check(key, got, per):
        if got.dtype == np.int64:
            ok = np.array_equal(got, np.sum(per, axis=0))
        else:
            want = np.sum([a.astype(np.float64) for a in per], axis=0)
            ok = np.allclose(got, want, rtol=1e-6, atol=1e-5)
        if not ok:
            problems.append(f"{key}: wrong sum")

    try:
        for dtype, n in (("int64", 1), ("int64", MAX_BYTES // 8), ("float32", 3), ("float32", MAX_BYTES // 4)):
            key = f"eager-{dtype}-{n}"
            per = inputs(key, dtype, n)
            x = torch.from_numpy(per[rank]).cuda()
            got = comm.all_reduce(x).cpu().numpy()
            check(key, got, per)
            if not np.array_equal(x.cpu().numpy(), per[rank]):
                problems.append(f"{key}: the input was modified")
        x = torch.zeros(MAX_BYTES // 8, dtype=torch.int64, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = comm.all_reduce(x)
        for i in range(3):
            key = f"graph-{i}"
            per = inputs(key, "int64", x.numel())
            x.copy_(torch.from_numpy(per[rank]))
            graph.replay()
            torch.cuda.synchronize()
            check(key, y.cpu().numpy(), per)
    finally:
        dist.all_reduce = wrapped
    if calls[0]:
        problems.append(f"{calls[0]} all-reduces went through dist.all_reduce")
    comm.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return problems


@pytest.mark.gpu
def test_plugin_cuda_all_reduces_use_the_direct_call():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    per_rank = H.run_ranks(_plugin_cuda_job, 2, init=False, timeout_s=180)
    for rank, problems in enumerate(per_rank):
        assert problems == [], (rank, problems)


class _Path:
    def __init__(self, disabled):
        self.disabled = disabled


def test_routing_size_and_contiguity():
    import torch

    comm = FakeCommunicator(torch.device("cpu"), None)
    x = torch.zeros(64)  # 256 bytes
    assert vllm_plugin.routes_to_resident(comm, x, 256)
    assert not vllm_plugin.routes_to_resident(comm, x, 255)
    assert not vllm_plugin.routes_to_resident(comm, torch.zeros(8, 8).t(), 4096)


def test_active_fast_paths():
    import torch

    comm = FakeCommunicator(torch.device("cpu"), None)
    assert vllm_plugin.active_fast_paths(comm) == []
    comm.ca_comm = _Path(disabled=True)
    comm.fi_ar_comm = _Path(disabled=True)
    assert vllm_plugin.active_fast_paths(comm) == []
    comm.ca_comm = _Path(disabled=False)
    comm.symm_mem_comm = _Path(disabled=False)
    assert vllm_plugin.active_fast_paths(comm) == ["CUSTOM", "SYMM_MEM"]
    comm.aiter_ar_comm = _Path(disabled=False)  # kept for DP gather/scatter only: not a path
    assert "AITER_CUSTOM" not in vllm_plugin.active_fast_paths(comm)
    comm.use_aiter_allreduce = True
    assert "AITER_CUSTOM" in vllm_plugin.active_fast_paths(comm)


@pytest.mark.parametrize("route,platform,spans,paths,want", [
    ("auto", "cuda", False, [], True),
    ("auto", "cuda", False, ["CUSTOM"], False),
    ("auto", "cuda", True, ["CUSTOM"], True),
    ("auto", "rocm", False, [], False),
    ("auto", "CpuPlatform", True, [], False),
    ("resident", "rocm", False, ["CUSTOM"], True),
    ("vllm", "cuda", True, [], False),
])
def test_decide(route, platform, spans, paths, want):
    use, reason = vllm_plugin.decide(route, platform, spans, paths)
    assert use is want and reason


def test_bad_route_is_rejected(monkeypatch):
    monkeypatch.setenv(vllm_plugin.ROUTE_VAR, "nccl")
    with pytest.raises(ValueError, match="RESIDENT_VLLM_ROUTE must be one of auto, resident, vllm"):
        vllm_plugin.route_option()


def test_register_is_off_unless_enabled(monkeypatch):
    monkeypatch.delenv(vllm_plugin.ENABLE_VAR, raising=False)
    assert vllm_plugin.register() is False
    monkeypatch.setenv(vllm_plugin.ENABLE_VAR, "0")
    assert vllm_plugin.register() is False
    monkeypatch.setenv(vllm_plugin.ENABLE_VAR, "maybe")
    with pytest.raises(ValueError, match="RESIDENT_VLLM must be 0 or 1"):
        vllm_plugin.register()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_register_without_vllm_names_the_problem(monkeypatch):
    monkeypatch.setenv(vllm_plugin.ENABLE_VAR, "1")
    with pytest.raises(ImportError, match="RESIDENT_VLLM=1 but vLLM"):
        vllm_plugin.register()


def test_bad_max_bytes_is_rejected(monkeypatch):
    monkeypatch.setenv(vllm_plugin.MAX_BYTES_VAR, "-3")
    with pytest.raises(ValueError, match="RESIDENT_VLLM_MAX_BYTES must be a positive integer"):
        vllm_plugin._positive_int(vllm_plugin.MAX_BYTES_VAR, 1)


def test_entry_point_is_declared():
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    eps = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"resident": "resident_pg.vllm_plugin:register"}
