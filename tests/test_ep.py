"""resident_pg.ep: the all_to_all with counts read on the device, and the DeepEP-low-latency-
shaped Buffer, checked against independent numpy references in spawned ranks.

Every rank regenerates every rank's inputs from seeds and computes the reference itself in numpy
(ep_scenarios.py; no code of resident_pg.moe / resident_pg.ep): moved rows and received layouts
compare bitwise, combined outputs within the payload dtype's rounding.

CPU (in CI; 2 and 4 ranks, the resident backend on CPU tensors), one job per world size:

* ``splits`` (ep_splits_cases.py): all_to_all_device_splits with random counts (zeros, the
  capacity, a rank's own rows), int32 and int64 counts, rows of 12 bytes and of 8 KiB (several
  64 KiB rounds per peer), counts given directly and exchanged first with all_to_all_single;
  rows past the counts keep their contents.
* ``ep`` (ep_buffer_cases.py): Buffer.low_latency_dispatch / low_latency_combine over the
  device-splits exchange (transport ``splits``), the padded all_to_all_single (``padded``) and a
  gloo group (the fallback, ``auto``): random routings with an expert nobody picks, ``-1``
  entries, a rank with no tokens, and every token to the same experts (the capacity edge).
* ``fp8`` (ep_fp8_cases.py): FP8 dispatch (``use_fp8``; with ``round_scale``; with
  ``use_ue8m0``) over the same three exchanges: the received fp8 bytes and scales compare bitwise
  with a numpy quantization of the routed rows (an fp8 e4m3fn encoder written from the format's
  definition), the scales' column-major layout, dequantized values within fp8 rounding of the
  inputs, combine of the dequantized experts' outputs, and an activation-dtype dispatch on the
  same Buffer afterwards.  Tokens have groups of 128 channels at magnitudes from 2**-24 (below
  the amax floor) to 2**9, and an all-zero group.
* ``errors`` (ep_buffer_cases.error_cases): bad calls raise ValueError (NotImplementedError for
  what is not implemented) before communicating.

GPU (``gpu`` marker; skipped without CUDA): the same cases on CUDA tensors plus graph replays
with fresh counts / routings (activation and FP8 dispatch), per world size
(RESIDENT_GPU_TESTS_WS, default 2,4,8) and path (direct, proxy, proxy+tcp; at 2 ranks each also
with round numbers that wrap)::

    python -m pytest -q tests/test_ep.py -m gpu

The FP8 cast itself, in one process: test_ep_fp8.py.
"""

from __future__ import annotations

import pytest

import cuda_harness as C
import dist_harness as H
from ep_buffer_cases import ep_case, ep_graph_case, error_cases
from ep_fp8_cases import ep_fp8_graph_case, fp8_cases
from ep_scenarios import (
    EP_FP8_SCENARIOS,
    EP_SCENARIOS,
    ep_params,
    ep_reference,
    ep_routing,
    split_counts,
)
from ep_splits_cases import catch, counts_bound_cases, split_cases, splits_graph_case

CPU_WORLD_SIZES = (2, 4)
GPU_PATHS = ("direct", "proxy", "proxy+tcp")


# ---------------------------------------------------------------- inside a rank


def cpu_job(rank, ws):
    import torch.distributed as dist

    res = split_cases(rank, ws, "cpu")
    gloo = dist.new_group(backend="gloo")
    for name in EP_SCENARIOS:
        for transport in ("splits", "padded"):
            res[f"ep[{name}-{transport}]"] = catch(ep_case, rank, ws, "cpu", name, transport)
        res[f"ep[{name}-gloo]"] = catch(ep_case, rank, ws, "cpu", name, "auto", gloo)
    # the graph programs, called eagerly on CPU (a replay is the step itself)
    res["graph[splits]"] = catch(splits_graph_case, rank, ws, "cpu", "g", 6, 5, 3)
    res["graph[ep]"] = catch(ep_graph_case, rank, ws, "cpu", 2)
    res.update(fp8_cases(rank, ws, "cpu", gloo))
    res["graph[ep-fp8]"] = catch(ep_fp8_graph_case, rank, ws, "cpu", "fp8_random_bf16", 2)
    return {"cases": res, "errors": error_cases(rank, ws)}


