"""CUDA tensors over the tcp transport: the GPU suites' cases with RESIDENT_TRANSPORT=tcp,
subgroups, and ranks in separate network namespaces (hosts played on one machine).

Design: the cases have one source, the suites that own them. This module runs their case
registries and job functions (test_cuda_collectives, test_cuda_async_ops, test_cuda_p2p_order,
test_cuda_graphs) under job keys whose path carries the ``tcp`` knob of cuda_harness.PATH_KNOBS
(RESIDENT_TRANSPORT=tcp, every peer over tcp even on one host), as the suites run their other
knobs; it adds only what those suites lack: the transport and path every peer reports, and
subgroups. With tcp every peer is proxied, so the keys use the proxy path (``proxy+tcp``,
knob variants ``proxy+KNOB+tcp``); ``direct+tcp`` must refuse to form with a clear error
(tested), so the suites' direct-path keys are not repeated here.

1. tcp on one host: every collective and dtype at 2 and 4 ranks (8 ranks: the reduced dtypes,
   marked slow; knob variants of the proxied protocol at 2 and 4 ranks), the send/recv call
   orders (default and ``own`` launch policy), the graph suite (captured collectives and p2p
   replayed with fresh data, eager ops between replays), and a subgroups case: subgroups
   alive at once (every rank, halves, even ranks, an odd-sized group), eager, async in flight
   together and captured into CUDA graphs, each op checked against an independent reference.
2. Network namespaces (tests/test_tcp_netns.py's hosts, made over rtnetlink by
   tests/netns.py; skips, saying why, without root or the right to make them): 2 ranks in 2 namespaces (tcp between them) and 4 ranks laid out [0, 0, 1, 1]
   (shm and the direct path inside a namespace, tcp and the proxy across), RESIDENT_PATH=auto,
   a selection of the collectives suite's cases (every op, several dtypes), the subgroups case
   (groups inside one namespace, across, and both), the graph suite's job, and the seeded
   op mixes of test_cuda_op_mix.py at 4 ranks (seeds 1 and 2, RESIDENT_OPMIX_SEEDS for others).

Every job key is one spawned job; each case (or graph item) is its own pytest item. Dry run
(RESIDENT_GPU_TESTS_DEVICE=cpu, see cuda_harness): the same jobs on CPU tensors, the namespace
tests included; ``RESIDENT_GPU_TESTS_WS`` limits the world sizes. On the GPU machine:
scripts/device_run.sh gpu-tests-tcp.
"""

from __future__ import annotations

import os

import pytest

import cuda_harness as C
import dist_harness as H
import test_cuda_async_ops as CA
import test_cuda_collectives as CC
import test_cuda_graphs as CG
import test_cuda_op_mix as COM
import test_cuda_p2p_order as CP
from cuda_harness import dev, host, sentinel
from dist_harness import a2a_split, compare_exact, compare_reduction, digest, make_input, reference_reduce
from op_mix_run import OpMixJobs
import tcp_hosts as TH

pytestmark = C.module_marks()


@pytest.fixture(scope="module")
def hosts():
    """Three hosts as in test_tcp_netns.py, under names and a subnet of their own (the kernel
    removes another module's namespaces asynchronously: the same names made again at once can
    still exist)."""
    yield from TH.hosts_for_module(3, 215, "rpc", 40, decoy=False)

WS = C.WORLD_SIZES
TCP = "proxy+tcp"
# Knobs that change what crosses tcp (cuda_harness.PATH_KNOBS): one trigger over several parts
# (one block per op); round numbers, and so the flags the proxy checks, that wrap.
VARIANTS = [(2, "proxy+blocks1+tcp"), (2, "proxy+wrap+tcp")]
COLL_KEYS = [(ws, TCP) for ws in WS] + [k for k in VARIANTS if k[0] in WS]
WRAP = [(2, "proxy+wrap+tcp")] if 2 in WS else []
P2P_KEYS = [(ws, p) for ws in WS for p in (TCP, "proxy+own+tcp") if ws <= 4 or p == TCP] + WRAP
GRAPH_KEYS = [(ws, TCP) for ws in WS] + WRAP
NETNS_LAYOUTS = {2: [0, 1], 4: [0, 0, 1, 1]}  # rank -> namespace index
NETNS_KEYS = [(ws, "auto") for ws in NETNS_LAYOUTS if ws in WS]
SUB_GRAPH_REPLAYS = 3
SUBGROUP_TIMEOUT_S = 60  # an op on a subgroup that hangs fails, naming itself, after this


