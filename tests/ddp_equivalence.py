"""DistributedDataParallel trained the same way on two backends: the job both test_ddp_cpu.py
and test_cuda_ddp.py run, once with resident and once with gloo, and the comparison of what
they return.

The model (8 linear layers of 1000 x 1000, 32 MB of float32 parameters) is built from a seed
on every rank; every rank trains on its own seeded batch for a few SGD steps. DDP reduces the
first step's gradients as one 32 MB bucket and then rebuilds its buckets by its cap.
Configurations: DDP's own allreduce with its default 25 MB cap, the same with a 1 MB cap (a
bucket per parameter, many in flight at once), and the comm hooks torch ships that go through
``Work.get_future()``:
``allreduce_hook`` and ``fp16_compress_hook``. Each rank returns a digest of its parameters
after every step (all ranks must agree: DDP keeps replicas equal) and rank 0 its parameters.

How equal gloo and resident must be: with 2 ranks the sum of two gradients is one rounding in
either backend (a + b == b + a), so parameters must be bitwise equal, fp16_compress_hook
included (resident adds two float16 values in float32 and rounds once; gloo's float16 add
does the same). With 3 or more ranks gloo's ring sums each chunk starting at a different rank
while resident sums in rank order 0..n-1, and float addition is not associative: the
parameters may differ by a few units in the last place of the gradients' sum, so they are
compared with a tolerance of 1e-6 relative (float32) and 2e-3 (float16 compression, one
float16 rounding of the sum), scaled by the parameter's magnitude.
"""

from __future__ import annotations

import hashlib

LAYERS = 8
WIDTH = 1000
BATCH = 4
STEPS = 3
LR = 0.05
CONFIGS = ("default-25MB", "buckets-1MB", "allreduce_hook", "fp16_compress_hook")


def _model(device):
    import torch

    torch.manual_seed(1234)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i + 1 < LAYERS:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(device)


def _batch(rank, step, device):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    return x.to(device), y.to(device)


def _flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def _digest(t) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def train(rank, ws, config, device):
    """Trains one configuration; returns per-step digests, the bucket sizes and (rank 0) the
    final parameters as a numpy array."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(device)
    kwargs = {"bucket_cap_mb": 1} if config == "buckets-1MB" else {}
    if device != "cpu":
        kwargs["device_ids"] = [torch.device(device).index or 0]
    ddp = DDP(model, **kwargs)
    if config == "allreduce_hook":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    elif config == "fp16_compress_hook":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    digests = []
    for step in range(STEPS):
        x, y = _batch(rank, step, device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        digests.append(_digest(_flat_params(model)))
    # DDP starts with every gradient in one bucket and rebuilds its buckets, by its cap, in
    # the order gradients became ready in the first step.
    logging = ddp._get_ddp_logging_data()
    sizes = logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "")
    bucket_sizes = [int(s) for s in str(sizes).split(",") if s.strip()]
    params = _flat_params(model).numpy() if rank == 0 else None
    return {"digests": digests, "bucket_sizes": bucket_sizes, "params": params,
            "backend": dist.get_backend()}


def job(rank, ws, configs, device="cpu"):
    return {c: train(rank, ws, c, device) for c in configs}


def problems(per_rank_a, per_rank_b, ws, names=("resident", "gloo")) -> list:
    """Compares the results of two backends' jobs (lists of per-rank dicts)."""
    import numpy as np

    out = []
    for label, per_rank in zip(names, (per_rank_a, per_rank_b)):
        for config in per_rank[0]:
            for r in range(1, ws):
                if per_rank[r][config]["digests"] != per_rank[0][config]["digests"]:
                    out.append(f"{label} {config}: rank {r}'s parameters differ from rank 0's")
            if per_rank[0][config]["backend"] != label:
                out.append(f"{label} {config}: the group's backend is {per_rank[0][config]['backend']}")
    for config in per_rank_a[0]:
        a, b = per_rank_a[0][config], per_rank_b[0][config]
        if config == "default-25MB" and max(a["bucket_sizes"] or [0]) < 16 * 1024 * 1024:
            out.append(f"{config}: the largest bucket is {max(a['bucket_sizes'] or [0])} bytes; "
                       f"the test means to reduce buckets of up to 25 MB")
        if config == "buckets-1MB" and len(a["bucket_sizes"]) < 8:
            out.append(f"{config}: only {len(a['bucket_sizes'])} buckets")
        pa, pb = a["params"], b["params"]
        if ws == 2:
            if a["digests"] != b["digests"]:
                diff = np.nonzero(pa.view(np.uint32) != pb.view(np.uint32))[0]
                out.append(f"{config}: {names[0]} and {names[1]} parameters differ (2 ranks must be "
                           f"bitwise equal): {diff.size} of {pa.size} values, first at {diff[:1]}: "
                           f"{pa[diff[:1]]} vs {pb[diff[:1]]}")
        else:
            rel = 2e-3 if config == "fp16_compress_hook" else 1e-6
            scale = np.maximum(np.abs(pb), 1e-3)
            err = np.abs(pa - pb) / scale
            if not np.all(np.isfinite(pa)) or err.max() > rel:
                i = int(np.argmax(err))
                out.append(f"{config}: {names[0]} and {names[1]} parameters differ by {err.max():.3g} "
                           f"relative (tolerance {rel}) at {i}: {pa[i]} vs {pb[i]}")
    return out


def differences(per_rank_a, per_rank_b) -> dict:
    """Per configuration: how many of rank 0's final parameters differ, and the largest
    relative difference (for the test's report)."""
    import numpy as np

    out = {}
    for config in per_rank_a[0]:
        pa, pb = per_rank_a[0][config]["params"], per_rank_b[0][config]["params"]
        rel = np.abs(pa - pb) / np.maximum(np.abs(pb), 1e-3)
        out[config] = (int(np.count_nonzero(pa.view(np.uint32) != pb.view(np.uint32))),
                       float(rel.max()))
    return out
