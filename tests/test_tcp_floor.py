"""benchmarks/floors/tcp_floor.cpp: built with g++, run briefly. Its JSON has a passing row per
placement, receive method and size, which the bench's floor loader accepts (an io_uring row may
instead be skipped, saying why: io_uring refused here, or SQPOLL on fewer than 4 CPUs); a spoiled
message is noticed on the far side; the network namespaces it makes are gone afterwards, also
after a SIGTERM, and without root the namespace row says why it did not run. Between two hosts
(one run with --listen, one with --connect; here both on loopback) the rows pass, the echo end's
checks reach the timing end, and the bench takes those rows as its tcp floor. CPU only, no
torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from cxx_build import build_cxx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "benchmarks", "floors", "tcp_floor.cpp")
# the library's address helpers (written and parsed as the tcp transport does)
LINKED = [os.path.join(REPO, "csrc", "core", "transport", "tcp_address.cpp")]
SIZES = [8, 1024, 8192, 65536, 262144]
METHODS = ["spin_recv", "epoll_recv", "uring", "uring_sqpoll"]
URING = {"uring", "uring_sqpoll"}
NETNS = ["resident_floor_a", "resident_floor_b"]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return build_cxx(tmp_path_factory, SRC, "tcp_floor", LINKED)


def _run(program, tmp_path, *args, timeout=240, **kw):
    out = tmp_path / "tcp.json"
    proc = subprocess.run([program, *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=timeout, **kw)
    doc = json.loads(out.read_text()) if out.exists() else None
    return proc, doc


def _netns_present():
    return [n for n in NETNS if os.path.exists(f"/var/run/netns/{n}")]


def _ran(r):
    """A row that ran; an io_uring row that did not must say why."""
    if r["skipped"]:
        assert r["variant"] in URING and r["note"].startswith("not run: ") and not r["ok"], r
        if r["variant"] == "uring_sqpoll" and len(os.sched_getaffinity(0)) < 4:
            assert "needs 4 usable CPUs" in r["note"], r
        return False
    return True


def _can_make_netns():
    return os.geteuid() == 0


def test_loopback_rows_pass_and_load_as_floors(program, tmp_path):
    proc, doc = _run(program, tmp_path, "--only", "tcp_loopback", "--iters", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = doc["results"]
    assert [(r["variant"], r["bytes"]) for r in rows] == [(m, n) for m in METHODS for n in SIZES]
    rows = [r for r in rows if _ran(r)]
    assert {r["variant"] for r in rows} >= {"spin_recv", "epoll_recv"}
    for r in rows:
        assert r["name"] == "tcp_loopback" and r["ok"] is True and not r["skipped"], r
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"], r
        assert "client=ok server=ok" in r["note"], r
        # a block cut by its time budget still has its samples; otherwise all of --iters
        assert r["samples"] == 200 or "budget_truncated" in r["note"], r
    assert doc["program"] == "tcp_floor" and doc["iters"] == 200 and doc["cpus"] >= 1
    import resident_pg.bench.cuda as bc
    floors = bc.load_floors(str(tmp_path / "tcp.json"))
    for n in SIZES:
        want = min(r["median_us"] for r in rows if r["bytes"] == n)
        assert floors["tcp_one_way_us"][str(n)] == pytest.approx(want)
    assert "median_us" in proc.stdout and "wrote" in proc.stdout


def test_a_spoiled_message_fails_its_row(program, tmp_path):
    """--corrupt flips a byte of each block's last message before it is sent: the far side's
    check fails every row (at 8 B the byte is in the message's sequence word)."""
    proc, doc = _run(program, tmp_path, "--only", "tcp_loopback", "--iters", "20", "--corrupt")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(doc["results"]) == len(SIZES) * len(METHODS)
    for r in filter(_ran, doc["results"]):
        assert r["ok"] is False and "server=mismatch" in r["note"], r
        assert ("sequence" if r["bytes"] == 8 else "payload differs") in r["note"], r
    assert "FAILED" in proc.stdout


def test_bad_option_is_a_usage_error(program):
    proc = subprocess.run([program, "--only", "tcp_nowhere"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "usage: tcp_floor" in proc.stderr


def test_netns_rows_and_cleanup(program, tmp_path):
    """Between the namespaces when this machine allows it (root); otherwise one
    skipped row saying why. Either way no namespace of the program is left."""
    proc, doc = _run(program, tmp_path, "--only", "tcp_netns", "--iters", "100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = doc["results"]
    made = not (len(rows) == 1 and rows[0]["skipped"] and rows[0]["variant"] in ("", None))
    if _can_make_netns() and made:
        assert [(r["variant"], r["bytes"]) for r in rows] == [
            (m, n) for m in METHODS for n in SIZES]
        assert all(r["ok"] and r["name"] == "tcp_netns" for r in rows if _ran(r)), rows
    else:
        (row,) = rows
        assert row["skipped"] is True and row["note"].startswith("not run: "), row
    assert _netns_present() == []


def test_netns_row_says_why_without_root(program, tmp_path):
    if os.geteuid() != 0:
        proc, doc = _run(program, tmp_path, "--only", "tcp_netns", "--iters", "20")
    else:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot drop root for this check")
        # a directory that user 65534 can reach: pytest's own tmp_path may be private to root
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            os.chmod(d, 0o777)
            exe, out = os.path.join(d, "tcp_floor"), os.path.join(d, "tcp.json")
            shutil.copy(program, exe)
            proc = subprocess.run(
                [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", exe, "--only",
                 "tcp_netns", "--iters", "20", "--json", out],
                capture_output=True, text=True, timeout=60)
            with open(out) as f:
                doc = json.load(f)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = doc["results"]
    assert row["skipped"] is True and row["ok"] is False
    assert row["note"] == "not run: network namespaces need root", row


def test_sigterm_removes_the_namespaces(program, tmp_path):
    if not _can_make_netns():
        pytest.skip("network namespaces need root")
    proc = subprocess.Popen([program, "--only", "tcp_netns", "--iters", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + 60
        while len(_netns_present()) < 2 and proc.poll() is None and time.time() < end:
            time.sleep(0.05)
        if proc.poll() is not None:
            out, err = proc.communicate()
            if "not run:" in out:
                pytest.skip(f"namespaces not made here: {out.strip().splitlines()[-1]}")
            pytest.fail(f"exited early: {out}{err}")
        assert len(_netns_present()) == 2
        time.sleep(0.5)  # the two ends are inside by now, or on their way in
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert _netns_present() == []
    end = time.time() + 10
    while any(_alive(p) for p in children) and time.time() < end:
        time.sleep(0.05)
    assert not [p for p in children if _alive(p)], "an end outlived the program"


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------
# Between two hosts: one run listening (the echo end), one connecting (the timing end), here both
# on loopback; tests/test_tcp_netns_torchrun.py runs them in two namespace hosts.
# --------------------------------------------------------------------------

HOST_METHODS = ["spin_recv", "epoll_recv"]


def _free_port(family=socket.AF_INET):
    with socket.socket(family) as s:
        s.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return s.getsockname()[1]


def _has_ipv6_loopback():
    try:
        _free_port(socket.AF_INET6)
        return True
    except OSError:
        return False


def run_together(cmds, stagger_s=0.0, timeout=120):
    """Runs the commands at once (each started `stagger_s` after the one before) and returns
    [(returncode, output)] in their order; none is left running."""
    procs = []
    try:
        for i, cmd in enumerate(cmds):
            if i:
                time.sleep(stagger_s)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, o) for p, o in zip(procs, outs)]


def _two_runs(program, tmp_path, *client_args, listen_first=True,
              hosts=("127.0.0.1", "localhost")):
    """--listen 127.0.0.1:PORT and --connect localhost:PORT (or the two `hosts`) as two runs;
    the connecting one started first when not `listen_first` (it tries again while refused).
    Returns the two (returncode, output), the listening run's first, the client's JSON and the
    port."""
    port = _free_port(socket.AF_INET6 if hosts[0].startswith("[") else socket.AF_INET)
    out = tmp_path / "hosts.json"
    listen = [program, "--listen", f"{hosts[0]}:{port}"]
    connect = [program, "--connect", f"{hosts[1]}:{port}", *client_args, "--json", str(out)]
    if listen_first:
        server, client = run_together([listen, connect], stagger_s=0.3)
    else:
        client, server = run_together([connect, listen], stagger_s=0.3)
    doc = json.loads(out.read_text()) if out.exists() else None
    return server, client, doc, port


@pytest.mark.parametrize("listen_first", (True, False), ids=("listen_first", "connect_first"))
def test_two_host_rows_pass_and_are_the_benchs_tcp_floor(program, tmp_path, listen_first):
    (s_rc, s_out), (c_rc, c_out), doc, port = _two_runs(
        program, tmp_path, "--iters", "200", listen_first=listen_first)
    assert s_rc == 0 and c_rc == 0, s_out + c_out
    assert f"listening on 127.0.0.1:{port}" in s_out and "every check passed" in s_out, s_out
    rows = doc["results"]
    assert [(r["name"], r["variant"], r["bytes"]) for r in rows] == [
        ("tcp_hosts", m, n) for m in HOST_METHODS for n in SIZES]
    for r in rows:
        assert r["ok"] is True and not r["skipped"] and "client=ok server=ok" in r["note"], r
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"], r
        assert r["samples"] == 200 or "budget_truncated" in r["note"], r
    assert doc["peer"] == f"localhost:{port}" and doc["iters"] == 200
    import resident_pg.bench.cuda as bc
    # with loopback rows in the same files, the rows between hosts are the tcp floor
    loop = tmp_path / "loop.json"
    loop.write_text(json.dumps({"results": [
        {"name": "tcp_loopback", "variant": "spin_recv", "bytes": n, "median_us": 0.5, "ok": True}
        for n in SIZES]}))
    floors = bc.load_floors([str(loop), str(tmp_path / "hosts.json")])
    assert floors["tcp_one_way_name"] == "tcp_hosts"
    for n in SIZES:
        assert floors["tcp_one_way_us"][str(n)] == pytest.approx(
            min(r["median_us"] for r in rows if r["bytes"] == n))
    value, which = bc.floor_for(floors, 8, "tcp")
    assert which == "tcp_hosts 8 B" and value == floors["tcp_one_way_us"]["8"]
    assert bc.load_floors(str(loop))["tcp_one_way_name"] == "tcp_loopback"


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback address on this machine")
def test_two_host_rows_over_ipv6(program, tmp_path):
    (s_rc, s_out), (c_rc, c_out), doc, port = _two_runs(
        program, tmp_path, "--iters", "50", hosts=("[::1]", "[::1]"))
    assert s_rc == 0 and c_rc == 0, s_out + c_out
    assert f"listening on [::1]:{port}" in s_out and "every check passed" in s_out, s_out
    assert len(doc["results"]) == len(SIZES) * len(HOST_METHODS)
    for r in doc["results"]:
        assert r["ok"] is True and "client=ok server=ok" in r["note"], r
    assert doc["peer"] == f"[::1]:{port}"


def test_two_host_spoiled_message_fails_on_both_ends(program, tmp_path):
    """The echo end's checks reach the timing end's rows (its verdict after the last block)."""
    (s_rc, s_out), (c_rc, c_out), doc, _ = _two_runs(program, tmp_path, "--iters", "20",
                                                     "--corrupt")
    assert s_rc == 1 and "FAILED spin_recv 8 B: mismatch" in s_out, s_out
    assert c_rc == 1 and "FAILED" in c_out, c_out
    assert len(doc["results"]) == len(SIZES) * len(HOST_METHODS)
    for r in doc["results"]:
        assert r["ok"] is False and "server=mismatch" in r["note"], r


@pytest.mark.parametrize("args, says", [
    (["--listen", "7000", "--iters", "10"], "usage: tcp_floor"),
    (["--connect", "127.0.0.1:9", "--only", "tcp_loopback"], "usage: tcp_floor"),
    (["--connect", "127.0.0.1"], "expected HOST:PORT, got '127.0.0.1'"),
    (["--connect", "127.0.0.1:0"], "bad port '0'"),
    (["--connect", "::1:7000"], "an IPv6 address goes in brackets: '[::1]:PORT'"),
    (["--connect", "no-such-host.invalid:7000"], "cannot resolve 'no-such-host.invalid'"),
    (["--listen", "127.0.0.1:99999"], "bad port '99999'"),
])
def test_two_host_bad_arguments(program, args, says):
    proc = subprocess.run([program, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
