"""CPU tests of resident_pg.bench.interference's pure parts (the benchmark itself needs CUDA):
option parsing, the replay plan, the overlap/latency arithmetic, the summary rows and the
table; and the exit code 2 with a clear message where CUDA is absent."""

import os
import subprocess
import sys

import pytest

from resident_pg.bench import interference as BI
from resident_pg.bench import interference_rank as BR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_args_defaults_and_errors(capsys):
    a = BI.parse_args([])
    assert (a.ws, a.batches, a.sizes, a.modes) == (2, [1, 8, 64], [8, 65536], ["default"])
    assert a.shape == (4096, 14336) and a.reps == 21 and a.time_limit is None and a.json is None
    a = BI.parse_args(["--ws", "4", "--batches", "1,64", "--sizes", "8,4K", "--modes", "proxy,default",
                       "--shape", "1024x2048", "--reps", "5", "--time-limit", "60", "--json", "x.json"])
    assert (a.ws, a.batches, a.sizes, a.modes, a.shape) == (4, [1, 64], [8, 4096],
                                                            ["proxy", "default"], (1024, 2048))
    assert a.time_limit == 60.0 and a.json == "x.json"
    for bad in (["--modes", "nccl"], ["--modes", "persistent"], ["--shape", "4096"],
                ["--batches", "0"], ["--sizes", "3"], ["--reps", "0"], ["--gemm-ranks", "1"]):
        with pytest.raises(SystemExit) as e:
            BI.parse_args(bad)
        assert e.value.code == 2, bad
    assert "error" in capsys.readouterr().err


def test_plan_replays():
    assert BR.plan_replays(1000.0, 100.0) == 16          # ceil(1.5 * 10) + 1
    assert BR.plan_replays(1000.0, 100.0, margin=1.0) == 11
    assert BR.plan_replays(1.0, 1000.0) == 2              # at least 2
    assert BR.plan_replays(1e9, 1.0, max_replays=50) == 50
    assert BR.plan_replays(1000.0, 0.0) == 2


def test_window_stats():
    marks = [0.0, 1.0, 2.0, 3.0, 4.0]  # ms: start, then the end of each of 4 replays
    st = BR.window_stats(marks, 0.5, 3.5, ops_per_replay=8)
    assert st["coverage"] == 1.0 and st["replays_inside"] == 2 and st["replays"] == 4
    assert st["per_op_us"] == pytest.approx(1000.0 / 8)
    st = BR.window_stats([0.0, 1.0, 3.0], 2.0, 6.0, ops_per_replay=1)  # covers 2..3 of 2..6
    assert st["coverage"] == pytest.approx(0.25) and st["replays_inside"] == 0
    assert st["per_op_us"] == pytest.approx(1500.0)  # none inside: all replays
    with pytest.raises(ValueError):
        BR.window_stats([0.0], 0.0, 1.0, 1)


def _rank(times_gemm, scale, check_errors=()):
    g = {"baseline": {"1": [10.0, 10.0, 10.0], "8": [20.0, 20.0, 20.0]},
         "alone": {"1": [11.0 * scale] * 3, "8": [20.0] * 3},
         "concurrent 8 B": {"1": [15.0 * scale] * 3, "8": [30.0] * 3}}
    return {"times_gemm": times_gemm, "gemm": g if times_gemm else {},
            "comm_alone": {"8": [4.0, 4.0, 4.0]},
            "concurrent": {"8": {"1": {"per_op_us": [5.0, 6.0, 7.0], "coverage": [1.0, 0.9]},
                                 "8": {"per_op_us": [5.0] * 3, "coverage": [1.0]}}},
            "check_errors": list(check_errors)}


def test_summarize_and_table():
    rows = BI.summarize("proxy", {0: _rank(True, 1.0), 1: _rank(True, 2.0)}, [1, 8], [8])
    assert [(r["condition"], r["batch"]) for r in rows] == [
        ("baseline", 1), ("baseline", 8), ("alone", 1), ("alone", 8),
        ("concurrent 8 B", 1), ("concurrent 8 B", 8)]
    by = {(r["condition"], r["batch"]): r for r in rows}
    assert by[("baseline", 1)]["vs_baseline"] == 1.0
    assert by[("alone", 1)]["gemm_median_us"] == 22.0 and by[("alone", 1)]["vs_baseline"] == 2.2
    c = by[("concurrent 8 B", 1)]
    assert c["vs_baseline"] == 3.0 and c["allreduce_us"] == 6.0 and c["allreduce_alone_us"] == 4.0
    assert c["overlap_min"] == 0.9 and c["size_bytes"] == 8 and c["check"] == "ok"
    assert "allreduce_us" not in by[("alone", 1)]

    # only rank 0 times the GEMM; a failed check marks every row of the mode
    rows2 = BI.summarize("default", {0: _rank(True, 1.0), 1: _rank(False, 1.0, ["wrong"])}, [1], [8])
    assert rows2[1]["gemm_median_us"] == 11.0 and all(r["check"] == "FAILED" for r in rows2)

    text = BI.format_table(rows + rows2, "interference test")
    assert "== interference test" in text
    for word in ("mode", "condition", "GEMM µs", "vs baseline", "all_reduce µs", "overlap",
                 "concurrent 8 B", "2.200x", "90%~", "proxy", "default"):
        assert word in text, word
    assert "\n\n" in text.split("-----", 1)[1]  # a blank line between the modes
    assert "! a correctness check FAILED" in text and "~ the all_reduces covered" in text


def _cuda_available():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.skipif(_cuda_available(), reason="checks the behaviour without CUDA")
def test_exits_2_without_cuda():
    cmd = [sys.executable, "-m", "resident_pg.bench.interference"]
    p = subprocess.run(cmd + ["--batches", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "needs CUDA" in p.stderr
