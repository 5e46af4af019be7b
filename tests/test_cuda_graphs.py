"""CUDA graphs: collectives captured with torch.cuda.graph and replayed with fresh data.

Per job (ws, RESIDENT_PATH), on static tensors:

* graph 1: all_reduce SUM bf16 (in place), all_gather_into_tensor, all_to_all_single,
  reduce_scatter_tensor, send/recv between pairs (r, r^1), broadcast;
* graph 2: async_op=True ops (all_reduce MAX int32, reduce_scatter_tensor AVG, isend/irecv
  ring, all_gather_into_tensor) whose work.wait() calls are inside the capture too;
* graph 3: messages larger than one 64 KiB slot (all_reduce of 256 KiB,
  all_to_all_single uneven with zero splits).

Each op is warmed up once eagerly on a side stream before capture (as torch recommends)
and those results are checked too.  The ranks agree through the parent's store (not the
backend) that every capture succeeded, then replay K=5 times: before each replay FRESH
random data is copied into the static inputs (`static.copy_(new)` outside the graph);
between the replays of graph 1 and graph 2, eager ops run on the same group.  Every
replay's outputs are checked against independent references; reductions must be bitwise
identical on all ranks.

Dry run (RESIDENT_GPU_TESTS_DEVICE=cpu): no capture, each "replay" calls the capture
function eagerly on CPU tensors (checks the data and reference logic only).
"""

from __future__ import annotations

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import dev, host, sentinel
from dist_harness import a2a_split, compare_exact, compare_reduction, digest, make_input, reference_reduce

pytestmark = C.module_marks()

K_REPLAYS = 5
# 8 ranks on the proxy path: a captured multi-round all_reduce followed by an all_to_all once
# stalled there (docs/decisions.md, "When a kernel lets the next one launch").
# Round numbers that wrap (cuda_harness.PATH_KNOBS) at 2 ranks: replays run past the wrap.
JOB_KEYS = [k for k in ((2, "direct"), (2, "proxy"), (4, "direct"), (8, "proxy"),
                        (2, "direct+wrap"), (2, "proxy+wrap"))
            if k[0] in C.WORLD_SIZES]
ITEMS = ("warmup_on_side_stream", "capture", "graph1_mixed_ops_replays",
         "graph2_async_wait_inside_capture_replays", "graph3_multi_slot_replays",
         "eager_ops_between_replays")


class _Prog:
    """Static tensors, fill (fresh inputs, outside the graph), step (the captured ops), check."""

    name = "?"

    def __init__(self, rank, ws):
        self.rank, self.ws = rank, ws
        self.right, self.left = (rank + 1) % ws, (rank - 1) % ws
        self.data = {}

    def gen(self, key, name, n, dt, kind="normal"):
        self.data[name] = [make_input(f"cuda/graph/{self.name}/{key}/{name}", r, n, dt, kind)
                           for r in range(self.ws)]
        return self.data[name][self.rank]

    def reduced(self, name, op, dt, got, label, errs, digs):
        ins = self.data[name]
        errs += compare_reduction(got, reference_reduce(ins, op, dt), ins, op, dt, label)
        digs[label] = digest(got)


