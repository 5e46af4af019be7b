"""torch.compile of a function that calls funcol.all_reduce on CUDA tensors.

One 2-rank job (world group on the direct path).  The function does some elementwise
work, a functional all_reduce on a given group, and more elementwise work; it is
compiled with fullgraph=True (the collective must be inside the compiled graph) and
called three times with fresh random data: twice with the world group (direct path),
once with a subgroup created with pg_options={"path": "proxy"} (the proxy path; the
group is a constant of the graph, so this recompiles).

Backend: the default inductor backend.  Where inductor is unavailable on the machine
(no triton for CUDA; no C++ compiler in the CPU dry run) the test falls back to
backend="aot_eager" and emits a warning saying so (the result still says which backend
ran).  Functional collectives without compile are covered in test_cuda_async_ops.py
(case functional_collectives, every world size and path).

The multiplications are by powers of two, so fused (FMA) and unfused code give the
same bits: the outputs before and after the collective compare exactly against a
reference computed in float32 from the compiled function's own all_reduce result.
"""

from __future__ import annotations

import traceback
import warnings

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import dev, host
from dist_harness import compare_exact, compare_reduction, digest, make_input, reference_reduce

pytestmark = C.module_marks()

WS = 2
N = 4099
ITEMS = ("world-direct-first-call", "world-direct-second-call", "subgroup-proxy")


def _pick_backend():
    if C.ON_GPU:
        try:
            from torch.utils._triton import has_triton

            return "inductor" if has_triton() else "aot_eager"
        except Exception:  # noqa: BLE001
            return "aot_eager"
    import shutil

    return "inductor" if any(shutil.which(c) for c in ("g++", "c++", "clang++")) else "aot_eager"


def compile_job(rank, ws):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    C.setup_rank(rank, ws)
    backend = _pick_backend()

    def fn(x, y, group):
        z = x * 2.0 + y
        r = funcol.all_reduce(z, "sum", group)
        return z, r, r * 0.5 + 1.0

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    proxy_group = dist.new_group(list(range(ws)), backend="resident", pg_options={"path": "proxy"})
    import resident_pg

    proxy_paths = {p: v["path"] for p, v in resident_pg.describe(proxy_group, device=C.DEVICE)["peers"].items()
                   if p != rank}
    out = {"backend": backend, "items": {}, "digests": {}}
    for item, group in zip(ITEMS, (dist.group.WORLD, dist.group.WORLD, proxy_group)):
        errs = []
        try:
            xs = [make_input(f"cuda/compile/{item}/x", r, N, "float32") for r in range(ws)]
            ys = [make_input(f"cuda/compile/{item}/y", r, N, "float32") for r in range(ws)]
            z, r, post = compiled(dev(xs[rank]), dev(ys[rank]), group)
            z, r, post = host(z), host(r), host(post)
            zs = [(xs[q] * 2.0 + ys[q]) for q in range(ws)]  # float32 on CPU, exact *2
            errs += compare_exact(z, zs[rank], f"{item}: elementwise before the collective")
            errs += compare_reduction(r, reference_reduce(zs, "SUM", "float32"), zs, "SUM", "float32",
                                      f"{item}: funcol.all_reduce inside the compiled graph")
            errs += compare_exact(post, r * 0.5 + 1.0, f"{item}: elementwise after the collective")
            out["digests"][item] = digest(r)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{item} raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
        if item == "subgroup-proxy" and set(proxy_paths.values()) != {"proxy"}:
            errs.append(f"the pg_options={{'path': 'proxy'}} subgroup reports paths {proxy_paths}")
        out["items"][item] = errs
    if C.ON_GPU:
        torch.cuda.synchronize()
    return out


_RESULT: dict = {}


def _job():
    if "r" not in _RESULT:
        try:
            per_rank = H.run_ranks(compile_job, WS, init=False, env={"RESIDENT_PATH": "direct",
                                                                     "TORCHINDUCTOR_COMPILE_THREADS": "1"},
                                   timeout_s=150 * C.TIME_SCALE, init_timeout_s=60)
            _RESULT["r"] = (per_rank, None)
        except H.RanksFailed as e:
            _RESULT["r"] = (None, str(e))
    return _RESULT["r"]


@pytest.mark.parametrize("item", ITEMS)
def test_torch_compile_funcol_all_reduce(item):
    per_rank, err = _job()
    if err is not None:
        pytest.fail(f"the torch.compile job failed as a whole:\n{err}", pytrace=False)
    if per_rank[0]["backend"] != "inductor":
        warnings.warn(f"inductor unavailable on this machine: compiled with backend="
                      f"{per_rank[0]['backend']!r} instead")
    problems = [f"rank {r}: {e}" for r, res in enumerate(per_rank) for e in res["items"][item]]
    if not problems:
        digs = {per_rank[r]["digests"].get(item) for r in range(WS)}
        if len(digs) != 1:
            problems.append(f"all_reduce results differ between ranks: {digs}")
    assert not problems, "\n".join(problems)
