"""The EP kind of an op mix (op_mix_plan.KINDS "ep_dispatch_combine"): one
``resident_pg.ep.Buffer.low_latency_dispatch``, stand-in experts, and one
``low_latency_combine`` on a group, with a random routing (op_mix_plan.EpCall), checked against
references computed from the inputs alone (ep_reference.py): the received rows and counts
bitwise (FP8: the fp8 bytes and the scales, float32 or packed UE8M0), the combined output within
the payload dtype's rounding, ``cumulative_local_expert_recv_stats``, the returned events and
hooks, and the inputs unmodified.

A Buffer allocates static buffers, so a rank keeps one per (group, EpShape) for the whole seed
(``Member.cache``, kept by op_mix_run's seed): later draws of that shape reuse it with other
routings, top-k widths and dispatch formats, and a graph op may capture one that an eager step
made. What a dispatch returns is the Buffer's own and is overwritten by the next dispatch on it,
so the op copies it into its own static buffers at once (stream-ordered, also inside a capture).

The expert of id ``e`` (numbered in the group: group rank ``r`` hosts ``r*L .. r*L+L-1``)
multiplies its rows by ``ep_reference.expert_scale(e)`` in float32 and rounds them to the payload
dtype; on FP8 rows it dequantizes them first (float32).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ep_reference import (
    combine_reference,
    dispatch_reference,
    expert_scale,
    fp8_dequantize,
    fp8_quantize,
    to_dtype,
    ue8m0_packed,
)
from op_mix_base import MixOp
from reference_data import rng_for

FP8_GROUP = 128  # channels per FP8 scale
UE8M0_PER_INT32 = 4


def ep_inputs(key: str, rank: int, T: int, call, group_size: int):
    """``(x [T, hidden] float64 values of the payload dtype, topk_idx [T, K] int64,
    topk_weights [T, K] float32)`` of global rank ``rank``; any rank regenerates any other's.

    Token rows: normal values times a magnitude of 2**-6 .. 2**6 per group of 128 channels (the
    FP8 scales differ within a row). Routing (``call.routing``): "random" draws K distinct experts
    with a skew to the low ids (some experts get none) and makes ~20% of the entries -1;
    "masked" ~60%, the first token's all; "hot" sends every token to ``call.hot``."""
    sh, K = call.shape, call.top_k
    E = sh.local_experts * group_size
    rng = rng_for(key, rank)
    groups = -(-sh.hidden // FP8_GROUP)
    mag = np.repeat(2.0 ** rng.uniform(-6, 6, (T, groups)), FP8_GROUP, axis=1)[:, :sh.hidden]
    x = to_dtype(rng.standard_normal((T, sh.hidden)) * mag, sh.dtype)
    if call.routing == "hot":
        idx = np.tile(np.asarray(call.hot, dtype=np.int64), (T, 1))
    else:
        p = 1.0 / (1.0 + np.arange(E)) ** 1.2
        p /= p.sum()
        idx = np.zeros((T, K), dtype=np.int64)
        for t in range(T):
            idx[t] = rng.choice(E, size=K, replace=False, p=p)
        idx[rng.random((T, K)) < (0.6 if call.routing == "masked" else 0.2)] = -1
        if call.routing == "masked" and T:
            idx[0] = -1
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    return x, idx, w


class _Finish:
    """The async handle of an ep_dispatch_combine issued with async_op: the combine's
    EventOverlap (a CUDA event with async_finish) and its receive hook."""

    def __init__(self, event, hook):
        self.event, self.hook = event, hook

    def wait(self):
        self.event.current_stream_wait()
        if self.hook is not None:
            self.hook()
        return True

    def is_completed(self):
        e = self.event.event
        return True if e is None else e.query()


def _fp8_flags(fp8: str) -> dict:
    return dict(use_fp8=bool(fp8), round_scale=fp8 in ("fp8_round", "fp8_ue8m0"),
                use_ue8m0=fp8 == "fp8_ue8m0")


class EpDispatchCombine(MixOp):
    def __init__(self, spec, m):
        super().__init__(spec, m)
        self.returned = []  # problems with what the calls returned besides the data
        self.layout = None  # [(name, dtype, shape, strides)] of the returned tensors

    def _dims(self):
        sh = self.spec.ep.shape
        L = sh.local_experts
        return L, L * self.m.size, self.m.size * sh.max_tokens, sh.hidden

    def fill(self, k):
        c, me = self.spec.ep, self.m.me
        L, _E, S, Hd = self._dims()
        self.inputs = [ep_inputs(f"{self.m.key}/{k}", self.m.glob(r), c.tokens[r], c,
                                 self.m.size) for r in range(self.m.size)]
        x, idx, w = self.inputs[me]
        self.put("x", torch.from_numpy(x).to(getattr(torch, c.shape.dtype)))
        self.put("topk_idx", torch.from_numpy(idx))
        self.put("topk_weights", torch.from_numpy(w))
        self.put("expert_scales", torch.tensor([expert_scale(me * L + l) for l in range(L)],
                                               dtype=torch.float32).view(L, 1, 1))
        if c.stats:
            self.put("stats", torch.zeros(L, dtype=torch.int32))
        if c.fp8:
            G = Hd // FP8_GROUP
            self.out("recv_codes", (L, S, Hd), "uint8")
            if c.fp8 == "fp8_ue8m0":
                self.out("recv_scales", (L, S, G // UE8M0_PER_INT32), "int32")
            else:
                self.out("recv_scales", (L, S, G), "float32")
        else:
            self.out("recv_x", (L, S, Hd))
        self.out("recv_count", (L,), "int32")
        self.out("y", (c.tokens[me], Hd))

    def buffer(self):
        """This rank's Buffer for the group and shape (made on first use; its static buffers for
        this draw's top-k width and dispatch format made with it)."""
        from resident_pg.ep import Buffer

        c = self.spec.ep
        key = (self.spec.group, c.shape)
        buf = self.m.cache.get(key)
        if buf is None:
            sh = c.shape
            fp8 = _fp8_flags(c.fp8)
            buf = Buffer(self.pg, sh.max_tokens, sh.hidden, sh.local_experts * self.m.size,
                         getattr(torch, sh.dtype), self.m.device, num_topk=c.top_k,
                         transport=sh.transport, use_fp8=fp8["use_fp8"],
                         use_ue8m0=fp8["use_ue8m0"])
            self.m.cache[key] = buf
        return buf

    def _check_returned(self, what, event, hook, async_finish, recv_hook):
        """What the call returned besides the data: host-side checks only (a capture runs
        them too)."""
        from resident_pg.ep import EventOverlap

        if not isinstance(event, EventOverlap):
            self.returned.append(f"{what}: event is {type(event).__name__}, not EventOverlap")
        elif (event.event is not None) != (async_finish and self.m.device != "cpu"):
            self.returned.append(f"{what}: async_finish={async_finish} on {self.m.device} "
                                 f"returned the event {event.event!r}")
        if recv_hook != callable(hook) or (not recv_hook and hook is not None):
            self.returned.append(f"{what}: return_recv_hook={recv_hook} returned the hook "
                                 f"{hook!r}")

    def issue(self, a):
        from resident_pg.ep_fp8 import dequantize

        c, sh, b = self.spec.ep, self.spec.ep.shape, self.buf
        L, E, S, Hd = self._dims()
        buf = self.buffer()
        recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
            b["x"], b["topk_idx"], sh.max_tokens, E,
            cumulative_local_expert_recv_stats=b["stats"] if c.stats else None,
            async_finish=c.async_finish[0], return_recv_hook=c.recv_hook[0], **_fp8_flags(c.fp8))
        self._check_returned("dispatch", event, hook, c.async_finish[0], c.recv_hook[0])
        event.current_stream_wait()
        if hook is not None:
            hook()
        dtype = getattr(torch, sh.dtype)
        if c.fp8:
            x8, scales = recv_x
            self.layout = [("x_fp8", x8.dtype, tuple(x8.shape), x8.stride()),
                           ("scales", scales.dtype, tuple(scales.shape), scales.stride())]
            b["recv_codes"].copy_(x8.view(torch.uint8))
            b["recv_scales"].copy_(scales)
            y_in = (dequantize(x8, scales) * b["expert_scales"]).to(dtype)
        else:
            self.layout = [("recv_x", recv_x.dtype, tuple(recv_x.shape), recv_x.stride())]
            b["recv_x"].copy_(recv_x)
            y_in = (recv_x.float() * b["expert_scales"]).to(dtype)
        self.layout.append(("recv_count", recv_count.dtype, tuple(recv_count.shape),
                            recv_count.stride()))
        b["recv_count"].copy_(recv_count)
        finish = c.async_finish[1] or a  # async_op: the event is what the mix waits on
        y, event, hook = buf.low_latency_combine(
            y_in, b["topk_idx"], b["topk_weights"], handle, async_finish=finish,
            return_recv_hook=c.recv_hook[1], out=b["y"] if c.out else None)
        self._check_returned("combine", event, hook, finish, c.recv_hook[1])
        if not c.out:
            b["y"].copy_(y)
        elif y is not b["y"]:
            self.returned.append("combine with out= returned another tensor")
        done = _Finish(event, hook)
        if a:
            return [done]
        done.wait()
        return []

    def _want_layout(self):
        c = self.spec.ep
        L, _E, S, Hd = self._dims()
        G = Hd // FP8_GROUP
        if not c.fp8:
            return [("recv_x", getattr(torch, c.shape.dtype), (L, S, Hd), (S * Hd, Hd, 1))]
        if c.fp8 == "fp8_ue8m0":
            sc = (torch.int32, (L, S, G // UE8M0_PER_INT32))
        else:
            sc = (torch.float32, (L, S, G))
        # scales column-major in the last two dimensions, as DeepEP returns them for TMA loads
        return [("x_fp8", torch.float8_e4m3fn, (L, S, Hd), (S * Hd, Hd, 1)),
                ("scales", sc[0], sc[1], (sc[1][2] * S, 1, S))]

    def verify(self):
        c, me = self.spec.ep, self.m.me
        L, _E, S, Hd = self._dims()
        self.errors += self.returned
        self.returned = []
        want = self._want_layout() + [("recv_count", torch.int32, (L,), (1,))]
        if self.layout != want:
            self.errors.append(f"returned {self.layout}, expected {want}")
        xs = [x for x, _i, _w in self.inputs]
        idxs = [i for _x, i, _w in self.inputs]
        x, idx, w = self.inputs[me]
        dt = c.shape.dtype
        if c.fp8:
            q = [fp8_quantize(v, c.fp8 != "fp8") for v in xs]
            codes, count = dispatch_reference(idxs, [qc for qc, _s in q], me, L, S)
            scales, _ = dispatch_reference(idxs, [qs for _c, qs in q], me, L, S)
            self.same("recv_codes", torch.from_numpy(codes), "fp8 bytes of recv_x")
            want_sc = ue8m0_packed(scales).view(np.int32) if c.fp8 == "fp8_ue8m0" else scales
            self.same("recv_scales", torch.from_numpy(np.ascontiguousarray(want_sc)),
                      "scales of recv_x")
            y_ref, tol = combine_reference(fp8_dequantize(*q[me]), idx, w.astype(np.float64),
                                           dt, lambda e: np.float32(expert_scale(e)))
        else:
            recv, count = dispatch_reference(idxs, xs, me, L, S)
            self.same("recv_x", torch.from_numpy(recv).to(getattr(torch, dt)), "recv_x")
            y_ref, tol = combine_reference(x, idx, w.astype(np.float64), dt, expert_scale)
        self.same("recv_count", torch.from_numpy(count), "recv_count")
        if c.stats:
            self.same("stats", torch.from_numpy(count), "cumulative_local_expert_recv_stats")
        got = self.host(self.buf["y"]).double().numpy()
        if got.shape != y_ref.shape:
            self.errors.append(f"combined output {got.shape}, reference {y_ref.shape}")
        else:
            bad = np.argwhere(~(np.abs(got - y_ref) <= tol))  # NaN is bad too
            if len(bad):
                i = tuple(int(v) for v in bad[0])
                self.errors.append(f"combined output: {len(bad)}/{got.size} elements off the "
                                   f"reference; first at [token, channel] {list(i)}: got "
                                   f"{got[i]!r}, expected {y_ref[i]!r} (tolerance {tol[i]:.3g})")
        self.unchanged("x", torch.from_numpy(x).to(getattr(torch, dt)))
        self.unchanged("topk_idx", torch.from_numpy(idx))
        self.unchanged("topk_weights", torch.from_numpy(w))
        self._check_transport()

    def _check_transport(self):
        """The Buffer's transport: "auto" is the device-splits exchange exactly where the
        group's backend is resident."""
        sh = self.spec.ep.shape
        buf = self.m.cache.get((self.spec.group, sh))
        if buf is None:
            return
        resident = "resident" in str(dist.get_backend(self.pg)).lower()
        want = sh.transport if sh.transport != "auto" else ("splits" if resident else "padded")
        if buf.transport != want:
            self.errors.append(f"Buffer transport {buf.transport!r}, expected {want!r} (backend "
                               f"{dist.get_backend(self.pg)!r})")


EP_OPS = {"ep_dispatch_combine": EpDispatchCombine}
