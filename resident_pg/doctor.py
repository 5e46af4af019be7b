"""``python -m resident_pg.doctor``: what this machine can do for the resident backend.

OK / MISSING / WARN lines, with a next step for each non-OK one (``--json``: one dict). Exit code
0, unless ``--strict`` and something ``--need cpu|cuda|rdma`` requires is missing: then 1. Needs
neither root nor the compiled extension (resident_pg._C is used only if it loads).
"""

import argparse
import ctypes
import ctypes.util
import glob
import importlib.util
import json
import ipaddress
import os
import platform
import shutil
import socket
import sys
import warnings

from resident_pg import options

# The registry's options (csrc/core/options.def through resident_pg.options): (variable, default).
CONFIG = [(o["variable"], o["default"] or "(unset)") for o in options.LIVE]
NOT_RUNTIME = {"RESIDENT_TEST_BACKEND", "RESIDENT_NO_CUDA"}  # read by tests / setup.py only
# Refused options (the persistent-kernel mode, switches that measurement settled): group creation
# fails while one is set.
REMOVED = {o["variable"]: o["doc"] for o in options.REMOVED}
NEEDS = {"cpu": {"cpu"}, "cuda": {"cpu", "cuda"}, "rdma": {"cpu", "rdma"}}
ALL = ("cpu", "cuda", "rdma")
# CUdevice_attribute values, the same numbers as cudaDeviceAttr's
CU_ATTRS = {"gpudirect_rdma_supported": 116, "gpudirect_rdma_writes_ordering": 118,
            "dma_buf_supported": 124}
BUILD = "MAX_JOBS=2 pip install --no-build-isolation -e ."
MPS_START = ("export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-log;"
             " nvidia-cuda-mps-control -d   (stop: echo quit | nvidia-cuda-mps-control)")


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


# ---- parsers of the machine's files: root="/" is this machine, tests pass a fake tree ----

def parse_proc_modules(root="/"):
    """Names of the loaded kernel modules (<root>/proc/modules), None if unreadable."""
    text = read_text(os.path.join(root, "proc/modules"))
    return None if text is None else {l.split()[0] for l in text.splitlines() if l.strip()}


def module_loaded(name, root="/"):
    """True/False from /proc/modules or /sys/module; None when neither can be read."""
    mods, sysmod = parse_proc_modules(root), os.path.join(root, "sys/module")
    if (mods is not None and name in mods) or os.path.isdir(os.path.join(sysmod, name)):
        return True
    return False if (mods is not None or os.path.isdir(sysmod)) else None


def parse_nvidia_version(text):
    """Text of /proc/driver/nvidia/version -> {"version", "open"}; None for no text."""
    if not text:
        return None
    line = next((l for l in text.splitlines() if "Kernel Module" in l), "")
    version = next((w for w in line.split() if w[:1].isdigit() and "." in w), None)
    return {"version": version, "open": "Open Kernel Module" in text}


def nvidia_module(root="/"):
    """{"loaded", "version", "open"}: open is True (open module), False (proprietary) or None."""
    info = parse_nvidia_version(read_text(os.path.join(root, "proc/driver/nvidia/version")))
    if info is not None:
        return dict(info, loaded=True)
    sysdir = os.path.join(root, "sys/module/nvidia")
    if not os.path.isdir(sysdir):
        return {"loaded": False, "version": None, "open": None}
    taint = read_text(os.path.join(sysdir, "taint"))  # "P": proprietary licence; open: no P
    return {"loaded": True, "version": read_text(os.path.join(sysdir, "version")),
            "open": None if taint is None else "P" not in taint}


