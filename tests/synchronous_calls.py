"""What a collective called with ``asyncOp`` off returns (torch's synchronous calls, e.g.
``dist.all_reduce(t)``): no Work, with the result in place on return (CPU) or ordered on the
current stream (CUDA); torch then skips its ``wait()``. With ``asyncOp`` on, a Work to wait on;
inside torch's ``allow_inflight_collective_as_graph_input_ctx``, which registers the Work with
the tensors, a Work in both cases. Shared by the CPU and CUDA backend-method tests: ``to_dev``
and ``to_host`` move a tensor to the tested device and back, ``sync`` waits for the device.
Every check is bitwise, against inputs regenerated from seeds."""

from __future__ import annotations

from dist_harness import compare_exact, make_input


def _opts(cls, async_op, **fields):
    o = cls()
    o.asyncOp = async_op
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def _calls(ws, rank, key, to_dev):
    """(name, call(async_op) -> returned object, check() -> problems) per op, on fresh data."""
    import torch
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist

    pg = dist.group.WORLD
    n = 1031
    ins = {r: make_input(f"{key}/in", r, n * ws, "int64") for r in range(ws)}
    total = sum(ins[r] for r in range(ws))
    state = {}

    def all_reduce(a):
        state["ar"] = to_dev(ins[rank].clone())
        return pg.allreduce([state["ar"]], _opts(c10d.AllreduceOptions, a))

    def all_gather(a):
        state["ag"] = to_dev(torch.zeros(n * ws, dtype=torch.int64))
        return pg._allgather_base(state["ag"], to_dev(ins[rank][:n].clone()),
                                  _opts(c10d.AllgatherOptions, a))

    def reduce_scatter(a):
        state["rs"] = to_dev(torch.zeros(n, dtype=torch.int64))
        return pg._reduce_scatter_base(state["rs"], to_dev(ins[rank].clone()),
                                       _opts(c10d.ReduceScatterOptions, a))

    def all_to_all(a):
        state["a2a"] = to_dev(torch.zeros(n * ws, dtype=torch.int64))
        return pg.alltoall_base(state["a2a"], to_dev(ins[rank].clone()), [], [],
                                _opts(c10d.AllToAllOptions, a))

    def broadcast(a):
        state["bc"] = to_dev(ins[rank].clone())
        return pg.broadcast([state["bc"]], _opts(c10d.BroadcastOptions, a, rootRank=ws - 1))

    def barrier(a):
        return pg.barrier(_opts(c10d.BarrierOptions, a))

    chunk = slice(rank * n, (rank + 1) * n)
    return [
        ("all_reduce", all_reduce, lambda h: compare_exact(h(state["ar"]), total, "all_reduce")),
        ("all_gather_into_tensor", all_gather,
         lambda h: compare_exact(h(state["ag"]), torch.cat([ins[r][:n] for r in range(ws)]),
                                 "all_gather_into_tensor")),
        ("reduce_scatter_tensor", reduce_scatter,
         lambda h: compare_exact(h(state["rs"]), total[chunk], "reduce_scatter_tensor")),
        ("all_to_all_single", all_to_all,
         lambda h: compare_exact(h(state["a2a"]), torch.cat([ins[r][chunk] for r in range(ws)]),
                                 "all_to_all_single")),
        ("broadcast", broadcast, lambda h: compare_exact(h(state["bc"]), ins[ws - 1], "broadcast")),
        ("barrier", barrier, lambda h: []),
    ]


def synchronous_call_problems(rank, ws, to_dev, to_host, sync) -> list:
    import torch.distributed as dist
    from torch.distributed._functional_collectives import (
        allow_inflight_collective_as_graph_input_ctx,
    )

    errs = []
    for async_op in (False, True):
        for name, call, check in _calls(ws, rank, f"sync/{async_op}", to_dev):
            got = call(async_op)
            if async_op:
                if not isinstance(got, dist.Work):
                    errs.append(f"{name} asyncOp=True: returned {type(got).__name__}, "
                                "expected a Work")
                    continue
                got.wait()
            elif got is not None:
                errs.append(f"{name}: a synchronous call returned {type(got).__name__}, "
                            "expected None (torch would wait on it for nothing)")
                if isinstance(got, dist.Work):
                    got.wait()
            sync()
            errs += [f"asyncOp={async_op}: {e}" for e in check(to_host)]
    # torch registers the Work of a call inside this context; one must come back.
    with allow_inflight_collective_as_graph_input_ctx():
        name, call, check = _calls(ws, rank, "sync/inflight", to_dev)[0]
        got = call(False)
        if not isinstance(got, dist.Work):
            errs.append(f"{name} inside allow_inflight_collective_as_graph_input_ctx: returned "
                        f"{type(got).__name__}, expected a Work")
        else:
            got.wait()
        sync()
        errs += [f"inflight context: {e}" for e in check(to_host)]
    return errs
