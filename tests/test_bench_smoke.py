"""Smoke test of resident_pg.bench: tiny run, checks the output and the JSON schema.

Never asserts on timings.  The gloo run always happens; the resident run only
when `import resident_pg` registers the backend (and it only checks that the
bench reports resident's results or its error in the expected shape).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_CMD = [sys.executable, "-m", "resident_pg.bench"]


OPS = ["all_reduce", "all_to_all_single", "all_gather_into_tensor",
       "reduce_scatter_tensor", "send_recv"]
SIZES = [8, 4096]


def _run_bench(tmp_path, backends, extra=()):
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [*BENCH_CMD, "--backends", backends, "--world-sizes", "2", "--sizes", "8,4K",
           "--ops", "all", "--reps", "3", "--min-reps", "2", "--warmup", "2",
           "--iters", "0.05", "--timeout", "60", "--max-restarts", "0",
           "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        doc = json.load(f)
    return proc, doc


def _check_schema(doc, labels):
    assert doc["schema"] == "resident_pg.bench/1"
    meta = doc["metadata"]
    for key in ("hostname", "cpu_count", "torch_version", "date", "git", "command_line", "env"):
        assert key in meta, key
    assert isinstance(meta["cpu_count"], int)
    assert isinstance(meta["command_line"], list)
    assert all(k.startswith("RESIDENT_") for k in meta["env"])
    assert "commit" in meta["git"]

    cfg = doc["config"]
    assert cfg["labels"] == labels
    assert cfg["world_sizes"] == [2]
    assert cfg["sizes"] == SIZES
    assert cfg["ops"] == OPS
    assert cfg["device"] == "cpu"

    rows = doc["results"]
    # one row per (world size, backend, op, size), in or out of error
    assert len(rows) == len(labels) * len(OPS) * len(SIZES)
    keys = {(r["world_size"], r["label"], r["op"], r["size_bytes"]) for r in rows}
    assert keys == {(2, lb, op, s) for lb in labels for op in OPS for s in SIZES}
    for r in rows:
        if "error" in r:
            assert isinstance(r["error"], str) and r["error"]
            continue
        for k in ("median_us", "p10_us", "p90_us"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["p10_us"] <= r["p90_us"]
        assert r["actual_bytes"] >= r["size_bytes"] or r["op"] == "all_gather_into_tensor"
        assert r["batch"] >= 1 and r["reps"] >= 1
        assert r["check"] in ("ok", "skipped") or r["check"].startswith("FAILED"), r
        expected_ranks = {"0", "1"}
        assert set(r["ranks"]) == expected_ranks
        for pr in r["ranks"].values():
            assert len(pr["samples_us"]) == r["reps"]
            assert pr["p10_us"] <= pr["median_us"] <= pr["p90_us"]
        assert r["median_us"] == max(pr["median_us"] for pr in r["ranks"].values())

    assert isinstance(doc["groups"], list) and len(doc["groups"]) == len(labels)
    assert isinstance(doc["errors"], list)
    assert "line" in doc["target"]


def test_helpers():
    from resident_pg.bench import common as bench
    assert bench.parse_sizes("8,64,512,4K,16KiB,1M") == [8, 64, 512, 4096, 16384, 1 << 20]
    assert bench.fmt_size(8) == "8 B" and bench.fmt_size(4096) == "4 KiB"
    assert bench.fmt_size(1 << 20) == "1 MiB"
    assert bench.parse_ops("allreduce,send_recv") == ["all_reduce", "send_recv"]
    assert bench.parse_ops("all") == OPS
    assert bench.backend_labels(["gloo", "gloo", "resident"]) == ["gloo", "gloo#2", "resident"]
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        bench.parse_size("3")  # less than one float32
    with pytest.raises(ValueError):
        bench.parse_ops("bogus")


def test_bench_smoke_gloo(tmp_path):
    # gloo twice: two groups, exercises the ratio columns without resident
    proc, doc = _run_bench(tmp_path, "gloo,gloo")
    _check_schema(doc, ["gloo", "gloo#2"])
    assert all("median_us" in r for r in doc["results"]), doc["errors"]
    assert all(r["check"] == "ok" for r in doc["results"])
    assert doc["errors"] == []
    assert "== world size 2" in proc.stdout
    assert "gloo#2/gloo" in proc.stdout
    assert "TARGET" in proc.stdout


def _resident_registered():
    code = ("import resident_pg, torch.distributed as d; "
            "import sys; sys.exit(0 if 'resident' in d.Backend.backend_list else 1)")
    try:
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              timeout=120).returncode == 0
    except Exception:
        return False


def test_bench_smoke_resident(tmp_path):
    if not _resident_registered():
        pytest.skip("resident backend not importable/registered (pip install -e . first)")
    proc, doc = _run_bench(tmp_path, "resident,gloo")
    _check_schema(doc, ["resident", "gloo"])
    # gloo must still have run whatever happened to resident
    assert all("median_us" in r for r in doc["results"] if r["label"] == "gloo")
    assert "TARGET 2 ranks, all_reduce 8 B" in proc.stdout


def test_cuda_tables_and_targets_from_the_h200_run(capsys):
    """The CUDA report path (resident_pg.bench.cuda's tables and targets, on the shared latency cells) on the
    committed 2/4/8-rank H200 ladder and its floors: the printed medians and ratios are those of
    the JSON, and the 8 B all_reduce target is reported as missed (3.98 us = 1.64x)."""
    import gzip

    import resident_pg.bench.cuda as bc
    data = os.path.join(REPO, "tests", "data")
    ladder = os.path.join(data, "bench_cuda_ws248_h200_2026-11-29.json.gz")
    with gzip.open(ladder, "rt") as f:
        doc = json.load(f)
    floors = bc.load_floors(os.path.join(data, "floors_h200_2026-11-29.json"))
    rows = [dict(r) for r in doc["results"]]
    bc.annotate_rows(rows, floors)
    variants = ["resident:path=direct", "resident:path=proxy"]
    bc.print_cuda_tables(rows, [2, 8], ["graph"], variants, ["all_reduce", "send_recv"],
                         [8, 65536], floors, spread=True)
    out = capsys.readouterr().out
    ar8 = next(line for line in out.splitlines()
               if line.startswith("all_reduce") and " 8 B " in line)
    assert "3.98" in ar8 and "6.48" in ar8 and "1.64x" in ar8 and "2.67x" in ar8, ar8
    assert "world size 8, mode graph" in out and "send_recv" in out
    results = bc.evaluate_targets(rows, floors, [8, 65536])
    first = results[0]
    assert first["verdict"] == "MISS" and "1.64x" in first["line"], first["line"]


def test_cuda_targets_judge_the_default_configuration_only():
    """An A/B run (RESIDENT_GPU_PROTOCOL=simple beside the default): the 64 KiB
    all_reduce target is judged on the default cells (12.67 us = 2.01x), not on the slower
    variant's (16.83 us = 2.66x), which the tables still show."""
    import gzip

    import resident_pg.bench.cuda as bc
    data = os.path.join(REPO, "tests", "data")
    with gzip.open(os.path.join(data, "bench_protocol_ab_h200_2026-11-30.json.gz"), "rt") as f:
        doc = json.load(f)
    floors = bc.load_floors(os.path.join(data, "floors_h200_2026-11-30.json"))
    rows = [dict(r) for r in doc["results"]]
    bc.annotate_rows(rows, floors)
    assert any(r.get("env_options") for r in rows) and any(not r.get("env_options") for r in rows)
    line = bc.evaluate_targets(rows, floors, [4096, 32768, 49152, 65536])[1]["line"]
    assert "all_reduce 64 KiB" in line and "12.67 µs = 2.01x" in line, line
    assert "2.66x" not in line, line
    assert not bc.default_configuration({"backend": "resident", "pg_options": {"path": "direct"},
                                         "env_options": {"RESIDENT_GPU_PROTOCOL": "simple"}})
    assert bc.default_configuration({"backend": "resident", "pg_options": {"path": "proxy"},
                                     "env_options": {}})


def test_cross_process_floor_is_the_lowest_flag_kind():
    """A floors JSON with the cross-process flag measured two ways (acquire/release
    2.149 us, LL line 2.003 us): the 8 B floor is the lower, and a file with only the
    acquire/release row still gives that row."""
    import resident_pg.bench.cuda as bc
    data = os.path.join(REPO, "tests", "data")
    floors = bc.load_floors(os.path.join(data, "floors_llflag_h200_2026-11-30.json"))
    assert abs(floors["cross_process_flag_us"] - 2.0032) < 1e-9
    assert bc.floor_for(floors, 8) == (floors["cross_process_flag_us"], bc.XP_FLOOR)
    older = bc.load_floors(os.path.join(data, "floors_h200_2026-11-30.json"))
    rows = [r for r in older["contents"]["results"] if r["name"] == bc.XP_FLOOR]
    assert len(rows) == 1 and older["cross_process_flag_us"] == float(rows[0]["median_us"])


def test_mps_warning_when_ranks_share_a_gpu_without_the_daemon(tmp_path):
    """Ranks outnumbering the GPUs with no MPS control pipe: a warning naming the pipe; none
    with a GPU per rank, with the pipe present, or when the GPUs cannot be counted."""
    from resident_pg.bench.ladder import mps_warning
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    (gpus / "0000:19:00.0").mkdir()
    pipe = tmp_path / "mps"
    pipe.mkdir()
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    w = mps_warning(2, env, str(gpus))
    assert w is not None and str(pipe) in w and "2 ranks on 1 GPU" in w
    assert mps_warning(1, env, str(gpus)) is None
    (pipe / "control").write_text("")
    assert mps_warning(2, env, str(gpus)) is None
    assert mps_warning(2, {"CUDA_VISIBLE_DEVICES": "0,1"}, str(gpus)) is None
    two = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_MPS_PIPE_DIRECTORY": str(gpus)}
    assert "4 ranks on 2 GPU(s)" in mps_warning(4, two, str(gpus))
    assert mps_warning(8, {}, str(tmp_path / "no_driver")) is None


def test_cuda_target_verdicts_incomplete_vs_miss():
    """A target whose measured cells are all within the limit but which lacks cells (an op not
    in the run, or a path not run) is INCOMPLETE, not MISS; one cell over the limit is a MISS
    whatever else is missing. Synthetic cells on a synthetic floor (2 us flat)."""
    import resident_pg.bench.cuda as bc
    floors = {"cross_process_flag_us": 2.0, "data_floor_sm_us": {"8": 2.0, "65536": 2.0}}

    def cell(op, path, us, size=8):
        return {"world_size": 2, "mode": "graph", "path": path, "op": op, "size_bytes": size,
                "median_us": us, "check": "ok", "backend": "resident"}

    def verdict(rows, index):
        return bc.evaluate_targets(rows, floors, [8])[index]

    # all_to_all only (the decode target also names the gathers and send/recv), both paths fine
    rows = [cell("all_to_all_single", "direct", 3.0), cell("all_to_all_single", "proxy", 3.5)]
    r = verdict(rows, 2)
    assert r["verdict"] == "INCOMPLETE", r["line"]
    assert r["paths_result"]["direct"]["verdict"] == "INCOMPLETE"
    # one path within, the other not run
    r = verdict([cell("all_reduce", "direct", 2.9)], 0)
    assert r["verdict"] == "INCOMPLETE" and "proxy: N/A" in r["line"], r["line"]
    # both paths within
    r = verdict([cell("all_reduce", "direct", 2.9), cell("all_reduce", "proxy", 2.95)], 0)
    assert r["verdict"] == "PASS", r["line"]
    # one cell over the limit: MISS, also with cells missing
    rows.append(cell("send_recv", "direct", 4.5))
    r = verdict(rows, 2)
    assert r["verdict"] == "MISS" and r["paths_result"]["direct"]["verdict"] == "MISS", r["line"]
    assert r["paths_result"]["proxy"]["verdict"] == "INCOMPLETE"


def test_worktree_tree_names_the_content_that_ran(tmp_path):
    """The bench records the git tree of the files as they are, so that a run from a copy whose
    HEAD is an older base (the GPU machine's) still names its content. Reference: the tree of a
    commit of the same files, made independently; the checkout's own index is left alone."""
    from resident_pg.bench import report as bench_report
    repo = str(tmp_path / "repo")
    os.makedirs(os.path.join(repo, "sub"))

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    with open(os.path.join(repo, "a.txt"), "w") as f:
        f.write("one\n")
    with open(os.path.join(repo, ".gitignore"), "w") as f:
        f.write("*.log\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    assert bench_report._worktree_tree(repo) == git("rev-parse", "HEAD^{tree}")
    # Changed, untracked and ignored files: the tree is that of a commit of the first two.
    with open(os.path.join(repo, "a.txt"), "w") as f:
        f.write("two\n")
    with open(os.path.join(repo, "sub", "new.py"), "w") as f:
        f.write("x = 1\n")
    with open(os.path.join(repo, "run.log"), "w") as f:
        f.write("ignored\n")
    tree = bench_report._worktree_tree(repo)
    assert tree != git("rev-parse", "HEAD^{tree}")
    assert not git("diff", "--cached", "--name-only")  # the checkout's index: nothing staged
    git("add", "-A")
    git("commit", "-qm", "changes")
    assert tree == git("rev-parse", "HEAD^{tree}")


def _torchrun_bench(tmp_path, nproc, extra):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "resident_pg.bench", "--sizes", "8,4K", "--ops", "all",
           "--reps", "3", "--min-reps", "2", "--warmup", "2", "--iters", "0.05",
           "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return proc, out


def test_bench_under_torchrun(tmp_path):
    """Under a launcher the bench spawns nothing: the launcher's processes are the ranks, rank 0
    reports every rank's results (here torchrun on one host; between hosts in
    test_tcp_netns_torchrun.py)."""
    if not _resident_registered():
        pytest.skip("resident backend not importable/registered (pip install -e . first)")
    proc, out = _torchrun_bench(tmp_path, 2, ["--backends", "resident,gloo"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    _check_schema(doc, ["resident", "gloo"])
    assert all("median_us" in r and r["check"] == "ok" for r in doc["results"]), doc["errors"]
    assert doc["errors"] == []
    assert doc["metadata"]["launcher"]["hosts"] == 1
    assert set(doc["metadata"]["launcher"]["rank_hosts"]) == {"0", "1"}
    assert doc["groups"][0]["rank_info"]["1"]["transports"] == ["shm"]
    # one report, from rank 0
    assert proc.stdout.count("== world size 2") == 1, proc.stdout
    assert "ranks of a launcher (env://): 2 on 1 host(s)" in proc.stdout


def test_bench_under_torchrun_refuses_other_world_sizes(tmp_path):
    proc, out = _torchrun_bench(tmp_path, 2, ["--backends", "gloo", "--world-sizes", "2,4"])
    assert proc.returncode != 0
    assert "under a launcher the world size is the launcher's (2 processes" in proc.stderr
    assert not out.exists()