def _marks(ws):
    return [pytest.mark.slow] if ws >= 8 else []


def _id(ws, path):
    return f"ws{ws}-{path}"


# --------------------------------------------------------------------------
# Cases this module adds to the collectives suite's
# --------------------------------------------------------------------------


def expected_link(me, peer):
    """(transport, path) rank ``me`` must report for global rank ``peer``, from the job's
    environment: namespaces (RESIDENT_TEST_NETNS) decide the host, else RESIDENT_TRANSPORT=tcp
    makes every peer tcp; None when neither is set."""
    names = os.environ.get("RESIDENT_TEST_NETNS", "").split(",")
    forced_proxy = os.environ.get("RESIDENT_PATH") == "proxy"
    if len(names) > max(me, peer) and names[me] and names[peer]:
        if names[me] == names[peer]:
            return ("shm", "proxy" if forced_proxy else "direct")
        return ("tcp", "proxy")
    if os.environ.get("RESIDENT_TRANSPORT") == "tcp":
        return ("tcp", "proxy")
    return None


def link_problems(rank, ranks, group, label):
    """Each peer of ``group`` (global ranks ``ranks``) as describe() reports it, against
    expected_link."""
    import resident_pg

    errs = []
    info = resident_pg.describe(group, device=C.DEVICE)
    for i, v in info["peers"].items():
        peer = ranks[i]
        if peer == rank:
            continue
        want = expected_link(rank, peer)
        if want is None:
            errs.append(f"{label}: the job sets neither RESIDENT_TRANSPORT=tcp nor namespaces")
            break
        if v != {"transport": want[0], "path": want[1]}:
            errs.append(f"{label}: rank {rank} -> rank {peer}: {v}, expected transport {want[0]}, "
                        f"path {want[1]}")
    return errs


def _describe(rank, ws):
    return link_problems(rank, list(range(ws)), None, "world"), {}


def subgroup_ranks(ws):
    """(name, sorted global ranks) of the subgroups, the same list on every rank: a second group
    over every rank, the two halves, the even ranks and a group of three (odd size, across the
    halves); groups of one rank have no peer and are left out."""
    half = ws // 2
    specs = [("all", list(range(ws))), ("low", list(range(half))), ("high", list(range(half, ws))),
             ("evens", list(range(0, ws, 2)))]
    if ws >= 4:
        specs.append(("three", sorted({0, 1, ws - 1})))
    return [(name, ranks) for name, ranks in specs if len(ranks) >= 2]


def _ring_on(rank, ranks, group, send, recv, right, left):
    """isend to ``right``, irecv from ``left`` (global ranks) on ``group``: the irecv posted first
    on even group ranks, the isend first on odd ones; returns both works."""
    import torch.distributed as dist

    if ranks.index(rank) % 2 == 0:
        wr = dist.irecv(recv, src=left, group=group)
        return wr, dist.isend(send, dst=right, group=group)
    wsend = dist.isend(send, dst=right, group=group)
    return dist.irecv(recv, src=left, group=group), wsend


