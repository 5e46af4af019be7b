"""The collective op kinds of an op mix (op_mix_plan.KINDS; point-to-point: op_mix_p2p.py; the
object collectives: op_mix_objects.py; resident_pg.ep.Buffer: op_mix_ep.py), and
:func:`make_op`, which picks an op's class: each issues its torch.distributed call on static
buffers and checks what it got against a reference it computes itself (how: op_mix_base.py).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from op_mix_base import SENTINEL, Member, MixOp
from op_mix_ep import EP_OPS
from op_mix_objects import OBJECT_OPS
from op_mix_p2p import BatchIsendIrecv, P2PPairs, P2PRing, P2PTagged
from op_mix_plan import FLOAT_DTYPES
from reference_data import compare_exact, count_parts


def data_kind(op: str, dtype: str) -> str:
    if op == "PRODUCT" and dtype in FLOAT_DTYPES:
        return "near1"  # products of N(0, 3) values leave the float range
    if op == "AVG" and dtype not in FLOAT_DTYPES:
        return "avg"
    return "normal"


def _works(w):
    return [] if w is None else [w]


class AllReduce(MixOp):
    def fill(self, k):
        s = self.spec
        kind = data_kind(s.redop, s.dtype)
        self.ins = [self.data(k, "x", r, s.n, kind=kind) for r in range(self.m.size)]
        self.put("x", self.ins[self.m.me])

    def issue(self, a):
        return _works(dist.all_reduce(self.buf["x"], op=self.redop(), group=self.pg, async_op=a))

    def verify(self):
        self.reduced("x", self.ins, self.spec.redop, self.spec.dtype, "all_reduce")


class Reduce(AllReduce):
    def issue(self, a):
        return _works(dist.reduce(self.buf["x"], dst=self.m.glob(self.spec.root), op=self.redop(),
                                  group=self.pg, async_op=a))

    def verify(self):
        if self.m.me == self.spec.root:
            self.reduced("x", self.ins, self.spec.redop, self.spec.dtype, "reduce", shared=False)


class AllReduceCoalesced(MixOp):
    def fill(self, k):
        s = self.spec
        self.ins = []
        for i, (dt, n) in enumerate(zip(s.dtypes, s.sizes)):
            kind = data_kind(s.redop, dt)
            self.ins.append([self.data(k, f"x{i}", r, n, dt, kind) for r in range(self.m.size)])
            self.put(f"x{i}", self.ins[i][self.m.me])

    def issue(self, a):
        ts = [self.buf[f"x{i}"] for i in range(len(self.spec.dtypes))]
        if self.spec.variant == "api":
            return _works(dist.all_reduce_coalesced(ts, op=self.redop(), group=self.pg, async_op=a))
        with dist._coalescing_manager(group=self.pg, async_ops=a) as cm:
            for t in ts:
                dist.all_reduce(t, op=self.redop(), group=self.pg)
        return [cm] if a else []

    def verify(self):
        for i, dt in enumerate(self.spec.dtypes):
            self.reduced(f"x{i}", self.ins[i], self.spec.redop, dt, f"tensor {i}")


class Broadcast(MixOp):
    def fill(self, k):
        self.ref = self.data(k, "x", self.spec.root, self.spec.n)
        self.put("x", self.data(k, "x", self.m.me, self.spec.n))

    def issue(self, a):
        return _works(dist.broadcast(self.buf["x"], src=self.m.glob(self.spec.root), group=self.pg,
                                     async_op=a))

    def verify(self):
        self.same("x", self.ref, "broadcast")


class AllGather(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        self.ins = [self.data(k, "x", r, s.n) for r in range(gs)]
        self.put("x", self.ins[self.m.me])
        for r in range(gs):
            self.out(f"o{r}", (s.n,))

    def issue(self, a):
        outs = [self.buf[f"o{r}"] for r in range(self.m.size)]
        return _works(dist.all_gather(outs, self.buf["x"], group=self.pg, async_op=a))

    def verify(self):
        for r in range(self.m.size):
            self.same(f"o{r}", self.ins[r], f"from group rank {r}")
        self.unchanged("x", self.ins[self.m.me])


class AllGatherIntoTensor(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        self.ins = [self.data(k, "x", r, s.n) for r in range(gs)]
        self.put("x", self.ins[self.m.me])
        self.out("o", (gs, s.n) if s.variant == "stack" else (gs * s.n,))

    def issue(self, a):
        return _works(dist.all_gather_into_tensor(self.buf["o"], self.buf["x"], group=self.pg,
                                                  async_op=a))

    def verify(self):
        self.same("o", torch.cat(self.ins).reshape(self.buf["o"].shape), "gathered")
        self.unchanged("x", self.ins[self.m.me])


class AllGatherIntoTensorCoalesced(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        self.ins = []
        for i, (dt, n) in enumerate(zip(s.dtypes, s.sizes)):
            self.ins.append([self.data(k, f"x{i}", r, n, dt) for r in range(gs)])
            self.put(f"x{i}", self.ins[i][self.m.me])
            self.make_outputs(i, n, dt)

    def make_outputs(self, i, n, dt):
        self.out(f"o{i}", (self.m.size * n,), dt)

    def issue(self, a):
        with dist._coalescing_manager(group=self.pg, async_ops=a) as cm:
            for i in range(len(self.spec.dtypes)):
                dist.all_gather_into_tensor(self.buf[f"o{i}"], self.buf[f"x{i}"], group=self.pg)
        return [cm] if a else []

    def verify(self):
        for i in range(len(self.spec.dtypes)):
            self.same(f"o{i}", torch.cat(self.ins[i]), f"tensor {i}")


class AllGatherCoalesced(AllGatherIntoTensorCoalesced):
    """The list form: rank r's tensor i lands in its own output."""

    def make_outputs(self, i, n, dt):
        for r in range(self.m.size):
            self.out(f"o{i}_{r}", (n,), dt)

    def issue(self, a):
        nt, gs = len(self.spec.dtypes), self.m.size
        outs = [[self.buf[f"o{i}_{r}"] for i in range(nt)] for r in range(gs)]
        ins = [self.buf[f"x{i}"] for i in range(nt)]
        return _works(dist.all_gather_coalesced(outs, ins, group=self.pg, async_op=a))

    def verify(self):
        for i in range(len(self.spec.dtypes)):
            for r in range(self.m.size):
                self.same(f"o{i}_{r}", self.ins[i][r], f"tensor {i} from group rank {r}")
            self.unchanged(f"x{i}", self.ins[i][self.m.me])


