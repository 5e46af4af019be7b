"""What an op-mix plan is made of (op_mix.py draws one from a seed): the dtypes and reduce ops
it draws from, the op kinds (:data:`KINDS`), the device capabilities that are part of its input
(:class:`Caps`), and the plan itself: groups, steps of :class:`OpSpec` ops, the graph phase, and
the :class:`EpCall` of the EP kind. Pure data (no torch), so every rank builds the same plan.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# Reduced on every device; bool (a logical or / and / xor) and complex64 (SUM and AVG of its
# parts) too.
REDUCE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8")
MAPPED_REDUCE_DTYPES = ("bool", "complex64")
MOVE_DTYPES = REDUCE_DTYPES + ("bool",)  # data movement: any dtype
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INT_OPS = FLOAT_OPS + ("BAND", "BOR", "BXOR")
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8,
            "uint8": 1, "bool": 1, "int8": 1, "complex64": 8}


def reduce_ops_for(dtypes) -> tuple:
    """The reduce ops valid for every dtype of a call, in INT_OPS order."""
    ops = FLOAT_OPS if any(d in FLOAT_DTYPES or d.startswith("complex") for d in dtypes) \
        else INT_OPS
    if any(d.startswith("complex") for d in dtypes):
        ops = tuple(o for o in ops if o in ("SUM", "AVG"))
    if "bool" in dtypes:
        ops = tuple(o for o in ops if o != "AVG")
    return ops


@dataclasses.dataclass(frozen=True)
class Caps:
    """What the device's path promises beyond the common ground; part of the plan's input."""

    device: str
    # CPU: send/recv tags match messages in any order; CUDA ignores tags (issue order matches).
    p2p_tags: bool
    # CPU: the coalesced forms take tensors of different dtypes in one call.
    coalesced_dtype_mix: bool
    graph_replays: int
    # The dtypes reductions draw from.
    reduce_dtypes: tuple
    # The backend under test is resident (RESIDENT_TEST_BACKEND): ops that only it serves, such
    # as resident_pg.ep.all_to_all_device_splits (a ValueError on another backend), are drawn.
    resident_ops: bool = True


CPU_CAPS = Caps("cpu", p2p_tags=True, coalesced_dtype_mix=True, graph_replays=3,
                reduce_dtypes=REDUCE_DTYPES + MAPPED_REDUCE_DTYPES)
CUDA_CAPS = Caps("cuda", p2p_tags=False, coalesced_dtype_mix=False, graph_replays=4,
                 reduce_dtypes=REDUCE_DTYPES + MAPPED_REDUCE_DTYPES)


@dataclasses.dataclass(frozen=True)
class Kind:
    weight: int
    min_group: int = 1      # smallest group it runs on
    batchable: bool = True  # may be issued with async_op=True
    capturable: bool = True  # may be captured into a CUDA graph
    needs: str = ""         # a Caps flag it needs


KINDS = {
    "all_reduce": Kind(10),
    "all_reduce_coalesced": Kind(3),
    "broadcast": Kind(5),
    "reduce": Kind(4),
    "all_gather": Kind(4),
    "all_gather_into_tensor": Kind(5),
    "all_gather_into_tensor_coalesced": Kind(2),
    # the list form (deprecated in torch): Backend::allgather_coalesced
    "all_gather_coalesced": Kind(1, capturable=False),
    "gather": Kind(3),
    "scatter": Kind(3),
    "reduce_scatter": Kind(3),
    "reduce_scatter_tensor": Kind(4),
    "reduce_scatter_tensor_coalesced": Kind(2),
    "all_to_all_single": Kind(5),
    "all_to_all": Kind(3),
    # resident_pg.ep: capacity buffers, per-peer row counts as tensors (read by the kernel)
    "all_to_all_device_splits": Kind(3, needs="resident_ops"),
    # resident_pg.ep.Buffer: one low_latency_dispatch + stand-in experts + low_latency_combine
    # (op_mix_ep.py). Issued async (a batch, or a graph op with async_op): the combine's
    # async_finish event is what is waited on.
    "ep_dispatch_combine": Kind(2),
    "p2p_pairs": Kind(4, min_group=2),
    "p2p_ring": Kind(4, min_group=2),
    "p2p_tagged": Kind(2, min_group=2, needs="p2p_tags"),
    "batch_isend_irecv": Kind(3, min_group=2),
    "barrier": Kind(2, capturable=False),
    "broadcast_object_list": Kind(1, batchable=False, capturable=False),
    "all_gather_object": Kind(1, batchable=False, capturable=False),
    "gather_object": Kind(1, batchable=False, capturable=False),
    "scatter_object_list": Kind(1, batchable=False, capturable=False),
}

# Op kinds torch.distributed has that the backend does not implement; test_op_mix checks that
# each still raises, so that implementing one fails that test until it joins KINDS.
UNSUPPORTED: dict = {}


# ep_dispatch_combine: the Buffer's activation dtypes (FP8 dispatch quantizes these too)
EP_DTYPES = ("bfloat16", "float16", "float32")
# "auto": the device-splits exchange where the group's backend is resident, else the padded
# all_to_all_single (the kind then runs on gloo too); "padded" on any backend. "splits" is not
# drawn: on another backend it is a ValueError, and on resident it is what "auto" picks.
EP_TRANSPORTS = ("auto", "padded")
# routings: "random" (skewed choice of distinct experts, ~20% -1), "masked" (~60% -1, a first
# token with none), "hot" (every token of every rank to the same top-k experts)
EP_ROUTINGS = ("random", "random", "masked", "hot")
# dispatch formats: activations, or FP8 (DeepEP's cast; round_scale; round_scale + UE8M0)
EP_FP8 = ("", "fp8", "fp8_round", "fp8_ue8m0")


@dataclasses.dataclass(frozen=True)
class EpShape:
    """What a resident_pg.ep.Buffer is made for; a rank keeps one Buffer per (group, shape)."""

    max_tokens: int      # num_max_dispatch_tokens_per_rank
    hidden: int
    local_experts: int   # num_experts = local_experts x group size
    dtype: str
    transport: str

    def describe(self) -> str:
        return (f"Buffer(M={self.max_tokens} hidden={self.hidden} L={self.local_experts} "
                f"{self.dtype} {self.transport})")


@dataclasses.dataclass(frozen=True)
class EpCall:
    """One dispatch + combine on a Buffer of ``shape``."""

    shape: EpShape
    top_k: int
    tokens: tuple        # tokens of each group rank (0 .. max_tokens)
    routing: str         # one of EP_ROUTINGS
    hot: tuple           # "hot": the experts every token goes to
    fp8: str             # one of EP_FP8
    async_finish: tuple  # (dispatch, combine)
    recv_hook: tuple     # return_recv_hook of (dispatch, combine)
    stats: bool          # cumulative_local_expert_recv_stats given
    out: bool            # combine writes into a given out tensor

    def describe(self) -> str:
        flags = [n for n, on in (("finish-d", self.async_finish[0]),
                                 ("finish-c", self.async_finish[1]),
                                 ("hook-d", self.recv_hook[0]), ("hook-c", self.recv_hook[1]),
                                 ("stats", self.stats), ("out", self.out)) if on]
        return (f"{self.shape.describe()} top{self.top_k} tokens={list(self.tokens)} "
                f"{self.routing}{list(self.hot) if self.hot else ''} {self.fp8 or 'activations'}"
                + (" " + ",".join(flags) if flags else ""))


@dataclasses.dataclass(frozen=True)
class Group:
    index: int
    ranks: tuple  # global ranks, sorted (a group's rank i is ranks[i])

    def label(self) -> str:
        return "world" if self.index == 0 else f"g{self.index}{list(self.ranks)}"


@dataclasses.dataclass
class OpSpec:
    """One op. ``n`` is elements per rank (per chunk for scatter / reduce_scatter, per unit of
    the split matrix for all_to_all); ``root``, ``pairs``, ``shift`` are group ranks."""

    kind: str
    group: int
    dtype: Optional[str] = None
    n: int = 0
    redop: Optional[str] = None
    root: int = 0
    variant: str = ""
    dtypes: tuple = ()   # coalesced: one dtype per tensor
    sizes: tuple = ()    # coalesced: elements per tensor; p2p_tagged: per message
    splits: tuple = ()   # all_to_all(_single): splits[s][d] = rows s sends to d
    cols: int = 1        # all_to_all_single "rows": elements per row
    pairs: tuple = ()    # p2p_pairs: (first sender, other); p2p_tagged: one (sender, receiver)
    shift: int = 1       # p2p_ring, batch_isend_irecv: send to rank + shift
    tags: tuple = ()     # p2p tags (unique within a plan)
    order: tuple = ()    # p2p_tagged: the receiver's posting order
    ep: Optional[EpCall] = None  # ep_dispatch_combine

    def describe(self, groups) -> str:
        g = groups[self.group]
        parts = [self.kind]
        if self.ep is not None:
            return f"{self.kind} {self.ep.describe()} on {g.label()}"
        if self.redop:
            parts.append(self.redop)
        if self.dtypes:
            parts.append("dtypes=" + ",".join(self.dtypes))
        elif self.dtype:
            parts.append(self.dtype)
        if self.sizes:
            parts.append(f"sizes={list(self.sizes)}")
        elif self.kind not in ("barrier",):
            parts.append(f"n={self.n}")
        if self.variant:
            parts.append(self.variant)
        if self.kind in ("broadcast", "reduce", "gather", "scatter", "broadcast_object_list",
                         "gather_object", "scatter_object_list"):
            parts.append(f"root={self.root}")
        if self.splits:
            parts.append(f"splits={[list(r) for r in self.splits]}")
        if self.cols != 1:
            parts.append(f"cols={self.cols}")
        if self.pairs:
            parts.append(f"pairs={[list(p) for p in self.pairs]}")
        if self.kind in ("p2p_ring", "batch_isend_irecv"):
            parts.append(f"shift={self.shift}")
        if self.order:
            parts.append(f"recv order={list(self.order)}")
        return " ".join(parts) + f" on {g.label()}"


@dataclasses.dataclass
class Step:
    index: int
    mode: str  # "sync", "async" (one op, waited at once) or "batch" (async ops, then waits)
    ops: list


@dataclasses.dataclass
class Plan:
    seed: int
    ws: int
    caps: Caps
    groups: list
    steps: list
    graph: list  # [(OpSpec, async_op)]: the ops captured into one CUDA graph and replayed

    def text(self) -> str:
        lines = [f"op mix seed {self.seed}, {self.ws} ranks, {self.caps.device}: "
                 + ", ".join(g.label() for g in self.groups)]
        for s in self.steps:
            for j, op in enumerate(s.ops):
                lines.append(f"step {s.index} [{s.mode}] op {j}: {op.describe(self.groups)}")
        for j, (op, a) in enumerate(self.graph):
            lines.append(f"graph op {j} [{'async' if a else 'sync'}]: {op.describe(self.groups)}")
        return "\n".join(lines)