def subgroup_ops(rank, ranks, group, key):
    """Eager ops on one subgroup, each checked: (errors, digests of the reductions)."""
    import torch
    import torch.distributed as dist

    errs, digs = [], {}
    i, k = ranks.index(rank), len(ranks)
    # all_reduce SUM bf16 (blocking), MAX int64 over more than one 64 KiB round (async)
    ins = [make_input(f"{key}/ar", r, 4099, "bfloat16") for r in ranks]
    t = dev(ins[i])
    dist.all_reduce(t, group=group)
    got = host(t)
    errs += compare_reduction(got, reference_reduce(ins, "SUM", "bfloat16"), ins, "SUM", "bfloat16",
                              f"{key} all_reduce SUM bfloat16")
    digs[f"{key}/ar"] = digest(got)
    ins = [make_input(f"{key}/armax", r, 8195, "int64") for r in ranks]
    t = dev(ins[i])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
    errs += compare_exact(host(t), reference_reduce(ins, "MAX", "int64"), f"{key} all_reduce MAX int64")
    # all_gather_into_tensor int32
    ins = [make_input(f"{key}/ag", r, 1031, "int32") for r in ranks]
    out = sentinel(k * 1031, "int32")
    dist.all_gather_into_tensor(out, dev(ins[i]), group=group)
    errs += compare_exact(host(out), torch.cat(ins), f"{key} all_gather_into_tensor")
    # reduce_scatter_tensor SUM float32
    c = 2053
    ins = [make_input(f"{key}/rs", r, k * c, "float32") for r in ranks]
    out = sentinel(c, "float32")
    dist.reduce_scatter_tensor(out, dev(ins[i]), group=group)
    chunks = [x[i * c:(i + 1) * c] for x in ins]
    errs += compare_reduction(host(out), reference_reduce(chunks, "SUM", "float32"), chunks, "SUM",
                              "float32", f"{key} reduce_scatter_tensor")
    # all_to_all_single, uneven with zero splits, float16
    splits = [[a2a_split(s, d, 37, "uneven") for d in range(k)] for s in range(k)]
    ins = [make_input(f"{key}/a2a", ranks[s], sum(splits[s]), "float16") for s in range(k)]
    out = sentinel(sum(splits[s][i] for s in range(k)), "float16")
    dist.all_to_all_single(out, dev(ins[i]), output_split_sizes=[splits[s][i] for s in range(k)],
                           input_split_sizes=splits[i], group=group)
    ref = torch.cat([ins[s][sum(splits[s][:i]):sum(splits[s][:i + 1])] for s in range(k)])
    errs += compare_exact(host(out), ref, f"{key} all_to_all_single uneven")
    # broadcast from the group's last member (a global rank)
    root = ranks[-1]
    t = dev(make_input(f"{key}/bc", rank, 5000, "uint8"))
    dist.broadcast(t, src=root, group=group)
    errs += compare_exact(host(t), make_input(f"{key}/bc", root, 5000, "uint8"), f"{key} broadcast")
    # isend/irecv ring inside the group (global ranks)
    right, left = ranks[(i + 1) % k], ranks[(i - 1) % k]
    send = dev(make_input(f"{key}/ring", rank, 777, "float64"))
    recv = sentinel(777, "float64")
    for w in _ring_on(rank, ranks, group, send, recv, right, left):
        w.wait()
    errs += compare_exact(host(recv), make_input(f"{key}/ring", left, 777, "float64"),
                          f"{key} irecv from {left}")
    return errs, digs


def subgroups_in_flight(rank, ws, groups, key):
    """An async all_reduce on each of this rank's subgroups and one on the world, all issued
    before any wait, waited in reverse."""
    import torch.distributed as dist

    errs, pending = [], []
    for name, ranks, g in groups:
        ins = [make_input(f"{key}/{name}", r, 4099, "float32") for r in ranks]
        t = dev(ins[ranks.index(rank)])
        pending.append((name, ins, t, dist.all_reduce(t, group=g, async_op=True)))
    w_ins = [make_input(f"{key}/world", r, 1031, "int64") for r in range(ws)]
    tw = dev(w_ins[rank])
    pending.append(("world", w_ins, tw, dist.all_reduce(tw, op=dist.ReduceOp.BXOR, async_op=True)))
    for name, ins, t, w in reversed(pending):
        w.wait()
        op = "BXOR" if name == "world" else "SUM"
        dt = "int64" if name == "world" else "float32"
        errs += compare_reduction(host(t), reference_reduce(ins, op, dt), ins, op, dt,
                                  f"{key} async all_reduce on {name}")
    return errs


