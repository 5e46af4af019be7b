"""The tcp transport: ranks on different hosts, played by Linux network namespaces.

A module fixture creates one network namespace per "host", each joined by a veth pair to a
bridge in the root namespace (every host its own 10.213.x.y/24 address; tcp_hosts.py); the
parent's TCPStore is reached at the bridge's address. Each rank enters its namespace first thing
in its process (RESIDENT_TEST_NETNS), so ranks see different network namespaces, count as
different hosts (localHostKey) and pick tcp with RESIDENT_TRANSPORT=auto. The namespaces go away
afterwards, also when a test fails; without root or the right to create namespaces the tests
that need them skip, saying why.

Every op on CPU tensors runs through the proxy and tcp at 2 and 3 ranks, reusing the cases of
test_collectives_cpu.py, test_async_ops_cpu.py and test_p2p_cpu.py (random data, numpy
references, bitwise for integers), plus describe() (transport "tcp", path "proxy"), the
coalesced and list forms, messages over 1 MiB, a group that mixes shm and tcp (and the seeded
random op mixes in such groups: 3 ranks on two hosts, 4 ranks two per host), hosts on an
IPv6-only network, file descriptors and threads back to baseline after destroy, and each peer
connection's 5 ms minimum RTO (where the kernel takes it). torchrun and the latency benchmark
across two hosts: test_tcp_netns_torchrun.py. Network faults (a killed peer, a vanished host, a
lossy network, a fuzzed listener): test_tcp_netns_faults.py. RESIDENT_TRANSPORT=tcp on one host (no
namespaces) runs everywhere.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

import dist_harness as H
import op_mix
import test_async_ops_cpu as A
import test_collectives_cpu as C
import test_p2p_cpu as P
from resident_pg import doctor
from dist_harness import compare_exact, compare_reduction, digest, make_input, reference_reduce
from op_mix_run import Hooks, OpMixJobs, run_modes
from tcp_hosts import (
    NETNS_MIX_MODES,
    ONE_HOST_TCP,
    NetnsMixEnv,
    hosts_for_module,
    mix_layout,
)

pytestmark = pytest.mark.resident_only

MiB = 1 << 20


# --------------------------------------------------------------------------
# Hosts: network namespaces on a bridge (tcp_hosts.py), this module's names and subnets
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    yield from hosts_for_module(3, 213, "rpb", 0, decoy=False)


@pytest.fixture(scope="module")
def decoy_hosts():
    """Two hosts whose first interface (decoy0) has an address no other host reaches; the
    network they share comes second, on an interface of the same name on both (eth1), as on
    machines with a management or container interface besides the data one."""
    yield from hosts_for_module(2, 212, "rpd", 10, decoy=True)


@pytest.fixture(scope="module")
def ipv6_hosts():
    """Two hosts with IPv6 addresses alone (an IPv6-only network, the store's host included)."""
    yield from hosts_for_module(2, 0x52, "rp6", 20, decoy=False, ipv6=True)


# --------------------------------------------------------------------------
# Cases: the CPU suites' cases, and tcp-specific ones
# --------------------------------------------------------------------------

COLLECTIVE_IDS = (
    ["sanity[backend-under-test]"]
    + [f"all_reduce[{op}-float32]" for op in C.FLOAT_OPS]
    + [f"all_reduce[{op}-int64]" for op in C.INT_OPS]
    + ["all_reduce[SUM-float16]", "all_reduce[AVG-bfloat16]", "all_reduce[MAX-float64]",
       "all_reduce[BXOR-uint8]", "all_reduce[PRODUCT-int32]", "all_reduce[SUM-float32-large]",
       "all_reduce[AVG-bfloat16-large]", "all_reduce[BXOR-uint8-large]",
       "all_reduce[avg-int-truncation-negative]",
       "all_reduce[SUM-rank-order-and-accumulation-precision]",
       "all_reduce[3d-shape-and-offset-view]",
       "all_to_all_single[even-float32]", "all_to_all_single[uneven-int64]",
       "all_to_all_single[uneven-rank0-sends-nothing]", "all_to_all_single[uneven-float32-large]",
       "all_gather_into_tensor[float32]", "all_gather_into_tensor[uint8]",
       "all_gather_into_tensor[float32-large]", "all_gather[int64]", "all_gather[float64-large]",
       "reduce_scatter_tensor[SUM-float32]", "reduce_scatter_tensor[AVG-int64]",
       "reduce_scatter_tensor[MAX-bfloat16]", "reduce_scatter_tensor[SUM-float32-large]",
       "reduce_scatter[SUM-float32]", "reduce_scatter[MIN-int32]",
       "broadcast[float32]", "broadcast[int64]", "broadcast[float32-large]",
       "reduce[SUM-float32]", "reduce[MAX-int32]", "reduce[SUM-float32-large]",
       "gather[int64]", "gather[float32-large]", "scatter[int32]", "scatter[float32-large]",
       "barrier", "functional_collectives", "async_ops_in_flight"]
)

CASES = H.CaseRegistry()
for _cid in COLLECTIVE_IDS:
    CASES[_cid] = C.CASES[_cid] if _cid in C.CASES else A.CASES[_cid]
for _cid in P.CASES:
    CASES[_cid] = P.CASES[_cid]


@CASES.case("tcp[describe-transport-and-path]", identical=False)
def _describe(rank, ws):
    import resident_pg

    info = resident_pg.describe()
    errs = []
    for p, v in info["peers"].items():
        want = ({"transport": "self", "path": "self"} if p == rank
                else {"transport": "tcp", "path": "proxy"})
        if v != want:
            errs.append(f"rank {rank} -> rank {p}: {v}, expected {want}")
    return errs, {}


@CASES.case("tcp[coalesced-and-list-forms]")
def _coalesced(rank, ws):
    import torch
    import torch.distributed as dist

    errs, digs = [], {}
    a_in = [make_input("tcp/ca", r, 1031, "float32") for r in range(ws)]
    b_in = [make_input("tcp/cb", r, 20000, "float32") for r in range(ws)]
    a, b = a_in[rank].clone(), b_in[rank].clone()
    dist.all_reduce_coalesced([a, b])
    errs += compare_reduction(a, reference_reduce(a_in, "SUM", "float32"), a_in, "SUM", "float32",
                              "all_reduce_coalesced a")
    errs += compare_reduction(b, reference_reduce(b_in, "SUM", "float32"), b_in, "SUM", "float32",
                              "all_reduce_coalesced b")
    digs["a"], digs["b"] = digest(a), digest(b)
    # all_to_all, list form, uneven: rank r sends 10 + r + p int32 to p.
    ins = [make_input(f"tcp/a2a/{rank}->{p}", 0, 10 + rank + p, "int32") for p in range(ws)]
    outs = [torch.empty(10 + rank + p, dtype=torch.int32) for p in range(ws)]
    dist.all_to_all(outs, ins)
    for p in range(ws):
        errs += compare_exact(outs[p], make_input(f"tcp/a2a/{p}->{rank}", 0, 10 + rank + p, "int32"),
                              f"all_to_all from {p}")
    # Coalesced all_gather_into_tensor and reduce_scatter_tensor.
    x_in = [make_input("tcp/cx", r, 513, "int64") for r in range(ws)]
    y_in = [make_input("tcp/cy", r, 7, "bfloat16") for r in range(ws)]
    gx, gy = torch.empty(513 * ws, dtype=torch.int64), torch.empty(7 * ws, dtype=torch.bfloat16)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(gx, x_in[rank].clone())
        dist.all_gather_into_tensor(gy, y_in[rank].clone())
    cm.wait()
    errs += compare_exact(gx, torch.cat(x_in), "coalesced all_gather int64")
    errs += compare_exact(gy, torch.cat(y_in), "coalesced all_gather bfloat16")
    r_in = [make_input("tcp/cr", r, 300 * ws, "int32") for r in range(ws)]
    out = torch.empty(300, dtype=torch.int32)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(out, r_in[rank].clone())
    cm.wait()
    blocks = [x[rank * 300:(rank + 1) * 300] for x in r_in]
    errs += compare_exact(out, reference_reduce(blocks, "SUM", "int32"), "coalesced reduce_scatter")
    return errs, digs


@CASES.case("tcp[messages-over-1MiB]")
def _big(rank, ws):
    import torch
    import torch.distributed as dist

    errs, digs = [], {}
    n = 3 * MiB // 8 + 5  # 3 MiB of int64: streamed through the slots, wrapping SUM
    ins = [make_input("tcp/big", r, n, "int64") for r in range(ws)]
    t = ins[rank].clone()
    dist.all_reduce(t)
    errs += compare_exact(t, reference_reduce(ins, "SUM", "int64"), "3 MiB all_reduce int64")
    digs["ar"] = digest(t)
    m = 5 * MiB + 3
    payload = make_input(f"tcp/p2p/{rank}", 0, m, "uint8")
    got = torch.empty(m, dtype=torch.uint8)
    src = (rank - 1) % ws
    reqs = [dist.isend(payload, (rank + 1) % ws, tag=3), dist.irecv(got, src, tag=3)]
    for r in reqs:
        r.wait()
    errs += compare_exact(got, make_input(f"tcp/p2p/{src}", 0, m, "uint8"), "5 MiB isend/irecv")
    return errs, {"ar": digs["ar"]}


def _tcp_job(rank, ws, case_ids):
    return H.execute_cases(CASES, case_ids, rank, ws)


JOBS = H.JobCache(CASES, _tcp_job, "test_tcp_netns_case", timeout_s=400, init_timeout_s=60)


@pytest.mark.parametrize("ws", (2, 3), ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("cid", list(CASES))
def test_tcp_netns_case(cid, ws, hosts, request):
    JOBS.env = hosts.env()
    JOBS.check(cid, ws, request.session)


# --------------------------------------------------------------------------
# Life cycle: descriptors, threads; the same on one host
# --------------------------------------------------------------------------


def _fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _threads():
    """Threads of this process, without the CUDA driver's helpers (see test_leaks.py)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += 0 if f.read().startswith("cuda") else 1
        except OSError:
            pass
    return n


TCP_RTO_MIN_US = doctor.TCP_RTO_MIN_US


def _lowered_rto_sockets() -> int:
    """This process's tcp sockets whose minimum RTO is below the kernel's 200 ms."""
    n = 0
    for fd, target in _fds().items():
        if not target.startswith("socket:"):
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                n += s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) < 200_000
            except OSError:
                pass
    return n


def _lifecycle_job(rank, ws, cycles):
    import resident_pg
    import torch.distributed as dist

    x = make_input("warm", rank, 1000, "float32")
    (x + x).sum().item()
    H.connect_store()
    report = []
    for c in range(cycles):
        fds_before, threads_before = _fds(), _threads()
        H.init_pg(prefix=f"life{c}/")
        info = resident_pg.describe()
        errs = []
        for n in (1, 1031, 2 * MiB // 4 + 1):
            ins = [make_input(f"life/{c}/{n}", r, n, "float32") for r in range(ws)]
            t = ins[rank].clone()
            dist.all_reduce(t)
            errs += compare_reduction(t, reference_reduce(ins, "SUM", "float32"), ins, "SUM",
                                      "float32", f"cycle {c} n={n}")
        # Before the barrier: a peer past it may destroy its group and close its connection.
        sockets_during = sum(1 for v in _fds().values() if v.startswith("socket:"))
        lowered_rto = _lowered_rto_sockets()
        dist.barrier()
        dist.destroy_process_group()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(_fds()) > len(fds_before)
                                               or _threads() > threads_before):
            time.sleep(0.05)
        fds_after = _fds()
        report.append({
            "cycle": c, "errors": errs, "peers": info["peers"], "sockets_during": sockets_during,
            "lowered_rto": lowered_rto,
            "fds_before": len(fds_before), "fds_after": len(fds_after),
            "new_fds": sorted(v for k, v in fds_after.items() if fds_before.get(k) != v),
            "threads_before": threads_before, "threads_after": _threads(),
        })
    return report


def _check_lifecycle(results, ws, want_transport):
    problems = []
    rto_floor = doctor.tcp_rto_floor_supported()
    for r, rep in enumerate(results):
        for c in rep:
            problems += [f"rank {r}: {e}" for e in c["errors"]]
            for p, v in c["peers"].items():
                want = ({"transport": "self", "path": "self"} if p == r
                        else {"transport": want_transport, "path": "proxy"})
                if v != want:
                    problems.append(f"rank {r} -> rank {p}: {v}, expected {want}")
            # one connection per peer, the listener, the store client (at least)
            if c["sockets_during"] < ws + 1:
                problems.append(f"rank {r}: only {c['sockets_during']} sockets while the group ran")
            # a lost segment of a connection to a peer is resent within milliseconds, not 200 ms
            if rto_floor and c["lowered_rto"] != ws - 1:
                problems.append(f"rank {r}: {c['lowered_rto']} sockets with a lowered minimum "
                                f"RTO, expected one per peer ({ws - 1})")
            if c["fds_after"] > c["fds_before"]:
                problems.append(f"rank {r} cycle {c['cycle']}: {c['fds_before']} fds before init, "
                                f"{c['fds_after']} after destroy: {c['new_fds']}")
            if c["threads_after"] > c["threads_before"]:
                problems.append(f"rank {r} cycle {c['cycle']}: {c['threads_before']} threads before "
                                f"init, {c['threads_after']} after destroy")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("ws", (2, 3), ids=lambda w: f"ws{w}")
def test_tcp_one_host(ws):
    """RESIDENT_TRANSPORT=tcp without namespaces: runs everywhere."""
    results = H.run_ranks(_lifecycle_job, ws, args=(2,), init=False, env=ONE_HOST_TCP,
                          timeout_s=120)
    _check_lifecycle(results, ws, "tcp")


def test_tcp_netns_lifecycle(hosts):
    results = H.run_ranks(_lifecycle_job, 3, args=(2,), init=False, env=hosts.env(),
                          timeout_s=120)
    _check_lifecycle(results, 3, "tcp")


def _mixed_job(rank, ws):
    import resident_pg
    import torch
    import torch.distributed as dist

    errs = []
    info = resident_pg.describe()
    for n in (7, 100_003, 3 * MiB // 4):
        ins = [make_input(f"mixed/{n}", r, n, "float32") for r in range(ws)]
        t = ins[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(ins, "SUM", "float32"), ins, "SUM",
                                  "float32", f"all_reduce n={n}")
    ins = [make_input("mixed/a2a", r, 6000 * ws, "int64") for r in range(ws)]
    out = torch.empty(6000 * ws, dtype=torch.int64)
    dist.all_to_all_single(out, ins[rank].clone())
    ref = torch.cat([ins[p][rank * 6000:(rank + 1) * 6000] for p in range(ws)])
    errs += compare_exact(out, ref, "all_to_all_single")
    got = torch.empty(200_000, dtype=torch.int32)
    src = (rank - 1) % ws
    reqs = [dist.isend(make_input(f"mixed/p2p/{rank}", 0, 200_000, "int32"), (rank + 1) % ws),
            dist.irecv(got, src)]
    for r in reqs:
        r.wait()
    errs += compare_exact(got, make_input(f"mixed/p2p/{src}", 0, 200_000, "int32"), "ring")
    return {"errors": errs, "peers": info["peers"]}


def test_tcp_netns_mixed_with_shm(hosts):
    """Ranks 0 and 1 share a host (shm, direct), rank 2 is elsewhere (tcp, proxy)."""
    results = H.run_ranks(_mixed_job, 3, env=hosts.env(layout=[0, 0, 1]), timeout_s=120)
    problems = []
    for r, res in enumerate(results):
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        for p, v in res["peers"].items():
            if p == r:
                continue
            want = ({"transport": "shm", "path": "direct"} if {r, p} == {0, 1}
                    else {"transport": "tcp", "path": "proxy"})
            if v != want:
                problems.append(f"rank {r} -> rank {p}: {v}, expected {want}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# Random op mixes across hosts: a host's ranks over shm, the hosts over tcp
# --------------------------------------------------------------------------

NETNS_MIX_ENV = NetnsMixEnv()


def _op_mix_job(rank, ws, job):
    out = run_modes(rank, ws, job, Hooks())
    out["netns"] = os.stat("/proc/self/ns/net").st_ino  # which host this rank played
    return out


NETNS_MIX_JOBS = OpMixJobs(_op_mix_job, "test_tcp_netns_op_mix", "tests/test_tcp_netns.py", "cpu",
                           per_mode=True, timeout_s=lambda runs: 120 + 90 * runs,
                           group_timeout_s=30, spawn_env=NETNS_MIX_ENV, modes=NETNS_MIX_MODES)


@pytest.mark.parametrize("ws,mode,seed", [
    pytest.param(len(mix_layout(env)), mode, seed, id=f"ws{len(mix_layout(env))}-{mode}-seed{seed}")
    for mode, env in NETNS_MIX_MODES for seed in op_mix.seeds_from_env(default=(1, 2))])
def test_tcp_netns_op_mix(ws, mode, seed, hosts, request):
    """The seeded op mixes of test_op_mix.py (subgroups, async ops and batches, graph-phase
    replays with fresh data) in a group that spans two hosts: 3 ranks (two on one host) and 4
    (two on each)."""
    NETNS_MIX_ENV.hosts = hosts
    NETNS_MIX_JOBS.check(ws, mode, seed, request.session)
    per_rank, _err, _wall = NETNS_MIX_JOBS.get((ws, mode), request.session)
    layout = mix_layout(dict(NETNS_MIX_MODES)[mode])
    for a in range(ws):
        for b in range(ws):
            same = per_rank[a]["netns"] == per_rank[b]["netns"]
            assert same == (layout[a] == layout[b]), f"ranks {a} and {b}: hosts {layout}"


# --------------------------------------------------------------------------
# Which address a host listens on
# --------------------------------------------------------------------------


def _endpoint_job(rank, ws):
    import resident_pg
    import torch.distributed as dist

    ins = [make_input("endpoint", r, 1031, "int64") for r in range(ws)]
    t = ins[rank].clone()
    dist.all_reduce(t)
    return {"endpoint": resident_pg.describe()["tcp_endpoint"],
            "errors": compare_exact(t, reference_reduce(ins, "SUM", "int64"), "all_reduce")}


def _listening_problems(hosts, setting):
    """Two ranks on `hosts` (RESIDENT_TCP_ADDR=`setting` unless "unset"): an exact all_reduce,
    and each listening on its host's address ("[address]:port" for IPv6)."""
    extra = {} if setting == "unset" else {"RESIDENT_TCP_ADDR": setting}
    results = H.run_ranks(_endpoint_job, 2, env=hosts.env(**extra), timeout_s=120,
                          init_timeout_s=60)
    problems = []
    for r, res in enumerate(results):
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        ip = hosts.ips[r]
        want = f"[{ip}]:" if ":" in ip else f"{ip}:"
        if not (res["endpoint"] or "").startswith(want):
            problems.append(f"rank {r} listens on {res['endpoint']}, expected {want}<port>")
    return problems


@pytest.mark.parametrize("setting", ("unset", "eth1"))
def test_tcp_netns_listens_where_peers_reach(decoy_hosts, setting):
    """A host's first interface is one its peers cannot reach: by default tcp listens on the
    interface that routes to the rendezvous store's host, and RESIDENT_TCP_ADDR=eth1 names the
    interface (the same name on every host); either way the group forms and runs."""
    problems = _listening_problems(decoy_hosts, setting)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("setting", ("unset", "eth1"))
def test_tcp_netns_ipv6_only_network(ipv6_hosts, setting):
    """Hosts with IPv6 addresses alone and the store at an IPv6 address: tcp listens on the
    host's IPv6 address (the route to the store, or RESIDENT_TCP_ADDR=eth1), the endpoint is
    written "[address]:port", and the group forms and runs."""
    problems = _listening_problems(ipv6_hosts, setting)
    assert not problems, "\n".join(problems)


# --- ib: selection without RDMA hardware ----------------------------------------------------


def _ib_forced(rank, ws):
    return "unreachable: group creation should have failed"


@pytest.mark.resident_only
def test_forced_ib_without_rdma_fails_clearly():
    """RESIDENT_TRANSPORT=ib on a machine without an active RDMA port: group creation fails on
    every rank with a ValueError naming the reason (no hang, no crash)."""
    import resident_pg._C as C

    ok, why = C.ib_available()
    if ok:
        pytest.skip("this machine has an active RDMA port")
    outcomes = H.run_ranks_collect(_ib_forced, 2, env={"RESIDENT_TRANSPORT": "ib"}, timeout_s=120)
    for o in outcomes:
        assert o.status == "error", (o.rank, o.status, o.value)
        assert o.exc_is_value_error, o.exc_type
        assert "RESIDENT_TRANSPORT=ib" in o.message and "libibverbs" in o.message, o.message
