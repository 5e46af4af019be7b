"""The bench's floors of the tcp path (resident_pg.bench.cuda): loading the tcp floors beside the
GPU floors, the floor each row is held to, the tcp targets' verdicts and the tables' ratios.

Synthetic floors files in the shape that benchmarks/floors/build/floors and build/tcp_floor write
(random medians); every expected floor and ratio is computed here from the raw rows, not through
the code under test. CPU only. The last test runs the CPU bench over tcp end to end."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

import resident_pg.bench.cuda as bc
from test_bench_smoke import _resident_registered

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TCP_SIZES = [8, 1024, 8192, 65536, 262144]
DATA_SIZES = [8, 1024, 4096, 8192, 16384, 65536, 262144, 1048576]


def _row(name, variant, nbytes, median, ok=True, **extra):
    return {"name": name, "variant": variant, "bytes": nbytes, "median_us": median,
            "p10_us": median * 0.9, "p90_us": median * 1.2, "samples": 1000,
            "unit": "us", "ok": ok, "note": "", **extra}


def _gpu_doc(rng):
    res = [_row("gpu_cpu_gpu_flag", "", 8, rng.uniform(1, 2)),
           _row("cross_process_flag", "", 8, rng.uniform(2, 3)),
           _row("cross_process_flag", "ll", 8, rng.uniform(1.5, 2.5))]
    for n in DATA_SIZES:
        res.append(_row("data_floor_sm", "sm_kernels", n, 3 + n / 10000 + rng.uniform(0, 0.5)))
        res.append(_row("data_floor_sm", "copy_engine", n, 8 + n / 8000))
    return {"device": "NVIDIA H200", "cc": "9.0", "iters": 1000, "results": res}


def _tcp_doc(rng, netns=True):
    res = []
    for name in ["tcp_loopback"] + (["tcp_netns"] if netns else []):
        for variant in ("spin_recv", "epoll_recv"):
            for n in TCP_SIZES:
                res.append(_row(name, variant, n, 3 + n / 5000 + rng.uniform(0, 3)))
    # a failed row faster than any other must not become the floor
    res.append(_row("tcp_loopback", "spin_recv", 8, 0.01, ok=False, note="client=mismatch"))
    if not netns:
        res.append({"name": "tcp_netns", "variant": "", "bytes": 0, "median_us": None,
                    "ok": False, "skipped": True, "note": "not run: network namespaces need root"})
    return {"program": "tcp_floor", "cpus": 2, "iters": 1000, "results": res}


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def _fastest(doc, name, n):
    return min(r["median_us"] for r in doc["results"]
               if r["name"] == name and r["bytes"] == n and r["ok"])


def _log_interp(points, n):
    """Reference: linear in log2(size) between the measured sizes around n, else the nearest."""
    pts = sorted(points.items())
    if n <= pts[0][0]:
        return pts[0][1]
    if n >= pts[-1][0]:
        return pts[-1][1]
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if s0 <= n <= s1:
            w = (math.log2(n) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return v0 + w * (v1 - v0)
    raise AssertionError("unreachable")


@pytest.fixture
def docs(tmp_path):
    rng = random.Random(32)
    gpu, tcp = _gpu_doc(rng), _tcp_doc(rng)
    return {"gpu": gpu, "tcp": tcp, "gpu_path": _write(tmp_path, "floors.json", gpu),
            "tcp_path": _write(tmp_path, "tcp_floors.json", tcp)}


def _refs(docs):
    """Independent references: the GPU floor and the tcp floor per size."""
    gpu, tcp = docs["gpu"], docs["tcp"]
    xp = min(r["median_us"] for r in gpu["results"] if r["name"] == "cross_process_flag")
    data = {r["bytes"]: r["median_us"] for r in gpu["results"]
            if r["name"] == "data_floor_sm" and r["variant"] == "sm_kernels"}
    tcp_pts = {n: _fastest(tcp, "tcp_loopback", n) for n in TCP_SIZES}

    def gpu_floor(n):
        return xp if n <= 8 else _log_interp(data, n)

    def tcp_floor(n):
        return _log_interp(tcp_pts, n)
    return gpu_floor, tcp_floor


def test_tcp_floor_is_the_faster_receive_method_of_passing_loopback_rows(docs):
    f = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    for n in TCP_SIZES:
        want = _fastest(docs["tcp"], "tcp_loopback", n)
        assert f["tcp_one_way_us"][str(n)] == pytest.approx(want)
        variant = next(r["variant"] for r in docs["tcp"]["results"]
                       if r["name"] == "tcp_loopback" and r["bytes"] == n and r["ok"]
                       and r["median_us"] == want)
        assert f["tcp_one_way_variant"][str(n)] == variant
        assert f["tcp_netns_one_way_us"][str(n)] == pytest.approx(
            _fastest(docs["tcp"], "tcp_netns", n))
    # the GPU floors of the pooled files are those of the GPU file alone
    alone = bc.load_floors(docs["gpu_path"])
    assert f["cross_process_flag_us"] == alone["cross_process_flag_us"]
    assert f["data_floor_sm_us"] == alone["data_floor_sm_us"]
    assert not alone["tcp_one_way_us"]
    # the merged contents (what a bench JSON embeds) give the same floors again
    again = bc.floors_from_doc(json.loads(json.dumps(f["contents"])), "embedded")
    assert again["tcp_one_way_us"] == f["tcp_one_way_us"]
    assert again["cross_process_flag_us"] == f["cross_process_flag_us"]
    assert [m["path"] for m in f["contents"]["merged_from"]] == [
        os.path.abspath(docs["gpu_path"]), os.path.abspath(docs["tcp_path"])]


def test_floor_for_each_kind_against_a_reference(docs):
    f = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    gpu_floor, tcp_floor = _refs(docs)
    rng = random.Random(5)
    sizes = [4, 8, 1024, 65536, 262144, 1 << 21] + [rng.randrange(9, 1 << 19) for _ in range(20)]
    for n in sizes:
        g, g_name = bc.floor_for(f, n, "gpu")
        t, t_name = bc.floor_for(f, n, "tcp")
        gt, gt_name = bc.floor_for(f, n, "gpu+tcp")
        assert g == pytest.approx(gpu_floor(n)), n
        assert t == pytest.approx(tcp_floor(n)), n
        assert gt == pytest.approx(gpu_floor(n) + tcp_floor(n)), n
        assert gt_name == f"{g_name} + {t_name}" and "tcp_loopback" in t_name
    assert bc.floor_for(f, 8) == (f["cross_process_flag_us"], bc.XP_FLOOR)
    with pytest.raises(ValueError, match="unknown floor kind"):
        bc.floor_for(f, 8, "tcp_gpu")


def test_floors_with_one_half_missing(tmp_path, docs):
    tcp_only = bc.load_floors(docs["tcp_path"])
    assert tcp_only["cross_process_flag_us"] is None and not tcp_only["data_floor_sm_us"]
    assert bc.floor_for(tcp_only, 8, "gpu") is None
    assert bc.floor_for(tcp_only, 8, "gpu+tcp") is None
    assert bc.floor_for(tcp_only, 8, "tcp")[0] == pytest.approx(
        _fastest(docs["tcp"], "tcp_loopback", 8))
    gpu_only = bc.load_floors(docs["gpu_path"])
    assert bc.floor_for(gpu_only, 8, "tcp") is None
    # a tcp file whose namespaces could not be made: loopback still gives the floor
    no_ns = bc.load_floors(_write(tmp_path, "t.json", _tcp_doc(random.Random(1), netns=False)))
    assert no_ns["tcp_one_way_us"] and not no_ns["tcp_netns_one_way_us"]
    # nothing usable, or half of the GPU floors: a clear error naming the file
    failed = {"results": [_row("tcp_loopback", "spin_recv", 8, 3.0, ok=False)]}
    with pytest.raises(ValueError, match="no passing"):
        bc.load_floors(_write(tmp_path, "bad.json", failed))
    half = {"results": [_row("cross_process_flag", "", 8, 2.0)]}
    with pytest.raises(ValueError, match="data_floor_sm"):
        bc.load_floors([_write(tmp_path, "half.json", half), docs["tcp_path"]])
    with pytest.raises(ValueError, match="no 'results' list"):
        bc.load_floors([docs["tcp_path"], _write(tmp_path, "x.json", {"rows": []})])


def _cell(op, us, size=8, transport=None, device="cuda", path="proxy", mode="graph", **extra):
    r = {"world_size": 2, "mode": mode, "path": path, "op": op, "size_bytes": size,
         "median_us": us, "check": "ok", "backend": "resident", "device": device,
         "variant": extra.pop("variant", f"{path}/{transport}"), "pg_options": {"path": path}}
    if transport is not None:
        r["transport"] = transport
    r.update(extra)
    return r


def test_row_floor_kind_and_annotation(docs):
    f = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    gpu_floor, tcp_floor = _refs(docs)
    rows = [_cell("all_reduce", 20.0, 65536, "tcp"),
            _cell("all_reduce", 30.0, 8, "tcp", device="cpu", mode="eager"),
            _cell("all_reduce", 9.0, 65536, "shm"),
            _cell("all_reduce", 5.0, 8),                        # older rows: no transport
            _cell("all_reduce", 4.0, 8, "shm", device="cpu"),   # cpu over shm: no floor
            _cell("all_reduce", 4.0, 8, "ib")]                  # ib: no floor of its own
    assert [bc.row_floor_kind(r) for r in rows] == ["gpu+tcp", "tcp", "gpu", "gpu", None, None]
    bc.annotate_rows(rows, f)
    assert rows[0]["floor_us"] == pytest.approx(gpu_floor(65536) + tcp_floor(65536))
    assert rows[0]["floor_ratio"] == pytest.approx(20.0 / (gpu_floor(65536) + tcp_floor(65536)))
    assert rows[1]["floor_us"] == pytest.approx(tcp_floor(8)) and rows[1]["floor_kind"] == "tcp"
    assert rows[2]["floor_us"] == pytest.approx(gpu_floor(65536))
    assert rows[3]["floor_us"] == pytest.approx(gpu_floor(8))
    assert all("floor_us" not in r for r in rows[4:])
    # GPU floors only: the tcp rows get none rather than the wrong one
    rows = [_cell("all_reduce", 20.0, 65536, "tcp")]
    bc.annotate_rows(rows, bc.load_floors(docs["gpu_path"]))
    assert "floor_us" not in rows[0]


def test_default_configuration_admits_the_transport():
    assert bc.default_configuration({"backend": "resident", "pg_options": {"transport": "tcp"}})
    assert bc.default_configuration({"backend": "resident",
                                     "env_options": {"RESIDENT_TRANSPORT": "tcp"}})
    assert not bc.default_configuration({"backend": "resident", "pg_options": {"transport": "tcp"},
                                         "env_options": {"RESIDENT_GPU_PROTOCOL": "ll"}})
    assert not bc.default_configuration({"backend": "resident",
                                         "pg_options": {"transport": "tcp", "spin_us": "5"}})


def _by_name(results):
    return {r["name"]: r for r in results}


def test_tcp_targets_hold_tcp_rows_to_the_composed_floor(docs):
    f = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    gpu_floor, tcp_floor = _refs(docs)

    def comp(n):
        return gpu_floor(n) + tcp_floor(n)
    sizes = [8, 1024, 65536]
    rows = [_cell("all_reduce", 1.4 * comp(8), 8, "tcp"),
            _cell("all_reduce", 1.6 * comp(65536), 65536, "tcp")]
    rows += [_cell(op, 1.9 * comp(n), n, "tcp") for op in bc.DECODE_OPS for n in sizes]
    # shm rows of the same run: held to the GPU floor, and never to a tcp target
    rows += [_cell("all_reduce", 1.2 * gpu_floor(8), 8, "shm", path=p) for p in ("direct", "proxy")]
    res = bc.evaluate_targets(rows, f, sizes)
    assert [r["name"] for r in res] == [t["name"] for t in bc.CUDA_TARGETS + bc.TCP_TARGETS
                                        if t["device"] == "cuda"]
    by = _by_name(res)
    ar8, ar64, decode = (by["all_reduce 8 B over tcp"], by["all_reduce 64 KiB over tcp"],
                         by["all_to_all_single, all_gather, reduce_scatter, send/recv <= 64 KiB "
                            "over tcp"])
    assert ar8["verdict"] == "PASS" and "1.40x" in ar8["line"], ar8["line"]
    assert "tcp_loopback 8 B" in ar8["line"] and "cross_process_flag" in ar8["line"]
    assert ar64["verdict"] == "MISS" and "1.60x" in ar64["line"], ar64["line"]
    assert decode["verdict"] == "PASS", decode["line"]
    assert decode["paths_result"]["proxy"]["worst_ratio"] == pytest.approx(1.9)
    # the shm 8 B target sees only the shm cells (1.2x), not the tcp cell (far over the GPU floor)
    shm8 = by["all_reduce 8 B"]
    assert shm8["verdict"] == "PASS" and "1.20x" in shm8["line"], shm8["line"]
    assert by["all_reduce 64 KiB"]["verdict"] == "N/A"
    # one decode cell over 2x: MISS
    rows.append(_cell("send_recv", 2.1 * comp(1024), 1024, "tcp", variant="again"))
    rows = [r for r in rows if not (r["op"] == "send_recv" and r["size_bytes"] == 1024
                                    and r["variant"] != "again")]
    decode = _by_name(bc.evaluate_targets(rows, f, sizes))[decode["name"]]
    assert decode["verdict"] == "MISS" and "1/" in decode["line"], decode["line"]


def test_tcp_targets_need_their_floors_and_their_cells(docs):
    rows = [_cell("all_reduce", 10.0, 8, "tcp")]
    by = _by_name(bc.evaluate_targets(rows, bc.load_floors(docs["gpu_path"]), [8]))
    assert by["all_reduce 8 B over tcp"]["verdict"] == "N/A"
    assert "lacks the gpu+tcp floor" in by["all_reduce 8 B over tcp"]["line"]
    by = _by_name(bc.evaluate_targets(rows, bc.load_floors(docs["tcp_path"]), [8]))
    assert "lacks the gpu+tcp floor" in by["all_reduce 8 B over tcp"]["line"]
    assert "lacks the gpu floor" in by["all_reduce 8 B"]["line"]
    both = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    by = _by_name(bc.evaluate_targets([_cell("all_reduce", 3.0, 8, "shm")], both, [8]))
    assert by["all_reduce 8 B over tcp"]["verdict"] == "N/A"   # no tcp cell in the run
    assert "proxy: N/A (not run)" in by["all_reduce 8 B over tcp"]["line"]


def test_cpu_tcp_target_limit_depends_on_the_host(docs):
    f = bc.load_floors(docs["tcp_path"])
    _, tcp_floor = _refs(docs)
    name = "CPU tensors, all_reduce 8 B over tcp"
    rows = [_cell("all_reduce", 2.2 * tcp_floor(8), 8, "tcp", device="cpu", mode="eager"),
            _cell("all_reduce", 0.1, 8, "shm", device="cpu", mode="eager")]
    small = bc.evaluate_targets(rows, f, [8], device="cpu", cpu_count=2)
    assert [r["name"] for r in small] == [name]
    assert small[0]["verdict"] == "PASS" and "<= 2.5x" in small[0]["line"], small[0]["line"]
    assert "2.20x" in small[0]["line"]
    # the same op over shm in the run, against the same floor: what the layers above take alone
    assert small[0]["shm_ratio"] == pytest.approx(0.1 / tcp_floor(8))
    assert f"over shm in this run: 0.10 µs = {0.1 / tcp_floor(8):.2f}x" in small[0]["line"], \
        small[0]["line"]
    big = bc.evaluate_targets(rows, f, [8], device="cpu", cpu_count=16)
    assert big[0]["verdict"] == "MISS" and "<= 2x" in big[0]["line"], big[0]["line"]
    # a CUDA tcp row is not a CPU cell
    cuda_only = [_cell("all_reduce", 1.0, 8, "tcp", mode="eager")]
    assert bc.evaluate_targets(cuda_only, f, [8], device="cpu")[0]["verdict"] == "N/A"


def test_tables_print_each_variant_against_its_floor(docs, capsys):
    f = bc.load_floors([docs["gpu_path"], docs["tcp_path"]])
    gpu_floor, tcp_floor = _refs(docs)
    shm_v, tcp_v = "resident:path=proxy", "resident:transport=tcp"
    rows = []
    for n, us_shm, us_tcp in [(8, 3.0, 13.0), (65536, 11.0, 57.0)]:
        rows.append(_cell("all_reduce", us_shm, n, "shm", variant=shm_v, actual_bytes=n))
        rows.append(_cell("all_reduce", us_tcp, n, "tcp", variant=tcp_v, actual_bytes=n))
    bc.annotate_rows(rows, f)
    bc.print_cuda_tables(rows, [2], ["graph"], [shm_v, tcp_v], ["all_reduce"], [8, 65536], f,
                         spread=False)
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("op "))
    assert "gpu+tcp floor µs" in head and " floor µs" in head, head
    for n, us_shm, us_tcp in [(8, 3.0, 13.0), (65536, 11.0, 57.0)]:
        line = next(ln for ln in out.splitlines() if ln.startswith("all_reduce")
                    and f" {bc._fmt_size(n)} " in ln)
        assert f"{us_shm / gpu_floor(n):.2f}x" in line, line
        assert f"{us_tcp / (gpu_floor(n) + tcp_floor(n)):.2f}x" in line, line
    assert "transport=tcp: gpu+tcp" in out and "proxy: gpu" in out, out
    # CPU over tcp: the table of the tcp variant against the tcp one-way floor
    cpu = [_cell("all_reduce", 7.0, 8, "tcp", device="cpu", mode="eager", variant="tcp",
                 actual_bytes=8),
           _cell("all_reduce", 400.0, 8, None, device="cpu", mode="eager", variant="gloo",
                 backend="gloo", actual_bytes=8)]
    bc.print_tcp_floor_table(cpu, [2], ["tcp", "gloo"], ["all_reduce"], [8], f)
    out = capsys.readouterr().out
    assert f"{7.0 / tcp_floor(8):.2f}x" in out and "gloo µs" not in out, out
    assert "tcp: tcp, gloo: none" in out


@pytest.mark.parametrize("rounds", [1, 2])
def test_cpu_bench_over_tcp_reports_ratio_and_target(tmp_path, rounds):
    """The CPU bench with resident:transport=tcp and a tcp floors file: the rows carry the
    transport the ranks report, the ratio to the floor, and the tcp target is printed. With
    several rounds the row combined over them keeps its transport (held to the tcp floor and
    judged by the tcp target, not taken for a row over shm)."""
    if not _resident_registered():
        pytest.skip("resident backend not importable/registered (build the extension first)")
    floors = _write(tmp_path, "tcp_floors.json", _tcp_doc(random.Random(3)))
    out = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "resident_pg.bench", "--backends", "resident:transport=tcp",
         "--world-sizes", "2", "--ops", "all_reduce", "--sizes", "8", "--quick", "--reps", "3",
         "--iters", "0.1", "--rounds", str(rounds), "--floors", floors, "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (row,) = doc["results"]
    assert row["transport"] == "tcp" and row["transport_configured"] == "tcp"
    assert row["rounds"] == rounds
    assert row["floor_kind"] == "tcp" and "median_us" in row
    want = _fastest(_tcp_doc(random.Random(3)), "tcp_loopback", 8)
    assert row["floor_us"] == pytest.approx(want)
    assert row["floor_ratio"] == pytest.approx(row["median_us"] / want)
    assert "TARGET cpu 2 ranks, eager, CPU tensors, all_reduce 8 B over tcp" in proc.stdout
    assert doc["target"]["tcp_targets"][0]["verdict"] in ("PASS", "MISS")
    assert "== cpu over tcp, world size 2" in proc.stdout
