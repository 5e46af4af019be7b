"""Process groups and API surface: subgroups alive at once, backend strings,
repeated init/destroy, torchrun launch, env:// and tcp:// rendezvous."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import dist_harness as H
from dist_harness import (
    compare_exact,
    compare_reduction,
    make_input,
    reference_reduce,
)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _fail_on_errors(per_rank):
    problems = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# several subgroups alive at once, interleaved with the world group
# --------------------------------------------------------------------------


def _subgroups_job(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    g01 = dist.new_group([0, 1])
    g23 = dist.new_group([2, 3])
    g02 = dist.new_group([0, 2])
    members = {"g01": (g01, [0, 1]), "g23": (g23, [2, 3]), "g02": (g02, [0, 2])}
    for name, (g, ranks) in members.items():
        if rank in ranks:
            if dist.get_rank(g) != ranks.index(rank):
                errs.append(f"{name}: get_rank={dist.get_rank(g)}, expected {ranks.index(rank)}")
            if dist.get_world_size(g) != 2:
                errs.append(f"{name}: get_world_size={dist.get_world_size(g)}, expected 2")

    def sub_inputs(key, ranks, n, dt, kind="normal"):
        return [make_input(key, r, n, dt, kind) for r in ranks]

    for it in range(3):
        k = f"grp/{it}"
        # world all_reduce
        inputs = [make_input(k + "/w", r, 1031, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                  "float32", f"it{it} world all_reduce")
        # g01 all_reduce MAX
        if rank in (0, 1):
            inp = sub_inputs(k + "/g01", [0, 1], 257, "int64")
            t = inp[rank].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g01)
            errs += compare_exact(t, reference_reduce(inp, "MAX", "int64"), f"it{it} g01 all_reduce MAX")
        # g23 all_gather_into_tensor
        if rank in (2, 3):
            inp = sub_inputs(k + "/g23", [2, 3], 99, "bfloat16")
            out = torch.empty(2 * 99, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(out, inp[rank - 2].clone(), group=g23)
            errs += compare_exact(out, torch.cat(inp), f"it{it} g23 all_gather_into_tensor")
        # g02 broadcast from global rank 2
        if rank in (0, 2):
            t = make_input(k + "/g02b", rank, 500, "float64")
            dist.broadcast(t, src=2, group=g02)
            errs += compare_exact(t, make_input(k + "/g02b", 2, 500, "float64"), f"it{it} g02 broadcast")
        # world all_gather
        inputs = [make_input(k + "/wag", r, 17, "int32") for r in range(ws)]
        out = torch.empty(ws * 17, dtype=torch.int32)
        dist.all_gather_into_tensor(out, inputs[rank].clone())
        errs += compare_exact(out, torch.cat(inputs), f"it{it} world all_gather")
        # g02 reduce_scatter SUM
        if rank in (0, 2):
            inp = sub_inputs(k + "/g02rs", [0, 2], 2 * 300, "float32")
            out = torch.empty(300, dtype=torch.float32)
            me = [0, 2].index(rank)
            dist.reduce_scatter_tensor(out, inp[me].clone(), group=g02)
            chunks = [x[me * 300:(me + 1) * 300] for x in inp]
            errs += compare_reduction(out, reference_reduce(chunks, "SUM", "float32"), chunks, "SUM",
                                      "float32", f"it{it} g02 reduce_scatter")
        # p2p inside g23 (dst/src are global ranks)
        if rank == 2:
            dist.send(make_input(k + "/p2p", 2, 64, "uint8"), dst=3, group=g23, tag=it)
        elif rank == 3:
            buf = torch.zeros(64, dtype=torch.uint8)
            dist.recv(buf, src=2, group=g23, tag=it)
            errs += compare_exact(buf, make_input(k + "/p2p", 2, 64, "uint8"), f"it{it} g23 send/recv")
        # async ops on different groups in flight together
        pending = []
        for name, (g, ranks) in members.items():
            if rank in ranks:
                inp = sub_inputs(f"{k}/async/{name}", ranks, 4099, "float32")
                t = inp[ranks.index(rank)].clone()
                pending.append((name, inp, t, dist.all_reduce(t, group=g, async_op=True)))
        inputs = [make_input(k + "/wasync", r, 4099, "int64") for r in range(ws)]
        tw = inputs[rank].clone()
        ww = dist.all_reduce(tw, op=dist.ReduceOp.BXOR, async_op=True)
        for name, inp, t, w in pending:
            w.wait()
            errs += compare_reduction(t, reference_reduce(inp, "SUM", "float32"), inp, "SUM", "float32",
                                      f"it{it} async {name}")
        ww.wait()
        errs += compare_exact(tw, reference_reduce(inputs, "BXOR", "int64"), f"it{it} async world")
    dist.barrier()
    return errs


def test_subgroups_alive_at_once_interleaved():
    _fail_on_errors(H.run_ranks(_subgroups_job, 4, timeout_s=120))


# --------------------------------------------------------------------------
# backend strings
# --------------------------------------------------------------------------


def _backend_string_job(rank, ws, expect_cpu_backend):
    import torch
    import torch.distributed as dist

    errs = []
    if H.IS_RESIDENT:
        if "resident" not in dist.Backend.backend_list:
            errs.append(f"'resident' not in dist.Backend.backend_list: {dist.Backend.backend_list}")
    cls = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    expected_cls = {"resident": "ProcessGroupResident", "gloo": "ProcessGroupGloo"}[expect_cpu_backend]
    if cls != expected_cls:
        errs.append(f"the CPU backend of the world group is {cls}, expected {expected_cls}")
    cfg = str(dist.get_backend_config())
    if f"cpu:{expect_cpu_backend}" not in cfg:
        errs.append(f"get_backend_config() = {cfg!r}; expected cpu:{expect_cpu_backend}")
    inputs = [make_input("bs/ar", r, 4099, "float32") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM", "float32",
                              "all_reduce")
    inputs = [make_input("bs/ag", r, 33, "int64") for r in range(ws)]
    out = torch.empty(ws * 33, dtype=torch.int64)
    dist.all_gather_into_tensor(out, inputs[rank].clone())
    errs += compare_exact(out, torch.cat(inputs), "all_gather_into_tensor")
    dist.barrier()
    return errs


@pytest.mark.parametrize(
    "backend_string, cpu_backend",
    [
        (f"cpu:{H.BACKEND}", H.BACKEND),
        (f"cpu:gloo,cuda:{H.BACKEND}", "gloo"),
    ],
    ids=["cpu:B", "cpu:gloo,cuda:B"],
)
def test_backend_strings(backend_string, cpu_backend):
    _fail_on_errors(H.run_ranks(_backend_string_job, 2, args=(cpu_backend,), backend=backend_string,
                                timeout_s=90))


def _subgroup_with_other_backend_job(rank, ws):
    """World group on gloo, a subgroup on the backend under test."""
    import torch
    import torch.distributed as dist

    errs = []
    H.import_backend_module(H.BACKEND)
    g = dist.new_group(list(range(ws)), backend=H.BACKEND)
    cls = type(g._get_backend(torch.device("cpu"))).__name__
    if H.IS_RESIDENT and cls != "ProcessGroupResident":
        errs.append(f"subgroup CPU backend is {cls}")
    inputs = [make_input("sgb", r, 1031, "float64") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g)
    errs += compare_exact(t, reference_reduce(inputs, "MIN", "float64"), "subgroup MIN")
    t2 = inputs[rank].clone()
    dist.all_reduce(t2)  # world (gloo)
    errs += compare_reduction(t2, reference_reduce(inputs, "SUM", "float64"), inputs, "SUM", "float64",
                              "world SUM")
    return errs


def test_new_group_with_backend_under_test_on_gloo_world():
    _fail_on_errors(H.run_ranks(_subgroup_with_other_backend_job, 2, backend="gloo", timeout_s=90))


# --------------------------------------------------------------------------
# repeated init / destroy in one process
# --------------------------------------------------------------------------


def _cycles_job(rank, ws, cycles):
    import torch
    import torch.distributed as dist

    errs = []
    for c in range(cycles):
        if dist.is_initialized():
            errs.append(f"cycle {c}: is_initialized() before init")
        H.init_pg(prefix=f"cycle{c}/")
        if dist.get_rank() != rank or dist.get_world_size() != ws:
            errs.append(f"cycle {c}: rank/world_size {dist.get_rank()}/{dist.get_world_size()}")
        inputs = [make_input(f"cyc/{c}", r, 2053, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                  "float32", f"cycle {c} all_reduce")
        sub = dist.new_group(list(range(ws)))
        t = inputs[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sub)
        errs += compare_exact(t, reference_reduce(inputs, "MAX", "float32"), f"cycle {c} subgroup MAX")
        dist.destroy_process_group(sub)  # the world group must keep working
        inputs = [make_input(f"cyc/{c}/b", r, 100, "int64") for r in range(ws)]
        out = torch.empty(ws * 100, dtype=torch.int64)
        dist.all_gather_into_tensor(out, inputs[rank].clone())
        errs += compare_exact(out, torch.cat(inputs), f"cycle {c} all_gather after subgroup destroy")
        dist.barrier()
        dist.destroy_process_group()
        if dist.is_initialized():
            errs.append(f"cycle {c}: is_initialized() after destroy")
    return errs


def test_repeated_init_destroy_in_one_process():
    _fail_on_errors(H.run_ranks(_cycles_job, 2, args=(3,), init=False, timeout_s=120))


# --------------------------------------------------------------------------
# rendezvous: env:// and tcp://
# --------------------------------------------------------------------------


def _rdzv_job(rank, ws):
    import torch.distributed as dist

    errs = []
    if dist.get_rank() != rank or dist.get_world_size() != ws:
        errs.append(f"rank/world_size {dist.get_rank()}/{dist.get_world_size()}")
    inputs = [make_input("rdzv", r, 777, "int32") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    errs += compare_exact(t, reference_reduce(inputs, "SUM", "int32"), "all_reduce SUM int32")
    return errs


@pytest.mark.parametrize("rendezvous", ["env", "tcp"])
def test_rendezvous_methods(rendezvous):
    _fail_on_errors(H.run_ranks(_rdzv_job, 2, rendezvous=rendezvous, timeout_s=90))


# --------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys
    sys.path.insert(0, sys.argv[3])
    import torch
    import torch.distributed as dist
    import dist_harness as H

    backend, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    H.import_backend_module(backend)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=30))
    rank, ws = dist.get_rank(), dist.get_world_size()
    errs = []
    if rank != int(os.environ["RANK"]) or ws != int(os.environ["WORLD_SIZE"]):
        errs.append("rank/world size do not match the environment")
    inputs = [H.make_input("torchrun", r, 3001, "float32") for r in range(ws)]
    t = inputs[rank].clone()
    dist.all_reduce(t)
    errs += H.compare_reduction(t, H.reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                "float32", "all_reduce")
    bc = H.make_input("torchrun/bc", rank, 100, "int64")
    dist.broadcast(bc, src=1)
    errs += H.compare_exact(bc, H.make_input("torchrun/bc", 1, 100, "int64"), "broadcast")
    if "resident" in backend:
        cls = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
        if cls != "ProcessGroupResident":
            errs.append(f"CPU backend is {cls}")
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "ws": ws, "errors": errs}, f)
    """
)


