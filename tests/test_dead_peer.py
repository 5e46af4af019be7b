"""A dead peer is noticed at once, on every transport and path; a stuck one at the timeout.

Each job runs its ranks as plain subprocesses (tests/dead_peer_rank.py) so that the test decides
whether a killed rank is reaped at once (as torchrun's agent does) or left a zombie (as a
torch.multiprocessing parent that has not joined it yet). Survivors must raise a
DistBackendError naming the dead rank within DETECT_S of its death (of their op's start when
it died while they were outside any op):
- during_op: the survivors wait inside an all_reduce when the victim is killed;
- between_ops: the victim is killed while the survivors are outside any op;
- subgroup: the victim and rank 1 form a subgroup; rank 1 waits on it, rank 0 on the world;
- creation: the victim is killed while it creates the group, before the others start theirs;
- stuck (alive, never calls): rank 0 gives up at its own short timeout, and rank 1, whose
  timeout is long, learns it from rank 0 at once;
- during EP: the survivors run resident_pg.ep.Buffer dispatch + combine when the victim dies;
- left (alive, destroys its group in order while the others wait inside an op it never joins):
  the survivors raise as for a death; get_error() says COMM_ERROR (the victim did not fail) or
  REMOTE_ERROR (another survivor's failure reached it first).
The group's Backend.get_error() then says REMOTE_ERROR (between ops: before any op, within
DETECT_S of the death); the rank that timed out says TIMEOUT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DETECT_S = 2.0
WS = 3
VICTIM = 2

MODES = {  # what a user can turn on for CPU tensors
    "shm": {},
    "proxy": {"RESIDENT_PATH": "proxy"},
    "tcp": {"RESIDENT_TRANSPORT": "tcp"},
}


class _Rank:
    def __init__(self, rank, cfg, env):
        self.rank = rank
        self.lines = []
        self.ready = threading.Event()
        self.result = None
        self.done = threading.Event()
        self.exit_s = None  # a killed victim: how long its exit took after SIGKILL
        self.left = threading.Event()  # scenario "left": the victim destroyed its group
        self.left_at = None
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dead_peer_rank.py"), json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.err = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ready"):
                self.ready.set()
            if "left" in msg:
                self.left_at = msg["left"]
                self.left.set()
            if "result" in msg:
                self.result = msg["result"]
                self.done.set()
        self.done.set()

    def describe(self):
        return (f"rank {self.rank}: rc={self.proc.poll()} result={self.result}\n"
                f"  stderr tail: {''.join(self.err[-15:])}")


def run_job(scenario, device="cpu", env_extra=None, reap=True, victim=VICTIM, timeouts=None,
            op="all_reduce"):
    """Runs one job; returns (ranks, t_kill): when the victim had exited (None: no victim)."""
    import torch.distributed as dist

    # Port 0: the store binds a free port itself (one picked beforehand may be taken meanwhile).
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = store.port
    marker = os.path.join(tempfile.mkdtemp(prefix="resident_dead_peer_"), "killed")
    env = dict(os.environ)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    timeouts = timeouts or [30] * WS
    ranks = []
    try:
        for r in range(WS):
            cfg = {"rank": r, "world_size": WS, "store_port": port, "scenario": scenario,
                   "device": device, "victim": victim, "timeout_s": timeouts,
                   "killed_marker": marker, "op": op}
            ranks.append(_Rank(r, cfg, env))
        t_kill = None
        if victim >= 0:
            v = ranks[victim]
            assert v.ready.wait(90), "the victim never got ready:\n" + v.describe()
            if scenario == "left":
                assert v.left.wait(90), "the victim never destroyed its group:\n" + v.describe()
                t_kill = v.left_at
            else:
                time.sleep(0.3)
            if scenario not in ("stuck", "left"):
                v.proc.send_signal(signal.SIGKILL)
                t_signal = time.time()
                # The death is the end of the victim's exit, which a loaded host can take seconds
                # to finish after SIGKILL (its pidfd turns readable only then): waited for here
                # without reaping it, unless the case reaps it.
                if reap:
                    v.proc.wait()
                else:
                    os.waitid(os.P_PID, v.proc.pid, os.WEXITED | os.WNOWAIT)
                t_kill = time.time()
                v.exit_s = t_kill - t_signal
                open(marker, "w").close()
        for r in ranks:
            if r.rank != victim:
                r.done.wait(90)
        return ranks, t_kill
    finally:
        for r in ranks:
            killable = r.rank != victim or reap or scenario in ("stuck", "left")
            if r.proc.poll() is None and killable:
                r.proc.kill()
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.wait()
        del store


def check_survivors(ranks, t_kill, victim=VICTIM, name=None, error="REMOTE_ERROR"):
    """Each survivor raised a DistBackendError naming the victim within DETECT_S, and its group's
    get_error() then said `error` (or one of them; between ops, before any op, within DETECT_S)."""
    name = f"rank {victim}" if name is None else name
    allowed = (error,) if isinstance(error, str) else error
    problems = []
    for r in ranks:
        if r.rank == victim:
            continue
        res = r.result
        if not res or not res.get("raised"):
            problems.append(f"rank {r.rank} did not raise:\n{r.describe()}")
            continue
        since = max(t_kill or 0.0, res["t_start"])
        took = res["t_raise"] - since
        if took > DETECT_S:
            exit_s = ranks[victim].exit_s if 0 <= victim < len(ranks) else None
            exited = "" if exit_s is None else f"; its exit took {exit_s:.2f} s after SIGKILL"
            problems.append(f"rank {r.rank} raised {took:.2f} s after the death (limit "
                            f"{DETECT_S} s{exited}): {res['message']}")
        if name not in res["message"]:
            problems.append(f"rank {r.rank}'s error does not name {name}: {res['message']}")
        if res["type"] != "DistBackendError":
            problems.append(f"rank {r.rank} raised {res['type']}, not DistBackendError: "
                            f"{res['message']}")
        if res["where"] == "op" and res.get("error") not in allowed:
            problems.append(f"rank {r.rank}: get_error() after the op raised is "
                            f"{res.get('error')}, expected {error}")
        if "error_between" in res and (res["error_between"] not in allowed
                                       or res["error_between_s"] > DETECT_S):
            problems.append(f"rank {r.rank}: get_error() between ops was {res['error_between']} "
                            f"{res['error_between_s']:.2f} s after the death, expected {error} "
                            f"within {DETECT_S} s")
    return problems


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("reap", [False, True], ids=["unreaped", "reaped"])
@pytest.mark.parametrize("scenario", ["during_op", "between_ops"])
def test_killed_peer_noticed_at_once(scenario, reap, mode):
    ranks, t_kill = run_job(scenario, env_extra=MODES[mode], reap=reap)
    problems = check_survivors(ranks, t_kill)
    assert not problems, "\n".join(problems)


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", ["shm", "tcp"])
@pytest.mark.parametrize("scenario", ["subgroup", "creation"])
def test_killed_peer_noticed_in_subgroup_and_creation(scenario, mode):
    ranks, t_kill = run_job(scenario, env_extra=MODES[mode], reap=False)
    problems = check_survivors(ranks, t_kill)
    assert not problems, "\n".join(problems)


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(MODES))
def test_killed_peer_noticed_during_ep(mode):
    """A rank killed while the others run EP dispatch + combine (resident_pg.ep.Buffer)."""
    ranks, t_kill = run_job("during_op", env_extra=MODES[mode], reap=False, op="ep")
    problems = check_survivors(ranks, t_kill)
    assert not problems, "\n".join(problems)


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_stuck_peer_times_out_and_the_failure_spreads(mode):
    # Rank 0 gives up after 2 s; rank 1 (timeout 60 s) must follow within DETECT_S of that.
    ranks, _ = run_job("stuck", env_extra=MODES[mode], timeouts=[2, 60, 60])
    r0, r1 = ranks[0].result, ranks[1].result
    assert r0 and r0.get("raised") and "timed out" in r0["message"].lower(), ranks[0].describe()
    assert r1 and r1.get("raised"), ranks[1].describe()
    assert r1["t_raise"] - r0["t_raise"] <= DETECT_S, (r0, r1)
    assert "rank 0" in r1["message"], r1["message"]
    # get_error(): rank 0 gave up waiting; rank 1 failed because rank 0's group did
    assert (r0["error"], r1["error"]) == ("TIMEOUT", "REMOTE_ERROR"), (r0, r1)


# A survivor whose op failed on the departed peer tells the others its group failed: whichever
# they learn first decides, so COMM_ERROR (the peer left) or REMOTE_ERROR (a survivor failed).
LEFT_ERRORS = ("COMM_ERROR", "REMOTE_ERROR")


@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", ["all_reduce", "recv"])
def test_left_peer_noticed_at_once(op, mode):
    """A peer that destroyed its group in order while the others wait inside an op it never
    joins (a different number of calls): they raise naming it at once, not at their timeout."""
    ranks, t_left = run_job("left", env_extra=MODES[mode], op=op)
    problems = check_survivors(ranks, t_left, error=LEFT_ERRORS)
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", ["all_reduce", "recv", "ep"])
def test_left_peer_noticed_cuda(op, mode):
    """CUDA tensors: the survivors' kernels waiting on a peer that left in order give up at once
    (GpuLayout::kPeersLeftWord), and the host raises naming it."""
    ranks, t_left = run_job("left", device="cuda", env_extra=MODES[mode], op=op)
    problems = check_survivors(ranks, t_left, error=LEFT_ERRORS)
    assert not problems, "\n".join(problems)


CUDA_CASES = [("during_op", "all_reduce"), ("between_ops", "all_reduce"), ("during_op", "ep")]


@pytest.mark.gpu
@pytest.mark.resident_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("reap", [False, True], ids=["unreaped", "reaped"])
@pytest.mark.parametrize("scenario,op", CUDA_CASES, ids=["during_op", "between_ops", "during_ep"])
def test_killed_peer_noticed_cuda(scenario, op, reap, mode):
    """CUDA tensors: the survivors' kernels waiting on the dead rank exit, the host raises naming
    it, and the GPU (and the MPS server, with several ranks on one GPU) still serve a fresh job.
    ``during_ep``: the survivors run EP dispatch + combine (the counts-with-rows exchange)."""
    ranks, t_kill = run_job(scenario, device="cuda", env_extra=MODES[mode], reap=reap, op=op)
    problems = check_survivors(ranks, t_kill)
    # A fresh job's ranks log what failed their group, if anything did (in describe()).
    after, _ = run_job("healthy", device="cuda", env_extra={**MODES[mode], "RESIDENT_DEBUG": "warn"},
                       victim=-1)
    for r in after:
        if not (r.result and r.result.get("healthy")):
            problems.append(f"a fresh job after the kill failed:\n{r.describe()}")
    assert not problems, "\n".join(problems)