class Mixed(_Prog):
    name = "g1"

    def __init__(self, rank, ws):
        super().__init__(rank, ws)
        self.n_ar, self.n_ag, self.m, self.n_rs, self.n_p2p, self.n_bc = 4099, 1031, 257, 2053, 999, 4099
        self.partner = rank ^ 1 if (rank ^ 1) < ws else None
        self.root = ws - 1
        self.ar = sentinel(self.n_ar, "bfloat16")
        self.ag_in, self.ag_out = sentinel(self.n_ag, "float32"), sentinel(ws * self.n_ag, "float32")
        self.a2a_in, self.a2a_out = sentinel(ws * self.m, "int64"), sentinel(ws * self.m, "int64")
        self.rs_in, self.rs_out = sentinel(ws * self.n_rs, "float32"), sentinel(self.n_rs, "float32")
        self.p_send, self.p_recv = sentinel(self.n_p2p, "float16"), sentinel(self.n_p2p, "float16")
        self.bc = sentinel(self.n_bc, "uint8")

    def fill(self, key):
        self.ar.copy_(dev(self.gen(key, "ar", self.n_ar, "bfloat16")))
        self.ag_in.copy_(dev(self.gen(key, "ag", self.n_ag, "float32")))
        self.a2a_in.copy_(dev(self.gen(key, "a2a", self.ws * self.m, "int64")))
        self.rs_in.copy_(dev(self.gen(key, "rs", self.ws * self.n_rs, "float32")))
        self.p_send.copy_(dev(self.gen(key, "p2p", self.n_p2p, "float16")))
        self.bc.copy_(dev(self.gen(key, "bc", self.n_bc, "uint8")))

    def step(self):
        import torch.distributed as dist

        dist.all_reduce(self.ar)
        dist.all_gather_into_tensor(self.ag_out, self.ag_in)
        dist.all_to_all_single(self.a2a_out, self.a2a_in)
        dist.reduce_scatter_tensor(self.rs_out, self.rs_in)
        if self.partner is not None:
            C.pair_exchange(self.rank, self.partner, self.p_send, self.p_recv, 3)
        dist.broadcast(self.bc, src=self.root)

    def check(self, label):
        import torch

        errs, digs = [], {}
        r, ws, d = self.rank, self.ws, self.data
        self.reduced("ar", "SUM", "bfloat16", host(self.ar), f"{label} all_reduce bf16", errs, digs)
        errs += compare_exact(host(self.ag_out), torch.cat(d["ag"]), f"{label} all_gather_into_tensor")
        ref = torch.cat([d["a2a"][s][r * self.m:(r + 1) * self.m] for s in range(ws)])
        errs += compare_exact(host(self.a2a_out), ref, f"{label} all_to_all_single")
        chunks = [x[r * self.n_rs:(r + 1) * self.n_rs] for x in d["rs"]]
        errs += compare_reduction(host(self.rs_out), reference_reduce(chunks, "SUM", "float32"), chunks,
                                  "SUM", "float32", f"{label} reduce_scatter_tensor")
        if self.partner is not None:
            errs += compare_exact(host(self.p_recv), d["p2p"][self.partner], f"{label} recv from {self.partner}")
        got = host(self.bc)
        errs += compare_exact(got, d["bc"][self.root], f"{label} broadcast")
        digs[f"{label} broadcast"] = digest(got)
        return errs, digs


class AsyncInCapture(_Prog):
    name = "g2"

    def __init__(self, rank, ws):
        super().__init__(rank, ws)
        self.n_x, self.n_rs, self.n_ring, self.n_ag = 1031, 515, 333, 64
        self.x = sentinel(self.n_x, "int32")
        self.rs_in, self.rs_out = sentinel(ws * self.n_rs, "float32"), sentinel(self.n_rs, "float32")
        self.r_send, self.r_recv = sentinel(self.n_ring, "float64"), sentinel(self.n_ring, "float64")
        self.ag_in, self.ag_out = sentinel(self.n_ag, "bfloat16"), sentinel(ws * self.n_ag, "bfloat16")

    def fill(self, key):
        self.x.copy_(dev(self.gen(key, "x", self.n_x, "int32")))
        self.rs_in.copy_(dev(self.gen(key, "rs", self.ws * self.n_rs, "float32")))
        self.r_send.copy_(dev(self.gen(key, "ring", self.n_ring, "float64")))
        self.ag_in.copy_(dev(self.gen(key, "ag", self.n_ag, "bfloat16")))

    def step(self):
        import torch.distributed as dist

        w1 = dist.all_reduce(self.x, op=dist.ReduceOp.MAX, async_op=True)
        w2 = dist.reduce_scatter_tensor(self.rs_out, self.rs_in, op=dist.ReduceOp.AVG, async_op=True)
        wr, wsend = C.ring_post(self.rank, self.r_send, self.right, self.r_recv, self.left, 5)
        w3 = dist.all_gather_into_tensor(self.ag_out, self.ag_in, async_op=True)
        for w in (w3, wsend, wr, w2, w1):
            w.wait()

    def check(self, label):
        import torch

        errs, digs = [], {}
        r, d = self.rank, self.data
        got = host(self.x)
        errs += compare_exact(got, reference_reduce(d["x"], "MAX", "int32"), f"{label} all_reduce MAX int32")
        digs[f"{label} all_reduce"] = digest(got)
        chunks = [x[r * self.n_rs:(r + 1) * self.n_rs] for x in d["rs"]]
        errs += compare_reduction(host(self.rs_out), reference_reduce(chunks, "AVG", "float32"), chunks,
                                  "AVG", "float32", f"{label} reduce_scatter_tensor AVG")
        errs += compare_exact(host(self.r_recv), d["ring"][self.left], f"{label} irecv from {self.left}")
        errs += compare_exact(host(self.ag_out), torch.cat(d["ag"]), f"{label} all_gather_into_tensor")
        return errs, digs


