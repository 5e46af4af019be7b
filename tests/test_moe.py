"""resident_pg.moe: EP dispatch/combine checked against an independent single-process reference.

Per world size (2 and 3 ranks, one spawned job each), every rank builds MoEDispatchers and runs:

* ``bf16``: bfloat16 payload, uneven top-k routing (a skewed expert popularity, one expert that
  receives nothing), a different token count per rank, two rounds on the same dispatcher (the
  second with other counts, one rank with 0 tokens);
* ``fp32_masked``: float32 payload, some top-k entries -1 (no expert), K=2;
* ``capacity``: ``slots_per_rank`` below the worst case, so some pairs are dropped by the
  documented rule (expert-major order inside a peer's slots, the tail is dropped);
* ``shrink``: six rounds alternating full and nearly empty ranks (the rows a round leaves past
  the new counts must read zero).

``test_moe_dispatch_combine_cuda`` (gpu marker): the same scenarios and checks on CUDA tensors,
where dispatch and combine run the kernels of resident_pg.ep_kernels (``shrink`` and the
second round of ``bf16`` leave rows that must read zero again), with
``topk_idx`` as int64, int32 and int16.

Each expert is a random linear layer; the parent recomputes everything in numpy (float64) from
the same seeds: expert counts must match **bitwise**, ``expert_x`` must hold exactly the rows the
layout promises (source rank order, then token order; zero padding), and ``combine`` must match
``sum_k w * (x @ W_e)`` within the payload dtype's rounding.  ``errors`` checks the ValueErrors.

``test_moe_graph_replay_*``: dispatch + experts + combine captured in one CUDA graph (gpu
marker) and replayed with fresh inputs; on CPU the same body runs eagerly (a dry run of the
test's logic).
"""

from __future__ import annotations

import numpy as np
import pytest

import dist_harness as H

WORLD_SIZES = (2, 3)


# --------------------------------------------------------------------------
# deterministic data (any process can regenerate any rank's inputs)
# --------------------------------------------------------------------------


def routing(key, rank, T, E, K, dead, masked=0.0):
    """[T, K] int64 top-k experts of `rank`: skewed popularity, expert `dead` never chosen."""
    rng = H.rng_for(key + "/route", rank)
    p = 1.0 / (1.0 + np.arange(E)) ** 1.3
    p[dead] = 0.0
    p /= p.sum()
    idx = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(T)]) if T else \
        np.zeros((0, K), dtype=np.int64)
    if masked and T:
        idx[rng.random((T, K)) < masked] = -1
    return idx.astype(np.int64)


def tokens(key, rank, T, Hd):
    return H.rng_for(key + "/x", rank).standard_normal((T, Hd))


def weights(key, rank, T, K):
    return H.rng_for(key + "/w", rank).uniform(0.1, 1.0, (T, K))


def expert_weights(key, E, Hd):
    return H.rng_for(key + "/experts", 0).standard_normal((E, Hd, Hd)) / np.sqrt(Hd)


