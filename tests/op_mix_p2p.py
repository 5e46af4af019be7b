"""The point-to-point kinds of an op mix (send / recv, isend / irecv, batch_isend_irecv): pairs,
rings and tagged messages between group ranks, each checked bitwise against what the sender's
input regenerates to.
"""

from __future__ import annotations

import torch.distributed as dist

from op_mix_base import MixOp


def _wait_all(works):
    for w in works:
        w.wait()
    return []


class P2PPairs(MixOp):
    """Disjoint pairs exchange one message each way; the pair's first rank sends first."""

    def fill(self, k):
        self.peer = self.first = None
        for a, b in self.spec.pairs:
            if self.m.me in (a, b):
                self.first = self.m.me == a
                self.peer = b if self.first else a
        if self.peer is None:
            return
        self.ref = self.data(k, "x", self.peer, self.spec.n)
        self.mine = self.data(k, "x", self.m.me, self.spec.n)
        self.put("x", self.mine)
        self.out("o", (self.spec.n,))

    def issue(self, a):
        if self.peer is None:
            return []
        peer, tag = self.m.glob(self.peer), self.spec.tags[0]
        x, o = self.buf["x"], self.buf["o"]
        if not a:
            if self.first:
                dist.send(x, dst=peer, group=self.pg, tag=tag)
                dist.recv(o, src=peer, group=self.pg, tag=tag)
            else:
                dist.recv(o, src=peer, group=self.pg, tag=tag)
                dist.send(x, dst=peer, group=self.pg, tag=tag)
            return []
        if self.first:
            return [dist.isend(x, dst=peer, group=self.pg, tag=tag),
                    dist.irecv(o, src=peer, group=self.pg, tag=tag)]
        return [dist.irecv(o, src=peer, group=self.pg, tag=tag),
                dist.isend(x, dst=peer, group=self.pg, tag=tag)]

    def verify(self):
        if self.peer is not None:
            self.same("o", self.ref, f"from group rank {self.peer}")
            self.unchanged("x", self.mine)


class P2PRing(MixOp):
    """isend to rank + shift, irecv from rank - shift; this rank picks which to post first."""

    def fill(self, k):
        s, gs, me = self.spec, self.m.size, self.m.me
        self.right, self.left = (me + s.shift) % gs, (me - s.shift) % gs
        self.recv_first = bool(self.m.rng.integers(2))
        self.ref = self.data(k, "x", self.left, s.n)
        self.mine = self.data(k, "x", me, s.n)
        self.put("x", self.mine)
        self.out("o", (s.n,))

    def post(self):
        tag = self.spec.tags[0]
        recv = (dist.irecv, self.buf["o"], self.m.glob(self.left))
        send = (dist.isend, self.buf["x"], self.m.glob(self.right))
        order = (recv, send) if self.recv_first else (send, recv)
        return [fn(t, peer, group=self.pg, tag=tag) for fn, t, peer in order]

    def issue(self, a):
        works = self.post()
        return works if a else _wait_all(works)

    def verify(self):
        self.same("o", self.ref, f"from group rank {self.left}")
        self.unchanged("x", self.mine)


class BatchIsendIrecv(P2PRing):
    def post(self):
        tag = self.spec.tags[0]
        recv = dist.P2POp(dist.irecv, self.buf["o"], self.m.glob(self.left), self.pg, tag)
        send = dist.P2POp(dist.isend, self.buf["x"], self.m.glob(self.right), self.pg, tag)
        return dist.batch_isend_irecv([recv, send] if self.recv_first else [send, recv])


class P2PTagged(MixOp):
    """One sender, one receiver, several messages with distinct tags; the receiver posts its
    irecvs in another order than the sends (CPU: tags match them)."""

    def fill(self, k):
        s = self.spec
        (self.src, self.dst), = s.pairs
        self.msgs = [self.data(k, f"m{i}", self.src, n) for i, n in enumerate(s.sizes)]
        if self.m.me == self.src:
            for i, t in enumerate(self.msgs):
                self.put(f"m{i}", t)
        elif self.m.me == self.dst:
            for i, n in enumerate(s.sizes):
                self.out(f"o{i}", (n,))

    def issue(self, a):
        s, works = self.spec, []
        if self.m.me == self.src:
            peer = self.m.glob(self.dst)
            works = [dist.isend(self.buf[f"m{i}"], dst=peer, group=self.pg, tag=s.tags[i])
                     for i in range(len(s.sizes))]
        elif self.m.me == self.dst:
            peer = self.m.glob(self.src)
            works = [dist.irecv(self.buf[f"o{i}"], src=peer, group=self.pg, tag=s.tags[i])
                     for i in s.order]
        return works if a else _wait_all(works)

    def verify(self):
        for i, t in enumerate(self.msgs):
            if self.m.me == self.dst:
                self.same(f"o{i}", t, f"message {i} (tag {self.spec.tags[i]})")
            elif self.m.me == self.src:
                self.unchanged(f"m{i}", t)