def test_torchrun_launch(tmp_path):
    script = tmp_path / "tiny_job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(script), H.BACKEND, str(tmp_path), TESTS_DIR]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail("torchrun job timed out after 120 s:\n" + out[-5000:])
    assert p.returncode == 0, f"torchrun exited {p.returncode}:\n{out[-5000:]}"
    for r in range(2):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{out[-5000:]}"
        res = json.loads(f.read_text())
        assert res["ws"] == 2 and res["rank"] == r
        assert not res["errors"], res["errors"]


# --------------------------------------------------------------------------
# the harness itself
# --------------------------------------------------------------------------


def _harness_selftest_job(rank, ws):
    import time

    if rank == 1:
        raise ValueError("boom from the harness self-test")
    time.sleep(300)  # a hung rank: the parent must kill it


def test_harness_reports_rank_exception_and_kills_hung_ranks():
    import time

    t0 = time.monotonic()
    with pytest.raises(H.RanksFailed) as ei:
        H.run_ranks(_harness_selftest_job, 2, init=False, timeout_s=60, error_grace_s=1)
    elapsed = time.monotonic() - t0
    text = str(ei.value)
    assert "rank 1" in text and "ValueError: boom from the harness self-test" in text, text
    assert "_harness_selftest_job" in text, "traceback text missing:\n" + text
    assert elapsed < 30, f"the parent took {elapsed:.1f}s to give up on the hung rank"
    o0 = ei.value.outcomes[0]
    assert o0.status == "killed", o0.describe()