class SubgroupGraph:
    """A subgroup's graph program (cuda_harness: fill, step, check): all_reduce SUM float32 in
    place and all_gather_into_tensor int64."""

    def __init__(self, rank, name, ranks, group):
        self.name, self.rank, self.ranks, self.group = f"subgroup {name}", rank, ranks, group
        self.i, self.k = ranks.index(rank), len(ranks)
        self.n_ar, self.n_ag = 4099, 257
        self.ar = sentinel(self.n_ar, "float32")
        self.ag_in, self.ag_out = sentinel(self.n_ag, "int64"), sentinel(self.k * self.n_ag, "int64")

    def fill(self, key):
        self.key = f"cuda/tcp/subgraph/{self.name}/{key}"
        self.ar_ins = [make_input(f"{self.key}/ar", r, self.n_ar, "float32") for r in self.ranks]
        self.ag_ins = [make_input(f"{self.key}/ag", r, self.n_ag, "int64") for r in self.ranks]
        self.ar.copy_(dev(self.ar_ins[self.i]))
        self.ag_in.copy_(dev(self.ag_ins[self.i]))

    def step(self):
        import torch.distributed as dist

        dist.all_reduce(self.ar, group=self.group)
        dist.all_gather_into_tensor(self.ag_out, self.ag_in, group=self.group)

    def check(self, label):
        import torch

        errs = compare_reduction(host(self.ar), reference_reduce(self.ar_ins, "SUM", "float32"),
                                 self.ar_ins, "SUM", "float32", f"{label} all_reduce")
        errs += compare_exact(host(self.ag_out), torch.cat(self.ag_ins), f"{label} all_gather_into_tensor")
        return errs, {}


def subgroup_graphs(rank, ws, groups):
    """Each subgroup's program warmed up on a side stream, captured, agreed on through the
    parent's store (every rank, members or not), then replayed with fresh data, checked."""
    import torch

    errs, replays = [], []
    for name, ranks in subgroup_ranks(ws):
        mine = [g for n, _r, g in groups if n == name]
        ok = True
        if mine:
            prog = SubgroupGraph(rank, name, ranks, mine[0])
            try:
                errs += C.warm_up_on_side_stream(prog)[0]
                replays.append((prog, C.capture_replay(prog.step)))  # dry run: prog.step
            except Exception as e:  # noqa: BLE001
                ok = False
                errs.append(f"subgroup {name}: warm-up or capture raised {C.exc_text(e)}")
        if not C.store_agree(f"cuda_tcp/subgraph/{name}", rank, ws, ok):
            if ok:
                errs.append(f"subgroup {name}: the capture failed on another rank; nothing replayed")
            return errs
    for it in range(SUB_GRAPH_REPLAYS):
        for prog, replay in replays:
            prog.fill(f"replay{it}")  # fresh data into the static inputs, outside the graph
            replay()
            errs += prog.check(f"{prog.name} replay {it}")[0]
    if C.ON_GPU:
        torch.cuda.synchronize()  # before the graphs (and then the groups) go
    return errs


def _subgroups(rank, ws):
    """Subgroups (subgroup_ranks) alive at once beside the world: their transports and paths,
    eager ops on each in turn (twice), async ops on all of them in flight together, CUDA
    graphs captured on each. Digests: the reductions of the group of every rank."""
    import datetime

    import torch.distributed as dist

    errs, digs = [], {}
    groups = []
    timeout = datetime.timedelta(seconds=SUBGROUP_TIMEOUT_S * C.TIME_SCALE)
    for name, ranks in subgroup_ranks(ws):
        # collective over the world: every rank, in the same order
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            groups.append((name, ranks, g))
    for name, ranks, g in groups:
        errs += link_problems(rank, ranks, g, f"subgroup {name}")
    for it in range(2):
        for name, ranks, g in groups:
            e, d = subgroup_ops(rank, ranks, g, f"cuda/tcp/sub/{it}/{name}")
            errs += e
            if name == "all":
                digs.update(d)
        errs += subgroups_in_flight(rank, ws, groups, f"cuda/tcp/sub/{it}/async")
    errs += subgroup_graphs(rank, ws, groups)
    return errs, digs


CASES = H.CaseRegistry({**CC.CASES, **CA.CASES})
CASES.add("tcp[describe-transport-and-path]", _describe, identical=False)
CASES.add("subgroups[eager-async-graph]", _subgroups)
OWN_CASES = ("tcp[describe-transport-and-path]", "subgroups[eager-async-graph]")


def cuda_tcp_job(rank, ws, case_ids):
    C.setup_rank(rank, ws)
    return H.execute_cases(CASES, case_ids, rank, ws)


