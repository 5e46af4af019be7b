"""Smoke tests of examples/tp_decode.py and examples/ep_decode.py: torchrun on CPU, tiny
dimensions, ``--check`` (resident vs gloo, and vs a single-process reference) must pass.

Timings are printed by the scripts but never asserted on."""

import os
import subprocess
import sys

import pytest

import dist_harness as H

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TP_TINY = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
           "--intermediate", "512"]
EP_TINY = ["--layers", "2", "--hidden", "64", "--top-k", "2", "--moe-intermediate", "32",
           "--batch", "4"]


def torchrun(script, nproc, args, timeout=240):
    env = dict(os.environ)
    # the examples import resident_pg: this checkout's, not whatever else is installed
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(REPO, "examples", script),
           "--device", "cpu", "--backend", H.BACKEND, "--steps", "5", "--warmup", "1", *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{out[-6000:]}"
    return p.stdout


def _checks(out, n):
    lines = [l for l in out.splitlines() if l.startswith("check:")]
    assert len(lines) == n and all(l.endswith("OK") for l in lines), out
    return lines


def test_tp_decode_cpu_check():
    out = torchrun("tp_decode.py", 2, TP_TINY + ["--check", "--kv-len", "64"])
    assert "comm share" in out and "method: no-op replacement" in out, out
    assert "per step 4 all-reduces of 1024 B" in out, out
    _checks(out, 2)


def test_tp_decode_cpu_three_ranks_batch():
    out = torchrun("tp_decode.py", 3, ["--layers", "1", "--hidden", "192", "--heads", "6",
                                       "--kv-heads", "3", "--intermediate", "384", "--batch", "3",
                                       "--kv-len", "32", "--check"])
    _checks(out, 2)


@pytest.mark.parametrize("nproc,experts,dispatch", [(2, 8, "both"), (3, 6, "ep")])
def test_ep_decode_cpu_check(nproc, experts, dispatch):
    out = torchrun("ep_decode.py", nproc, EP_TINY + ["--experts", str(experts), "--check",
                                                     "--dispatch", dispatch])
    engines = ("ep", "moe") if dispatch == "both" else (dispatch,)
    for eng in engines:
        assert f"[{eng}] step" in out and f"[{eng}] dispatch+combine alone" in out, out
    assert "comm share" in out, out
    if H.BACKEND == "resident":  # the ep engine moves only the routed rows
        assert "[ep] transport splits" in out, out
    lines = _checks(out, 2 * len(engines) + (len(engines) == 2))
    assert all(any(l.startswith(f"check: [{eng}]") for l in lines) for eng in engines), lines
