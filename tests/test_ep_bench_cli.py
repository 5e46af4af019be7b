"""benchmarks/ep_bench.py as a user runs it, on CPU tensors (its functional dry run): the rows it
prints and writes; a run whose ranks fail ends at once, naming the failing ranks and keeping the
shapes measured before, instead of waiting for rows that never come; expert counts it cannot
route are refused before any rank starts."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "ep_bench.py")

pytestmark = pytest.mark.resident_only


def _run(tmp_path, *args, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "ep.json"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--ranks", "2", "--json",
                        str(out), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p, (json.loads(out.read_text()) if out.exists() else None), time.monotonic() - t0


def test_ep_bench_rows(tmp_path):
    p, data, _ = _run(tmp_path, "--hidden", "256", "--tokens", "1,3", "--experts", "8",
                      "--iters", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert data["complete"] is True
    assert [(r["hidden"], r["experts"], r["tokens"]) for r in data["rows"]] == [(256, 8, 1),
                                                                                (256, 8, 3)]
    for r in data["rows"]:
        assert r["ep_us"] > 0 and r["moe_us"] > 0 and r["a2a_us"] > 0
        # Padded: tokens * min(top_k, experts per rank) slots of 256 bf16 values per peer.
        assert r["padded_bytes_per_peer"] == r["tokens"] * min(8, 4) * 256 * 2
        assert 0 < r["ep_bytes_per_peer"] <= r["padded_bytes_per_peer"]
    lines = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("256")]
    assert len(lines) == 2, p.stdout


def test_ep_bench_fails_fast_naming_the_ranks(tmp_path):
    # FP8 dispatch at hidden 100 (not a multiple of 128): every rank's Buffer raises a ValueError
    # on the second shape; the first shape's row is kept.
    p, data, took = _run(tmp_path, "--hidden", "256,100", "--tokens", "1", "--experts", "8",
                         "--iters", "2", "--fp8", timeout=180)
    assert p.returncode != 0
    # Both ranks fail; the run names each rank it saw exit (the first one at least).
    assert re.search(r"rank [01] exited with code 1", p.stderr) and "1 shapes measured" in \
        p.stderr, p.stderr[-3000:]
    assert "multiple of 128" in p.stderr
    assert data is not None and data["complete"] is False
    assert [r["hidden"] for r in data["rows"]] == [256]
    assert took < 120, took


def test_ep_bench_refuses_experts_it_cannot_route(tmp_path):
    p, data, _ = _run(tmp_path, "--experts", "12", "--top-k", "8", "--ranks", "8", timeout=60)
    assert p.returncode == 2 and data is None
    assert "--experts 12: each value must be a multiple of --ranks (8)" in p.stderr, p.stderr
