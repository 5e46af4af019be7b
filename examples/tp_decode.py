"""Tensor-parallel decode of a Llama-style decoder stack, one token per sequence per step.

    torchrun --nproc-per-node 2 examples/tp_decode.py --device cpu --layers 2 --hidden 256 \\
        --heads 4 --kv-heads 2 --intermediate 512 --check
    torchrun --nproc-per-node 8 examples/tp_decode.py --device cuda --graph --batch 8

Each layer: RMSNorm -> attention (RoPE, grouped KV heads, a KV cache of fixed capacity
``--kv-len`` per sequence, the new token written at the current position, attention over the
positions written so far) -> RMSNorm -> SwiGLU MLP, with residuals.  Llama-3.1-8B shapes by
default (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, head dim hidden/heads); random
weights; ``--layers`` (default 2) layers.  Megatron-style TP over the ranks: QKV and gate/up
projections column-parallel (heads and intermediate split), O and down projections
row-parallel, so a layer does TWO all-reduces of ``batch x hidden`` activations.

Measured per step (median per rank, maximum over ranks):
  * ``full``: the decode step as it runs;
  * ``no-comm``: the same step with both all-reduces replaced by no-ops (wrong numbers, same
    compute): communication share = (full - no-comm) / full.  This is the method the
    script reports as "comm share"; it includes the waiting for the slowest rank;
  * ``all-reduces alone``: 2 x layers back-to-back all-reduces of the same size, for scale.
On CUDA, ``--graph`` captures each variant once into a CUDA graph and times replays; on CPU
every variant runs eagerly.

``--check``: runs ``--check-steps`` steps from the same weights, cache and inputs through the
backend under test (default resident) and through a second group on ``--check-backend``
(gloo on CPU, nccl on CUDA) and reports the max difference; rank 0 also runs the unsharded
model (all shards concatenated, no communication) and compares.  Exits 1 if a difference is
above the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import decode_common as dc


rand = dc.seeded_randn


class Stack:
    """The layers' weights and KV caches for the shards ``shards`` of a ``tp``-way split
    (one shard on a TP rank; all of them, concatenated, for the unsharded reference)."""

    def __init__(self, a, tp, shards, device, dtype):
        self.a, self.device, self.dtype = a, device, dtype
        H, nh, nkv, I = a.hidden, a.heads, a.kv_heads, a.intermediate
        D = H // nh
        hl, kvl, il = nh // tp, nkv // tp, I // tp
        self.D, self.hl, self.kvl = D, hl * len(shards), kvl * len(shards)
        B, S, s = a.batch, a.kv_len, a.seed
        self.layers = []
        for i in range(a.layers):
            def col(name, rows, cols):
                return torch.cat([rand((rows, cols), s, i, name, sh, scale=cols ** -0.5,
                                       device=device) for sh in shards], 0)

            def row(name, rows, cols, total):
                return torch.cat([rand((rows, cols), s, i, name, sh, scale=total ** -0.5,
                                       device=device) for sh in shards], 1)

            def cache(name):
                return torch.cat([rand((B, kvl, S, D), s, i, name, sh, device=device)
                                  for sh in shards], 1)

            w = dict(attn_norm=1 + 0.1 * rand(H, s, i, "n1", device=device),
                     mlp_norm=1 + 0.1 * rand(H, s, i, "n2", device=device),
                     wq=col("q", hl * D, H), wk=col("k", kvl * D, H), wv=col("v", kvl * D, H),
                     wo=row("o", H, hl * D, nh * D), w_gate=col("g", il, H), w_up=col("u", il, H),
                     w_down=row("d", H, il, I), k_cache=cache("kc"), v_cache=cache("vc"))
            self.layers.append({k: v.to(device=device, dtype=dtype) for k, v in w.items()})
        half = torch.arange(0, D, 2, dtype=torch.float32) / D
        self.inv_freq = (1.0 / (500000.0 ** half)).to(device)
        self.start = S - (a.check_steps + a.steps + a.warmup + 2)
        if self.start < 1:
            raise SystemExit(f"--kv-len {S} is too short for the steps asked for")
        self.pos = torch.full((1,), self.start, dtype=torch.int64, device=device)
        self.positions = torch.arange(S, device=device)

    def reset_pos(self):
        self.pos.fill_(self.start)

    def rope(self, t):  # t [B, heads, 1, D], rotate-half convention
        ang = self.pos.to(torch.float32) * self.inv_freq               # [D/2]
        cos, sin = torch.cat([ang.cos()] * 2), torch.cat([ang.sin()] * 2)
        t1, t2 = t.float().chunk(2, dim=-1)
        return (t.float() * cos + torch.cat([-t2, t1], -1) * sin).to(t.dtype)

    def step(self, x, allreduce):
        """x [B, H] -> [B, H]; ``allreduce(t)`` reduces a partial sum in place."""
        B, D = x.shape[0], self.D
        for w in self.layers:
            h = F.rms_norm(x, (x.shape[-1],), w["attn_norm"], eps=1e-5)
            q = (h @ w["wq"].t()).view(B, self.hl, 1, D)
            k = (h @ w["wk"].t()).view(B, self.kvl, 1, D)
            v = (h @ w["wv"].t()).view(B, self.kvl, 1, D)
            q, k = self.rope(q), self.rope(k)
            w["k_cache"].index_copy_(2, self.pos, k)
            w["v_cache"].index_copy_(2, self.pos, v)
            mask = (self.positions <= self.pos).view(1, 1, 1, -1)
            att = F.scaled_dot_product_attention(q, w["k_cache"], w["v_cache"], attn_mask=mask,
                                                 enable_gqa=True)
            o = att.reshape(B, self.hl * D) @ w["wo"].t()
            allreduce(o)
            x = x + o
            h = F.rms_norm(x, (x.shape[-1],), w["mlp_norm"], eps=1e-5)
            m = (F.silu(h @ w["w_gate"].t()) * (h @ w["w_up"].t())) @ w["w_down"].t()
            allreduce(m)
            x = x + m
        self.pos.add_(1)
        return x


def inputs(a, step, device, dtype):
    return rand((a.batch, a.hidden), a.seed, "input", step, device=device).to(dtype=dtype)


def run_steps(a, tp, shards, device, dtype, allreduce):
    model = Stack(a, tp, shards, device, dtype)
    return [model.step(inputs(a, i, device, dtype), allreduce).float().cpu()
            for i in range(a.check_steps)]


def max_rel_diff(xs, ys):
    ref = max(float(y.abs().max()) for y in ys) or 1.0
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys)) / ref


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    dc.add_common_args(p)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--kv-len", type=int, default=1024, help="KV cache capacity per sequence")
    p.add_argument("--no-reference", action="store_true",
                   help="--check: skip the unsharded single-process reference on rank 0")
    a = p.parse_args(argv)
    device = dc.setup(a)
    dtype, tp, rank = a.torch_dtype, dist.get_world_size(), dist.get_rank()
    for what, n in (("heads", a.heads), ("kv-heads", a.kv_heads), ("intermediate", a.intermediate)):
        if n % tp:
            raise SystemExit(f"--{what} {n} must be a multiple of the world size {tp}")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        raise SystemExit("--hidden / --heads must be an even head dimension")

    msg = a.batch * a.hidden * dtype.itemsize
    dc.log0(f"tp_decode: {tp} ranks, backend {a.backend}, device {a.device}, {a.dtype}, "
            f"{a.layers} layers, hidden {a.hidden}, heads {a.heads}/{a.kv_heads} kv, "
            f"intermediate {a.intermediate}, batch {a.batch}, kv-len {a.kv_len}, "
            f"{'graph' if a.graph else 'eager'}; per step {2 * a.layers} all-reduces of "
            f"{msg} B")

    def allreduce(t):
        dist.all_reduce(t)

    def noop(t):
        pass

    model = Stack(a, tp, [rank], device, dtype)
    x_s = inputs(a, 0, device, dtype)
    res = {}
    for name, fn in (("full", allreduce), ("no-comm", noop)):
        res[name] = dc.report_ms(dc.time_step(lambda: model.step(x_s, fn), device, steps=a.steps,
                                              warmup=a.warmup, graph=a.graph,
                                              before=model.reset_pos))
    bufs = [torch.zeros(a.batch, a.hidden, device=device, dtype=dtype) for _ in range(2 * a.layers)]

    def comm_only():
        for b in bufs:
            dist.all_reduce(b)

    res["comm"] = dc.report_ms(dc.time_step(comm_only, device, steps=a.steps, warmup=a.warmup,
                                            graph=a.graph))
    dc.log0(f"step (median, slowest rank): {res['full']:.3f} ms; with all-reduces as no-ops: "
            f"{res['no-comm']:.3f} ms -> {dc.share_text(res['full'], res['no-comm'])}")
    dc.log0(f"all-reduces alone: {2 * a.layers} x {msg} B = {res['comm']:.3f} ms "
            f"({1e3 * res['comm'] / (2 * a.layers):.1f} us each; "
            f"{100 * res['comm'] / res['full']:.1f}% of the step)")

    ok = True
    if a.check:
        cb, cg = dc.check_group(a)
        got = run_steps(a, tp, [rank], device, dtype, allreduce)
        other = run_steps(a, tp, [rank], device, dtype, lambda t: dist.all_reduce(t, group=cg))
        tol = dc.tolerance(dtype)
        d = dc.max_over_ranks(max_rel_diff(got, other))
        ok = d <= tol
        dc.log0(f"check: {a.check_steps} steps, max |{a.backend} - {cb}| / max|{cb}| = {d:.3g} "
                f"(tolerance {tol:g}): {'OK' if ok else 'FAIL'}")
        if not a.no_reference:
            dref = -1.0
            if rank == 0:
                ref = run_steps(a, tp, list(range(tp)), device, dtype, lambda t: None)
                dref = max_rel_diff(got, ref)
            dref = dc.max_over_ranks(dref)
            ok = ok and dref <= tol
            dc.log0(f"check: max |{a.backend} TP{tp} - unsharded single process| / max = "
                    f"{dref:.3g} (tolerance {tol:g}): {'OK' if dref <= tol else 'FAIL'}")
        dist.destroy_process_group(cg)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