def _round(a, dtype_name):
    """numpy float64 -> the payload dtype's values, back as float64."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(H.tdtype(dtype_name)).double().numpy()


SCENARIOS = {
    # name: (dtype, E per rank, hidden, max_tokens, K, tokens per rank per round, masked, slots)
    "bf16": ("bfloat16", 4, 32, 6, 3, [[6, 3, 5], [2, 0, 6]], 0.0, None),
    "fp32_masked": ("float32", 2, 24, 5, 2, [[5, 4, 1]], 0.25, None),
    "capacity": ("float32", 3, 16, 8, 3, [[8, 8, 7]], 0.0, 4),
    # rounds that alternate full and nearly empty ranks: the rows a round leaves must read zero
    "shrink": ("float32", 2, 200, 8, 2, [[8, 8, 8], [1, 0, 1], [8, 7, 8], [0, 1, 1], [8, 8, 6],
                                         [1, 1, 0]], 0.0, None),
}


def scenario_params(name, ws):
    dt, lpe, Hd, M, K, rounds, masked, slots = SCENARIOS[name]
    E = lpe * ws
    dead = E // 2 + 1  # an expert on a rank > 0 that receives nothing
    return dt, E, Hd, M, K, [r[:ws] for r in rounds], masked, slots, dead


# --------------------------------------------------------------------------
# inside a rank
# --------------------------------------------------------------------------


def _run_scenario(name, rank, ws, device="cpu", index_dtype=None):
    import torch

    from resident_pg.moe import MoEDispatcher

    dt, E, Hd, M, K, rounds, masked, slots, dead = scenario_params(name, ws)
    dtype = H.tdtype(dt)
    moe = MoEDispatcher(None, E, Hd, M, K, dtype, device, slots_per_rank=slots)
    L = moe.local_experts
    Wx = torch.from_numpy(expert_weights(name, E, Hd)[rank * L:(rank + 1) * L]).float()
    Wx = Wx.to(device)
    out = []
    for rnd, Ts in enumerate(rounds):
        key = f"{name}/{rnd}"
        T = Ts[rank]
        x = torch.from_numpy(tokens(key, rank, T, Hd)).to(dtype).to(device)
        idx = torch.from_numpy(routing(key, rank, T, E, K, dead, masked))
        idx = idx.to(index_dtype or idx.dtype).to(device)
        w = torch.from_numpy(weights(key, rank, T, K)).float().to(device)
        expert_x, counts, handle = moe.dispatch(x, idx, w)
        got_x = expert_x.double().cpu().numpy().copy()
        got_counts = counts.cpu().numpy().copy()
        expert_y = torch.bmm(expert_x.float(), Wx).to(dtype)  # padding rows too: static shapes
        y = moe.combine(expert_y, handle)
        out.append({"expert_x": got_x, "counts": got_counts, "y": y.double().cpu().numpy(),
                    "y_dtype": str(y.dtype), "dropped": int(handle.dropped),
                    "max_slots": moe.max_slots, "slots": moe.slots_per_rank})
    return out


def _error_cases(rank, ws):
    """Every bad call must raise ValueError before any communication (all ranks make them)."""
    import torch

    from resident_pg.moe import MoEDispatcher

    E, Hd, M, K = 2 * ws, 8, 4, 2
    res = {}

    def expect(label, fn, fragment):
        H.expect_error(res, label, fn, fragment)

    expect("experts_not_multiple", lambda: MoEDispatcher(None, 2 * ws + 1, Hd, M, K,
                                                         torch.float32, "cpu"), "multiple")
    expect("top_k_too_big", lambda: MoEDispatcher(None, E, Hd, M, E + 1, torch.float32, "cpu"),
           "top_k")
    expect("bad_hidden", lambda: MoEDispatcher(None, E, 0, M, K, torch.float32, "cpu"), "hidden")
    S, rows = ws * M, dict(dispatch_dtype=torch.uint8, dispatch_hidden=24)
    for label, into, fragment in (
            ("unpack_into_pair", torch.zeros(2, S, 16, dtype=torch.uint8), "pair"),
            ("unpack_into_head", (torch.zeros(2, S, 6, dtype=torch.uint8),
                                  torch.zeros(2, 2, S, dtype=torch.int32)), "head"),
            ("unpack_into_tail", (torch.zeros(2, S, 16, dtype=torch.uint8),
                                  torch.zeros(2, S, 2, dtype=torch.int32)), "tail")):
        expect(label, lambda: MoEDispatcher(None, E, Hd, M, K, torch.bfloat16, "cpu",
                                            unpack_into=into, **rows), fragment)
    moe = MoEDispatcher(None, E, Hd, M, K, torch.bfloat16, "cpu")
    x = torch.zeros(3, Hd, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [E - 1, 0]])
    w = torch.ones(3, K)
    expect("too_many_tokens", lambda: moe.dispatch(torch.zeros(M + 1, Hd, dtype=torch.bfloat16),
                                                   torch.zeros(M + 1, K, dtype=torch.int64),
                                                   torch.ones(M + 1, K)), "max_tokens_per_rank")
    expect("x_dtype", lambda: moe.dispatch(x.float(), idx, w), "dtype")
    expect("x_shape", lambda: moe.dispatch(x[:, :-1], idx, w), "x must be")
    expect("x_1d", lambda: moe.dispatch(x[0], idx, w), "x must be")
    expect("idx_shape", lambda: moe.dispatch(x, idx[:, :1], w), "topk_idx must have shape")
    expect("idx_float", lambda: moe.dispatch(x, idx.float(), w), "integer")
    expect("w_shape", lambda: moe.dispatch(x, idx, w[:2]), "topk_weights must have shape")
    expect("w_int", lambda: moe.dispatch(x, idx, idx), "floating")
    expect("idx_too_big", lambda: moe.dispatch(x, torch.tensor([[0, 1], [1, E], [0, 1]]), w),
           "not an expert")
    expect("idx_negative", lambda: moe.dispatch(x, torch.tensor([[0, -2], [1, 0], [0, 1]]), w),
           "not an expert")
    expect("idx_duplicate", lambda: moe.dispatch(x, torch.tensor([[0, 1], [2, 2], [0, 1]]), w),
           "twice")
    # a valid call afterwards: the group is still in step (no failed call communicated)
    ex, counts, h = moe.dispatch(x, idx, w)
    expect("expert_y_shape", lambda: moe.combine(ex[:, :-1], h), "expert_y must have shape")
    expect("expert_y_dtype", lambda: moe.combine(ex.float(), h), "dtype")
    expect("handle", lambda: moe.combine(ex, None), "handle")
    y = moe.combine(ex, h)
    res["valid_after_errors"] = "ok" if tuple(y.shape) == (3, Hd) else f"shape {tuple(y.shape)}"
    return res


def rank_job(rank, ws):
    return {"scenarios": {name: _run_scenario(name, rank, ws) for name in SCENARIOS},
            "errors": _error_cases(rank, ws)}


def gpu_rank_job(rank, ws):
    """The scenarios on CUDA tensors (the dispatch/combine kernels of resident_pg.ep_kernels),
    topk_idx as int64 and as int32 (the kernel reads both) and as int16 (converted first)."""
    import torch

    import cuda_harness as C

    C.setup_rank(rank, ws, timeout_s=60)
    return {f"{name}/{str(it).split('.')[-1]}": _run_scenario(name, rank, ws, "cuda", it)
            for name in SCENARIOS for it in (torch.int64, torch.int32, torch.int16)}


# --------------------------------------------------------------------------
# parent: independent reference
# --------------------------------------------------------------------------


def reference(name, ws, rnd):
    """Expected counts / expert rows per rank, and y per rank, for one round of a scenario."""
    dt, E, Hd, M, K, rounds, masked, slots, dead = scenario_params(name, ws)
    L = E // ws
    C = slots if slots is not None else M * min(K, L)
    S = ws * min(M, C)
    key = f"{name}/{rnd}"
    Wexp = expert_weights(name, E, Hd)
    inp = []
    for r in range(ws):
        T = rounds[rnd][r]
        inp.append((_round(tokens(key, r, T, Hd), dt), routing(key, r, T, E, K, dead, masked),
                    weights(key, r, T, K).astype(np.float32).astype(np.float64)))
    # placement: per source rank and destination, pairs in (local expert, token) order; the
    # first C fit
    placed = []  # per source: set of (t, k)
    for r, (x, idx, w) in enumerate(inp):
        ok = set()
        for d in range(ws):
            pairs = sorted(((int(idx[t, k]) % L, t, k) for t in range(idx.shape[0])
                            for k in range(K) if idx[t, k] >= 0 and idx[t, k] // L == d))
            ok.update((t, k) for _, t, k in pairs[:C])
        placed.append(ok)
    counts = np.zeros(E, dtype=np.int64)
    rows = [[] for _ in range(E)]
    for r, (x, idx, w) in enumerate(inp):   # source rank order, then token order
        for t in range(idx.shape[0]):
            for k in range(K):
                if (t, k) in placed[r]:
                    e = int(idx[t, k])
                    counts[e] += 1
                    rows[e].append(x[t])
    exp_x = []
    for r in range(ws):
        a = np.zeros((L, S, Hd))
        for l in range(L):
            if rows[r * L + l]:
                a[l, :len(rows[r * L + l])] = np.stack(rows[r * L + l])
        exp_x.append(a)
    ys, tols = [], []
    for r, (x, idx, w) in enumerate(inp):
        y = np.zeros((x.shape[0], Hd))
        mag = np.zeros((x.shape[0], Hd))
        for t in range(x.shape[0]):
            for k in range(K):
                if (t, k) in placed[r]:
                    out = x[t] @ Wexp[int(idx[t, k])]
                    y[t] += w[t, k] * out
                    mag[t] += np.abs(w[t, k] * out)
        if dt == "bfloat16":   # expert output and result rounded to bf16 (8-bit mantissa)
            tol = mag * 2.0 ** -7 + np.abs(y) * 2.0 ** -8 + 1e-6
        else:
            tol = mag * 1e-5 + 1e-6
        ys.append(y)
        tols.append(tol)
    dropped = [sum(1 for t in range(i[1].shape[0]) for k in range(K) if i[1][t, k] >= 0)
               - len(placed[r]) for r, i in enumerate(inp)]
    return {"counts": counts, "expert_x": exp_x, "y": ys, "tol": tols, "dropped": dropped,
            "L": L, "S": S}


@pytest.fixture(scope="module")
def jobs():
    cache = {}

    def get(ws):
        if ws not in cache:
            cache[ws] = H.run_ranks(rank_job, ws, timeout_s=240, init_timeout_s=60)
        return cache[ws]
    return get


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_moe_dispatch_combine(jobs, ws, name):
    _check_scenario([job["scenarios"][name] for job in jobs(ws)], ws, name)


_GPU_JOBS = {}


@pytest.mark.gpu
@pytest.mark.resident_only
@pytest.mark.parametrize("index_dtype", ["int64", "int32", "int16"])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_moe_dispatch_combine_cuda(ws, name, index_dtype):
    import cuda_harness as C

    if C.DRY_RUN:
        pytest.skip("the dispatch/combine kernels need a GPU")
    if ws not in _GPU_JOBS:
        _GPU_JOBS[ws] = H.run_ranks(gpu_rank_job, ws, init=False, timeout_s=240,
                                    init_timeout_s=60)
    _check_scenario([job[f"{name}/{index_dtype}"] for job in _GPU_JOBS[ws]], ws, name)


def _check_scenario(got_per_rank, ws, name):
    dt = SCENARIOS[name][0]
    n_rounds = len(SCENARIOS[name][5])
    problems = []
    for rnd in range(n_rounds):
        ref = reference(name, ws, rnd)
        L = ref["L"]
        if name == "capacity":
            assert sum(ref["dropped"]) > 0, "the capacity scenario must drop some pairs"
        if name == "bf16" and rnd == 0:
            assert (ref["counts"] == 0).sum() >= 1, "some expert must receive nothing"
            assert ref["counts"].max() > 2 * max(1, ref["counts"].min()), "loads must be uneven"
        for r in range(ws):
            got = got_per_rank[r][rnd]
            tag = f"ws={ws} {name} round {rnd} rank {r}"
            want_counts = ref["counts"][r * L:(r + 1) * L].astype(np.int32)
            if got["counts"].dtype != np.int32 or not np.array_equal(got["counts"], want_counts):
                problems.append(f"{tag}: counts {got['counts']!r} != {want_counts!r}")
            if got["max_slots"] != ref["S"]:
                problems.append(f"{tag}: max_slots {got['max_slots']} != {ref['S']}")
            if not np.array_equal(got["expert_x"], ref["expert_x"][r]):
                bad = np.argwhere(got["expert_x"] != ref["expert_x"][r])[0]
                problems.append(f"{tag}: expert_x differs first at [expert, row, col] = "
                                f"{bad.tolist()}")
            if got["dropped"] != ref["dropped"][r]:
                problems.append(f"{tag}: dropped {got['dropped']} != {ref['dropped'][r]}")
            if got["y_dtype"] != f"torch.{dt}":
                problems.append(f"{tag}: combine returned {got['y_dtype']}")
            y, want, tol = got["y"], ref["y"][r], ref["tol"][r]
            if y.shape != want.shape:
                problems.append(f"{tag}: y shape {y.shape} != {want.shape}")
                continue
            diff = np.abs(y - want)
            if (diff > tol).any():
                i = np.unravel_index(np.argmax(diff - tol), diff.shape)
                problems.append(f"{tag}: y[{i}] = {y[i]!r}, reference {want[i]!r}, |diff| "
                                f"{diff[i]:.3g} > tol {tol[i]:.3g}")
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_moe_value_errors(jobs, ws):
    per_rank = jobs(ws)
    bad = [f"rank {r} {label}: {v}" for r in range(ws)
           for label, v in per_rank[r]["errors"].items() if v != "ok"]
    assert len(per_rank[0]["errors"]) >= 21
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------
# CUDA graph capture (gpu) and its CPU dry run
# --------------------------------------------------------------------------

G_E, G_H, G_M, G_K, G_REPLAYS = 8, 64, 16, 4, 3


def _graph_job(rank, ws, device):
    """Capture dispatch + experts + combine once, replay with fresh inputs, compare each
    replay to a reference computed on this rank from every rank's regenerated inputs."""
    import torch

    from resident_pg.moe import MoEDispatcher

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.zeros(1, device="cuda").add_(1)
    H.init_pg()
    E, Hd, M, K = G_E * ws // 2, G_H, G_M, G_K
    dtype = torch.bfloat16
    moe = MoEDispatcher(None, E, Hd, M, K, dtype, device)
    L = moe.local_experts
    Wall = torch.from_numpy(expert_weights("graph", E, Hd)).float()
    Wx = Wall[rank * L:(rank + 1) * L].to(device)
    x_s = torch.zeros(M, Hd, dtype=dtype, device=device)
    idx_s = torch.zeros(M, K, dtype=torch.int64, device=device)
    w_s = torch.zeros(M, K, dtype=torch.float32, device=device)

    def inputs(rep, r):
        key = f"graph/{rep}"
        return (torch.from_numpy(tokens(key, r, M, Hd)).to(dtype),
                torch.from_numpy(routing(key, r, M, E, K, dead=E - 1)),
                torch.from_numpy(weights(key, r, M, K)).float())

    def fill(rep):
        x, idx, w = inputs(rep, rank)
        x_s.copy_(x)
        idx_s.copy_(idx)
        w_s.copy_(w)

    def step():
        expert_x, counts, handle = moe.dispatch(x_s, idx_s, w_s)
        expert_y = torch.bmm(expert_x.float(), Wx).to(dtype)
        return moe.combine(expert_y, handle), counts

    fill(0)
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # the first op of the group registers memory: never inside a capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_s, counts_s = step()

        def replay():
            graph.replay()
            torch.cuda.synchronize()
            return y_s, counts_s
    else:
        replay = step
    errs = []
    for rep in range(1, G_REPLAYS + 1):
        fill(rep)
        y, counts = replay()
        y, counts = y.double().cpu(), counts.cpu()
        want_counts = torch.zeros(E, dtype=torch.int64)
        x, idx, w = inputs(rep, rank)
        for r in range(ws):
            want_counts += torch.bincount(inputs(rep, r)[1].reshape(-1), minlength=E)
        if not torch.equal(counts.long(), want_counts[rank * L:(rank + 1) * L]):
            errs.append(f"replay {rep}: counts {counts.tolist()} != "
                        f"{want_counts[rank * L:(rank + 1) * L].tolist()}")
        outs = torch.einsum("th,tkhj->tkj", x.double(), Wall.double()[idx])
        ref = (outs * w.double().unsqueeze(-1)).sum(1)
        tol = (outs.abs() * w.double().unsqueeze(-1)).sum(1) * 2.0 ** -7 + ref.abs() * 2.0 ** -8
        if not bool(((y - ref).abs() <= tol + 1e-6).all()):
            errs.append(f"replay {rep}: max |y - ref| = {float((y - ref).abs().max()):.4g}")
    return errs


@pytest.mark.gpu
@pytest.mark.resident_only
def test_moe_graph_replay_cuda():
    per_rank = H.run_ranks(_graph_job, 2, args=("cuda",), init=False, timeout_s=300,
                           init_timeout_s=60)
    assert not any(per_rank), per_rank


def test_moe_graph_replay_cpu_dry_run():
    per_rank = H.run_ranks(_graph_job, 2, args=("cpu",), init=False, timeout_s=180,
                           init_timeout_s=60)
    assert not any(per_rank), per_rank
