"""The c10d::Backend methods beyond the common collectives on CUDA tensors (docs/ops.md):
all_gather_coalesced and gather_single run on the device, checked bitwise against the inputs;
a recv from any source into a CUDA tensor raises ValueError naming the reason; a call with asyncOp
off returns no Work, its result ordered on the current stream (synchronous_calls.py); a group of
one rank (each rank's own, as a TP group of one) gives back its input from every collective,
eager, async and (on the GPU) replayed from a captured graph. 2 ranks, both paths. In the dry
run (RESIDENT_GPU_TESTS_DEVICE=cpu, see cuda_harness.py) the same bodies run on CPU tensors,
where the any-source recv is served."""

from __future__ import annotations

import traceback

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import dev, host
from dist_harness import compare_exact, make_input

pytestmark = C.module_marks()

WS = 2
ITEMS = ("all_gather_coalesced", "gather_single", "recv_any_source", "synchronous_calls",
         "group_of_one")


def _all_gather_coalesced(rank, ws):
    import torch.distributed as dist

    errs = []
    for dt in ("float32", "bfloat16", "int64", "uint8"):
        sizes = (1, 1031, (1 << 20) // 4 + 3)
        inputs = {r: [make_input(f"cuda/agc/{dt}/{i}", r, n, dt) for i, n in enumerate(sizes)]
                  for r in range(ws)}
        outs = [[C.sentinel(n, dt) for n in sizes] for _ in range(ws)]
        for async_op in (False, True):
            handle = dist.all_gather_coalesced(outs, [dev(t) for t in inputs[rank]], async_op=async_op)
            if async_op:
                handle.wait()
            for r in range(ws):
                for i, n in enumerate(sizes):
                    errs += compare_exact(host(outs[r][i]), inputs[r][i],
                                          f"{dt} async={async_op} rank {r} tensor {i} (n={n})")
    return errs


def _gather_single(rank, ws):
    import torch.distributed as dist

    errs = []
    if not hasattr(dist, "gather_single"):  # the test item skips, saying why
        return errs
    for dt, n in (("float32", 1031), ("int32", 1), ("float16", (1 << 20) // 2 + 1)):
        for root in range(ws):
            inputs = [make_input(f"cuda/gs/{dt}/{n}/{root}", r, n, dt) for r in range(ws)]
            out = C.sentinel(ws * n, dt) if rank == root else None
            dist.gather_single(dev(inputs[rank]), out, dst=root)
            if rank == root:
                import torch

                errs += compare_exact(host(out), torch.cat(inputs), f"{dt} n={n} root={root}")
    return errs


def _recv_any_source(rank, ws):
    import torch.distributed as dist

    errs = []
    msg = make_input("cuda/any", 1, 64, "float32")
    if C.ON_GPU:
        if rank == 0:
            try:
                dist.recv(C.sentinel(64, "float32"), tag=3)
                errs.append("recv from any source into a CUDA tensor did not raise")
            except ValueError as e:
                if "any source" not in str(e) or "CUDA" not in str(e):
                    errs.append(f"the error does not name the op and the reason: {e}")
        dist.barrier()
        return errs
    if rank == 1:
        dist.send(dev(msg), dst=0, tag=3)
    elif rank == 0:
        buf = C.sentinel(64, "float32")
        src = dist.recv(buf, tag=3)
        if src != 1:
            errs.append(f"recv returned sender {src}, expected 1")
        errs += compare_exact(host(buf), msg, "the message")
    return errs


def _synchronous_calls(rank, ws):
    from synchronous_calls import synchronous_call_problems

    def sync():
        if C.ON_GPU:
            import torch

            torch.cuda.synchronize()

    return synchronous_call_problems(rank, ws, dev, host, sync)


def _group_of_one(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    solo = [dist.new_group([r]) for r in range(ws)][rank]  # new_group is collective
    for dt, n in (("float32", 1031), ("int64", 3), ("bfloat16", (1 << 16) + 5)):
        x = make_input(f"cuda/solo/{dt}/{n}", rank, n, dt)
        for async_op in (False, True):
            what = f"{dt} n={n} async={async_op}"
            ops = []
            t = dev(x)
            ops.append(("all_reduce SUM", t, dist.all_reduce(t, group=solo, async_op=async_op)))
            if dt != "int64":
                a = dev(x)
                avg = dist.all_reduce(a, op=dist.ReduceOp.AVG, group=solo, async_op=async_op)
                ops.append(("all_reduce AVG", a, avg))
            g = C.sentinel(n, dt)
            ops.append(("all_gather_into_tensor",
                        g, dist.all_gather_into_tensor(g, dev(x), group=solo, async_op=async_op)))
            rs = C.sentinel(n, dt)
            ops.append(("reduce_scatter_tensor",
                        rs, dist.reduce_scatter_tensor(rs, dev(x), group=solo, async_op=async_op)))
            a2a = C.sentinel(n, dt)
            ops.append(("all_to_all_single",
                        a2a, dist.all_to_all_single(a2a, dev(x), group=solo, async_op=async_op)))
            b = dev(x)
            ops.append(("broadcast", b, dist.broadcast(b, src=rank, group=solo, async_op=async_op)))
            for name, out, work in ops:
                if async_op:
                    work.wait()
                errs += compare_exact(host(out), x, f"{name} {what}")
    if C.ON_GPU:
        # Captured on a side stream, replayed with fresh inputs.
        n, dt = 4099, "float32"
        src, out = C.sentinel(n, dt), C.sentinel(n, dt)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            dist.all_reduce(src, group=solo)
            dist.all_gather_into_tensor(out, src, group=solo)
        torch.cuda.current_stream().wait_stream(stream)
        for replay in range(3):
            x = make_input(f"cuda/solo/graph/{replay}", rank, n, dt)
            src.copy_(dev(x))
            out.fill_(C.sentinel_value(dt))
            graph.replay()
            errs += compare_exact(host(out), x, f"graph replay {replay}")
    dist.barrier()
    return errs


def methods_job(rank, ws):
    C.setup_rank(rank, ws)
    out = {}
    for item, fn in zip(ITEMS, (_all_gather_coalesced, _gather_single, _recv_any_source,
                                  _synchronous_calls, _group_of_one)):
        try:
            out[item] = fn(rank, ws)
        except Exception as e:  # noqa: BLE001
            out[item] = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"]
    if C.ON_GPU:
        import torch

        torch.cuda.synchronize()
    return out


_RESULTS: dict = {}


def _job(path):
    if path not in _RESULTS:
        try:
            _RESULTS[path] = (H.run_ranks(methods_job, WS, init=False, env={"RESIDENT_PATH": path},
                                          timeout_s=120 * C.TIME_SCALE, init_timeout_s=60), None)
        except H.RanksFailed as e:
            _RESULTS[path] = (None, str(e))
    return _RESULTS[path]


@pytest.mark.parametrize("path", C.PATHS)
@pytest.mark.parametrize("item", ITEMS)
def test_cuda_backend_method(item, path):
    import torch.distributed as dist

    if item == "gather_single" and not hasattr(dist, "gather_single"):
        pytest.skip(f"this torch ({__import__('torch').__version__}) has no dist.gather_single "
                    "(torch 2.14 has)")
    per_rank, err = _job(path)
    if err is not None:
        pytest.fail(f"the {path} job failed as a whole:\n{err}", pytrace=False)
    problems = [f"rank {r}: {e}" for r, res in enumerate(per_rank) for e in res[item]]
    assert not problems, "\n".join(problems)
