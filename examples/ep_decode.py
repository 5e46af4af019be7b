"""Expert-parallel decode of Qwen3-30B-A3B-shaped MoE layers with resident_pg.ep and
resident_pg.moe.

    torchrun --nproc-per-node 2 examples/ep_decode.py --device cpu --layers 2 --hidden 64 \\
        --experts 8 --top-k 2 --moe-intermediate 32 --batch 4 --check
    torchrun --nproc-per-node 8 examples/ep_decode.py --device cuda --graph --batch 8

Every rank holds its own ``--batch`` tokens (attention data-parallel, MoE expert-parallel, as
in DeepEP-style serving) and ``experts / world`` experts.  A layer: RMSNorm -> router (a
replicated ``hidden x experts`` linear, softmax, top-k, renormalised as in Qwen3) -> dispatch
-> each local expert's SwiGLU MLP on its padded buffer (batched matmuls over all local experts
and slots: static shapes; a real engine's grouped GEMM skips the rows beyond the counts) ->
combine -> residual add.  Defaults are Qwen3-30B-A3B's: hidden 2048, 128 experts, top-8, expert
intermediate 768 (random weights, ``--layers`` 2 of its 48).

``--dispatch`` picks the dispatch/combine engine, ``both`` (default) runs them side by side:
  * ``ep``: ``resident_pg.ep.Buffer.low_latency_dispatch`` / ``low_latency_combine`` (DeepEP's
    low-latency shape); on a resident group the payload moves only the routed rows
    (``transport`` splits), on another backend the padded buffers (``padded``);
  * ``moe``: ``resident_pg.moe.MoEDispatcher``, ``all_to_all_single`` of the padded buffers.

Measured per step and engine (median per rank, maximum over ranks):
  * ``full``: the step as it runs;
  * ``no-comm``: the same step with every exchange replaced by a local copy of the whole
    buffer (wrong numbers, same compute and index work): comm share = (full - no-comm) / full,
    the method the script reports;
  * ``dispatch+combine alone``: the layers' dispatch and combine with identity experts.

``--check``, per engine: (1) the same steps through the engine on a second group
(``--check-backend``, gloo on CPU, nccl on CUDA): the exchange only moves data, so the outputs
must be identical; (2) a single-process reference on every rank: each layer's output
recomputed from that layer's input with ALL experts' weights (generated from the same seeds)
and no communication, ``y = sum_k w_k * expert_k(x)``; with both engines also (3) ``ep`` and
``moe`` give identical outputs (the same rows meet the same experts and the same float32
combine).  Exits 1 if a difference is above the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import decode_common as dc
from resident_pg.ep import Buffer
from resident_pg.moe import MoEDispatcher

ENGINES = ("ep", "moe")


rand = dc.seeded_randn


def expert_weights(a, layer, experts, device, dtype):
    """[n, H, I] gate, [n, H, I] up, [n, I, H] down for the global experts `experts`."""
    H, I, s = a.hidden, a.moe_intermediate, a.seed

    def one(name, e, shape, fan_in):
        return rand(shape, s, layer, name, e, scale=fan_in ** -0.5, device=device)
    gate = torch.stack([one("gate", e, (H, I), H) for e in experts])
    up = torch.stack([one("up", e, (H, I), H) for e in experts])
    down = torch.stack([one("down", e, (I, H), I) for e in experts])
    return [t.to(device=device, dtype=dtype) for t in (gate, up, down)]


def local_copy(out, inp, *_counts, group=None):
    """The no-comm stand-in of an exchange (all_to_all, or one with row counts): a local copy
    of the whole buffer."""
    out.copy_(inp)


class MoEStack:
    """The layers with one dispatch/combine engine (``ep`` or ``moe``); ``local``: every
    exchange replaced by a local copy (the no-comm variant); ``share``: another stack's
    weights."""

    def __init__(self, a, group, device, dtype, engine, local=False, share=None):
        self.a, self.dtype, self.engine = a, dtype, engine
        W, r = dist.get_world_size(group), dist.get_rank(group)
        if engine == "ep":
            self.buf = Buffer(group, a.batch, a.hidden, a.experts, dtype, device,
                              num_topk=a.top_k)
            self.moe = self.buf.dispatcher(a.top_k)
            if local:
                self.moe.all_to_all = local_copy
                if self.moe.payload_exchange is not None:
                    self.moe.payload_exchange = local_copy
        else:
            self.buf = None
            self.moe = MoEDispatcher(group, a.experts, a.hidden, a.batch, a.top_k, dtype,
                                     device, all_to_all=local_copy if local else None)
        L = self.moe.local_experts
        self.layers = share.layers if share is not None else []  # same weights, other exchange
        for i in range(a.layers if share is None else 0):
            self.layers.append({
                "norm": (1 + 0.1 * rand(a.hidden, a.seed, i, "norm", device=device)).to(dtype=dtype),
                "router": rand((a.hidden, a.experts), a.seed, i, "router", device=device,
                               scale=a.hidden ** -0.5).to(device, dtype),
                "experts": expert_weights(a, i, range(r * L, (r + 1) * L), device, dtype)})
        self.record = None  # list of per-layer (h, idx, w, y) when --check records
        assert W == a.world

    def describe(self) -> str:
        if self.buf is None:
            return (f"padded all_to_all_single, {self.moe.message_bytes()} B per peer per "
                    f"payload exchange")
        if self.buf.transport == "splits":
            return (f"transport splits: routed rows only, at most {self.moe.message_bytes()} B "
                    f"per peer per payload exchange")
        return (f"transport {self.buf.transport}: {self.moe.message_bytes()} B per peer per "
                f"payload exchange")

    def route(self, layer, x):
        h = F.rms_norm(x, (x.shape[-1],), layer["norm"], eps=1e-6)
        probs = torch.softmax((h @ layer["router"]).float(), dim=-1)
        w, idx = probs.topk(self.a.top_k, dim=-1)
        return h, idx, w / w.sum(-1, keepdim=True)

    def step(self, x, experts=True):
        a = self.a
        for layer in self.layers:
            h, idx, w = self.route(layer, x)
            if self.buf is not None:
                ex, counts, handle, _, _ = self.buf.low_latency_dispatch(h, idx, a.batch,
                                                                         a.experts)
            else:
                ex, counts, handle = self.moe.dispatch(h, idx, w)
            if experts:
                gate, up, down = layer["experts"]
                ey = torch.bmm(F.silu(torch.bmm(ex, gate)) * torch.bmm(ex, up), down)
            else:
                ey = ex
            if self.buf is not None:
                y = self.buf.low_latency_combine(ey, idx, w, handle)[0]
            else:
                y = self.moe.combine(ey, handle)
            if self.record is not None:
                self.record.append((h.float().cpu(), idx.cpu(), w.cpu(), y.float().cpu()))
            x = x + y
        return x


def reference_layer(a, i, h, idx, w, dtype, device):
    """y = sum_k w_k * expert_{idx_k}(h) with every expert's weights, on one process."""
    # generated where the ranks generated theirs (the same numbers), computed on the CPU
    gate, up, down = (t.cpu() for t in expert_weights(a, i, range(a.experts), device,
                                                        torch.float32))
    hf = h.to(dtype).float()
    y = torch.zeros_like(hf)
    for k in range(a.top_k):
        e = idx[:, k]
        g = torch.einsum("th,thi->ti", hf, gate[e])
        u = torch.einsum("th,thi->ti", hf, up[e])
        y += w[:, k:k + 1] * torch.einsum("ti,tih->th", F.silu(g) * u, down[e])
    return y