# --------------------------------------------------------------------------
# knob validation at group creation
# --------------------------------------------------------------------------


@pytest.mark.resident_only
@pytest.mark.parametrize("var,value", [("RESIDENT_GPU_MAX_BLOCKS", "65"),
                                       ("RESIDENT_GPU_CHUNK_BYTES", "1024"),
                                       ("RESIDENT_PROXY_CPU", "-2")])
def test_gpu_knobs_are_validated(var, value):
    out = H.run_ranks(H.init_outcome_job, 1, env={var: value}, init=False, timeout_s=60)[0]
    assert "invalid value" in out and var.lower().replace("resident_", "") in out, out


@pytest.mark.resident_only
@pytest.mark.parametrize("var,bad,choices,good", [
    ("RESIDENT_GPU_P2P_STREAM", "caller", "auto or own", "own"),
    ("RESIDENT_GPU_PROTOCOL", "ll128", "ll or simple", "simple"),
    ("RESIDENT_TRANSPORT", "verbs", "auto, shm, tcp or ib", "shm")])
def test_choice_knobs_are_validated(var, bad, choices, good):
    """A knob with named choices takes only those; anything else fails the group's creation
    with a message that names the variable and the choices."""
    out = H.run_ranks(H.init_outcome_job, 1, env={var: bad}, init=False, timeout_s=60)[0]
    assert f"{var} must be {choices}" in out and bad in out, out
    ok = H.run_ranks(H.init_outcome_job, 1, env={var: good}, init=False, timeout_s=60)[0]
    assert ok == "no error", ok