def read_rdma(root="/"):
    """Devices and ports of <root>/sys/class/infiniband; None without that directory."""
    base = os.path.join(root, "sys/class/infiniband")
    if not os.path.isdir(base):
        return None
    devices = []
    for dev in sorted(os.listdir(base)):
        pdir = os.path.join(base, dev, "ports")
        names = os.listdir(pdir) if os.path.isdir(pdir) else []
        ports = []
        for p in sorted(names, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s)):
            f = lambda key: read_text(os.path.join(pdir, p, key))  # noqa: E731
            state = f("state")  # e.g. "4: ACTIVE"
            ports.append({"port": int(p) if p.isdigit() else p,
                          "state": state.split(":", 1)[-1].strip() if state else None,
                          "link_layer": f("link_layer"), "rate": f("rate"),
                          "active": bool(state) and "ACTIVE" in state.upper()})
        devices.append({"name": dev, "ports": ports})
    return devices


def mps_pipe(env=None):
    """The MPS pipe directory a client here uses, and whether the daemon's control pipe is in it."""
    env = os.environ if env is None else env
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return pipe, os.path.exists(os.path.join(pipe, "control"))


def mps_processes(root="/"):
    """PIDs of nvidia-cuda-mps-control/-server by argv[0] (comm cuts both to 15 characters)."""
    found = {"nvidia-cuda-mps-control": [], "nvidia-cuda-mps-server": []}
    for d in glob.glob(os.path.join(root, "proc/[0-9]*")):
        try:
            with open(os.path.join(d, "cmdline"), "rb") as f:
                name = os.path.basename(f.read().split(b"\0", 1)[0].decode(errors="replace"))
        except OSError:
            continue
        if name in found:
            found[name].append(int(os.path.basename(d)))
    return {k: sorted(v) for k, v in found.items()}


