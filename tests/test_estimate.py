"""resident_pg.estimate: curve interpolation, communication plan, fraction saved, CLI.

The arithmetic is checked on synthetic curves written to tmp_path (power laws, which log-log
interpolation reproduces exactly); the CLI also runs on the real H200 and CPU bench JSON."""

import gzip
import json
import math
import os
import subprocess
import sys

import pytest

from resident_pg import estimate as est

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(REPO, "tests", "data", "bench_cuda_ws2_h200_2026-11-29.json")
CPU16 = os.path.join(REPO, "tests", "data", "bench_cpu_h200host_2026-11-29.json")
H200_248 = os.path.join(REPO, "tests", "data",
                        "bench_cuda_ws248_h200_2026-11-29.json.gz")
NCCL_A40 = os.path.join(REPO, "tests", "data", "baseline_nccl_graph_allreduce_a40_edr.json")
SIZES = (8, 1024, 65536, 1 << 20)
OPS = ("all_reduce", "all_to_all_single", "send_recv")


def res_us(s):
    return 4.0 * (s / 8) ** 0.25


def base_us(s):
    return 20.0 * (s / 8) ** 0.25


def write_bench(path, variants, world_sizes=(2,)):
    rows = []
    for ws in world_sizes:
        for backend, variant, path_, fn in variants:
            for op in OPS:
                for s in SIZES:
                    rows.append({"world_size": ws, "backend": backend, "label": variant + " graph",
                                 "device": "cuda", "mode": "graph", "variant": variant,
                                 "path": path_, "op": op, "size_bytes": s,
                                 "median_us": fn(s) * (1 + 0.1 * (ws - 2)), "check": "ok"})
    path.write_text(json.dumps({"schema": est.SCHEMA, "config": {}, "results": rows}))
    return str(path)


@pytest.fixture
def synth(tmp_path):
    return write_bench(tmp_path / "synth.json",
                       [("resident", "resident:path=direct", "direct", res_us),
                        ("nccl", "nccl", "", base_us)])


def run(argv, capsys):
    rc = est.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


COMPUTE = ["--compute-ms", "llama-3.1-8b=3", "--compute-ms", "llama-3.1-70b=20",
           "--compute-ms", "qwen3-30b-a3b=4", "--compute-ms", "qwen3-30b-a3b@64=9"]


# --------------------------------------------------------------------------
# pieces
# --------------------------------------------------------------------------

def test_curve_interpolates_in_log_log():
    c = est.Curve("c", [(1024, 16.0), (8, 4.0)])
    assert c.at(8) == (4.0, "")
    assert c.at(1024) == (16.0, "")
    mid = 8 * math.sqrt(128)  # geometric midpoint -> geometric mean of the latencies
    assert c.at(mid)[0] == pytest.approx(8.0, rel=1e-12) and c.at(mid)[1] == ""
    assert c.at(4) == (4.0, "below")          # flat below the range, flagged
    v, flag = c.at(4096)                      # last segment's slope above it, flagged
    assert flag == "above" and v == pytest.approx(16.0 * 4 ** (math.log(4) / math.log(128)))
    with pytest.raises(est.EstimateError):
        est.Curve("bad", [(8, 1.0), (8, 2.0)])
    with pytest.raises(est.EstimateError):
        est.Curve("bad", [(0, 1.0)])