def gpu_job(rank, ws):
    C.setup_rank(rank, ws, timeout_s=60)
    res = split_cases(rank, ws, "cuda")
    for name in EP_SCENARIOS:
        for transport in ("splits", "padded"):
            res[f"ep[{name}-{transport}]"] = catch(ep_case, rank, ws, "cuda", name, transport)
    res["graph[splits-small]"] = catch(splits_graph_case, rank, ws, "cuda", "gs", 6, 5, 4)
    res["graph[splits-rounds]"] = catch(splits_graph_case, rank, ws, "cuda", "gr", 40, 2048, 4)
    res["graph[ep]"] = catch(ep_graph_case, rank, ws, "cuda", 4)
    res.update(fp8_cases(rank, ws, "cuda"))
    for name in EP_FP8_SCENARIOS:
        res[f"graph[ep-{name}]"] = catch(ep_fp8_graph_case, rank, ws, "cuda", name, 4)
    res.update(counts_bound_cases(rank, ws))
    return {"cases": res}


# ---------------------------------------------------------------- parent side


def test_counts_with_rows_bound_follows_the_farthest_transport():
    """A group with any peer over a network transport takes the network bound."""
    from resident_pg import ep

    assert ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK < ep.COUNTS_WITH_ROWS_MAX_BYTES
    assert ep.counts_with_rows_max_bytes(["self", "shm", "shm"]) == ep.COUNTS_WITH_ROWS_MAX_BYTES
    for far in ("tcp", "ib"):
        assert ep.counts_with_rows_max_bytes(["shm", "self", far]) == \
            ep.COUNTS_WITH_ROWS_MAX_BYTES_NETWORK


def _problems(per_rank, cid):
    return [f"rank {r}: {p}" for r, v in enumerate(per_rank) for p in v["cases"][cid]]


_CPU_JOBS = {}


def _cpu(ws):
    if ws not in _CPU_JOBS:
        _CPU_JOBS[ws] = H.run_ranks(cpu_job, ws, timeout_s=300, init_timeout_s=60)
    return _CPU_JOBS[ws]


@pytest.mark.resident_only
@pytest.mark.parametrize("ws", CPU_WORLD_SIZES)
def test_ep_cpu(ws):
    per_rank = _cpu(ws)
    cases = per_rank[0]["cases"]
    assert len(cases) == 3 * 2 * 3 + 2 * 2 * 2 + 5 * 3 + 2 + 3 * 3 + 1
    problems = [p for cid in cases for p in _problems(per_rank, cid)]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.resident_only
@pytest.mark.parametrize("ws", CPU_WORLD_SIZES)
def test_ep_cpu_value_errors(ws):
    per_rank = _cpu(ws)
    bad = [f"rank {r} {label}: {v}" for r in range(ws)
           for label, v in per_rank[r]["errors"].items() if v != "ok"]
    assert len(per_rank[0]["errors"]) >= 20
    assert not bad, "\n".join(bad)


def test_ep_references_see_the_edges():
    """The scenarios reach what they are there for: an expert with no tokens, -1 entries, a rank
    without tokens, every slot of a peer filled, and split counts of 0 and of the capacity."""
    counts = [ep_reference("random_bf16", 4, r, 0, "ep/random_bf16/0")[1] for r in range(4)]
    assert min(c.min() for c in counts) == 0
    assert ep_params("random_bf16", 4)[6][0][2] == 0
    idx = ep_routing("ep/masked_f32/0", 0, 5, 12, 4, "masked")
    assert (idx == -1).all(axis=1).any() and (idx >= 0).any()
    hot = ep_reference("hot_f32", 2, 0, 0, "ep/hot_f32/0")[1]
    assert hot.tolist() == [2 * 5, 2 * 5]  # every token of both ranks: experts 0 and 1
    c = split_counts("x", 4, 7)
    assert (c == 0).any() and (c == 7).any()


_GPU_JOBS = {}

# Plus, at 2 ranks, every path with round numbers that wrap at the job's first op
# (cuda_harness.PATH_KNOBS["wrap"]): the counts-with-rows exchange's header mark among them.
GPU_KEYS = [(ws, p) for ws in C.WORLD_SIZES for p in GPU_PATHS]
GPU_KEYS += [(2, p) for p in ("direct+wrap", "proxy+wrap", "proxy+wrap+tcp") if 2 in C.WORLD_SIZES]


@pytest.mark.gpu
@pytest.mark.resident_only
@pytest.mark.parametrize("ws,path", GPU_KEYS, ids=[f"{p}-{ws}" for ws, p in GPU_KEYS])
def test_ep_gpu(ws, path):
    if C.DRY_RUN:
        pytest.skip("CUDA graphs and device splits need a GPU")
    key = (ws, path)
    if key not in _GPU_JOBS:
        _GPU_JOBS[key] = H.run_ranks(gpu_job, ws, env=C.path_env(path), init=False,
                                     timeout_s=300 * C.TIME_SCALE, init_timeout_s=60)
    per_rank = _GPU_JOBS[key]
    problems = [p for cid in per_rank[0]["cases"] for p in _problems(per_rank, cid)]
    assert not problems, "\n".join(problems[:20])
