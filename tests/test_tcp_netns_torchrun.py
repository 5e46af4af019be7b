"""torchrun across two hosts, played by Linux network namespaces (tcp_hosts.py): a user's script
on two hosts of two ranks each (`--nnodes 2`, static rendezvous; shm within a host, tcp between
hosts, nothing set but the backend's name), and the latency benchmark between two hosts of one
rank each, held to the tcp floor measured between them (tcp_floor --listen / --connect) or, given
only a loopback floor, warning so. Without root or the right to create namespaces the tests skip,
saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from tcp_hosts import hosts_for_module

pytestmark = pytest.mark.resident_only


@pytest.fixture(scope="module")
def hosts():
    yield from hosts_for_module(2, 216, "rpt", 50, decoy=False)


TWO_NODE_SCRIPT = """
import datetime, json, os, sys
sys.path.insert(0, sys.argv[2])
import torch
import torch.distributed as dist
import dist_harness as H
import resident_pg

torch.set_num_threads(1)
dist.init_process_group("resident", timeout=datetime.timedelta(seconds=60))
rank, ws = dist.get_rank(), dist.get_world_size()
errs = []
# 80 KB per rank: a CPU slot's payload sent at once (over tcp) and streamed through the ring.
ins = [H.make_input("two-nodes", r, 20001, "float32") for r in range(ws)]
t = ins[rank].clone()
dist.all_reduce(t)
errs += H.compare_reduction(t, H.reference_reduce(ins, "SUM", "float32"), ins, "SUM", "float32",
                            "all_reduce")
blocks = [H.make_input(f"two-nodes/a2a/{r}", r, 4099 * ws, "int64") for r in range(ws)]
out = torch.empty_like(blocks[rank])
dist.all_to_all_single(out, blocks[rank])
want = torch.cat([blocks[r].view(ws, -1)[rank] for r in range(ws)])
errs += H.compare_exact(out, want, "all_to_all_single")
peers = {str(p): v for p, v in resident_pg.describe()["peers"].items()}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "ws": ws, "node": int(os.environ["GROUP_RANK"]), "peers": peers,
               "errors": errs}, f)
"""

# Enters a namespace, then runs torchrun there: what `ip netns exec <ns> torchrun ...` does.
ENTER_AND_RUN = ("import os, sys; sys.path.insert(0, sys.argv[1]); import netns; "
                 "netns.enter(sys.argv[2]); os.execv(sys.executable, [sys.executable, '-m', "
                 "'torch.distributed.run'] + sys.argv[3:])")


def _torchrun_on_two_hosts(hosts, tmp_path, nproc, target, extra_env=None):
    """torchrun on each of two hosts, as on two machines (`--nnodes 2 --node-rank i
    --master-addr <host 0>`, static rendezvous), each agent started inside its namespace;
    `target`: torchrun's arguments after its own (a script and its arguments, or -m MODULE ...).
    Returns the two agents' output, after checking that both succeeded."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(extra_env or {}))
    env["PYTHONPATH"] = os.path.dirname(tests_dir) + os.pathsep + env.get("PYTHONPATH", "")
    port = random.randint(20000, 40000)
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-c", ENTER_AND_RUN, tests_dir, hosts.names[node], "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-addr",
               hosts.ips[0], "--master-port", str(port), *target]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, start_new_session=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("torchrun on two hosts timed out after 240 s:\n" +
                        "\n".join(q.communicate()[0][-3000:] for q in procs))
    log = "\n".join(f"--- node {i}:\n{o[-4000:]}" for i, o in enumerate(outs))
    assert all(p.returncode == 0 for p in procs), log
    return outs, log


