"""Shared pieces of examples/tp_decode.py and examples/ep_decode.py (torchrun scripts).

* :func:`setup`: ``init_process_group`` with the backend under test (default ``resident``) on
  the device of ``LOCAL_RANK``; on CPU one intra-op thread per rank unless told otherwise.
* :func:`time_step`: per-step latencies of a step function, eager (synchronize after each step)
  or captured once into a CUDA graph and replayed; :func:`report_ms` takes the median per rank
  and the maximum over ranks (the slowest rank sets the step time).
* :func:`check_group`: a second group on another backend (gloo on CPU, nccl on CUDA) for the
  scripts' ``--check``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
import zlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist


def seeded_randn(shape, seed, *parts, scale: float = 1.0, device="cpu") -> torch.Tensor:
    """Normal float32 numbers named by (seed, *parts): the same tensor whichever rank or shard
    layout asks for it, generated on ``device`` (on the GPU a full model's weights take
    milliseconds; the CPU's generator needs minutes for the unsharded reference)."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32("/".join(map(str, (seed,) + parts)).encode()))
    return torch.randn(shape, generator=g, device=device) * scale


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="resident", help="backend under test (default resident)")
    p.add_argument("--check-backend", default=None,
                   help="backend that --check compares against (default gloo on cpu, nccl on cuda)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="activations and weights (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--batch", type=int, default=1, help="sequences per decode step (B)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--graph", action="store_true",
                   help="cuda: capture one decode step in a CUDA graph and time replays")
    p.add_argument("--check", action="store_true", help="compare outputs (see the script's doc)")
    p.add_argument("--check-steps", type=int, default=3, help="decode steps compared by --check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="cpu: intra-op threads per rank")


def setup(args) -> torch.device:
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        torch.zeros(1, device="cuda").add_(1)  # the CUDA context exists before the group
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        if args.graph:
            raise SystemExit("--graph needs --device cuda")
        torch.set_num_threads(max(1, args.threads))
        device = torch.device("cpu")
    if "resident" in args.backend:
        importlib.import_module("resident_pg")  # registers it (the entry point does too)
    dist.init_process_group(backend=args.backend)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.torch_dtype = getattr(torch, args.dtype)
    return device


def check_group(args):
    backend = args.check_backend or ("nccl" if args.device == "cuda" else "gloo")
    return backend, dist.new_group(backend=backend)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], object], device: torch.device, *, steps: int, warmup: int,
              graph: bool, before: Optional[Callable[[], None]] = None) -> List[float]:
    """Milliseconds of each of `steps` calls of `step` (after `warmup` untimed ones).

    ``before`` runs outside the timed region (and outside the graph) before every step.
    With ``graph``: warm-up eagerly on a side stream, capture one step, time replays.
    The ranks start each variant together (a barrier on the default group)."""
    run = step
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                if before:
                    before()
                step()
        torch.cuda.current_stream().wait_stream(side)
        sync(device)
        g = torch.cuda.CUDAGraph()
        if before:
            before()
        with torch.cuda.graph(g):
            step()
        run = g.replay
    else:
        for _ in range(warmup):
            if before:
                before()
            step()
    sync(device)
    dist.barrier()
    out = []
    for _ in range(steps):
        if before:
            before()
        t0 = time.perf_counter()
        run()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def report_ms(samples: List[float]) -> float:
    """Median of this rank's samples, maximum over the ranks (a CPU all_reduce MAX)."""
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def share_text(full: float, nocomm: float) -> str:
    """'comm share X%' = (full - no-comm) / full; a negative value is noise, and says so."""
    share = (full - nocomm) / full if full > 0 else float("nan")
    note = " (negative: the difference is within the noise)" if share < 0 else ""
    return f"comm share {100 * share:.1f}%{note} (method: no-op replacement)"


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance (to the reference's max |value|) of a --check comparison."""
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


def log0(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)
