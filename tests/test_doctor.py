"""python -m resident_pg.doctor: the command, its JSON, --strict/--need, and its parsers.

The machine-facts tests assert what this (GPU-less, RDMA-less) machine must report and the other
branch where the machine has the thing; the parsers are tested against fake /proc, /sys, /dev trees.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from resident_pg import doctor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNS = {}


def run_doctor(*args):
    if args not in _RUNS:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENT_")}
        _RUNS[args] = subprocess.run([sys.executable, "-m", "resident_pg.doctor", *args], cwd=ROOT,
                                     env=env, capture_output=True, text=True, timeout=120)
    return _RUNS[args]


def report():
    p = run_doctor("--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def check(rep, section, name):
    found = [c for c in rep["checks"] if c["section"] == section and c["name"] == name]
    assert len(found) == 1, (section, name, rep["checks"])
    return found[0]


def has_cuda():
    try:
        import torch

        return torch.cuda.device_count() > 0
    except Exception:
        return False


# ---- the command ----

def test_human_output_has_sections_and_next_steps():
    p = run_doctor()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for section in ("System", "GPUs", "MPS", "RDMA", "GPUDirect RDMA", "Transports and paths",
                    "Configuration"):
        assert f"\n{section}" in out, section
    assert re.search(r"^  OK +python", out, re.M)
    assert "RESIDENT_SLOT_BYTES" in out
    # every MISSING/WARN line is followed by a next step
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^  (MISSING|WARN) ", line):
            assert "next step:" in lines[i + 1], line


def test_json_keys_and_types():
    rep = report()
    for key, typ in {"python": str, "torch": dict, "host": dict, "extension": dict, "cuda": dict,
                     "mps": dict, "rdma": dict, "gdr": dict, "tcp": dict, "plan": dict, "config": dict,
                     "checks": list, "need": str, "strict": bool, "missing_required": list,
                     "summary": dict, "exit_code": int}.items():
        assert isinstance(rep[key], typ), key
    assert rep["need"] == "cpu" and rep["strict"] is False and rep["exit_code"] == 0
    host = rep["host"]
    assert isinstance(host["cpu_count"], int) and host["cpu_count"] >= 1
    assert host["allowed_cpus"] == sorted(os.sched_getaffinity(0))
    assert isinstance(host["dev_shm"]["size_bytes"], int) and host["dev_shm"]["free_bytes"] >= 0
    assert isinstance(rep["cuda"]["device_count"], int) and isinstance(rep["cuda"]["devices"], list)
    assert isinstance(rep["mps"]["pipe_reachable"], bool)
    assert set(rep["mps"]["processes"]) == {"nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}
    assert isinstance(rep["rdma"]["devices"], list) and isinstance(rep["rdma"]["uverbs"], list)
    assert isinstance(rep["rdma"]["libibverbs"]["loadable"], bool)
    assert isinstance(rep["gdr"]["available"], bool)
    assert rep["plan"]["same_host"] == {"transport": "shm", "path": "direct"}
    assert rep["plan"]["other_hosts"]["transport"] in ("ib", "tcp")
    assert list(rep["config"]) == [name for name, _ in doctor.CONFIG]
    for v in rep["config"].values():
        assert set(v) == {"value", "default", "set"} and v["set"] is False
    for c in rep["checks"]:
        assert set(c) == {"section", "name", "status", "detail", "next_step", "required_for"}
        assert c["status"] in ("OK", "MISSING", "WARN")
        assert isinstance(c["detail"], str) and c["detail"]
        assert (c["next_step"] is None) == (c["status"] == "OK"), c
        assert set(c["required_for"]) <= {"cpu", "cuda", "rdma"}
    assert sum(rep["summary"].values()) == len(rep["checks"])
    # no RDMA port here: other hosts are reached over tcp, which this build has
    other = check(rep, "Transports and paths", "other hosts")
    if rep["extension"]["loadable"] and rep["plan"]["other_hosts"]["transport"] == "tcp":
        assert "tcp" in rep["extension"]["transports"]
        assert other["status"] == "OK" and other["detail"].startswith("tcp")


def test_reports_cuda_devices_or_their_absence():
    rep = report()
    if has_cuda():
        assert rep["cuda"]["device_count"] > 0
        assert check(rep, "GPUs", "cuda:0")["detail"]
        return
    assert rep["cuda"]["device_count"] == 0
    c = check(rep, "GPUs", "cuda")
    assert c["status"] == "MISSING" and c["next_step"] and c["required_for"] == ["cuda"]
    assert c["detail"] == "no CUDA device: the CUDA path is unavailable; CPU tensors only"
    assert check(rep, "Transports and paths", "GPU memory")["detail"].startswith("no CUDA device")


def test_reports_rdma_devices_or_their_absence():
    rep = report()
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        assert rep["rdma"]["devices"]
        return
    assert rep["rdma"]["devices"] == []
    c = check(rep, "RDMA", "devices")
    assert c["status"] == "MISSING" and c["next_step"] and "no RDMA devices" in c["detail"]
    assert rep["plan"]["other_hosts"] == {"transport": "tcp",
                                          "built": rep["extension"]["loadable"],
                                          "reason": "no usable active RDMA port"}
    if not os.path.exists("/dev/infiniband"):
        assert check(rep, "RDMA", "uverbs")["status"] == "MISSING"


def test_strict_need_cuda_fails_without_a_gpu():
    p = run_doctor("--strict", "--need", "cuda")
    if has_cuda():
        pytest.skip("this machine has a CUDA device")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "missing: GPUs: cuda" in p.stdout


def test_strict_need_cpu_passes_here():
    p = run_doctor("--strict", "--need", "cpu")
    ext = report()["extension"]
    if ext["loadable"]:
        assert p.returncode == 0, p.stdout + p.stderr
        assert "for --need cpu: nothing missing" in p.stdout
    else:  # the extension is being rebuilt: the only thing cpu lacks
        assert p.returncode == 1 and "missing: System: extension" in p.stdout


def test_need_without_strict_always_exits_0():
    assert doctor.finish({"checks": [{"section": "S", "name": "x", "status": "MISSING",
                                      "required_for": ["rdma"]}]}, "rdma", False)["exit_code"] == 0
    out = doctor.finish({"checks": [{"section": "S", "name": "x", "status": "MISSING",
                                     "required_for": ["rdma"]}]}, "rdma", True)
    assert out["exit_code"] == 1 and out["missing_required"] == ["S: x"]
    assert doctor.finish({"checks": [{"section": "S", "name": "x", "status": "MISSING",
                                      "required_for": ["rdma"]}]}, "cuda", True)["exit_code"] == 0


def test_config_table_matches_tuning_doc():
    """docs/tuning.md's "## Configuration" table lists doctor.CONFIG's options (the registry's),
    with the same defaults."""
    doc = open(os.path.join(ROOT, "docs", "tuning.md")).read()
    table = re.search(r"## Configuration\n(.*?)\n## ", doc, re.S).group(1)
    rows = re.findall(r"^\| `(RESIDENT_\w+)` \| `?([^|`]+?)`? \|", table, re.M)
    assert sorted(rows) == sorted(doctor.CONFIG) and len(rows) == len(doctor.CONFIG)


def test_diagnose_names_the_closest_option_and_checks_values(tmp_path):
    """An unknown RESIDENT_* name is a warning that names the nearest registered option; a value
    outside an option's range or choices is a warning naming the problem; a removed switch is a
    warning saying why and to unset it."""
    (tmp_path / "dev/shm").mkdir(parents=True)
    env = {"RESIDENT_SPIN_U": "1", "RESIDENT_SLOTS": "1", "RESIDENT_GPU_PREFETCH": "0",
           "RESIDENT_MAX_INFLIGHT": "64"}
    rep = doctor.finish(doctor.diagnose(env=env, root=str(tmp_path)), "cpu", False)
    c = check(rep, "Configuration", "RESIDENT_SPIN_U")
    assert c["status"] == "WARN" and "RESIDENT_SPIN_US" in c["detail"], c
    c = check(rep, "Configuration", "RESIDENT_SLOTS")
    assert c["status"] == "WARN" and "[2, 1024]" in c["detail"], c
    c = check(rep, "Configuration", "RESIDENT_GPU_PREFETCH")
    assert c["status"] == "WARN" and "removed" in c["detail"] and "typo" not in c["detail"], c
    assert c["next_step"] == "unset RESIDENT_GPU_PREFETCH", c
    assert not [x for x in rep["checks"] if x["name"] == "RESIDENT_MAX_INFLIGHT"]
    assert rep["config"]["RESIDENT_MAX_INFLIGHT"] == {"value": "64", "default": "256", "set": True}


def test_diagnose_reports_the_tcp_address_and_loss_recovery(tmp_path):
    """Where tcp would listen: RESIDENT_TCP_ADDR as an address or an interface name (lo: a
    loopback address, a warning), an unknown interface a warning naming it; unset, the route
    to MASTER_ADDR. And whether the kernel takes the 5 ms minimum RTO."""
    (tmp_path / "dev/shm").mkdir(parents=True)

    def tcp_of(env):
        rep = doctor.finish(doctor.diagnose(env=env, root=str(tmp_path)), "cpu", False)
        return rep, [c for c in rep["checks"] if c["name"] == "tcp address"]

    rep, _ = tcp_of({})
    if not rep["extension"]["loadable"]:
        pytest.skip("the extension does not load here")
    loss = check(rep, "Transports and paths", "tcp loss recovery")
    assert loss["status"] == ("OK" if doctor.tcp_rto_floor_supported() else "WARN"), loss
    rep, (c,) = tcp_of({"RESIDENT_TCP_ADDR": "lo"})
    assert rep["tcp"]["address"] == "127.0.0.1" and c["status"] == "WARN", c
    assert "RESIDENT_TCP_ADDR=lo" in c["detail"] and "loopback" in c["next_step"], c
    rep, (c,) = tcp_of({"RESIDENT_TCP_ADDR": "::1"})  # IPv6 too
    assert rep["tcp"]["address"] == "::1" and c["status"] == "WARN", c
    rep, (c,) = tcp_of({"RESIDENT_TCP_ADDR": "nosuchif0"})
    assert c["status"] == "WARN" and "'nosuchif0'" in c["detail"] and "lo 127.0.0.1" in c["detail"]
    assert rep["tcp"]["address"] is None
    rep, (c,) = tcp_of({"MASTER_ADDR": "127.0.0.1"})  # a loopback route: the first interface
    assert "MASTER_ADDR=127.0.0.1" in c["detail"], c
    first = rep["tcp"]["address"]
    if not first.startswith("127."):
        rep, (c,) = tcp_of({"MASTER_ADDR": first})
        assert c["status"] == "OK" and rep["tcp"]["address"] == first, c
        assert "route to the rendezvous host" in c["detail"], c


# ---- parsers, against fake trees ----

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_rdma_fake_sysfs(tmp_path):
    ib = tmp_path / "sys/class/infiniband"
    write(ib / "mlx5_0/ports/1/state", "4: ACTIVE\n")
    write(ib / "mlx5_0/ports/1/link_layer", "InfiniBand\n")
    write(ib / "mlx5_0/ports/1/rate", "200 Gb/sec (4X HDR)\n")
    for port, state in (("2", "1: DOWN"), ("10", "4: ACTIVE")):
        write(ib / f"mlx5_1/ports/{port}/state", state)
        write(ib / f"mlx5_1/ports/{port}/link_layer", "Ethernet")
    devs = doctor.read_rdma(str(tmp_path))
    assert [d["name"] for d in devs] == ["mlx5_0", "mlx5_1"]
    assert devs[0]["ports"] == [{"port": 1, "state": "ACTIVE", "link_layer": "InfiniBand",
                                 "rate": "200 Gb/sec (4X HDR)", "active": True}]
    assert [(p["port"], p["state"], p["active"], p["rate"]) for p in devs[1]["ports"]] == \
        [(2, "DOWN", False, None), (10, "ACTIVE", True, None)]
    assert doctor.read_rdma(str(tmp_path / "nothing")) is None


def test_proc_modules_and_module_loaded(tmp_path):
    assert doctor.parse_proc_modules(str(tmp_path)) is None
    assert doctor.module_loaded("nvidia_peermem", str(tmp_path)) is None  # nothing readable
    write(tmp_path / "proc/modules",
          "nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)\n"
          "nvidia 9760768 20 nvidia_uvm,nvidia_peermem, Live 0x0000000000000000 (POE)\n"
          "ib_uverbs 196608 2 nvidia_peermem,rdma_ucm, Live 0x0000000000000000\n")
    assert doctor.parse_proc_modules(str(tmp_path)) == {"nvidia_peermem", "nvidia", "ib_uverbs"}
    assert doctor.module_loaded("nvidia_peermem", str(tmp_path)) is True
    assert doctor.module_loaded("mlx5_ib", str(tmp_path)) is False
    other = tmp_path / "other"
    (other / "sys/module/nvidia_peermem").mkdir(parents=True)  # /sys/module only
    assert doctor.module_loaded("nvidia_peermem", str(other)) is True
    assert doctor.module_loaded("mlx5_ib", str(other)) is False


OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 00:58:26 UTC 2025\n"
        "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.154.05  Thu Dec 28 15:37:48 "
               "UTC 2023\nGCC version:  gcc version 11.4.0 (Ubuntu 11.4.0-1ubuntu1~22.04)\n")


def test_nvidia_version_parsing(tmp_path):
    assert doctor.parse_nvidia_version(OPEN) == {"version": "570.86.15", "open": True}
    assert doctor.parse_nvidia_version(PROPRIETARY) == {"version": "535.154.05", "open": False}
    assert doctor.parse_nvidia_version("") is None and doctor.parse_nvidia_version(None) is None
    assert doctor.nvidia_module(str(tmp_path)) == {"loaded": False, "version": None, "open": None}
    write(tmp_path / "proc/driver/nvidia/version", OPEN)
    assert doctor.nvidia_module(str(tmp_path)) == {"loaded": True, "version": "570.86.15",
                                                   "open": True}
    sysfs = tmp_path / "sysonly"  # no /proc/driver/nvidia: version and taint from /sys/module
    write(sysfs / "sys/module/nvidia/version", "550.54.15\n")
    write(sysfs / "sys/module/nvidia/taint", "POE\n")
    assert doctor.nvidia_module(str(sysfs)) == {"loaded": True, "version": "550.54.15",
                                                "open": False}
    write(sysfs / "sys/module/nvidia/taint", "OE\n")
    assert doctor.nvidia_module(str(sysfs))["open"] is True


def test_mps_processes_and_small_parsers(tmp_path):
    write(tmp_path / "proc/101/cmdline", "nvidia-cuda-mps-control\0-d\0")
    write(tmp_path / "proc/202/cmdline", "/usr/bin/nvidia-cuda-mps-server\0")
    write(tmp_path / "proc/303/cmdline", "python\0-m\0x\0")
    (tmp_path / "proc/404").mkdir()  # a process without a readable cmdline
    assert doctor.mps_processes(str(tmp_path)) == {"nvidia-cuda-mps-control": [101],
                                                   "nvidia-cuda-mps-server": [202]}
    assert doctor.parse_kernel_release("6.8.0-45-generic") == (6, 8)
    assert doctor.parse_kernel_release("5.4.0") == (5, 4)
    assert doctor.parse_kernel_release("weird") is None
    assert doctor.cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_diagnose_on_a_fake_rdma_host(tmp_path, monkeypatch):
    ib = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    write(ib / "state", "4: ACTIVE")
    write(ib / "link_layer", "Ethernet")
    write(ib / "rate", "100 Gb/sec (2X HDR)")
    write(tmp_path / "dev/infiniband/uverbs0", "")
    (tmp_path / "dev/shm").mkdir(parents=True)
    monkeypatch.setattr(doctor, "libibverbs",
                        lambda: {"loadable": True, "library": "libibverbs.so.1", "error": None})
    env = {"RESIDENT_PATH": "proxy", "RESIDENT_TRANSPORT": "verbs", "RESIDENT_SLOT_BYTE": "1"}
    rep = doctor.finish(doctor.diagnose(env=env, root=str(tmp_path)), "rdma", True)
    assert check(rep, "RDMA", "mlx5_0/1")["status"] == "OK"
    assert "RoCE" in check(rep, "RDMA", "mlx5_0/1")["detail"]
    assert check(rep, "RDMA", "uverbs")["status"] == "OK"
    assert rep["plan"]["same_host"] == {"transport": "shm", "path": "proxy"}
    assert rep["plan"]["other_hosts"]["transport"] == "ib"
    if rep["extension"]["loadable"]:  # ib is built, never run on hardware: a warning, not missing
        assert rep["plan"]["other_hosts"]["built"]
        assert check(rep, "Transports and paths", "other hosts")["status"] == "WARN"
        assert "Transports and paths: other hosts" not in rep["missing_required"]
    assert check(rep, "Configuration", "RESIDENT_TRANSPORT")["status"] == "WARN"
    assert check(rep, "Configuration", "RESIDENT_SLOT_BYTE")["status"] == "WARN"
    assert rep["config"]["RESIDENT_PATH"] == {"value": "proxy", "default": "auto", "set": True}


def test_diagnose_warns_about_the_persistent_mode_variables(tmp_path):
    """The persistent-kernel mode's variables fail group creation: the doctor names each one
    that is set (not as a typo) and says to unset it; unset, nothing is reported."""
    (tmp_path / "dev/shm").mkdir(parents=True)
    env = {"RESIDENT_GPU_PERSISTENT": "1", "RESIDENT_GPU_PERSISTENT_IDLE_US": "0"}
    rep = doctor.finish(doctor.diagnose(env=env, root=str(tmp_path)), "cpu", False)
    for name in env:
        c = check(rep, "Configuration", name)
        assert c["status"] == "WARN" and "removed" in c["detail"] and "typo" not in c["detail"], c
        assert "faster" in c["detail"] and c["next_step"] == f"unset {name}", c
    assert "RESIDENT_GPU_PERSISTENT" not in rep["config"]
    rep = doctor.finish(doctor.diagnose(env={}, root=str(tmp_path)), "cpu", False)
    assert not [x for x in rep["checks"] if "PERSISTENT" in x["name"]]