def parse_kernel_release(release):
    """"6.8.0-45-generic" -> (6, 8); None when it does not start with two numbers."""
    parts = release.split("-", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def cpu_ranges(cpus):
    out = []
    for c in sorted(cpus):
        if out and c == out[-1][1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def gib(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# ---- probes that load libraries, all guarded ----

def load_first(names):
    err = "not found"
    for n in names:
        if n:
            try:
                return ctypes.CDLL(n), n, None
            except OSError as e:
                err = str(e)
    return None, None, err


def libibverbs():
    lib, name, err = load_first(["libibverbs.so.1"])
    if lib is None:
        lib, name, _ = load_first([ctypes.util.find_library("ibverbs")])
    return {"loadable": lib is not None, "library": name, "error": None if lib else err}


def cudart_candidates():
    """torch's bundled libcudart (torch/lib, site-packages/nvidia/*/lib), then the system's."""
    dirs = []
    spec = importlib.util.find_spec("torch")
    for p in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(os.path.join(p, "lib"))
    for sp in dict.fromkeys(p for p in sys.path if p.endswith("-packages")):
        dirs += [os.path.join(sp, "nvidia/cuda_runtime/lib")] + glob.glob(f"{sp}/nvidia/cu*/lib")
    found = [f for d in dirs for f in sorted(glob.glob(os.path.join(d, "libcudart.so*")))]
    return found + [ctypes.util.find_library("cudart")]


def cuda_attributes(count):
    """Driver's CUDA version and the GDR attributes of each device, from libcuda or libcudart."""
    out = {"source": None, "driver_cuda": None,
           "devices": [{k: "unknown" for k in CU_ATTRS} for _ in range(count)]}
    lib, name, _ = load_first(["libcuda.so.1", ctypes.util.find_library("cuda")])
    if lib is not None and lib.cuInit(0) == 0:
        def attr(i, a):
            dev, v = ctypes.c_int(), ctypes.c_int()
            if lib.cuDeviceGet(ctypes.byref(dev), i) or lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev):
                return "unknown"
            return v.value
        get_version = lib.cuDriverGetVersion
    else:
        lib, name, _ = load_first(cudart_candidates())
        if lib is None:
            return out

        def attr(i, a):
            v = ctypes.c_int()
            return "unknown" if lib.cudaDeviceGetAttribute(ctypes.byref(v), a, i) else v.value
        get_version = lib.cudaDriverGetVersion
    v = ctypes.c_int(0)
    if get_version(ctypes.byref(v)) == 0 and v.value > 0:
        out["driver_cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    out["source"] = name
    out["devices"] = [{k: attr(i, a) for k, a in CU_ATTRS.items()} for i in range(count)]
    return out


def extension_info():
    info = {"path": None, "loadable": False, "error": None, "transports": None,
            "cuda_path_built": None}
    try:
        spec = importlib.util.find_spec("resident_pg._C")
        info["path"] = spec.origin if spec else None
        from resident_pg import _C
        info["loadable"] = True
        t = getattr(_C, "transports", None)  # absent in builds before tcp/ib: shm only
        info["transports"] = sorted(t() if callable(t) else t) if t is not None else ["shm"]
    except Exception as e:  # noqa: BLE001 - missing, mid-rebuild, built for another torch
        info["error"] = f"{type(e).__name__}: {e}"
    if info["path"] and os.path.isfile(info["path"]):
        with open(info["path"], "rb") as f:  # only csrc/c10d/no_cuda.cpp carries this message
            info["cuda_path_built"] = b"built without nvcc" not in f.read()
    return info


TCP_RTO_MIN_US = 45  # <linux/tcp.h>, Linux 6.15+


def tcp_rto_floor_supported():
    """Whether the kernel takes a socket's own minimum RTO (the tcp transport sets 5 ms)."""
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 5000)
        except OSError:
            return False
        return s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US) < 200_000


def tcp_checks(env, ext, add, facts, section):
    """Where tcp would listen (RESIDENT_TCP_ADDR, else the route to MASTER_ADDR, the rendezvous
    host of torchrun and env://) and whether a lost segment is resent within milliseconds."""
    setting, host = env.get("RESIDENT_TCP_ADDR", ""), env.get("MASTER_ADDR", "")
    facts["tcp"] = tcp = {"address": None, "reason": None, "rto_floor": tcp_rto_floor_supported()}
    if ext["loadable"] and "tcp" in (ext["transports"] or []):
        from resident_pg import _C
        try:
            tcp["address"], tcp["reason"] = _C.tcp_listen_address(setting, host)
        except ValueError as e:
            add(section, "tcp address", "WARN", str(e), "set RESIDENT_TCP_ADDR to an address of "
                "this host or the name of an interface with one (or unset it)")
        else:
            loop = ipaddress.ip_address(tcp["address"]).is_loopback
            where = "" if setting else (f"; MASTER_ADDR={host}" if host else "; MASTER_ADDR "
                                        "unset here: ranks follow the route to their store's host")
            add(section, "tcp address", "WARN" if loop else "OK",
                f"groups would listen on {tcp['address']} ({tcp['reason']}{where})",
                "other hosts cannot reach a loopback address: set RESIDENT_TCP_ADDR to the "
                "address or interface they reach" if loop else None)
    add(section, "tcp loss recovery", "OK" if tcp["rto_floor"] else "WARN",
        f"kernel {platform.release()}: " + ("a lost lone segment is resent after ~10-20 ms "
        "(5 ms minimum RTO per connection)" if tcp["rto_floor"] else "no per-socket minimum RTO "
        "(TCP_RTO_MIN_US, Linux 6.15+): a lost lone segment waits ~200 ms"),
        None if tcp["rto_floor"] else "a newer kernel, or `ip route change ... rto_min 5ms` on "
        "the route to the other hosts")


def torch_info():
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"version": None, "error": repr(e), "cuda_build": None, "devices": []}
    devices = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                devices.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_bytes": int(p.total_memory)})
        except Exception:  # noqa: BLE001
            pass
    return {"version": torch.__version__, "error": None, "cuda_build": torch.version.cuda,
            "devices": devices}


# ---- the report ----