class MultiSlot(_Prog):
    name = "g3"

    def __init__(self, rank, ws):
        super().__init__(rank, ws)
        self.n_ar, self.m = 65536 + 5, 2000
        self.splits = [[a2a_split(s, dd, self.m, "uneven") for dd in range(ws)] for s in range(ws)]
        self.ar = sentinel(self.n_ar, "float32")
        self.a_in = sentinel(sum(self.splits[rank]), "float16")
        self.a_out = sentinel(sum(self.splits[s][rank] for s in range(ws)), "float16")

    def fill(self, key):
        self.ar.copy_(dev(self.gen(key, "ar", self.n_ar, "float32")))
        self.data["a2a"] = [make_input(f"cuda/graph/g3/{key}/a2a", s, sum(self.splits[s]), "float16")
                            for s in range(self.ws)]
        self.a_in.copy_(dev(self.data["a2a"][self.rank]))

    def step(self):
        import torch.distributed as dist

        dist.all_reduce(self.ar)
        dist.all_to_all_single(self.a_out, self.a_in,
                               output_split_sizes=[self.splits[s][self.rank] for s in range(self.ws)],
                               input_split_sizes=self.splits[self.rank])

    def check(self, label):
        import torch

        errs, digs = [], {}
        r, sp = self.rank, self.splits
        self.reduced("ar", "SUM", "float32", host(self.ar), f"{label} all_reduce 256 KiB", errs, digs)
        ref = torch.cat([self.data["a2a"][s][sum(sp[s][:r]):sum(sp[s][:r + 1])] for s in range(self.ws)])
        errs += compare_exact(host(self.a_out), ref, f"{label} all_to_all_single uneven")
        return errs, digs


def _eager(rank, ws, i):
    """Eager ops on the same (world) group between replays."""
    import torch
    import torch.distributed as dist

    errs, digs = [], {}
    ins = [make_input(f"cuda/graph/eager/{i}/ar", r, 4099, "float32") for r in range(ws)]
    t = dev(ins[rank])
    dist.all_reduce(t)
    got = host(t)
    errs += compare_reduction(got, reference_reduce(ins, "SUM", "float32"), ins, "SUM", "float32",
                              f"eager {i} all_reduce")
    digs[f"eager {i}"] = digest(got)
    splits = [[a2a_split(s, d, 11, "uneven") for d in range(ws)] for s in range(ws)]
    ins = [make_input(f"cuda/graph/eager/{i}/a2a", s, sum(splits[s]), "int32") for s in range(ws)]
    out = sentinel(sum(splits[s][rank] for s in range(ws)), "int32")
    w = dist.all_to_all_single(out, dev(ins[rank]), output_split_sizes=[splits[s][rank] for s in range(ws)],
                               input_split_sizes=splits[rank], async_op=True)
    w.wait()
    ref = torch.cat([ins[s][sum(splits[s][:rank]):sum(splits[s][:rank + 1])] for s in range(ws)])
    errs += compare_exact(host(out), ref, f"eager {i} all_to_all_single")
    return errs, digs


