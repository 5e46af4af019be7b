"""benchmarks/probes/tcp_exchange_probe.cpp: built with g++ (-Werror), run briefly. It prints one
JSON line per variant and message size, each exchange's message checked by its number on the far
side: every line ok, a positive period, and the stage stand-in where the variant has one (the
sending-thread variants need 4 CPUs and say so where there are fewer); a wrong number (--corrupt) fails it at once, saying so. CPU only, no torch."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from cxx_build import build_cxx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "benchmarks", "probes", "tcp_exchange_probe.cpp")
VARIANTS = ["exchange", "exchange+stage", "exchange+stage, out of phase",
            "exchange+stage, socket per direction",
            "exchange+stage, sending thread, socket per direction",
            "exchange+stage, sending thread, out of phase"]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return build_cxx(tmp_path_factory, SRC, "tcp_exchange_probe")


def test_probe_runs_and_checks_its_messages(program):
    proc = subprocess.run([program, "200"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [(r["bytes"], r["variant"]) for r in rows] == [
        (b, v) for b in (8, 65536) for v in VARIANTS]
    for r in rows:
        if "sending thread" in r["variant"] and (os.cpu_count() or 1) < 4:
            # the sending thread needs a core of its own beside each process's
            assert r == {"probe": "tcp_exchange", "variant": r["variant"], "bytes": r["bytes"],
                         "skipped": "needs 4 CPUs", "ok": True}, r
            continue
        assert r["ok"] is True and r["iters"] == 200, r
        assert 0 < r["min_us"] <= r["period_us"] <= r["max_us"], r
        assert (r["stage_us"] > 0) == (r["variant"] != "exchange"), r
        # the spun stage is part of every exchange's period
        assert r["period_us"] >= r["stage_us"], r


def test_a_wrong_message_fails_the_probe(program):
    proc = subprocess.run([program, "200", "--corrupt"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert '"error": "exchange, 8 bytes: a message with a wrong number"' in proc.stdout, proc.stdout
