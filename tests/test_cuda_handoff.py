"""The large-message hand-off to NCCL on GPUs (docs/handoff.md).

With one rank per GPU (2 GPUs needed) the group's NCCL hand-off is on: ops below
RESIDENT_HANDOFF_BYTES run resident, ops from it run on NCCL (the adapter's counters and the
profiler's event names say which), with results checked against references computed from the
inputs, sync, async and in a captured CUDA graph that mixes both paths. With two ranks on one
GPU (1 GPU needed) the hand-off is off on every rank, with the reason.

    python -m pytest -q tests/test_cuda_handoff.py

Skipped without CUDA (the gpu marker), and the one-rank-per-GPU tests with fewer than 2 GPUs.
"""

from __future__ import annotations

import pytest

import dist_harness as H
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce, tdtype

pytestmark = [pytest.mark.gpu, pytest.mark.resident_only]

CROSSOVER = 256 * 1024  # RESIDENT_HANDOFF_BYTES set by these tests (the default is 0: off)
ENV = {"RESIDENT_HANDOFF_BYTES": str(CROSSOVER)}
GROUP_TIMEOUT_S = 120


def _gpus():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs (one rank per GPU)")


def _init(rank, gpu):
    import torch

    torch.cuda.set_device(gpu)
    torch.zeros(1, device="cuda").add_(1)
    H.init_pg(timeout_s=GROUP_TIMEOUT_S)


def _forwarded():
    import resident_pg

    return dict(resident_pg.describe(None, "cuda")["handoff"]["forwarded"])


def _ops_job(rank, ws):
    import torch
    import torch.distributed as dist

    import resident_pg

    _init(rank, rank)
    errs = []
    info = resident_pg.describe(None, "cuda")["handoff"]
    if not info["on"] or info["backend"] != "nccl" or info["device"] != "cuda":
        return [f"hand-off not on NCCL with one rank per GPU: {info}"]
    for async_op in (False, True):
        for dtype in ("float32", "bfloat16", "int64"):
            isz = H.itemsize(dtype)
            for n in (1000 // isz + 1, CROSSOVER // isz, (1 << 20) // isz + 3):
                big = n * isz >= CROSSOVER
                label = f"{dtype} n={n} async={async_op}"
                before = _forwarded()
                op = "MAX" if dtype == "bfloat16" else "SUM"
                ins = [make_input(f"cho/{label}/ar", r, n, dtype) for r in range(ws)]
                t = ins[rank].cuda()
                w = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=async_op)
                if async_op:
                    w.wait()
                errs += compare_reduction(t.cpu(), reference_reduce(ins, op, dtype), ins, op, dtype,
                                          f"all_reduce {label}")
                t = ins[rank].cuda()
                w = dist.broadcast(t, src=1, async_op=async_op)
                if async_op:
                    w.wait()
                errs += compare_exact(t.cpu(), ins[1], f"broadcast {label}")
                out = torch.zeros(ws * n, dtype=tdtype(dtype), device="cuda")
                w = dist.all_gather_into_tensor(out, ins[rank].cuda(), async_op=async_op)
                if async_op:
                    w.wait()
                errs += compare_exact(out.cpu(), torch.cat(ins), f"all_gather_into_tensor {label}")
                rs = [make_input(f"cho/{label}/rs", r, ws * n, dtype) for r in range(ws)]
                out = torch.zeros(n, dtype=tdtype(dtype), device="cuda")
                w = dist.reduce_scatter_tensor(out, rs[rank].cuda(), op=getattr(dist.ReduceOp, op),
                                               async_op=async_op)
                if async_op:
                    w.wait()
                part = [x[rank * n:(rank + 1) * n] for x in rs]
                errs += compare_reduction(out.cpu(), reference_reduce(part, op, dtype), part, op,
                                          dtype, f"reduce_scatter_tensor {label}")
                a2a = [make_input(f"cho/{label}/a2a", r, ws * n, dtype) for r in range(ws)]
                out = torch.zeros(ws * n, dtype=tdtype(dtype), device="cuda")
                w = dist.all_to_all_single(out, a2a[rank].cuda(), async_op=async_op)
                if async_op:
                    w.wait()
                want = torch.cat([a2a[r][rank * n:(rank + 1) * n] for r in range(ws)])
                errs += compare_exact(out.cpu(), want, f"all_to_all_single {label}")
                buf = torch.zeros(n, dtype=tdtype(dtype), device="cuda")
                works = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, ins[rank].cuda(), (rank + 1) % ws),
                    dist.P2POp(dist.irecv, buf, (rank - 1) % ws)])
                for w in works:
                    w.wait()
                errs += compare_exact(buf.cpu(), ins[(rank - 1) % ws], f"send/recv {label}")
                after = _forwarded()
                for kind, per_op in (("all_reduce", 1), ("broadcast", 1),
                                     ("all_gather_into_tensor", 1), ("reduce_scatter_tensor", 1),
                                     ("all_to_all_single", 1), ("send_recv", 2)):
                    got = after[kind] - before[kind]
                    if got != (per_op if big else 0):
                        errs.append(f"{kind} {label}: forwarded count rose by {got}")
    return errs


def _graph_job(rank, ws):
    """A captured graph with a resident all_reduce and an NCCL one, replayed with fresh data."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    _init(rank, rank)
    errs = []
    small = torch.zeros(256, device="cuda")
    large = torch.zeros(CROSSOVER // 4 + 5, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        dist.all_reduce(small)
        dist.all_reduce(large)
    torch.cuda.current_stream().wait_stream(side)
    before = _forwarded()["all_reduce"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(small)
        dist.all_reduce(large)
    for replay in range(3):
        ins = {name: [make_input(f"chg/{replay}/{name}", r, t.numel(), "float32")
                      for r in range(ws)] for name, t in (("small", small), ("large", large))}
        small.copy_(ins["small"][rank])
        large.copy_(ins["large"][rank])
        graph.replay()
        torch.cuda.synchronize()
        for name, t in (("small", small), ("large", large)):
            errs += compare_reduction(t.cpu(), reference_reduce(ins[name], "SUM", "float32"),
                                      ins[name], "SUM", "float32", f"graph replay {replay} {name}")
    if _forwarded()["all_reduce"] - before != 1:
        errs.append("the captured large all_reduce was not handed off (once, at capture)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(small)
        dist.all_reduce(large)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    for want in ("resident:all_reduce", "resident:all_reduce->nccl"):
        if want not in names:
            errs.append(f"profiler: no event named {want!r}")
    return errs


def _shared_gpu_job(rank, ws):
    import resident_pg

    _init(rank, 0)
    return resident_pg.describe(None, "cuda")["handoff"]


@needs_two_gpus
def test_cuda_handoff_ops_one_rank_per_gpu():
    per_rank = H.run_ranks(_ops_job, 2, env=ENV, init=False, timeout_s=600, init_timeout_s=GROUP_TIMEOUT_S)
    problems = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems[:40])


@needs_two_gpus
def test_cuda_handoff_graph_capture_and_profiler_names():
    per_rank = H.run_ranks(_graph_job, 2, env=ENV, init=False, timeout_s=300, init_timeout_s=GROUP_TIMEOUT_S)
    problems = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems[:40])


def test_cuda_handoff_off_with_two_ranks_on_one_gpu():
    per_rank = H.run_ranks(_shared_gpu_job, 2, env=ENV, init=False, timeout_s=300,
                           init_timeout_s=GROUP_TIMEOUT_S)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0]["on"] is False
    assert "ranks 0 and 1 share GPU" in per_rank[0]["reason"], per_rank[0]