class Gather(MixOp):
    def fill(self, k):
        s = self.spec
        self.ins = [self.data(k, "x", r, s.n) for r in range(self.m.size)]
        self.put("x", self.ins[self.m.me])
        if self.m.me == s.root:
            for r in range(self.m.size):
                self.out(f"o{r}", (s.n,))

    def issue(self, a):
        outs = ([self.buf[f"o{r}"] for r in range(self.m.size)] if self.m.me == self.spec.root
                else None)
        return _works(dist.gather(self.buf["x"], gather_list=outs, dst=self.m.glob(self.spec.root),
                                  group=self.pg, async_op=a))

    def verify(self):
        if self.m.me == self.spec.root:
            for r in range(self.m.size):
                self.same(f"o{r}", self.ins[r], f"from group rank {r}")
        self.unchanged("x", self.ins[self.m.me])


class Scatter(MixOp):
    def fill(self, k):
        s = self.spec
        self.chunks = [self.data(k, f"c{d}", s.root, s.n) for d in range(self.m.size)]
        if self.m.me == s.root:
            for d in range(self.m.size):
                self.put(f"c{d}", self.chunks[d])
        self.out("o", (s.n,))

    def issue(self, a):
        lst = ([self.buf[f"c{d}"] for d in range(self.m.size)] if self.m.me == self.spec.root
               else None)
        return _works(dist.scatter(self.buf["o"], scatter_list=lst, src=self.m.glob(self.spec.root),
                                   group=self.pg, async_op=a))

    def verify(self):
        self.same("o", self.chunks[self.m.me], "scattered chunk")


