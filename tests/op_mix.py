"""Seeded random op mixes for the resident backend: a seed becomes a plan that every rank builds
alike (the subgroups, the steps and their ops, the ops of a final CUDA-graph phase).

A plan is pure data (no torch; its types and the op kinds: op_mix_plan.py): :func:`make_plan`
turns ``(seed, world size, capabilities)`` into groups and steps; op_mix_ops.py runs and checks
each op, op_mix_run.py runs a plan inside a rank. Every random choice comes from
``numpy.random.default_rng`` seeded with the plan's seed, so a failing sequence is rerun exactly
from its seed (``RESIDENT_OPMIX_SEEDS``), and ``python tests/op_mix.py --seed S --ws N
[--device cuda]`` prints it.

What a plan covers: every op kind of ``op_mix_plan.KINDS`` x the dtypes each takes (reductions:
the eight reduction dtypes, bool and complex64 with every reduce op valid for the dtype; data
movement also bool) x sizes from empty to ~100k elements (odd sizes and the 2 KiB / 32 KiB /
64 KiB / 128 KiB boundaries of the CPU slots and the GPU rounds favoured) x groups (the world
and one to three subgroups from ``dist.new_group``: a second communicator over every rank,
single ranks, and rank subsets that are not contiguous) x sync / async (single async ops waited
at once, and batches of async ops waited in a random order, some through ``get_future()``, some
polled). Every kind is drawn at least once per plan before the draws become weighted.
"""

from __future__ import annotations

import os
from typing import Optional

from op_mix_plan import (
    CPU_CAPS,
    CUDA_CAPS,
    EP_DTYPES,
    EP_FP8,
    EP_ROUTINGS,
    EP_TRANSPORTS,
    ITEMSIZE,
    KINDS,
    MOVE_DTYPES,
    Caps,
    EpCall,
    EpShape,
    Group,
    OpSpec,
    Plan,
    Step,
    reduce_ops_for,
)

MAX_ELEMS = 100_003
# Byte counts where the transfer changes shape: a GPU part (2 KiB), half a GPU round (the simple
# protocol's threshold), one CPU slot / GPU round (64 KiB), two of them.
BOUNDARY_BYTES = (2048, 32768, 65536, 131072)

# The settings every sequence runs under. An axis is (name, {value: environment}); the modes are
# the product of the axes, so one more line here adds a dimension to both test modules, e.g.
#     ("debug", {"OFF": {"TORCH_DISTRIBUTED_DEBUG": "OFF"}, "DETAIL": {...}}),
# (op_mix_run applies a mode's environment before the mode's groups are created and calls
# torch.distributed.set_debug_level_from_env() after setting it).
MODE_AXES = [
    ("mode", {"default": {}, "proxy": {"RESIDENT_PATH": "proxy"},
              "tcp": {"RESIDENT_TRANSPORT": "tcp"}}),
]