def _args(**kw):
    a = est.build_parser().parse_args(["x.json"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_comm_plan_message_sizes_and_counts():
    a = _args()
    assert est.comm_plan("llama-3.1-8b", 8, 2, a) == [("all_reduce", 8 * 4096 * 2, 64)]
    assert est.comm_plan("llama-3.1-70b", 1, 4, a) == [("all_reduce", 8192 * 2, 160)]
    assert est.comm_plan("llama-3.1-70b", 64, 8, a) == [("all_reduce", 64 * 8192 * 2, 160)]
    # EP: per peer batch*top_k*hidden*bytes/world; the a2a curve is read at the per-rank buffer
    assert est.comm_plan("qwen3-30b-a3b", 8, 2, a) == [("all_to_all_single", 8 * 8 * 2048 * 2, 96)]
    assert est.comm_plan("qwen3-30b-a3b", 1, 8, a) == [("all_to_all_single", 8 * 2048 * 2, 96)]
    p2p = _args(ep_approx="p2p")
    assert est.comm_plan("qwen3-30b-a3b", 8, 4, p2p) == [("send_recv", 8 * 8 * 2048 * 2 // 4, 96)]
    # resident_pg.moe's padded layout: batch*min(top_k, E/world) slots per peer + counts
    pad = _args(ep_layout="padded")
    assert est.comm_plan("qwen3-30b-a3b", 8, 2, pad) == [
        ("all_to_all_single", 2 * 8 * 8 * 2048 * 2, 96), ("all_to_all_single", 2 * 64 * 8, 48)]
    assert est.comm_plan("qwen3-30b-a3b", 4, 32, pad)[0] == ("all_to_all_single",
                                                             32 * 4 * 4 * 2048 * 2, 96)
    fp32 = _args(bytes=4)
    assert est.comm_plan("llama-3.1-8b", 1, 2, fp32) == [("all_reduce", 4096 * 4, 64)]


def test_assumed_compute_formula():
    a = _args()
    kv = 1 * 2048 * 2 * 32 * 8 * 128 * 2
    want = (7.50e9 * 2 + kv) / 2 / (4800e9 * 0.6) * 1e3 + 32 * 10 / 1e3
    assert est.assumed_compute_ms("llama-3.1-8b", 1, 2, a) == pytest.approx(want)
    # EP: more tokens touch more experts -> more bytes
    assert est.assumed_compute_ms("qwen3-30b-a3b", 64, 8, a) > \
        est.assumed_compute_ms("qwen3-30b-a3b", 1, 8, a)


def test_selectors():
    assert est.parse_selector("path=direct, mode=graph,ws=2") == {
        "path": "direct", "mode": "graph", "world_size": "2"}
    assert est.parse_selector("variant=resident:path=proxy") == {"variant": "resident:path=proxy"}
    for bad in ("path", "colour=red"):
        with pytest.raises(est.EstimateError):
            est.parse_selector(bad)
    with pytest.raises(est.EstimateError, match="MODEL=MS"):
        est.parse_compute(["llama-3.1-8b"])
    with pytest.raises(est.EstimateError, match="unknown model"):
        est.parse_compute(["gpt=3"])


# --------------------------------------------------------------------------
# whole estimate on synthetic curves
# --------------------------------------------------------------------------

def test_fraction_saved_on_synthetic_curves(synth, tmp_path, capsys):
    out_json = tmp_path / "est.json"
    rc, out, err = run([synth, "--baseline", "backend=nccl", "--no-png", "--json", str(out_json),
                        "--batches", "1,8", *COMPUTE], capsys)
    assert rc == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 6 and not any(r["extrapolated"] for r in rows)
    compute = {"llama-3.1-8b": 3.0, "llama-3.1-70b": 20.0, "qwen3-30b-a3b": 4.0}
    for r in rows:
        (c,) = r["comms"]
        assert c["resident_us"] == pytest.approx(res_us(c["size_bytes"]), rel=1e-9)
        assert c["baseline_us"] == pytest.approx(base_us(c["size_bytes"]), rel=1e-9)
        n, cms = c["count"], compute[r["model"]]
        assert r["compute_ms"] == cms and r["compute_source"] == "given"
        lb, lr = n * c["baseline_us"] / 1e3, n * c["resident_us"] / 1e3
        assert r["step_baseline_ms"] == pytest.approx(cms + lb)
        assert r["step_resident_ms"] == pytest.approx(cms + lr)
        assert r["saved_fraction"] == pytest.approx((lb - lr) / (cms + lb), rel=1e-12)
    r8 = next(r for r in rows if r["model"] == "llama-3.1-8b" and r["batch"] == 8)
    assert r8["comms"][0]["size_bytes"] == 65536 and r8["comms"][0]["count"] == 64
    assert "llama-3.1-8b" in out and "TP2" in out and "EP2" in out and "saved" in out


def test_baseline_from_file_constant_and_ambiguity(synth, tmp_path, capsys):
    # a plain curve file as the baseline
    curve = tmp_path / "nccl_net.json"
    curve.write_text(json.dumps({"name": "nccl-net", "points": [[s, base_us(s)] for s in SIZES]}))
    j1, j2 = tmp_path / "a.json", tmp_path / "b.json"
    rc, _, err = run([synth, "--resident", "backend=resident", "--baseline", str(curve),
                      "--no-png", "--json", str(j1), *COMPUTE], capsys)
    assert rc == 0, err
    rc, _, err = run([synth, "--resident", "backend=resident", "--baseline", "backend=nccl",
                      "--no-png", "--json", str(j2), *COMPUTE], capsys)
    assert rc == 0, err
    a, b = (json.loads(p.read_text())["rows"] for p in (j1, j2))
    assert [r["saved_fraction"] for r in a] == pytest.approx([r["saved_fraction"] for r in b])
    # a constant
    rc, out, err = run([synth, "--baseline-us", "25", "--no-png", "--batches", "1", *COMPUTE],
                       capsys)
    assert rc == 0 and "constant 25 us" in out, err
    # ambiguity is an error that names the candidates
    rc, _, err = run([synth, "--resident", "mode=graph", "--baseline-us", "25", "--no-png"], capsys)
    assert rc == 2 and "2 all_reduce curves" in err and "nccl" in err and "narrow" in err.lower()
    rc, _, err = run([synth, "--no-png"], capsys)
    assert rc == 2 and "no baseline" in err
    rc, _, err = run([synth, "--baseline", "backend=gloo", "--no-png"], capsys)
    assert rc == 2 and "no all_reduce rows" in err


def test_world_sizes_and_extrapolation_warning(tmp_path, capsys):
    f = write_bench(tmp_path / "ws.json", [("resident", "resident", "", res_us),
                                           ("gloo", "gloo", "", base_us)], world_sizes=(2, 4))
    out_json = tmp_path / "o.json"
    rc, out, err = run([f, "--baseline", "backend=gloo", "--no-png", "--json", str(out_json),
                        *COMPUTE], capsys)
    assert rc == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted({r["world_size"] for r in rows}) == [2, 4] and len(rows) == 18
    # qwen batch 64: 64*8*2048*2 = 2 MiB > 1 MiB measured: extrapolated, warned, starred
    ext = [r for r in rows if r["extrapolated"]]
    assert ext and all(r["model"] == "qwen3-30b-a3b" and r["batch"] == 64 for r in ext)
    assert "extrapolated" in err and "above the measured range" in err and "*" in out
    assert est.main([f, "--baseline", "backend=gloo", "--no-png", "--world-size", "4",
                     "--json", str(out_json), *COMPUTE]) == 0
    assert {r["world_size"] for r in json.loads(out_json.read_text())["rows"]} == {4}
    capsys.readouterr()
    rc, _, err = run([f, "--baseline", "backend=gloo", "--no-png", "--strict", *COMPUTE], capsys)
    assert rc == 2 and "--strict" in err


# --------------------------------------------------------------------------
# the real benchmark data
# --------------------------------------------------------------------------

def _measured(file, op, size, **sel):
    opener = gzip.open if file.endswith(".gz") else open
    with opener(file, "rt") as f:
        doc = json.load(f)
    (r,) = [r for r in doc["results"] if r["op"] == op and r["size_bytes"] == size
            and all(r.get(k) == v for k, v in sel.items())]
    return r["median_us"]


def test_real_h200_json(tmp_path, capsys):
    out_json = tmp_path / "h200.json"
    rc, out, err = run([H200, "--resident", "path=direct,mode=graph", "--baseline",
                        "path=proxy,mode=graph", "--no-png", "--json", str(out_json)], capsys)
    assert rc == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert len(rows) == 9 and all(r["world_size"] == 2 for r in rows)
    assert all(math.isfinite(r["saved_fraction"]) and r["compute_source"] == "assumed"
               for r in rows)
    # 8B batch 8: 64 KiB, a measured size: the curve value is the measurement itself
    r = next(r for r in rows if r["model"] == "llama-3.1-8b" and r["batch"] == 8)
    c = r["comms"][0]
    assert c["size_bytes"] == 65536
    assert c["resident_us"] == pytest.approx(_measured(H200, "all_reduce", 65536, mode="graph",
                                                       path="direct"))
    assert c["baseline_us"] == pytest.approx(_measured(H200, "all_reduce", 65536, mode="graph",
                                                       path="proxy"))
    assert "compute 'assumed'" in out
    # the measured range ends at 1 MiB: Qwen batch 64 (2 MiB) is extrapolated and says so
    assert "extrapolated" in err
    # without narrowing, the JSON's four resident curves are listed, nothing is picked
    rc, _, err = run([H200, "--baseline-us", "25", "--no-png"], capsys)
    assert rc == 2 and "4 all_reduce curves" in err


def test_gzipped_2_4_8_rank_json_against_a_curve_file(tmp_path, capsys):
    """The committed 2/4/8-rank H200 ladder (gzipped JSON) against the two-point NCCL curve
    of the measurement study: every world size estimated, the measured sizes read exactly."""
    out_json = tmp_path / "h200_248.json"
    rc, out, err = run([H200_248, "--resident", "path=proxy,mode=graph", "--baseline", NCCL_A40,
                        "--no-png", "--json", str(out_json)], capsys)
    assert rc == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted({r["world_size"] for r in rows}) == [2, 4, 8] and len(rows) == 27
    r = next(r for r in rows if r["world_size"] == 2 and r["model"] == "llama-3.1-8b"
             and r["batch"] == 8)
    c = r["comms"][0]
    assert c["size_bytes"] == 65536 and c["baseline_us"] == pytest.approx(37.0)
    assert c["resident_us"] == pytest.approx(_measured(H200_248, "all_reduce", 65536,
                                                       mode="graph", path="proxy", world_size=2))


def test_real_cpu_json_without_mode_fields(tmp_path, capsys):
    out_json = tmp_path / "cpu.json"
    rc, out, err = run([CPU16, "--baseline", "backend=gloo", "--no-png", "--json",
                        str(out_json), "--models", "llama-3.1-8b"], capsys)
    assert rc == 0, err
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted({r["world_size"] for r in rows}) == [2, 4, 8]
    r = next(r for r in rows if r["world_size"] == 2 and r["batch"] == 8)
    assert r["comms"][0]["resident_us"] == pytest.approx(
        _measured(CPU16, "all_reduce", 65536, backend="resident", world_size=2))
    assert r["saved_fraction"] > 0  # gloo is far slower on every size


def test_png_written_or_skipped(synth, tmp_path, capsys, monkeypatch):
    png = tmp_path / "chart.png"
    args = [synth, "--baseline", "backend=nccl", "--png", str(png), *COMPUTE]
    import importlib.util
    have = importlib.util.find_spec("matplotlib") is not None
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    if have:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in out
    else:
        assert not png.exists() and "matplotlib is not installed" in err
    png2 = tmp_path / "none.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = run([synth, "--baseline", "backend=nccl", "--png", str(png2), *COMPUTE], capsys)
    assert rc == 0 and not png2.exists() and "matplotlib is not installed" in err


def test_cli_help_states_assumptions():
    p = subprocess.run([sys.executable, "-m", "resident_pg.estimate", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stderr
    for word in ("ASSUMPTION", "--compute-ms", "extrapolat", "log-log", "all_to_all"):
        assert word in p.stdout, word


# --------------------------------------------------------------------------
# the chart
# --------------------------------------------------------------------------

def test_chart_is_written_or_skipped_with_a_message(synth, tmp_path, capsys):
    """With matplotlib the PNG is written (a real PNG file); without it the run still succeeds
    and says why there is no chart."""
    import importlib.util

    png = tmp_path / "chart.png"
    rc, out, err = run([synth, "--baseline", "backend=nccl", "--png", str(png), "--batches", "1",
                        *COMPUTE], capsys)
    assert rc == 0, err
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists()
        assert "matplotlib is not installed: skipping the chart" in err
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