REMOVED_PERSISTENT_VARS = ("RESIDENT_GPU_PERSISTENT", "RESIDENT_GPU_PERSISTENT_BLOCKS",
                           "RESIDENT_GPU_PERSISTENT_IDLE_US", "RESIDENT_GPU_PERSISTENT_SLOTS",
                           "RESIDENT_GPU_PERSISTENT_GRAPHS")


@pytest.mark.resident_only
@pytest.mark.parametrize("var", REMOVED_PERSISTENT_VARS)
def test_persistent_mode_variables_fail_group_creation(var):
    """The backend has no persistent-kernel mode: any of its variables, with any value (0
    included), fails the group's creation with a ValueError that names the variable and says
    why, instead of being ignored."""
    for value in ("1", "0"):
        out = H.run_ranks(H.init_outcome_job, 1, env={var: value}, init=False, timeout_s=60)[0]
        assert out.startswith("ValueError: ") and f"{var} is not supported" in out, out
        assert "a kernel per op was measured faster" in out and "docs/decisions.md" in out, out


def _persistent_option_job(rank, ws):
    import torch
    import torch.distributed as dist

    outcomes = {}
    for key in ("gpu_persistent", "RESIDENT_GPU_PERSISTENT_IDLE_US"):
        try:
            dist.new_group([0], backend="resident", pg_options={key: "0"})
            outcomes[key] = "no error"
        except Exception as e:  # noqa: BLE001
            outcomes[key] = f"{type(e).__name__}: {e}"
    t = torch.arange(6, dtype=torch.int64) + rank
    dist.all_reduce(t)  # the world group is unaffected
    return {"outcomes": outcomes, "sum": t.tolist()}


@pytest.mark.resident_only
def test_persistent_mode_options_fail_group_creation():
    """The same names as pg_options: new_group raises ValueError naming the option and its
    variable; the groups that exist keep working."""
    out = H.run_ranks(_persistent_option_job, 1, timeout_s=60)[0]
    got = out["outcomes"]
    for key, var in (("gpu_persistent", "RESIDENT_GPU_PERSISTENT"),
                     ("RESIDENT_GPU_PERSISTENT_IDLE_US", "RESIDENT_GPU_PERSISTENT_IDLE_US")):
        text = got[key]
        assert text.startswith("ValueError: ") and f"({var}) is not supported" in text, text
        assert "a kernel per op was measured faster" in text, text
    assert out["sum"] == list(range(6))


def _form_pair_group(opts):
    """dist.new_group([0, 1]) with ``opts`` as its pg_options: "no error", or the exception."""
    import torch.distributed as dist

    try:
        dist.new_group([0, 1], backend="resident", pg_options=opts)
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _pair_group_sum(rank, opts):
    """A new [0, 1] group with ``opts`` and its all_reduce of arange(4) * (rank + 3), which is
    [0, 7, 14, 21] when the group works."""
    import torch
    import torch.distributed as dist

    g = dist.new_group([0, 1], backend="resident", pg_options=opts)
    t = torch.arange(4, dtype=torch.int64) * (rank + 3)
    dist.all_reduce(t, group=g)
    return g, t.tolist()