class _Gen:
    """The draws of one plan from one rng: a seed's plan is the sequence of these calls, so their
    order is what keeps a seed's plan the same."""

    def __init__(self, seed: int, ws: int, caps: Caps):
        import numpy as np

        self.rng = np.random.default_rng([seed, ws, 0x6F706D78])
        self.ws = ws
        self.caps = caps
        self.next_tag = 1
        self.deck = []  # kinds not drawn yet in this plan
        self.ep_shapes = {}  # group index -> the EpShapes drawn on it (their Buffers are reused)

    def choice(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def coin(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def tags(self, k: int) -> tuple:
        t = tuple(range(self.next_tag, self.next_tag + k))
        self.next_tag += k
        return t

    # ---- groups -------------------------------------------------------------

    def groups(self) -> list:
        ws = self.ws
        out = [Group(0, tuple(range(ws)))]
        for i in range(int(self.rng.integers(1, 4))):
            if i == 0 and ws >= 3:
                ranks = self._non_contiguous()
            elif self.coin(0.2):
                ranks = tuple(range(ws))  # a second communicator over every rank
            elif self.coin(0.15):
                ranks = (int(self.rng.integers(ws)),)
            else:
                k = int(self.rng.integers(2, ws + 1))
                ranks = tuple(sorted(int(r) for r in self.rng.choice(ws, size=k, replace=False)))
            out.append(Group(len(out), ranks))
        return out

    def _non_contiguous(self) -> tuple:
        while True:
            k = int(self.rng.integers(2, self.ws))
            ranks = tuple(sorted(int(r) for r in self.rng.choice(self.ws, size=k, replace=False)))
            if ranks[-1] - ranks[0] + 1 != len(ranks):
                return ranks

    # ---- sizes and dtypes ---------------------------------------------------

    def size(self, dtype: str, empty: bool = True, cap: int = MAX_ELEMS) -> int:
        r = self.rng.random()
        if empty and r < 0.04:
            return 0
        if r < 0.14:
            b = self.choice(BOUNDARY_BYTES) // ITEMSIZE[dtype] + int(self.rng.integers(-1, 2))
            return max(1, min(b, cap))
        if r < 0.40:
            n = int(self.rng.integers(1, 17))
        elif r < 0.72:
            n = int(self.rng.integers(17, 2049))
        elif r < 0.92:
            n = int(self.rng.integers(2049, 20001))
        else:
            n = int(self.rng.integers(20001, MAX_ELEMS + 1))
        if n % 2 == 0 and self.coin(0.5):
            n += 1
        return max(1, min(n, cap))

    def per_peer(self, dtype: str, gsize: int) -> int:
        """Elements per peer for kinds whose volume grows with the group."""
        n = self.size(dtype)
        return 0 if n == 0 else max(1, n // gsize)

    def redop(self, dtypes) -> str:
        return self.choice(reduce_ops_for(dtypes))

    # ---- ops ----------------------------------------------------------------

    def allowed(self, batchable: bool, capturable: bool) -> list:
        return [k for k, v in KINDS.items()
                if (not v.needs or getattr(self.caps, v.needs))
                and (v.batchable or not batchable) and (v.capturable or not capturable)]

    def kind(self, batchable: bool, capturable: bool) -> str:
        allowed = self.allowed(batchable, capturable)
        for i, k in enumerate(self.deck):
            if k in allowed:
                return self.deck.pop(i)
        w = [KINDS[k].weight for k in allowed]
        total = float(sum(w))
        return str(self.rng.choice(allowed, p=[x / total for x in w]))

    def op(self, groups, batchable=False, capturable=False, world=False) -> OpSpec:
        kind = self.kind(batchable, capturable)
        fits = [g for g in groups if len(g.ranks) >= KINDS[kind].min_group]
        g = groups[0] if world or self.coin(0.5) else self.choice(fits)
        if len(g.ranks) < KINDS[kind].min_group:
            g = groups[0]
        spec = OpSpec(kind, g.index)
        getattr(self, "_" + kind)(spec, len(g.ranks))
        return spec

    def _reduction(self, s: OpSpec):
        s.dtype = self.choice(self.caps.reduce_dtypes)
        s.redop = self.redop([s.dtype])

    def _all_reduce(self, s, gs):
        self._reduction(s)
        s.n = self.size(s.dtype)

    def _coalesced(self, s, dtypes_from, per_peer_of, mix=True):
        k = int(self.rng.integers(1, 5))
        if mix and self.caps.coalesced_dtype_mix and self.coin(0.5):
            s.dtypes = tuple(self.choice(dtypes_from) for _ in range(k))
        else:
            s.dtypes = (self.choice(dtypes_from),) * k
        s.sizes = tuple(per_peer_of(d) for d in s.dtypes)

    def _all_reduce_coalesced(self, s, gs):
        # dist.all_reduce_coalesced takes one dtype; all_reduce calls in a coalescing manager
        # reach the backend's allreduce_coalesced with several
        s.variant = self.choice(("api", "manager"))
        self._coalesced(s, self.caps.reduce_dtypes, self.size, mix=s.variant == "manager")
        s.redop = self.redop(s.dtypes)

    def _broadcast(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        s.n = self.size(s.dtype)
        s.root = int(self.rng.integers(gs))

    def _reduce(self, s, gs):
        self._all_reduce(s, gs)
        s.root = int(self.rng.integers(gs))

    def _all_gather(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        s.n = self.per_peer(s.dtype, gs)

    def _all_gather_into_tensor(self, s, gs):
        self._all_gather(s, gs)
        s.variant = self.choice(("cat", "stack"))

    def _all_gather_into_tensor_coalesced(self, s, gs):
        self._coalesced(s, MOVE_DTYPES, lambda d: self.per_peer(d, gs))

    def _all_gather_coalesced(self, s, gs):
        self._coalesced(s, MOVE_DTYPES, lambda d: self.per_peer(d, gs), mix=False)

    def _gather(self, s, gs):
        self._all_gather(s, gs)
        s.root = int(self.rng.integers(gs))

    def _scatter(self, s, gs):
        self._gather(s, gs)

    def _reduce_scatter(self, s, gs):
        self._reduction(s)
        s.n = self.per_peer(s.dtype, gs)

    def _reduce_scatter_tensor(self, s, gs):
        self._reduce_scatter(s, gs)
        s.variant = self.choice(("cat", "stack"))

    def _reduce_scatter_tensor_coalesced(self, s, gs):
        self._coalesced(s, self.caps.reduce_dtypes, lambda d: self.per_peer(d, gs))
        s.redop = self.redop(s.dtypes)

    def _split_matrix(self, gs: int, m: int) -> tuple:
        """Uneven splits with zeros: row s = what group rank s sends to each d."""
        zero_p = 0.25 if gs > 1 else 0.0
        return tuple(tuple(0 if self.coin(zero_p) else int(self.rng.integers(0, 2 * m + 2))
                           for _ in range(gs)) for _ in range(gs))

    def _all_to_all_single(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        m = self.per_peer(s.dtype, gs)
        s.variant = self.choice(("even", "uneven", "rows"))
        if s.variant == "even":
            s.n = m
            return
        if s.variant == "rows":
            s.cols = int(self.rng.integers(2, 9))
            m = max(1, m // s.cols) if m else 0
        s.n = m
        s.splits = self._split_matrix(gs, m)

    def _all_to_all(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        s.n = self.per_peer(s.dtype, gs)
        s.splits = self._split_matrix(gs, s.n)

    def _all_to_all_device_splits(self, s, gs):
        """Capacity ``n`` rows of ``cols`` elements per peer; ``splits[s][d]`` rows (at most
        ``n``) go from group rank s to d, as one count per peer or (variant ``parts=k``) k counts
        per peer that add up to it; variant ``out``: recv_rows is written (``counts_out``)."""
        s.dtype = self.choice(MOVE_DTYPES)
        s.cols = int(self.rng.integers(1, 9))
        s.n = self.per_peer(s.dtype, gs) // s.cols
        s.splits = tuple(tuple(min(v, s.n) for v in row) for row in self._split_matrix(gs, s.n))
        if self.coin(0.5):
            s.variant = f"parts={int(self.rng.integers(2, 6))}"
        # recv_rows written from the peers' counts (counts_out) for even widths: a draw the
        # stream has already made, so that the mix's other ops stay as they were
        if s.cols % 2 == 0:
            s.variant = ",".join(v for v in (s.variant, "out") if v)

    def _ep_shape(self, group: int) -> EpShape:
        """Half the time a Buffer already drawn on the group (reused by the ranks: other routings,
        top-k widths and dispatch formats on the same static buffers), else a fresh shape."""
        drawn = self.ep_shapes.setdefault(group, [])
        if drawn and self.coin(0.5):
            return self.choice(drawn)
        r = self.rng.random()
        if r < 0.4:
            hidden = int(self.rng.integers(1, 97))  # activations only
        elif r < 0.8:
            hidden = 128 * int(self.rng.integers(1, 4))  # FP8: one scale per 128 channels
        else:
            hidden = 512  # FP8 with UE8M0: four scales per int32
        shape = EpShape(self.choice((1, 2, 3, 5, 8)), hidden, int(self.rng.integers(1, 4)),
                        self.choice(EP_DTYPES), self.choice(EP_TRANSPORTS))
        drawn.append(shape)
        return shape

    def _ep_dispatch_combine(self, s, gs):
        shape = self._ep_shape(s.group)
        experts = shape.local_experts * gs
        k = int(self.rng.integers(1, min(experts, 8) + 1))
        tokens = tuple(0 if self.coin(0.25) else int(self.rng.integers(1, shape.max_tokens + 1))
                       for _ in range(gs))
        routing = self.choice(EP_ROUTINGS)
        hot = (tuple(sorted(int(e) for e in self.rng.choice(experts, size=k, replace=False)))
               if routing == "hot" else ())
        formats = [f for f in EP_FP8
                   if not f or shape.hidden % (512 if f == "fp8_ue8m0" else 128) == 0]
        fp8 = self.choice(formats[1:]) if len(formats) > 1 and self.coin(0.5) else ""
        s.dtype = shape.dtype
        s.ep = EpCall(shape, k, tokens, routing, hot, fp8,
                      (self.coin(0.5), self.coin(0.5)), (self.coin(0.5), self.coin(0.5)),
                      self.coin(0.3), self.coin(0.5))

    def _p2p_pairs(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        s.n = self.size(s.dtype)
        order = [int(r) for r in self.rng.permutation(gs)]
        s.pairs = tuple((order[i], order[i + 1]) for i in range(0, gs - 1, 2))
        s.tags = self.tags(1)

    def _p2p_ring(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        s.n = self.size(s.dtype)
        s.shift = int(self.rng.integers(1, gs))
        s.tags = self.tags(1)

    def _p2p_tagged(self, s, gs):
        s.dtype = self.choice(MOVE_DTYPES)
        k = int(self.rng.integers(2, 5))
        s.sizes = tuple(self.size(s.dtype, cap=20001) for _ in range(k))
        a, b = (int(r) for r in self.rng.choice(gs, size=2, replace=False))
        s.pairs = ((a, b),)
        s.tags = self.tags(k)
        s.order = tuple(int(i) for i in self.rng.permutation(k))

    def _batch_isend_irecv(self, s, gs):
        self._p2p_ring(s, gs)

    def _barrier(self, s, gs):
        pass

    def _object(self, s, gs):
        s.n = int(self.rng.integers(1, 5))  # objects per rank (broadcast_object_list)
        s.root = int(self.rng.integers(gs))

    _broadcast_object_list = _all_gather_object = _gather_object = _scatter_object_list = _object

    # ---- steps and the graph phase ------------------------------------------

    def step(self, index: int, groups) -> Step:
        r = self.rng.random()
        if r < 0.25:
            k = int(self.rng.integers(2, 6))
            return Step(index, "batch", [self.op(groups, batchable=True) for _ in range(k)])
        if r < 0.45:
            return Step(index, "async", [self.op(groups, batchable=True)])
        return Step(index, "sync", [self.op(groups)])

    def graph(self, groups) -> list:
        # An all_reduce of the world with data: every rank's graph captures a kernel (a rank
        # outside the other ops' groups would otherwise capture an empty graph).
        first = OpSpec("all_reduce", 0)
        self._all_reduce(first, self.ws)
        first.n = max(1, first.n)
        k = int(self.rng.integers(1, 5))
        ops = [(first, self.coin(0.4))]
        ops += [(self.op(groups, capturable=True), self.coin(0.4)) for _ in range(k)]
        return [ops[int(i)] for i in self.rng.permutation(len(ops))]


def default_steps() -> int:
    return int(os.environ.get("RESIDENT_OPMIX_STEPS", "40"))


def make_plan(seed: int, ws: int, caps: Caps, steps: Optional[int] = None) -> Plan:
    g = _Gen(seed, ws, caps)
    groups = g.groups()
    g.deck = [str(k) for k in g.rng.permutation(sorted(g.allowed(False, False)))]
    n_steps = default_steps() if steps is None else steps
    body = [g.step(i, groups) for i in range(n_steps)]
    graph = g.graph(groups)
    return Plan(seed, ws, caps, groups, body, graph)


def modes(axes=None) -> list:
    """[(mode id, environment)] over the product of MODE_AXES."""
    out = [("", {})]
    for _name, values in (MODE_AXES if axes is None else axes):
        out = [(f"{mid}-{v}" if mid else v, {**env, **venv})
               for mid, env in out for v, venv in values.items()]
    return out


def seeds_from_env(default) -> list:
    """RESIDENT_OPMIX_SEEDS: '7', '1,5,9' or '100-199' (ranges inclusive, may be mixed)."""
    spec = os.environ.get("RESIDENT_OPMIX_SEEDS", "").strip()
    if not spec:
        return list(default)
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out:
        raise ValueError(f"RESIDENT_OPMIX_SEEDS={spec!r} names no seed")
    return out


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Print the op mix of a seed.")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--ws", type=int, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=None)
    a = p.parse_args(argv)
    caps = CPU_CAPS if a.device == "cpu" else CUDA_CAPS
    print(make_plan(a.seed, a.ws, caps, a.steps).text())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