def diagnose(env=None, root="/"):
    """Facts (dict) plus "checks": a list of {section, name, status, detail, next_step,
    required_for}, status OK / MISSING / WARN."""
    env = os.environ if env is None else env
    checks, facts = [], {}

    def add(section, name, status, detail, next_step=None, required_for=()):
        checks.append({"section": section, "name": name, "status": status, "detail": detail,
                       "next_step": next_step, "required_for": sorted(required_for)})

    S, tinfo, ext = "System", torch_info(), extension_info()
    add(S, "python", "OK", f"Python {platform.python_version()} ({sys.executable})")
    if tinfo["version"]:
        add(S, "torch", "OK", f"torch {tinfo['version']} (CUDA build: {tinfo['cuda_build']})")
    else:
        add(S, "torch", "MISSING", f"torch does not import: {tinfo['error']}",
            "pip install torch==2.14.1", ALL)
    allowed, ncpu = sorted(os.sched_getaffinity(0)), os.cpu_count()
    add(S, "cpus", "OK" if len(allowed) > 1 else "WARN",
        f"{ncpu} CPUs, {len(allowed)} allowed to this process: {cpu_ranges(allowed)}",
        None if len(allowed) > 1 else "allow more than one CPU (taskset, cgroup cpuset): ranks "
        "and proxy threads share one core, so waits fall back to yield/sleep")
    shm = {"path": os.path.join(root, "dev/shm"), "size_bytes": None, "free_bytes": None}
    try:
        st = os.statvfs(shm["path"])
        shm.update(size_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)
        low = shm["free_bytes"] < 2**30
        add(S, "/dev/shm", "WARN" if low else "OK",
            f"{gib(shm['size_bytes'])}, {gib(shm['free_bytes'])} free", "enlarge it (docker: "
            "--shm-size=4g or --ipc=host): a rank's segment takes per peer 2 x RESIDENT_SLOTS x "
            "RESIDENT_SLOT_BYTES (512 KiB by default) and, with CUDA, 8 chunks of its rounds "
            "(512 KiB on one host, 2 MiB over a network); a group that does not fit fails at "
            "creation, naming /dev/shm" if low else None)
    except OSError as e:
        add(S, "/dev/shm", "MISSING", f"not usable: {e}", "mount a tmpfs at /dev/shm (docker: "
            "--shm-size=1g or --ipc=host): the shm transport lives there", ALL)
    if ext["loadable"]:
        add(S, "extension", "OK", f"resident_pg._C loads; transports: {', '.join(ext['transports'])}"
            f"; CUDA path built: {ext['cuda_path_built']}")
    else:
        add(S, "extension", "MISSING", f"resident_pg._C does not load ({ext['error']})",
            f"build it: {BUILD}", ALL)
    facts.update(python=platform.python_version(), torch=tinfo, extension=ext,
                 host={"cpu_count": ncpu, "allowed_cpus": allowed, "dev_shm": shm})

    G, devs, nv = "GPUs", tinfo["devices"], nvidia_module(root)
    cu = cuda_attributes(len(devs))
    facts["cuda"] = {"device_count": len(devs), "devices": devs, "torch_cuda": tinfo["cuda_build"],
                     "driver_cuda": cu["driver_cuda"], "driver_version": nv["version"],
                     "attributes_source": cu["source"]}
    if not devs:
        step = "run on a host with an NVIDIA GPU and its driver (nvidia-smi lists the GPU)"
        if "CUDA_VISIBLE_DEVICES" in env:
            step += f"; CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} hides devices"
        if tinfo["version"] and not tinfo["cuda_build"]:
            step = "install a CUDA build of torch (this one is CPU-only)"
        elif cu["driver_cuda"] and tinfo["cuda_build"] and \
                int(cu["driver_cuda"].split(".")[0]) < int(tinfo["cuda_build"].split(".")[0]):
            step = (f"the driver supports CUDA {cu['driver_cuda']}, torch needs "
                    f"{tinfo['cuda_build']}: upgrade the driver or install a matching torch")
        add(G, "cuda", "MISSING", "no CUDA device: the CUDA path is unavailable; CPU tensors only",
            step, {"cuda"})
    for d in devs:
        major, name = int(d["capability"].split(".")[0]), f"cuda:{d['index']}"
        line = (f"{d['name']}, compute capability {d['capability']}, {gib(d['memory_bytes'])}; "
                f"driver {nv['version'] or '?'} (CUDA {cu['driver_cuda'] or '?'}), torch built "
                f"for CUDA {tinfo['cuda_build']}")
        if major < 9:
            add(G, name, "MISSING", line + "; the kernels are built for sm_90 (PTX compute_90) "
                "and cannot run on it", "use a Hopper (9.0) or newer GPU, or add a -gencode for "
                "it in setup.py and rebuild", {"cuda"})
        else:
            add(G, name, "OK", line + ("" if major == 9 else "; kernels JIT-compiled from PTX"))
    if devs and ext["cuda_path_built"] is False:
        add(G, "cuda path", "MISSING", "the extension was built without nvcc: CUDA tensors are "
            "refused", f"put nvcc on PATH (or set CUDA_HOME) and rebuild: {BUILD}", {"cuda"})

    M, (pipe, reachable), procs = "MPS", mps_pipe(env), mps_processes(root)
    control = procs["nvidia-cuda-mps-control"]
    facts["mps"] = {"pipe_directory": pipe, "pipe_reachable": reachable, "processes": procs,
                    "control_binary": shutil.which("nvidia-cuda-mps-control")}
    if control and reachable:
        add(M, "daemon", "OK", f"running (control pid {control[0]}), {pipe}/control reachable")
    elif control:
        add(M, "daemon", "WARN", f"running, but no pipe at {pipe}/control: clients here will not "
            "reach it", "set CUDA_MPS_PIPE_DIRECTORY to the daemon's pipe directory")
    else:
        add(M, "daemon", "MISSING", "no MPS control daemon running; several ranks on one GPU need "
            "it (time-sliced, a flag wait takes ms instead of µs)"
            + (f"; stale pipe at {pipe}/control" if reachable else ""), MPS_START
            + ("" if facts["mps"]["control_binary"] else "; nvidia-cuda-mps-control is not on "
               "PATH: it ships with the NVIDIA driver"))

    R, rdma, ibv = "RDMA", read_rdma(root), libibverbs()
    uv = sorted(glob.glob(os.path.join(root, "dev/infiniband/uverbs*")))
    ports = [dict(p, device=d["name"]) for d in rdma or [] for p in d["ports"]]
    facts["rdma"] = {"devices": rdma or [], "uverbs": uv, "libibverbs": ibv}
    if not ports:
        add(R, "devices", "MISSING", "no RDMA devices (" + ("/sys/class/infiniband is absent: no "
            "RDMA subsystem or NIC)" if rdma is None else "no ports in /sys/class/infiniband)"),
            "ranks on other hosts would need tcp; for ib: an InfiniBand/RoCE NIC with its driver "
            "(e.g. mlx5_ib) and `modprobe ib_uverbs`", {"rdma"})
    for p in ports:
        kind = "InfiniBand" if p["link_layer"] == "InfiniBand" else f"{p['link_layer']} (RoCE)"
        add(R, f"{p['device']}/{p['port']}", "OK" if p["active"] else "WARN",
            f"{p['state']}, {kind}, {p['rate']}", None if p["active"] else
            "bring the link up: cable, subnet manager (opensm) for IB; check with `ibstat`")
    add(R, "uverbs", "OK" if uv else "MISSING", ", ".join(uv) or "no /dev/infiniband/uverbs*",
        None if uv else "modprobe ib_uverbs; in a container pass --device=/dev/infiniband", {"rdma"})
    add(R, "libibverbs", "OK" if ibv["loadable"] else "MISSING",
        f"{ibv['library']} loads" if ibv["loadable"]
        else f"libibverbs.so.1 does not load ({ibv['error']})",
        None if ibv["loadable"] else "apt-get install -y libibverbs1 ibverbs-providers", {"rdma"})

    # GPUDirect RDMA is never required: resident stages GPU payloads through pinned host memory.
    D, kernel, peermem = "GPUDirect RDMA", parse_kernel_release(platform.release()), \
        module_loaded("nvidia_peermem", root)
    flavour = {True: "open kernel module", False: "proprietary kernel module", None: "open or not: unknown"}
    if nv["loaded"]:
        add(D, "nvidia module", "OK" if nv["open"] else "WARN", f"{nv['version'] or '?'}, "
            + flavour[nv["open"]], None if nv["open"] else "dma-buf registration of GPU memory "
            "needs the open kernel module (nvidia-open)")
    else:
        add(D, "nvidia module", "MISSING", "no NVIDIA kernel module loaded (no "
            "/proc/driver/nvidia/version)", "install the NVIDIA driver (open kernel modules) on a GPU host")
    add(D, "nvidia_peermem", {True: "OK", False: "MISSING", None: "WARN"}[peermem],
        {True: "loaded", False: "not loaded", None: "unknown (/proc/modules, /sys/module unreadable)"}
        [peermem], None if peermem else "modprobe nvidia_peermem (ships with the driver; load the "
        "RDMA stack first)")
    attrs, kernel_ok = cu["devices"], bool(kernel and kernel >= (5, 12))
    dmabuf = kernel_ok and nv["open"] is not False and bool(attrs) and \
        all(a["dma_buf_supported"] == 1 for a in attrs)
    attr_txt = ", ".join(f"cuda:{i}={a['dma_buf_supported']}" for i, a in enumerate(attrs))
    add(D, "dma-buf", "OK" if dmabuf else "MISSING", f"kernel {platform.release()} (>= 5.12: "
        f"{'yes' if kernel_ok else 'no'}), {flavour[nv['open']] if nv['loaded'] else 'no NVIDIA module'}"
        f", DmaBufSupported: {attr_txt or 'no CUDA device'}", None if dmabuf else "needs kernel "
        ">= 5.12, the open NVIDIA kernel module and cudaDevAttrDmaBufSupported=1")
    for i, a in enumerate(attrs):
        unknown = "unknown" in a.values()
        add(D, f"cuda:{i} attributes", "WARN" if unknown else "OK", ", ".join(
            f"{k}={v}" for k, v in a.items()) + f" (from {cu['source']})", "libcuda/libcudart "
            "could not answer: check the driver installation" if unknown else None)
    via = [n for n, ok in (("nvidia_peermem", peermem is True), ("dma-buf", dmabuf)) if ok]
    gdr = bool(devs and via) and all(a["gpudirect_rdma_supported"] != 0 for a in attrs)
    facts["gdr"] = {"available": gdr, "via": via, "nvidia_peermem": peermem, "dma_buf": dmabuf,
                    "kernel": platform.release(), "nvidia_module": nv, "attributes": attrs}

    T, path = "Transports and paths", env.get("RESIDENT_PATH", "auto").lower()
    ib_ok = any(p["active"] for p in ports) and bool(uv) and ibv["loadable"]
    remote, reason = ("ib", "an active RDMA port") if ib_ok else ("tcp", "no usable active RDMA port")
    add(T, "same host", "OK", "shm, " + ("proxy path: every write through the proxy thread "
        "(RESIDENT_PATH=proxy)" if path == "proxy" else "direct path: stores straight into "
        "the peer's shared segment" + (" (required: RESIDENT_PATH=direct)" if path == "direct" else "")))
    if remote == "ib" and remote in (ext["transports"] or []):
        add(T, "other hosts", "WARN", f"ib ({reason}); the ib transport is built but has not run "
            "on RDMA hardware yet", "if groups across hosts misbehave, set RESIDENT_TRANSPORT=tcp "
            "and report it")
    elif remote in (ext["transports"] or []):
        add(T, "other hosts", "OK", f"{remote} ({reason}; RESIDENT_TRANSPORT=tcp|ib forces one); "
            "tcp: CPU and CUDA tensors tested between network namespaces of one host, not yet "
            "between separate machines (docs/performance.md)")
    else:
        add(T, "other hosts", "MISSING", f"would be {remote} ({reason}), but tcp and ib are not "
            "built yet in this version (" + ("shm only in this build" if ext["loadable"] else
            "extension not loadable") + "): a group spanning hosts is refused at creation",
            "keep every group's ranks on one host for now", {"rdma"})
    gpu_mem = f"registered for RDMA (GDR via {', '.join(via)})" if gdr else "host-staged"
    add(T, "GPU memory", "OK", f"{gpu_mem}: GPU payloads go through mapped pinned host memory, "
        "which is what resident does on every path anyway" if devs else "no CUDA device: CPU tensors only")
    tcp_checks(env, ext, add, facts, T)
    facts["plan"] = {"same_host": {"transport": "shm", "path": "proxy" if path == "proxy" else "direct"},
                     "other_hosts": {"transport": remote, "built": remote in (ext["transports"] or []),
                                     "reason": reason}, "gpu_memory": gpu_mem if devs else None}

    C = "Configuration"
    facts["config"] = cfg = {n: {"value": env.get(n, d), "default": d, "set": n in env} for n, d in CONFIG}
    for name in sorted(k for k in env if k in options.BY_VARIABLE and k not in REMOVED):
        opt = options.BY_VARIABLE[name]
        problem = options.check_value(opt, env[name])
        if problem:
            effect = ("group creation will fail" if opt["reader"] == "Config"
                      else f"{opt['reader']} refuses it")
            add(C, name, "WARN", f"{env[name]!r} is {problem}: {effect}",
                f"unset {name} or see docs/tuning.md")
    for name in sorted(k for k in env if k in REMOVED):
        add(C, name, "WARN", f"{REMOVED[name]}: group creation fails while this is set",
            f"unset {name}")
    for name in sorted(k for k in env if k.startswith("RESIDENT_")):
        if name not in options.BY_VARIABLE and name not in NOT_RUNTIME:
            near = options.closest(name)
            add(C, name, "WARN", "not a resident setting (typo?" + (f" did you mean {near}?)" if near
                                                                    else ")"), "see docs/tuning.md")
    return dict(facts, checks=checks)


