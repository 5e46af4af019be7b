"""The ops of resident_pg.bench (rank side): each (op, size) cell is an OpCase built by
build_op on the rank's device object, with a correctness check against known values."""

from __future__ import annotations

from . import common




# --------------------------------------------------------------------------
# ops (rank side)
# --------------------------------------------------------------------------

class OpCase:
    """One (op, size) cell on one rank.

    The correctness check is split so that graph mode can capture it: `setup`
    writes known inputs (and poisons outputs), `body` issues the op(s), `verify`
    raises CheckError on a wrong result.  Eager check: setup, body, verify."""

    def __init__(self, step, actual_bytes, participates, setup=None, body=None, verify=None,
                 scale=1.0, reset=None):
        self.step = step                  # issues one op (one round trip for send_recv)
        self.actual_bytes = actual_bytes  # bytes of the buffer the size refers to
        self.participates = participates  # False: this rank is idle for this op
        self.setup, self.body, self.verify = setup, body, verify
        self.scale = scale                # per-step time -> reported time
        self.reset = reset                # () -> None, restores timing buffers

    def check(self) -> None:
        self.setup()
        self.body()
        self.verify()


class CheckError(RuntimeError):
    pass


def _current(dist, name, old_name):
    """torch.distributed's function under its current name: torch 2.14 renamed
    all_gather_into_tensor and reduce_scatter_tensor (…_single), and the old names' deprecation
    wrapper warns on every call, ~1 µs of an 8 B op on the 2-core machine. The rows keep the
    old names."""
    return getattr(dist, name, None) or getattr(dist, old_name)


POISON = -7.0  # outputs are filled with this before a checked op


def _expect(name, got, want) -> None:
    import torch
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        idx = int(bad[0]) if bad.numel() else -1
        raise CheckError(f"{name}: wrong result at element {idx}: got "
                         f"{got.flatten()[idx].item()} want {want.flatten()[idx].item()} "
                         f"({bad.numel()} of {got.numel()} elements differ)")


def build_op(op: str, nbytes: int, rank: int, ws: int, dev) -> OpCase:
    """Buffers and a step function for one (op, size) cell.

    Size conventions (as nccl-tests): all_reduce: the tensor; all_to_all_single:
    the per-rank input (= output) buffer, rounded up to a multiple of world
    size elements; all_gather_into_tensor: the gathered output; reduce_scatter
    _tensor: the input; send_recv: the message.  Buffers are at least one
    float32 per rank; `actual_bytes` says what was really used.
    """
    import torch
    import torch.distributed as dist
    n = max(1, nbytes // common.ELEM_BYTES)

    if op == "all_reduce":
        t = dev.alloc(n, 0.0)

        def step():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

        want = torch.full_like(t, ws * (ws + 1) / 2)
        return OpCase(step, n * common.ELEM_BYTES, True,
                      setup=lambda: t.fill_(rank + 1), body=step,
                      verify=lambda: _expect(op, t, want), reset=lambda: t.zero_())

    if op == "all_to_all_single":
        n = max(ws, -(-n // ws) * ws)
        chunk = n // ws
        inp, out = dev.alloc(n, 0.0), dev.alloc(n, None)
        # every element of chunk j sent by rank r holds r*ws + j
        known = rank * ws + dev.arange(n) // chunk
        want = dev.arange(n) // chunk * ws + rank  # chunk i came from rank i

        def step():
            dist.all_to_all_single(out, inp)

        def setup():
            inp.copy_(known)
            out.fill_(POISON)

        return OpCase(step, n * common.ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want), reset=lambda: inp.zero_())

    if op == "all_gather_into_tensor":
        chunk = max(1, n // ws)
        inp, out = dev.alloc(chunk, float(rank)), dev.alloc(chunk * ws, None)
        want = dev.arange(chunk * ws) // chunk
        gather = _current(dist, "all_gather_single", "all_gather_into_tensor")

        def step():
            gather(out, inp)

        def setup():
            inp.fill_(rank)
            out.fill_(POISON)

        return OpCase(step, chunk * ws * common.ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want))

    if op == "reduce_scatter_tensor":
        chunk = max(1, n // ws)
        inp, out = dev.alloc(chunk * ws, 0.0), dev.alloc(chunk, None)
        # element of chunk j on rank r: r + j  -> rank i gets sum_r (r + i)
        known = dev.arange(chunk * ws) // chunk + rank
        want = torch.full_like(out, ws * (ws - 1) / 2 + ws * rank)

        scatter = _current(dist, "reduce_scatter_single", "reduce_scatter_tensor")

        def step():
            scatter(out, inp, op=dist.ReduceOp.SUM)

        def setup():
            inp.copy_(known)
            out.fill_(POISON)

        return OpCase(step, chunk * ws * common.ELEM_BYTES, True, setup=setup, body=step,
                      verify=lambda: _expect(op, out, want), reset=lambda: inp.zero_())

    if op == "send_recv":
        if ws < 2:
            raise ValueError("send_recv needs at least 2 ranks")
        t = dev.alloc(n, 0.0)
        sent, back = dev.arange(n), dev.arange(n) + 1
        # rank 0 sends 0..n-1, rank 1 adds 1 and sends it back: both end with 1..n
        if rank == 0:
            def step():
                dist.send(t, 1)
                dist.recv(t, 1)

            setup = lambda: t.copy_(sent)  # noqa: E731
            body = step
            what = op + " (rank 0 got back)"
        elif rank == 1:
            def step():
                dist.recv(t, 0)
                dist.send(t, 0)

            def body():
                dist.recv(t, 0)
                t.add_(1)
                dist.send(t, 0)

            setup = lambda: t.fill_(POISON)  # noqa: E731
            what = op + " (rank 1 got, plus 1)"
        else:
            return OpCase(None, n * common.ELEM_BYTES, False, scale=0.5)
        return OpCase(step, n * common.ELEM_BYTES, True, setup=setup, body=body,
                      verify=lambda: _expect(what, t, back), scale=0.5)

    raise ValueError(f"unknown op {op!r}")
