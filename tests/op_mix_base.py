"""One op of an op mix on one rank: :class:`Member` (where it runs) and :class:`MixOp`, the base
of every op kind (op_mix_ops.py, op_mix_p2p.py, op_mix_objects.py, op_mix_ep.py).

An op object lives on one rank of its group. ``fill(key)`` generates every member's input from
(key, global rank) with reference_data.make_input, copies this rank's into the
static buffers (created on the first fill, reused afterwards: a captured CUDA graph reads them)
and resets the outputs to a sentinel; ``issue(async_op)`` makes the call and returns the Works
still to wait on (none when synchronous); ``check()`` returns the mismatches, references in
numpy / float64 (reductions in rank order 0..n-1, float16 / bfloat16 accumulated in float32 and
rounded once, integers bitwise, data movement bitwise). ``digests`` holds the outputs every
member of the group must have bitwise alike.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from reference_data import compare_exact, compare_reduction, digest, make_input, reference_reduce

SENTINEL = {"uint8": 123, "int8": -77, "bool": True, "int32": -77, "int64": -77}


class Member:
    """Where an op runs: this rank's place in the op's group, the device, the data key."""

    def __init__(self, plan, spec, rank: int, pg, device: str, key: str, local_rng,
                 cache=None):
        self.ranks = plan.groups[spec.group].ranks
        self.rank = rank
        self.me = self.ranks.index(rank)
        self.size = len(self.ranks)
        self.pg = pg  # None: the default group
        self.device = device
        self.key = key
        self.rng = local_rng  # this rank's own choices (posting orders)
        # objects kept across the ops of a seed (op_mix_ep: a Buffer per group and shape);
        # None: the op's own
        self.cache = {} if cache is None else cache

    def glob(self, group_rank: int) -> int:
        return self.ranks[group_rank]


class MixOp(abc.ABC):
    def __init__(self, spec, m: Member):
        self.spec, self.m = spec, m
        self.buf = {}
        self.outputs = []  # names of the buffers the op writes (in creation order)
        self.digests = {}
        self.errors = []

    # ---- helpers -------------------------------------------------------------

    def data(self, fill_key, tag, group_rank, n, dtype=None, kind="normal"):
        return make_input(f"{self.m.key}/{fill_key}/{tag}", self.m.glob(group_rank), n,
                         dtype or self.spec.dtype, kind)

    def put(self, name, host_tensor):
        """Static buffer ``name`` holding a copy of host_tensor (same shape on every fill)."""
        if name in self.buf:
            self.buf[name].copy_(host_tensor)
        else:
            self.buf[name] = host_tensor.to(self.m.device, copy=True)
        return self.buf[name]

    def out(self, name, shape, dtype=None):
        dtype = dtype or self.spec.dtype
        value = SENTINEL.get(dtype, -77.25)
        if name in self.buf:
            self.buf[name].fill_(value)
        else:
            self.buf[name] = torch.full(shape, value, dtype=getattr(torch, dtype),
                                        device=self.m.device)
            self.outputs.append(name)
        return self.buf[name]

    @staticmethod
    def host(t):
        return t.detach().to("cpu", copy=True)

    def same(self, name, ref, what):
        self.errors += compare_exact(self.host(self.buf[name]), ref, what)

    def unchanged(self, name, ref):
        self.errors += compare_exact(self.host(self.buf[name]), ref, f"input {name} modified")

    def reduced(self, name, inputs, op, dtype, what, shared=True):
        got = self.host(self.buf[name])
        self.errors += compare_reduction(got, reference_reduce(inputs, op, dtype), inputs, op,
                                         dtype, what)
        if shared:
            self.digests[what] = digest(got)

    @property
    def pg(self):
        return self.m.pg

    def redop(self):
        return getattr(dist.ReduceOp, self.spec.redop)

    def check(self):
        self.errors, self.digests = [], {}
        self.verify()
        return self.errors

    # ---- per kind --------------------------------------------------------------

    @abc.abstractmethod
    def fill(self, fill_key):
        """This rank's inputs of ``fill_key`` in the static buffers, the outputs reset."""

    @abc.abstractmethod
    def issue(self, async_op):
        """The call; the Works still to wait on."""

    @abc.abstractmethod
    def verify(self):
        """Appends mismatches to ``errors`` and shared outputs to ``digests``."""