# --------------------------------------------------------------------------
# 1. tcp on one host: the suites' cases
# --------------------------------------------------------------------------

COLL_JOBS = C.GpuJobCache(CASES, cuda_tcp_job, "test_cuda_tcp_collective", timeout_s=300)


def _collective_params():
    out = []
    for p in CC._params(COLL_KEYS) + CA._params(COLL_KEYS):
        cid, ws, path = p.values
        out.append(pytest.param(cid, ws, path, id=p.id, marks=_marks(ws)))
    for ws, path in COLL_KEYS:
        out += [pytest.param(cid, ws, path, id=f"{cid}-{_id(ws, path)}", marks=_marks(ws))
                for cid in OWN_CASES]
    return out


@pytest.mark.parametrize("cid,ws,path", _collective_params())
def test_cuda_tcp_collective(cid, ws, path, request):
    COLL_JOBS.check(cid, (ws, path), request.session)


@pytest.mark.parametrize("ws,path", [pytest.param(ws, p, id=_id(ws, p), marks=_marks(ws))
                                     for ws, p in COLL_KEYS if p == TCP])
def test_no_shm_left_after_cuda_tcp_job(ws, path, request):
    """After a normal job over tcp, no /dev/shm entry named resident* made during it remains."""
    left, failed = COLL_JOBS.shm_left_after((ws, path), request.session,
                                            ["tcp[describe-transport-and-path]",
                                             "all_reduce[SUM-float32]", "send_recv_isend_irecv[int64]"])
    assert not left, (f"left in /dev/shm after the ws={ws} path={path} job "
                      f"({'failed' if failed else 'normal exit'}): {sorted(left)}")


P2P_JOBS = C.GpuJobCache(CP.CASES, CP.cuda_p2p_order_job, "test_cuda_tcp_p2p_order", timeout_s=180)


@pytest.mark.parametrize("cid,ws,path", [pytest.param(cid, ws, p, id=f"{cid}-{_id(ws, p)}", marks=_marks(ws))
                                         for ws, p in P2P_KEYS for cid in CP.CASES])
def test_cuda_tcp_p2p_order(cid, ws, path, request):
    P2P_JOBS.check(cid, (ws, path), request.session)


@pytest.mark.parametrize("ws,path", [pytest.param(ws, p, id=_id(ws, p), marks=_marks(ws))
                                     for ws, p in GRAPH_KEYS])
@pytest.mark.parametrize("item", CG.ITEMS)
def test_cuda_tcp_graph(item, ws, path):
    CG.test_cuda_graph(item, ws, path)


def _form_group(rank, ws):
    C.setup_rank(rank, ws)
    return "formed"