def graphs_job(rank, ws, _ids=None):
    import torch

    C.setup_rank(rank, ws, timeout_s=20)
    items = {k: [] for k in ITEMS}
    digs = {k: {} for k in ITEMS}
    progs = [Mixed(rank, ws), AsyncInCapture(rank, ws), MultiSlot(rank, ws)]
    item_of = dict(zip(("g1", "g2", "g3"), ITEMS[2:5]))

    # warm-up: every op once, eagerly, on a side stream
    side = torch.cuda.Stream() if C.ON_GPU else None
    for p in progs:
        try:
            e, d = C.warm_up_on_side_stream(p, side)
            items["warmup_on_side_stream"] += e
            digs["warmup_on_side_stream"].update(d)
        except Exception as e:  # noqa: BLE001
            items["warmup_on_side_stream"].append(f"{p.name} warm-up raised {C.exc_text(e)}")

    # capture every program; all ranks agree (through the store) before any replay
    graphs = {}
    for p in progs:
        ok = True
        try:
            graphs[p.name] = C.capture_replay(p.step)  # dry run: p.step, run eagerly
        except Exception as e:  # noqa: BLE001
            ok = False
            items["capture"].append(f"capturing {p.name} raised {C.exc_text(e)}")
        if not C.store_agree(f"capture/{p.name}", rank, ws, ok):
            graphs.pop(p.name, None)
            if ok:
                items["capture"].append(f"{p.name}: capture failed on another rank; not replayed")
            items[item_of[p.name]].append(f"{p.name} not replayed: its capture failed")

    broken = set()
    for i in range(K_REPLAYS):
        for p in progs:
            if p.name not in graphs or p.name in broken:
                continue
            try:
                p.fill(f"replay{i}")  # fresh data into the static inputs, outside the graph
                graphs[p.name]()
                e, d = p.check(f"{p.name} replay {i}")
                items[item_of[p.name]] += e
                digs[item_of[p.name]].update(d)
            except Exception as e:  # noqa: BLE001
                broken.add(p.name)
                items[item_of[p.name]].append(f"{p.name} replay {i} raised {C.exc_text(e)}")
            if p.name == "g1":
                try:
                    e, d = _eager(rank, ws, i)
                    items["eager_ops_between_replays"] += e
                    digs["eager_ops_between_replays"].update(d)
                except Exception as e:  # noqa: BLE001
                    items["eager_ops_between_replays"].append(f"eager ops after replay {i} raised {C.exc_text(e)}")
    if C.ON_GPU:
        torch.cuda.synchronize()
    return {"items": items, "digests": digs}


_RESULTS: dict = {}


def run_graphs_job(ws, env):
    """graphs_job in ``ws`` ranks with ``env``: (per-rank results, None), or (None, why the job
    failed as a whole)."""
    try:
        return H.run_ranks(graphs_job, ws, env=env, init=False, timeout_s=90 * C.TIME_SCALE,
                           init_timeout_s=20), None
    except H.RanksFailed as e:
        return None, str(e)


def _job(key):
    if key not in _RESULTS:
        ws, path = key
        _RESULTS[key] = run_graphs_job(ws, C.path_env(path))
    return _RESULTS[key]


def item_problems(per_rank, item, ws):
    """The problems of one item of a graphs job: every rank's errors, then (when there are
    none) every digest that differs from rank 0's."""
    problems = [f"rank {r}: {e}" for r, res in enumerate(per_rank) for e in res["items"][item]]
    if not problems:
        d0 = per_rank[0]["digests"][item]
        for r in range(1, ws):
            for k, v in d0.items():
                if per_rank[r]["digests"][item].get(k) != v:
                    problems.append(f"{k}: rank {r} result {per_rank[r]['digests'][item].get(k)} "
                                    f"differs from rank 0 result {v}")
    return problems


@pytest.mark.parametrize("ws,path", JOB_KEYS, ids=[f"ws{w}-{p}" for w, p in JOB_KEYS])
@pytest.mark.parametrize("item", ITEMS)
def test_cuda_graph(item, ws, path):
    per_rank, err = _job((ws, path))
    if err is not None:
        pytest.fail(f"the ws={ws} path={path} CUDA-graph job failed as a whole:\n{err}", pytrace=False)
    problems = item_problems(per_rank, item, ws)
    assert not problems, f"{item} ws={ws} path={path}:\n" + "\n".join(problems[:40])
