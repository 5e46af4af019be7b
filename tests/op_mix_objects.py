"""The object collectives of an op mix (broadcast_object_list, all_gather_object,
gather_object, scatter_object_list): synchronous, never captured; each rank's objects come from
(key, global rank), and what a rank received must equal the objects it regenerates itself."""

from __future__ import annotations

import torch.distributed as dist

from op_mix_base import MixOp
from reference_data import rng_for


def make_object(key: str, rank: int):
    """A picklable Python object of a rank: nested containers, ints beyond 64 bits, floats,
    text, and bytes from a few bytes to ~200 KiB (several slots)."""
    rng = rng_for(key, rank)
    big = int(rng.integers(0, 4)) == 0
    nbytes = int(rng.integers(100_000, 200_000)) if big else int(rng.integers(0, 3000))
    return {"rank": rank, "key": key, "int": int(rng.integers(-2**62, 2**62)) * 2**70 + rank,
            "floats": [float(x) for x in rng.standard_normal(int(rng.integers(0, 20)))],
            "text": "é" * int(rng.integers(0, 40)) + key,
            "blob": rng.bytes(nbytes), "nested": [(rank, None, True), {"k": (1.5, "v")}]}


class ObjectOp(MixOp):
    def obj(self, k, group_rank, i=0):
        return make_object(f"{self.m.key}/{k}/{i}", self.m.glob(group_rank))

    def issue(self, a):
        if a:
            raise ValueError("object collectives have no async_op")
        self.call()
        return []


class BroadcastObjectList(ObjectOp):
    def fill(self, k):
        s = self.spec
        self.ref = [self.obj(k, s.root, i) for i in range(s.n)]
        self.lst = list(self.ref) if self.m.me == s.root else [None] * s.n

    def call(self):
        dist.broadcast_object_list(self.lst, src=self.m.glob(self.spec.root), group=self.pg)

    def verify(self):
        if self.lst != self.ref:
            self.errors.append("broadcast_object_list: the objects differ from the root's")


class AllGatherObject(ObjectOp):
    def fill(self, k):
        self.ref = [self.obj(k, r) for r in range(self.m.size)]
        self.lst = [None] * self.m.size

    def call(self):
        dist.all_gather_object(self.lst, self.ref[self.m.me], group=self.pg)

    def verify(self):
        bad = [r for r in range(self.m.size) if self.lst[r] != self.ref[r]]
        if bad:
            self.errors.append(f"all_gather_object: the objects of group ranks {bad} differ")


class GatherObject(AllGatherObject):
    def call(self):
        root = self.spec.root
        dist.gather_object(self.ref[self.m.me], self.lst if self.m.me == root else None,
                           dst=self.m.glob(root), group=self.pg)

    def verify(self):
        if self.m.me == self.spec.root:
            super().verify()


class ScatterObjectList(ObjectOp):
    def fill(self, k):
        self.ref = [self.obj(k, self.spec.root, d) for d in range(self.m.size)]
        self.got = [None]

    def call(self):
        root = self.spec.root
        dist.scatter_object_list(self.got, self.ref if self.m.me == root else None,
                                 src=self.m.glob(root), group=self.pg)

    def verify(self):
        if self.got[0] != self.ref[self.m.me]:
            self.errors.append("scatter_object_list: the object differs from the root's")


OBJECT_OPS = {
    "broadcast_object_list": BroadcastObjectList,
    "all_gather_object": AllGatherObject,
    "gather_object": GatherObject,
    "scatter_object_list": ScatterObjectList,
}