def finish(report, need, strict):
    """Add what --need requires and is missing, the counts and the exit code."""
    missing = [f"{c['section']}: {c['name']}" for c in report["checks"]
               if c["status"] == "MISSING" and NEEDS[need] & set(c["required_for"])]
    return dict(report, need=need, strict=strict, missing_required=missing,
                summary={s: sum(c["status"] == s for c in report["checks"])
                         for s in ("OK", "WARN", "MISSING")},
                exit_code=1 if strict and missing else 0)


def render(out):
    lines, section = ["resident doctor: what this machine can do for the resident backend"], None
    for c in sorted(out["checks"], key=lambda c: c["section"] == "Configuration"):  # stable
        if c["section"] != section:
            section = c["section"]
            lines += ["", section]
        lines.append(f"  {c['status']:<8} {c['name']:<18} {c['detail']}")
        if c["next_step"]:
            lines.append(f"  {'':<8} {'':<18} next step: {c['next_step']}")
    if section != "Configuration":
        lines += ["", "Configuration"]
    lines.append("  (environment; pg_options override it per group)")
    for name, v in out["config"].items():
        lines.append(f"  {name:<28} {v['value']:<8} {'(set)' if v['set'] else '(default)'}")
    s, miss = out["summary"], out["missing_required"]
    lines += ["", f"{s['OK']} OK, {s['WARN']} WARN, {s['MISSING']} MISSING; for --need "
              f"{out['need']}: " + ("missing: " + "; ".join(miss) if miss else "nothing missing")]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m resident_pg.doctor",
                                 description="What this machine can do for the resident backend.")
    ap.add_argument("--json", action="store_true", help="print a machine-readable dict")
    ap.add_argument("--need", choices=sorted(NEEDS), default="cpu",
                    help="what --strict checks for (default: cpu)")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 if something --need requires is missing")
    args = ap.parse_args(argv)
    out = finish(diagnose(), args.need, args.strict)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return out["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