def test_tcp_netns_torchrun_two_nodes(hosts, tmp_path):
    """torchrun on two hosts, two ranks each: exact results, shm between a host's ranks and
    tcp between hosts, with nothing set but the backend's name."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "two_nodes.py"
    script.write_text(TWO_NODE_SCRIPT)
    _, log = _torchrun_on_two_hosts(hosts, tmp_path, 2, [str(script), str(tmp_path), tests_dir])
    problems = []
    for r in range(4):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result\n{log}"
        res = json.loads(f.read_text())
        assert res["ws"] == 4 and res["node"] == r // 2, res
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        for p, v in res["peers"].items():
            if int(p) == r:
                continue
            want = ({"transport": "shm", "path": "direct"} if int(p) // 2 == r // 2
                    else {"transport": "tcp", "path": "proxy"})
            if v != want:
                problems.append(f"rank {r} -> rank {p}: {v}, expected {want}")
    assert not problems, "\n".join(problems) + "\n" + log


ENTER_AND_EXEC = ("import os, sys; sys.path.insert(0, sys.argv[1]); import netns; "
                  "netns.enter(sys.argv[2]); os.execv(sys.argv[3], sys.argv[3:])")


def _tcp_floor_between_hosts(hosts, tmp_path_factory, json_path):
    """benchmarks/floors/build/tcp_floor between the two hosts, as on two machines: --listen on
    host 1, --connect from host 0 (--json `json_path`)."""
    from cxx_build import build_cxx
    from test_tcp_floor import LINKED, SRC, run_together

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    program = build_cxx(tmp_path_factory, SRC, "tcp_floor", LINKED)
    port = random.randint(40001, 60000)
    ends = [[hosts.names[1], program, "--listen", f"{hosts.ips[1]}:{port}"],
            [hosts.names[0], program, "--connect", f"{hosts.ips[1]}:{port}", "--iters", "300",
             "--json", str(json_path)]]
    done = run_together([[sys.executable, "-c", ENTER_AND_EXEC, tests_dir, *end] for end in ends])
    assert all(rc == 0 for rc, _ in done), "\n".join(out for _, out in done)


@pytest.mark.parametrize("floor", ("tcp_hosts", "tcp_loopback"))
def test_tcp_netns_bench_between_hosts(hosts, tmp_path, tmp_path_factory, floor):
    """The latency benchmark between two hosts, one rank each, started by torchrun on each
    (`torchrun ... -m resident_pg.bench`): every op's result checked, resident over tcp beside
    gloo, rank 0's report naming both hosts, the resident rows held to the tcp floor measured
    between the two hosts (tcp_floor --listen / --connect), or, given only a loopback floor, to
    that with a warning that says how to measure the right one. gloo listens where the host's
    name resolves unless GLOO_SOCKET_IFNAME names the interface (here the name resolves to
    loopback)."""
    out, floors = tmp_path / "bench.json", tmp_path / "tcp_floors.json"
    if floor == "tcp_hosts":
        _tcp_floor_between_hosts(hosts, tmp_path_factory, floors)
    else:
        floors.write_text(json.dumps({"results": [
            {"name": "tcp_loopback", "variant": "spin_recv", "bytes": n, "median_us": 3.0,
             "ok": True} for n in (8, 65536)]}))
    outs, log = _torchrun_on_two_hosts(hosts, tmp_path, 1, [
        "-m", "resident_pg.bench", "--backends", "resident,gloo", "--sizes", "8,4K",
        "--ops", "all", "--reps", "3", "--min-reps", "2", "--warmup", "2", "--iters", "0.05",
        "--floors", str(floors), "--json", str(out)], extra_env={"GLOO_SOCKET_IFNAME": "eth1"})
    doc = json.loads(out.read_text())
    assert doc["metadata"]["launcher"]["hosts"] == 2, doc["metadata"]["launcher"]
    warnings = doc["metadata"]["floors"]["warnings"]
    assert doc["metadata"]["floors"]["tcp_one_way_name"] == floor
    if floor == "tcp_hosts":
        assert warnings == []
    else:
        assert len(warnings) == 1 and "span 2 hosts but the tcp floor is tcp_loopback" in \
            warnings[0] and "tcp_floor --listen / --connect" in warnings[0], warnings
        assert "WARNING: the ranks span 2 hosts" in outs[0], log
    assert doc["errors"] == [], doc["errors"]
    rows = doc["results"]
    assert {r["label"] for r in rows} == {"resident", "gloo"}
    assert len(rows) == 2 * 5 * 2, [(r["label"], r["op"], r["size_bytes"]) for r in rows]
    for r in rows:
        assert r["world_size"] == 2 and r["check"] == "ok" and r["median_us"] > 0, r
        if r["label"] == "resident":
            assert r["transport"] == "tcp" and r["path"] == "proxy", r
            assert r["floor_kind"] == "tcp" and r["floor"].startswith(floor + " "), r
            assert r["floor_ratio"] > 0, r
    assert "ranks of a launcher (env://): 2 on 2 host(s)" in outs[0], log
    where = "two hosts" if floor == "tcp_hosts" else "two processes"
    assert f"tcp: {floor} one-way (busy-polled TCP ping-pong between {where}" in outs[0], log
    assert "== world size 2" not in outs[1], log   # rank 1 only measures