class ReduceScatter(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        kind = data_kind(s.redop, s.dtype)
        self.ins = [[self.data(k, f"d{d}", r, s.n, kind=kind) for d in range(gs)] for r in range(gs)]
        for d in range(gs):
            self.put(f"x{d}", self.ins[self.m.me][d])
        self.out("o", (s.n,))

    def issue(self, a):
        src = [self.buf[f"x{d}"] for d in range(self.m.size)]
        return _works(dist.reduce_scatter(self.buf["o"], src, op=self.redop(), group=self.pg,
                                          async_op=a))

    def verify(self):
        me = self.m.me
        chunks = [self.ins[r][me] for r in range(self.m.size)]
        self.reduced("o", chunks, self.spec.redop, self.spec.dtype, "reduce_scatter", shared=False)
        for d in range(self.m.size):
            self.unchanged(f"x{d}", self.ins[me][d])


class ReduceScatterTensor(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        kind = data_kind(s.redop, s.dtype)
        self.ins = [self.data(k, "x", r, gs * s.n, kind=kind) for r in range(gs)]
        x = self.ins[self.m.me]
        self.put("x", x.reshape(gs, s.n) if s.variant == "stack" else x)
        self.out("o", (s.n,))

    def issue(self, a):
        return _works(dist.reduce_scatter_tensor(self.buf["o"], self.buf["x"], op=self.redop(),
                                                 group=self.pg, async_op=a))

    def verify(self):
        n, me = self.spec.n, self.m.me
        chunks = [x[me * n:(me + 1) * n] for x in self.ins]
        self.reduced("o", chunks, self.spec.redop, self.spec.dtype, "reduce_scatter", shared=False)
        self.errors += compare_exact(self.host(self.buf["x"]).reshape(-1), self.ins[me],
                                     "input x modified")


class ReduceScatterTensorCoalesced(MixOp):
    def fill(self, k):
        s, gs = self.spec, self.m.size
        self.ins = []
        for i, (dt, n) in enumerate(zip(s.dtypes, s.sizes)):
            kind = data_kind(s.redop, dt)
            self.ins.append([self.data(k, f"x{i}", r, gs * n, dt, kind) for r in range(gs)])
            self.put(f"x{i}", self.ins[i][self.m.me])
            self.out(f"o{i}", (n,), dt)

    def issue(self, a):
        with dist._coalescing_manager(group=self.pg, async_ops=a) as cm:
            for i in range(len(self.spec.dtypes)):
                dist.reduce_scatter_tensor(self.buf[f"o{i}"], self.buf[f"x{i}"], op=self.redop(),
                                           group=self.pg)
        return [cm] if a else []

    def verify(self):
        me = self.m.me
        for i, (dt, n) in enumerate(zip(self.spec.dtypes, self.spec.sizes)):
            chunks = [x[me * n:(me + 1) * n] for x in self.ins[i]]
            self.reduced(f"o{i}", chunks, self.spec.redop, dt, f"tensor {i}", shared=False)


class AllToAllSingle(MixOp):
    def _splits(self):
        s, gs = self.spec, self.m.size
        if s.variant == "even":
            return [[s.n] * gs for _ in range(gs)]
        return [list(r) for r in s.splits]

    def fill(self, k):
        s, gs, me = self.spec, self.m.size, self.m.me
        sp = self._splits()
        self.ins = [self.data(k, "x", r, sum(sp[r]) * s.cols).reshape(-1, s.cols) for r in range(gs)]
        if s.variant != "rows":
            self.ins = [x.reshape(-1) for x in self.ins]
        self.put("x", self.ins[me])
        rows = sum(sp[r][me] for r in range(gs))
        self.out("o", (rows, s.cols) if s.variant == "rows" else (rows,))

    def issue(self, a):
        s, me, gs = self.spec, self.m.me, self.m.size
        if s.variant == "even":
            return _works(dist.all_to_all_single(self.buf["o"], self.buf["x"], group=self.pg,
                                                 async_op=a))
        sp = self._splits()
        return _works(dist.all_to_all_single(self.buf["o"], self.buf["x"],
                                             output_split_sizes=[sp[r][me] for r in range(gs)],
                                             input_split_sizes=sp[me], group=self.pg, async_op=a))

    def verify(self):
        sp, me = self._splits(), self.m.me
        parts = [self.ins[r][sum(sp[r][:me]):sum(sp[r][:me + 1])] for r in range(self.m.size)]
        self.same("o", torch.cat(parts), "received")
        self.unchanged("x", self.ins[me])


class AllToAll(MixOp):
    def fill(self, k):
        s, gs, me = self.spec, self.m.size, self.m.me
        self.ins = [[self.data(k, f"to{d}", r, s.splits[r][d]) for d in range(gs)] for r in range(gs)]
        for d in range(gs):
            self.put(f"x{d}", self.ins[me][d])
            self.out(f"o{d}", (s.splits[d][me],))

    def issue(self, a):
        gs = self.m.size
        return _works(dist.all_to_all([self.buf[f"o{d}"] for d in range(gs)],
                                      [self.buf[f"x{d}"] for d in range(gs)], group=self.pg,
                                      async_op=a))

    def verify(self):
        me = self.m.me
        for r in range(self.m.size):
            self.same(f"o{r}", self.ins[r][me], f"from group rank {r}")


class AllToAllDeviceSplits(MixOp):
    """resident_pg.ep.all_to_all_device_splits: [group size, n, cols] capacity buffers, the
    rows each peer gets given by count tensors; rows past the counts keep their contents."""

    def fill(self, k):
        s, gs, me = self.spec, self.m.size, self.m.me
        self.ins = [self.data(k, "x", r, gs * s.n * s.cols).reshape(gs, s.n, s.cols)
                    for r in range(gs)]
        self.put("x", self.ins[me])
        self.out("o", (gs, s.n, s.cols))
        send = [s.splits[me][d] for d in range(gs)]
        recv = [s.splits[r][me] for r in range(gs)]
        flags = s.variant.split(",")
        k = next((int(f.split("=")[1]) for f in flags if f.startswith("parts=")), 0)
        self.counts_out = "out" in flags
        if self.counts_out:  # recv_rows is written: each pair's parts drawn from the pair's key
            send = self._pair_counts(k, [(me, d) for d in range(gs)])
            self.recv_counts = self._pair_counts(k, [(r, me) for r in range(gs)])
            self.put("send_rows", send)
            self.out("recv_rows", tuple(send.shape), "int64")
            return
        if k:  # [gs, k] counts, each peer's row adding up to its rows
            send, recv = count_parts(self.m.rng, send, k), count_parts(self.m.rng, recv, k)
        self.put("send_rows", torch.tensor(send))
        self.put("recv_rows", torch.tensor(recv))

    def _pair_counts(self, k, pairs):
        """The counts group rank src sends dst ([gs], or [gs, k] parts), the same on both ranks."""
        rows = []
        for src, dst in pairs:
            v = self.spec.splits[src][dst]
            key = zlib.crc32(f"{self.m.key}/counts/{self.m.glob(src)}/{self.m.glob(dst)}".encode())
            rows.append(count_parts(np.random.default_rng(key), [v], k)[0] if k else v)
        return torch.tensor(np.array(rows, dtype=np.int64))

    def issue(self, a):
        from resident_pg.ep import all_to_all_device_splits

        return _works(all_to_all_device_splits(self.buf["o"], self.buf["x"],
                                               self.buf["send_rows"], self.buf["recv_rows"],
                                               group=self.pg, async_op=a,
                                               counts_out=self.counts_out))

    def verify(self):
        s, me = self.spec, self.m.me
        if self.counts_out:
            self.same("recv_rows", self.recv_counts, "recv_rows from the peers' counts")
        got = self.host(self.buf["o"])
        for r in range(self.m.size):
            rows = s.splits[r][me]
            self.errors += compare_exact(got[r, :rows], self.ins[r][me, :rows],
                                         f"rows from group rank {r}")
            self.errors += compare_exact(got[r, rows:], torch.full_like(got[r, rows:], SENTINEL.get(
                s.dtype, -77.25)), f"rows past the count from group rank {r} (must stay)")
        self.unchanged("x", self.ins[me])


class Barrier(MixOp):
    def fill(self, k):
        pass

    def issue(self, a):
        return _works(dist.barrier(group=self.pg, async_op=a))

    def verify(self):
        pass


OPS = {
    "all_reduce": AllReduce,
    "all_reduce_coalesced": AllReduceCoalesced,
    "broadcast": Broadcast,
    "reduce": Reduce,
    "all_gather": AllGather,
    "all_gather_into_tensor": AllGatherIntoTensor,
    "all_gather_into_tensor_coalesced": AllGatherIntoTensorCoalesced,
    "all_gather_coalesced": AllGatherCoalesced,
    "gather": Gather,
    "scatter": Scatter,
    "reduce_scatter": ReduceScatter,
    "reduce_scatter_tensor": ReduceScatterTensor,
    "reduce_scatter_tensor_coalesced": ReduceScatterTensorCoalesced,
    "all_to_all_single": AllToAllSingle,
    "all_to_all": AllToAll,
    "all_to_all_device_splits": AllToAllDeviceSplits,
    "p2p_pairs": P2PPairs,
    "p2p_ring": P2PRing,
    "p2p_tagged": P2PTagged,
    "batch_isend_irecv": BatchIsendIrecv,
    "barrier": Barrier,
}


def make_op(spec, member: Member) -> MixOp:
    return (OPS.get(spec.kind) or OBJECT_OPS.get(spec.kind) or EP_OPS[spec.kind])(spec, member)
