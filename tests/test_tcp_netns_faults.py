"""The tcp transport under network faults, ranks on hosts played by network namespaces
(test_tcp_netns.py's ``hosts`` fixture): a SIGKILLed peer (DistBackendError naming it within
the timeout), a host that vanishes without closing its connections (its link down, its rank
stopped: the same error within the tcp unreachable timeout, well before the group's, or at the
next op when the survivors were idle meanwhile), a network that drops 2% of tcp segments (exact
results, no peer declared gone; needs nftables' `nft`, which the README's set-up installs, else
it skips saying so), and a fuzz test of the listening socket of a live group (on one host, and
across namespaces).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

import pytest

import dist_harness as H
import netns as N
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce
import tcp_hosts as TH
from tcp_hosts import GROUP_TIMEOUT_S, NAMES_RANK_1, ONE_HOST_TCP, SLACK_S

pytestmark = pytest.mark.resident_only


@pytest.fixture(scope="module")
def hosts():
    """Three hosts as in test_tcp_netns.py, under names and a subnet of their own: the kernel
    removes the namespaces of that module's hosts (and their veth pairs) asynchronously, so the
    same names made again at once can still exist."""
    yield from TH.hosts_for_module(3, 214, "rpf", 30, decoy=False)


# --------------------------------------------------------------------------
# A lossy network
# --------------------------------------------------------------------------

LOSS_PER_MILLE = 20  # of the tcp segments leaving and entering each host


@contextlib.contextmanager
def _lossy(names, per_mille):
    """nftables rules in each namespace dropping ``per_mille`` of its tcp segments at random, in
    and out; yields a dict whose "dropped" is the count of segments dropped, once done."""
    nft = shutil.which("nft")
    if nft is None:
        pytest.skip("no nft (nftables) on this machine: the lossy network drops segments with it")
    rule = f"meta l4proto tcp numgen random mod 1000 < {per_mille} counter drop;"
    table = ("table inet resident_loss {\n"
             f"  chain out {{ type filter hook output priority 0; {rule} }}\n"
             f"  chain in {{ type filter hook input priority 0; {rule} }}\n}}\n")
    for name in names:
        with N.inside(name):  # nft, forked from this thread, runs in the namespace
            r = subprocess.run([nft, "-f", "-"], input=table, text=True, capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"nft could not add the rules: {r.stderr.strip()}")
    result = {"dropped": 0}
    try:
        yield result
    finally:
        for name in names:
            with N.inside(name):
                out = subprocess.run([nft, "list", "table", "inet", "resident_loss"], text=True,
                                     capture_output=True).stdout
                subprocess.run([nft, "delete", "table", "inet", "resident_loss"],
                               capture_output=True)
            result["dropped"] += sum(int(x) for x in re.findall(r"packets (\d+)", out))


def _lossy_job(rank, ws, iterations):
    """Random all_reduces, all_to_alls and send/recv round trips, each checked."""
    import numpy as np
    import torch
    import torch.distributed as dist

    rng = np.random.default_rng(7)  # the same draws on every rank
    errs = []
    for i in range(iterations):
        n = int(rng.integers(1, 5000))
        dt, op = ("float32", "SUM") if i % 2 else ("int64", "BXOR")
        ins = [make_input(f"lossy/{i}", r, n, dt) for r in range(ws)]
        t = ins[rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        errs += compare_reduction(t, reference_reduce(ins, op, dt), ins, op, dt, f"{i} all_reduce")
        m = int(rng.integers(1, 300))
        ins = [make_input(f"lossy/a2a/{i}", r, m * ws, "int32") for r in range(ws)]
        out = torch.empty(m * ws, dtype=torch.int32)
        dist.all_to_all_single(out, ins[rank].clone())
        ref = torch.cat([ins[p][rank * m:(rank + 1) * m] for p in range(ws)])
        errs += compare_exact(out, ref, f"{i} all_to_all_single")
        a, b = int(rng.integers(0, ws)), int(rng.integers(0, ws - 1))
        b = b + (b >= a)  # a round trip a -> b -> a: one segment in flight each way
        msg = make_input(f"lossy/rt/{i}", a, 16, "float32")
        if rank == a:
            dist.send(msg, b)
            back = torch.empty(16)
            dist.recv(back, b)
            errs += compare_exact(back, msg * 2, f"{i} round trip from {b}")
        elif rank == b:
            got = torch.empty(16)
            dist.recv(got, a)
            errs += compare_exact(got, msg, f"{i} round trip from {a}")
            dist.send(got * 2, a)
    return errs


def test_tcp_netns_lossy_network(hosts):
    """Three hosts whose network drops 2% of tcp segments each way: every result still exact
    (tcp resends what is lost; docs/decisions.md: in milliseconds), no peer declared gone."""
    with _lossy(hosts.names, LOSS_PER_MILLE) as loss:
        results = H.run_ranks(_lossy_job, 3, args=(150,), env=hosts.env(), timeout_s=300)
    problems = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not problems, "\n".join(problems[:20])
    assert loss["dropped"] > 0, "no segment was dropped: the test did not test a lossy network"


# --------------------------------------------------------------------------
# A killed peer
# --------------------------------------------------------------------------


def _kill_job(rank, ws):
    import torch.distributed as dist

    for i in range(3):
        ins = [make_input(f"tcpkill/warm/{i}", r, 1031, "float32") for r in range(ws)]
        t = ins[rank].clone()
        dist.all_reduce(t)
    big = make_input("tcpkill/big", rank, (4 << 20) // 4 + 1, "float32")
    if rank == 1:
        dist.all_reduce(big.clone(), async_op=True)  # die with a large collective in flight
        H.request_sigkill("tcp kill test")
    t0 = time.monotonic()
    try:
        for _ in range(20):
            dist.all_reduce(big.clone())
        return {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "elapsed": time.monotonic() - t0, "type": type(e).__name__,
                "message": str(e)}


def _survivor_problems(outcomes, what, within_s, must_say=""):
    """Ranks 0 and 2 each raised a DistBackendError naming rank 1 (and `must_say`) within
    `within_s` of their first op without it."""
    problems = []
    for o in (outcomes[0], outcomes[2]):
        if o.status != "ok":
            problems.append(o.describe())
            continue
        v = o.value
        if not v["raised"]:
            problems.append(f"rank {o.rank}: no error although {what}")
            continue
        if v["type"] != "DistBackendError":
            problems.append(f"rank {o.rank}: raised {v['type']}, expected DistBackendError")
        if not NAMES_RANK_1.search(v["message"]) or must_say not in v["message"]:
            problems.append(f"rank {o.rank}: the error does not name rank 1"
                            f"{' and ' + repr(must_say) if must_say else ''}: {v['message']}")
        if v["elapsed"] > within_s:
            problems.append(f"rank {o.rank}: raised after {v['elapsed']:.1f} s")
    return problems


def test_tcp_netns_killed_peer(hosts):
    outcomes = H.run_ranks_collect(_kill_job, 3, init_timeout_s=GROUP_TIMEOUT_S, timeout_s=90,
                                   stop_when_done=[0, 2], destroy_grace_s=15, env=hosts.env())
    problems = []
    if outcomes[1].status != "killed":
        problems.append(f"rank 1 was not killed: {outcomes[1].describe()}")
    problems += _survivor_problems(outcomes, "rank 1 was SIGKILLed", GROUP_TIMEOUT_S + SLACK_S)
    for o in (outcomes[0], outcomes[2]):
        if o.status == "ok" and o.destroy_status != "ok":
            problems.append(f"rank {o.rank}: destroy_process_group {o.destroy_status}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# A host that vanishes
# --------------------------------------------------------------------------

VANISH_GROUP_TIMEOUT_S = 60  # the group's: the survivors must not need it
UNREACHABLE_S = 10  # TcpOptions::unreachable_timeout_ns, below the group's timeout


def _vanish_job(rank, ws, idle_s):
    """Rank 1's host vanishes after the warm-up: the link of its namespace goes down (no FIN, no
    RST: what a power loss or a cut cable leaves) and the rank stops itself (SIGSTOP); ranks 0
    and 2 call all_reduce again after `idle_s` (0: at once, so that their data to rank 1 goes
    unacknowledged; past the unreachable timeout: the idle connections' keepalive probes did)."""
    import signal

    import torch
    import torch.distributed as dist

    for i in range(3):
        ins = [make_input(f"tcpvanish/warm/{i}", r, 1031, "float32") for r in range(ws)]
        t = ins[rank].clone()
        dist.all_reduce(t)
    if rank == 1:
        N.set_up("eth1", False)  # this rank's namespace's link to the bridge
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent SIGKILLs it when the others are done
    time.sleep(idle_s)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    before = backend.get_error().name  # idle: the connection to rank 1 already failed
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(t)
        return {"raised": False, "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "elapsed": time.monotonic() - t0, "type": type(e).__name__,
                "message": str(e), "error_before": before, "error": backend.get_error().name}


@pytest.mark.parametrize("when", ["in_op", "idle"])
def test_tcp_netns_vanished_host(hosts, when):
    idle_s = UNREACHABLE_S + 4 if when == "idle" else 0
    try:
        outcomes = H.run_ranks_collect(_vanish_job, 3, args=(idle_s,),
                                       init_timeout_s=VANISH_GROUP_TIMEOUT_S, timeout_s=120,
                                       stop_when_done=[0, 2], destroy_grace_s=15,
                                       env=hosts.env())
    finally:  # the host comes back for the module's other tests
        N.set_up("eth1", netns=hosts.names[1])
    # the group's timeout is VANISH_GROUP_TIMEOUT_S: the survivors must not need it
    # idle: the connections failed while the survivors slept, so their next op fails at once
    within_s = 2.0 if when == "idle" else UNREACHABLE_S + SLACK_S
    problems = _survivor_problems(outcomes, "rank 1's host vanished", within_s, must_say="network")
    # get_error(): REMOTE_ERROR once the op raised, and while idle before any op
    for o in (outcomes[0], outcomes[2]):
        v = o.value if o.status == "ok" and isinstance(o.value, dict) else {}
        want = {"error": "REMOTE_ERROR"}
        if when == "idle":
            want["error_before"] = "REMOTE_ERROR"
        got = {k: v.get(k) for k in want}
        if v.get("raised") and got != want:
            problems.append(f"rank {o.rank}: get_error() {got}, expected {want}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# Fuzzing the listening socket of a live group
# --------------------------------------------------------------------------

HELLO_MAGIC = 0x314F4C4C45485352  # "RSHELLO1"


def _hello(secret: bytes, rank: int, nranks: int) -> bytes:
    return struct.pack("<Q16sII", HELLO_MAGIC, secret, rank, nranks)


def _frame(kind: int, offset: int, value: int) -> bytes:
    return struct.pack("<IIQQ", kind, 0, offset, value)


def _attack(endpoint: str, secret: bytes, ws: int, victim: int) -> int:
    """Connections that must all be rejected; returns how many were made."""
    host, port = endpoint.rsplit(":", 1)
    rng = random.Random(4242)
    oversized = _frame(1, 0, 1 << 40)
    out_of_range = _frame(1, 1 << 50, 64) + bytes(64)
    payloads = [
        bytes(rng.getrandbits(8) for _ in range(4096)),               # random bytes
        struct.pack("<Q", HELLO_MAGIC) + b"\x01\x02",                  # truncated handshake
        _hello(bytes(16), victim ^ 1, ws) + oversized,                # wrong secret, then frames
        _hello(secret, victim ^ 1, ws + 5) + out_of_range,            # wrong group size
        _hello(secret, 1000, ws),                                     # rank out of range
        _hello(secret, victim, ws),                                   # the victim's own rank
        _hello(secret, (victim + 1) % ws, ws) + oversized,            # a duplicate of a peer
        oversized + out_of_range,                                     # frames without a hello
        _frame(2, 8, 1)[:13],                                         # a truncated frame
    ]
    made = 0
    for data in payloads:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            made += 1
            try:
                s.sendall(data)
                time.sleep(0.05)
            except OSError:
                pass  # the victim may already have closed it
    # A burst of idle connections beyond the pending limit, closed again.
    burst = [socket.create_connection((host, int(port)), timeout=5) for _ in range(24)]
    made += len(burst)
    time.sleep(0.2)
    for s in burst:
        s.close()
    return made


def _fuzz_job(rank, ws):
    import torch.distributed as dist

    fd, log_path = tempfile.mkstemp(prefix="resident-fuzz-")
    saved = os.dup(2)
    os.dup2(fd, 2)  # the core's logger writes to fd 2: keep what it says about the attacks
    try:
        H.init_pg()
        errs = []
        t = make_input("fuzz/warm", rank, 1031, "float32")
        dist.all_reduce(t)
        store = H.connect_store()
        keys = store.list_keys()
        secret_key = next(k for k in keys if k.endswith("resident/tcp_secret"))
        secret = bytes.fromhex(store.get(secret_key).decode())
        victim = (rank + 1) % ws
        desc_key = next(k for k in keys if k.endswith(f"resident/desc/{victim}"))
        # the descriptor: name|bytes|slots|slot_bytes|transport|endpoint|...
        endpoint = store.get(desc_key).decode().split("|")[5]
        dist.barrier()
        made = _attack(endpoint, secret, ws, victim)
        dist.barrier()
        for i in range(5):  # the group keeps working
            ins = [make_input(f"fuzz/{i}", r, 70_001, "float32") for r in range(ws)]
            t = ins[rank].clone()
            dist.all_reduce(t)
            errs += compare_reduction(t, reference_reduce(ins, "SUM", "float32"), ins, "SUM",
                                      "float32", f"all_reduce {i} after the attacks")
        time.sleep(0.5)  # let the listener finish with the burst
        dist.barrier()
        dist.destroy_process_group()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    with open(log_path) as f:
        log = f.read()
    os.unlink(log_path)
    return {"errors": errs, "log": log, "made": made, "endpoint": endpoint}


# Alternatives separated by "|": a duplicate of rank 0 at rank 1 is refused because rank 0
# never connects to rank 1 (rank 1 connects to rank 0), at rank 0 because rank 1 is connected.
FUZZ_REASONS = (
    "bad magic in the handshake",
    "closed during the handshake",
    "wrong group secret",
    "group size does not match",
    "rank out of range",
    "claims this rank's own rank",
    "is already connected|does not connect to this rank",
    "too many connections are waiting",
)


@pytest.mark.parametrize("where", ["one-host", "netns"])
def test_tcp_listener_fuzz(where, request):
    if where == "netns":
        env = request.getfixturevalue("hosts").env(RESIDENT_DEBUG="warn")
    else:
        env = dict(ONE_HOST_TCP, RESIDENT_DEBUG="warn")
    results = H.run_ranks(_fuzz_job, 2, env=env, init=False, timeout_s=120)
    problems = []
    for r, res in enumerate(results):
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        attacker = (r - 1) % 2
        log = results[r]["log"]
        rejected = log.count("rejected a tcp connection")
        if rejected < results[attacker]["made"]:
            problems.append(f"rank {r}: {rejected} rejections logged for "
                            f"{results[attacker]['made']} hostile connections")
        for reason in FUZZ_REASONS:
            if not any(alt in log for alt in reason.split("|")):
                problems.append(f"rank {r}: no '{reason}' in its log")
        if "poison" in log.lower() or "malformed frame" in log:
            problems.append(f"rank {r}: a hostile connection reached the data path")
    assert not problems, "\n".join(problems) + "\n--- rank 0 log ---\n" + results[0]["log"][-3000:]