def test_cuda_tcp_direct_path_refused():
    """RESIDENT_PATH=direct with RESIDENT_TRANSPORT=tcp: no peer is reachable by direct stores,
    so group creation fails on every rank with a ValueError naming the setting and the peer."""
    outcomes = H.run_ranks_collect(_form_group, 2, init=False, env=C.path_env("direct+tcp"),
                                   timeout_s=60 * C.TIME_SCALE)
    problems = []
    for o in outcomes:
        if o.status != "error" or not o.exc_is_value_error:
            problems.append(f"expected a ValueError from group creation: {o.describe()}")
        elif "RESIDENT_PATH=direct" not in o.message or f"rank {1 - o.rank}" not in o.message:
            problems.append(f"rank {o.rank}: the message names neither the setting nor the peer: "
                            f"{o.message!r}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# 2. Ranks in separate network namespaces
# --------------------------------------------------------------------------

NETNS_CASE_IDS = (
    "tcp[describe-transport-and-path]",
    "all_reduce[SUM-float32]", "all_reduce[AVG-bfloat16]", "all_reduce[PRODUCT-float64]",
    "all_reduce[MIN-float16]", "all_reduce[BXOR-int64]", "all_reduce[MAX-uint8]",
    "all_reduce[SUM-int32]",
    "reduce_scatter_tensor[SUM-float32]", "reduce_scatter[SUM-int64]", "reduce[SUM-bfloat16]",
    "all_gather_into_tensor[bfloat16]", "all_gather[int32]", "gather[float64]", "scatter[uint8]",
    "broadcast[float16]", "all_to_all_single[int64]", "all_to_all[float32]",
    "send_recv_isend_irecv[bfloat16]",
    "barrier", "async_ops_in_flight", "one_round_boundary", "functional_collectives",
    "subgroups[eager-async-graph]",
)
NETNS_JOBS = C.GpuJobCache(CASES, cuda_tcp_job, "test_cuda_tcp_netns_case", timeout_s=300)
_NETNS_GRAPHS: dict = {}


def netns_env(hosts, ws):
    """Rank r in namespace NETNS_LAYOUTS[ws][r], RESIDENT_PATH=auto (direct inside a namespace)."""
    return hosts.env(layout=NETNS_LAYOUTS[ws])


@pytest.mark.parametrize("cid,ws,path", [pytest.param(cid, ws, p, id=f"{cid}-{_id(ws, p)}")
                                         for ws, p in NETNS_KEYS for cid in NETNS_CASE_IDS])
def test_cuda_tcp_netns_case(cid, ws, path, hosts, request):
    NETNS_JOBS.check(cid, (ws, path), request.session, env=netns_env(hosts, ws))


@pytest.mark.parametrize("ws", [ws for ws, _p in NETNS_KEYS], ids=lambda w: f"ws{w}-netns")
@pytest.mark.parametrize("item", CG.ITEMS)
def test_cuda_tcp_netns_graph(item, ws, hosts):
    if ws not in _NETNS_GRAPHS:
        _NETNS_GRAPHS[ws] = CG.run_graphs_job(ws, {**C.path_env("auto"), **netns_env(hosts, ws)})
    per_rank, err = _NETNS_GRAPHS[ws]
    if err is not None:
        pytest.fail(f"the ws={ws} CUDA-graph job across namespaces failed as a whole:\n{err}",
                    pytrace=False)
    problems = CG.item_problems(per_rank, item, ws)
    assert not problems, f"{item} ws={ws} across namespaces:\n" + "\n".join(problems[:40])


# The seeded CUDA op mixes (test_cuda_op_mix.py: eager steps, async ops, graph captures replayed
# with fresh data) in the 4-rank layout: the default of a group spanning two hosts.
NETNS_MIX_MODES = [m for m in TH.NETNS_MIX_MODES if len(TH.mix_layout(m[1])) == 4]
NETNS_MIX_ENV = TH.NetnsMixEnv(C.path_env("auto"))


NETNS_MIX_JOBS = OpMixJobs(COM.cuda_op_mix_job, "test_cuda_tcp_netns_op_mix",
                           "tests/test_cuda_tcp.py", C.DEVICE, caps="cuda", per_mode=True,
                           group_timeout_s=COM.GROUP_TIMEOUT_S,
                           timeout_s=lambda runs: (120 + 90 * runs) * C.TIME_SCALE,
                           spawn_env=NETNS_MIX_ENV, modes=NETNS_MIX_MODES)


@pytest.mark.parametrize("ws,mode,seed", [
    pytest.param(4, mode, seed, id=f"ws4-{mode}-seed{seed}")
    for mode, _env in NETNS_MIX_MODES for seed in COM.SEEDS if 4 in WS])
def test_cuda_tcp_netns_op_mix(ws, mode, seed, hosts, request):
    NETNS_MIX_ENV.hosts = hosts
    NETNS_MIX_JOBS.check(ws, mode, seed, request.session)


def test_cuda_tcp_case_lists_are_sane():
    for cid in NETNS_CASE_IDS:
        assert cid in CASES, cid
    assert all(k[1].endswith("+tcp") for k in COLL_KEYS + P2P_KEYS + GRAPH_KEYS)
    assert not any(C.is_variant(p) for _w, p in COLL_KEYS[:len(WS)])
    every = CC._params([(2, TCP)])
    assert len(every) == len(CC._params([(2, "proxy")])) > 90
    assert subgroup_ranks(4) == [("all", [0, 1, 2, 3]), ("low", [0, 1]), ("high", [2, 3]),
                                 ("evens", [0, 2]), ("three", [0, 1, 3])]