def _chunk_of(group):
    import torch

    cfg = group._get_backend(torch.device("cpu")).config()
    return int(cfg.split("gpu_chunk_bytes=")[1].split()[0])


def _rounds_agreement_job(rank, ws):
    out = {"chunk": _form_pair_group({"gpu_chunk_bytes": "131072"} if rank == 0 else None),
           "first": _form_pair_group({"gpu_first_round": "7"} if rank == 1 else None),
           # the automatic chunk over tcp is 256 KiB: a rank that asks for 64 KiB differs
           "auto_tcp": _form_pair_group({"transport": "tcp",
                                         **({"gpu_chunk_bytes": "65536"} if rank == 0 else {})}),
           "auto_tcp_same": _form_pair_group({"transport": "tcp",
                                              **({"gpu_chunk_bytes": "262144"} if rank == 1 else {})})}
    g, out["sum"] = _pair_group_sum(rank, {"gpu_chunk_bytes": "131072", "gpu_first_round": "7"})
    out["chunks"] = [_chunk_of(g)]
    for opts in (None, {"transport": "tcp"}):
        g, _ = _pair_group_sum(rank, opts)
        out["chunks"].append(_chunk_of(g))
    return out


@pytest.mark.resident_only
def test_gpu_rounds_must_agree():
    """Both ranks of a pair cut a CUDA message into rounds of RESIDENT_GPU_CHUNK_BYTES and number
    them from RESIDENT_GPU_FIRST_ROUND, so a group whose ranks differ on either fails to form on
    every rank with a message naming both settings (instead of pairs out of step until the
    device's timeout), the automatic chunk compared as resolved; a group that agrees works. The
    automatic chunk is 64 KiB within a host, 256 KiB where a pair talks over tcp."""
    for out in H.run_ranks(_rounds_agreement_job, 2, timeout_s=90):
        for key, differ in (("chunk", "RESIDENT_GPU_CHUNK_BYTES="), ("first", "RESIDENT_GPU_FIRST_ROUND=")):
            text = out[key]
            assert text.startswith("ValueError") and "all ranks must agree" in text, out
            want = ("131072", "65536") if key == "chunk" else ("7", "0")
            assert all(f"{differ}{v}" in text for v in want), out
        text = out["auto_tcp"]
        assert text.startswith("ValueError") and "all ranks must agree" in text, out
        assert "RESIDENT_GPU_CHUNK_BYTES=65536" in text and "RESIDENT_GPU_CHUNK_BYTES=262144" in text, out
        assert out["auto_tcp_same"] == "no error", out
        assert out["sum"] == [0, 7, 14, 21], out
        # given, automatic within a host, automatic over tcp
        assert out["chunks"] == [131072, 65536, 262144], out


def _protocol_agreement_job(rank, ws):
    import torch

    # The default is simple: rank 0 asks for ll.
    out = {"protocol": _form_pair_group({"gpu_protocol": "ll"} if rank == 0 else None),
           "path": _form_pair_group({"path": "proxy" if rank == 0 else "auto"}),
           "ll_paths": _form_pair_group({"gpu_protocol": "ll",
                                         "path": "proxy" if rank == 0 else "auto"})}
    g, out["sum"] = _pair_group_sum(rank, {"gpu_protocol": "simple"})
    out["config"] = g._get_backend(torch.device("cpu")).config()
    return out


@pytest.mark.resident_only
def test_gpu_protocol_must_agree():
    """RESIDENT_GPU_PROTOCOL picks the CUDA path's wire format per pair on the device, so all
    ranks must agree on it (and, with
    RESIDENT_GPU_PROTOCOL=simple, on RESIDENT_PATH); a group whose ranks differ fails to form on
    every rank with a message naming both settings. Otherwise different paths work (a pair
    proxied one way takes the proxied rule on both ranks); a group that agrees works."""
    for r, out in enumerate(H.run_ranks(_protocol_agreement_job, 2, timeout_s=90)):
        assert out["protocol"].startswith("ValueError") and "all ranks must agree" in out["protocol"], out
        assert "RESIDENT_GPU_PROTOCOL=simple" in out["protocol"], out
        assert "RESIDENT_GPU_PROTOCOL=ll" in out["protocol"], out
        assert "RESIDENT_PATH=proxy" in out["path"] and "RESIDENT_PATH=auto" in out["path"], out
        assert out["ll_paths"] == "no error", out
        assert out["sum"] == [0, 7, 14, 21], out
        assert "gpu_protocol=simple" in out["config"], out