def inputs(a, rank, step, device, dtype):
    return rand((a.batch, a.hidden), a.seed, "tokens", rank, step, device=device).to(dtype=dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    dc.add_common_args(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--dispatch", choices=("both",) + ENGINES, default="both",
                   help="ep: resident_pg.ep.Buffer; moe: the padded MoEDispatcher; both: side "
                        "by side (default)")
    a = p.parse_args(argv)
    device = dc.setup(a)
    dtype, rank = a.torch_dtype, dist.get_rank()
    a.world = dist.get_world_size()
    if a.experts % a.world:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the world size {a.world}")
    engines = ENGINES if a.dispatch == "both" else (a.dispatch,)

    models, weights = {}, None
    for eng in engines:
        models[eng] = MoEStack(a, None, device, dtype, eng, share=weights)
        weights = weights or models[eng]
    first = models[engines[0]]
    dc.log0(f"ep_decode: {a.world} ranks, backend {a.backend}, device {a.device}, {a.dtype}, "
            f"{a.layers} layers, hidden {a.hidden}, {a.experts} experts "
            f"({first.moe.local_experts}/rank), top-{a.top_k}, expert intermediate "
            f"{a.moe_intermediate}, {a.batch} tokens/rank, {'graph' if a.graph else 'eager'}; "
            f"per step {3 * a.layers} exchanges (per layer: counts, payload, payload back)")
    x_s = inputs(a, rank, 0, device, dtype)
    for eng in engines:
        model = models[eng]
        nocomm = MoEStack(a, None, device, dtype, eng, local=True, share=weights)
        res = {}
        for name, fn in (("full", lambda: model.step(x_s)), ("no-comm", lambda: nocomm.step(x_s)),
                         ("comm", lambda: model.step(x_s, experts=False))):
            res[name] = dc.report_ms(dc.time_step(fn, device, steps=a.steps, warmup=a.warmup,
                                                  graph=a.graph))
        dc.log0(f"[{eng}] {model.describe()}")
        dc.log0(f"[{eng}] step (median, slowest rank): {res['full']:.3f} ms; with the exchanges "
                f"as local copies: {res['no-comm']:.3f} ms -> "
                f"{dc.share_text(res['full'], res['no-comm'])}")
        dc.log0(f"[{eng}] dispatch+combine alone (identity experts; includes the routing index "
                f"work): {res['comm']:.3f} ms ({100 * res['comm'] / res['full']:.1f}% of the "
                f"step)")

    ok = True
    if a.check:
        tol = dc.tolerance(dtype)
        cb, cg = dc.check_group(a)
        outs = {}
        for eng in engines:
            model = models[eng]
            other = MoEStack(a, cg, device, dtype, eng, share=weights)
            model.record = []
            outs[eng] = [model.step(inputs(a, rank, s, device, dtype)).float().cpu()
                         for s in range(a.check_steps)]
            outs2 = [other.step(inputs(a, rank, s, device, dtype)).float().cpu()
                     for s in range(a.check_steps)]
            d = dc.max_over_ranks(max(float((o - q).abs().max())
                                      for o, q in zip(outs[eng], outs2)))
            ok = ok and d == 0.0
            dc.log0(f"check: [{eng}] {a.check_steps} steps, max |{a.backend} - {cb}| = {d:.3g} "
                    f"(the exchange moves data only: must be 0): {'OK' if d == 0.0 else 'FAIL'}")
            worst = 0.0
            for n, (h, idx, w, y) in enumerate(model.record):
                ref = reference_layer(a, n % a.layers, h, idx, w, dtype, device)
                worst = max(worst, float((y - ref).abs().max()) / max(float(ref.abs().max()),
                                                                      1e-30))
            worst = dc.max_over_ranks(worst)
            ok = ok and worst <= tol
            dc.log0(f"check: [{eng}] {len(model.record)} layer calls, max |{a.backend} "
                    f"EP{a.world} - single-process reference| / max = {worst:.3g} (tolerance "
                    f"{tol:g}): {'OK' if worst <= tol else 'FAIL'}")
        if len(engines) == 2:
            d = dc.max_over_ranks(max(float((o - q).abs().max())
                                      for o, q in zip(outs["ep"], outs["moe"])))
            ok = ok and d == 0.0
            dc.log0(f"check: {a.check_steps} steps, max |ep - moe| = {d:.3g} (the same rows "
                    f"meet the same experts and combine: must be 0): "
                    f"{'OK' if d == 0.0 else 'FAIL'}")
        dist.destroy_process_group(cg)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
