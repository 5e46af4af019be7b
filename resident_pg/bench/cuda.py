"""The CUDA half of resident_pg.bench: ``--device cuda``, ``--mode graph``, ``--floors``.

Used by the bench's rank side (rank.py) and its parent (ladder.py); it imports only common and
report's table printer.

* :class:`CudaDevice`: each rank uses GPU ``rank % device_count`` (on the GPU machine all ranks
  share one H200 under MPS); ``synchronize`` waits for the current stream, so a timed region
  ends when the ops it issued (ordered on that stream, as a blocking op is) have finished.
  Not ``torch.cuda.synchronize()``: that also waits for every other stream of the process.
* :func:`graph_batch` (mode "graph"): ``count`` back-to-back steps captured into ONE CUDA graph
  (after a warm-up on a side stream, as torch recommends); one timed repetition is one replay
  followed by a synchronize, so the per-op time is replay time / count.
* :func:`graph_check`: the correctness check of a cell, captured into a graph and replayed twice
  with fresh inputs and poisoned outputs in between: a backend whose ops are not really captured
  (replay does nothing) fails it instead of timing as "fast".
* floors: :func:`load_floors` reads the JSON of ``benchmarks/floors/build/floors --json`` and/or
  ``build/tcp_floor --json`` (several files pooled); :func:`row_floor_kind` says which floor a
  row is held to (GPU, GPU + tcp for CUDA tensors over tcp, tcp for CPU tensors over tcp) and
  :func:`floor_for` gives its value; :func:`evaluate_targets` evaluates the targets of
  :data:`CUDA_TARGETS` and :data:`TCP_TARGETS`; :func:`print_cuda_tables` and
  :func:`print_tcp_floor_table` print µs and ratios to the floors.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import common
from .report import print_table

_fmt_size, _fmt_us = common.fmt_size, common.fmt_us

# --------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------


class CudaDevice(common.TorchBuffers):
    """Buffers on GPU ``rank % device_count``; synchronize() waits for this process's GPU work."""

    name = "cuda"

    def __init__(self, rank: int, world_size: int) -> None:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
        self.torch = torch
        self.index = rank % torch.cuda.device_count()
        torch.cuda.set_device(self.index)
        self.device = torch.device("cuda", self.index)
        torch.zeros(1, device=self.device).add_(1)  # the CUDA context exists before the group
        torch.cuda.synchronize(self.index)

    def synchronize(self) -> None:
        self.torch.cuda.current_stream(self.index).synchronize()

    def info(self) -> Dict[str, Any]:
        t = self.torch
        p = t.cuda.get_device_properties(self.index)
        return {"index": self.index, "device_count": t.cuda.device_count(), "name": p.name,
                "capability": f"{p.major}.{p.minor}", "torch_cuda": t.version.cuda,
                "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}



def capture(fn: Callable[[], None], count: int, warmup: int = 3):
    """Warm ``fn`` up on a side stream, then capture ``count`` calls of it into one CUDA graph."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(count):
            fn()
    torch.cuda.synchronize()
    return g


def graph_batch(step: Callable[[], None], count: int, dev) -> Callable[[], None]:
    """MODES["graph"]: one replay of a graph of ``count`` steps (the caller synchronizes)."""
    g = capture(step, count)

    def run() -> None:
        g.replay()
    run.graph = g  # type: ignore[attr-defined]  # keeps the graph alive as long as `run`
    return run


def graph_check(setup: Callable[[], None], body: Callable[[], None],
                verify: Callable[[], None], dev, replays: int = 2) -> None:
    """Capture ``body`` (the op on known inputs) once; ``replays`` times: ``setup`` (fresh inputs,
    poisoned outputs), replay, synchronize, ``verify`` (raises on a wrong result)."""
    g = capture(body, 1)
    for _ in range(replays):
        setup()
        g.replay()
        dev.synchronize()
        verify()
    del g


# --------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------

XP_FLOOR = "cross_process_flag"      # two processes' kernels via shared host memory (MPS)
DATA_FLOOR = ("data_floor_sm", "sm_kernels")  # N bytes GPU->host->GPU by SM stores/loads
# benchmarks/floors/build/tcp_floor: busy-polled TCP ping-pong between two processes, one-way.
# Ranks on one host are held to loopback (netns is shown for reference); ranks on two hosts to
# the rows of tcp_floor --listen / --connect between them, which take precedence in a floors file.
TCP_FLOOR = "tcp_loopback"
TCP_NETNS = "tcp_netns"
TCP_HOSTS = "tcp_hosts"

# Which floor a row is held to (row_floor_kind): "gpu" (CUDA tensors between ranks of one host:
# the cross-process flag at 8 B, the SM data floor above), "gpu+tcp" (CUDA tensors over tcp: the
# GPU floor at that size plus the tcp one-way floor at that size), "tcp" (CPU tensors over tcp).
FLOOR_KINDS = ("gpu", "gpu+tcp", "tcp")


def load_floors(paths) -> Dict[str, Any]:
    """The floors JSON (benchmarks/floors/build/floors --json PATH, and/or build/tcp_floor --json
    PATH) plus the values used here. ``paths``: one path or a list of them; the results of several
    files are pooled (e.g. the GPU floors and the tcp floors of one machine).

    Returns {"path", "contents", "cross_process_flag_us", "gpu_cpu_gpu_flag_us",
    "data_floor_sm_us": {bytes (str): median µs}, "tcp_one_way_us": {bytes (str): median µs},
    "tcp_one_way_variant": {bytes (str): receive method}, "tcp_one_way_name" (TCP_HOSTS where the
    files have such rows, else TCP_FLOOR), "tcp_netns_one_way_us", "warnings"};
    raises ValueError if the files hold no usable floor."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise ValueError("no floors file given")
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    names = [os.path.abspath(p) for p in paths]
    if len(docs) == 1:
        return floors_from_doc(docs[0], names[0])
    return floors_from_doc(merge_floor_docs(docs, names), " + ".join(names))


def merge_floor_docs(docs: Sequence[Any], names: Sequence[str]) -> Dict[str, Any]:
    """One floors document from several: every file's header under "merged_from" (with its
    path), all their result rows in "results" (each with its "source" path)."""
    merged: Dict[str, Any] = {"merged_from": [], "results": []}
    for doc, name in zip(docs, names):
        res = doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(res, list):
            raise ValueError(f"{name}: no 'results' list (not a floors --json file?)")
        merged["merged_from"].append(
            {"path": name, **{k: v for k, v in doc.items() if k != "results"}})
        merged["results"] += [dict(r, source=name) for r in res if isinstance(r, dict)]
    return merged


def floors_from_doc(doc: Any, path: str) -> Dict[str, Any]:
    """As load_floors, from the parsed JSON (e.g. a bench JSON's metadata.floors.contents)."""
    res = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(res, list):
        raise ValueError(f"{path}: no 'results' list (not a floors --json file?)")

    def ok_rows(name: str, variant: Optional[str] = "") -> List[dict]:
        """Passing rows of that name (and variant; None: any variant)."""
        return [r for r in res if isinstance(r, dict) and r.get("name") == name
                and (variant is None or (r.get("variant") or "") == variant)
                and r.get("ok") is True
                and isinstance(r.get("median_us"), (int, float)) and r["median_us"] > 0]

    def fastest_per_size(name: str) -> Dict[int, dict]:
        """The lowest median per size over the receive methods measured."""
        best: Dict[int, dict] = {}
        for r in ok_rows(name, None):
            b = int(r["bytes"])
            if b not in best or r["median_us"] < best[b]["median_us"]:
                best[b] = r
        return best

    # The lowest of the flag kinds measured (acquire/release, LL line): a floor is the fastest
    # way found, and the kernels signal with LL lines.
    xp = sorted(ok_rows(XP_FLOOR) + ok_rows(XP_FLOOR, "ll"), key=lambda r: r["median_us"])
    data = {int(r["bytes"]): float(r["median_us"]) for r in ok_rows(*DATA_FLOOR)}
    hosts = fastest_per_size(TCP_HOSTS)
    tcp_name = TCP_HOSTS if hosts else TCP_FLOOR
    tcp, netns = hosts or fastest_per_size(TCP_FLOOR), fastest_per_size(TCP_NETNS)
    if not (xp or data or tcp):
        raise ValueError(f"{path}: no passing '{XP_FLOOR}', '{DATA_FLOOR[0]}', "
                         f"'{TCP_FLOOR}' or '{TCP_HOSTS}' row")
    # The GPU floors come as a pair (one floors run); one without the other is a broken file.
    if data and not xp:
        raise ValueError(f"{path}: no passing '{XP_FLOOR}' row")
    if xp and not data:
        raise ValueError(f"{path}: no passing '{DATA_FLOOR[0]}/{DATA_FLOOR[1]}' rows")
    warnings = []
    if xp and ("budget" in str(xp[0].get("note", "")) or xp[0]["median_us"] > 100):
        warnings.append(f"{XP_FLOOR} = {xp[0]['median_us']} µs ({xp[0].get('note', '')}): "
                        "measured without MPS? ratios to it are meaningless")
    g2c = ok_rows("gpu_cpu_gpu_flag")
    return {
        "path": path,
        "contents": doc,
        "cross_process_flag_us": float(xp[0]["median_us"]) if xp else None,
        "gpu_cpu_gpu_flag_us": float(g2c[0]["median_us"]) if g2c else None,
        "data_floor_sm_us": {str(k): data[k] for k in sorted(data)},
        "tcp_one_way_us": {str(k): float(tcp[k]["median_us"]) for k in sorted(tcp)},
        "tcp_one_way_variant": {str(k): tcp[k].get("variant") or "" for k in sorted(tcp)},
        "tcp_one_way_name": tcp_name,
        "tcp_netns_one_way_us": {str(k): float(netns[k]["median_us"]) for k in sorted(netns)},
        "warnings": warnings,
    }


def _interpolate(points: Dict[str, float], nbytes: int, name: str) -> Tuple[float, str]:
    """The value at ``nbytes`` of a floor measured at some sizes: exact, else linear in log2(size)
    between the two measured sizes around it, else the nearest measured size."""
    pts = sorted((int(k), v) for k, v in points.items())
    for s, v in pts:
        if s == nbytes:
            return v, f"{name} {_fmt_size(s)}"
    below = [p for p in pts if p[0] < nbytes]
    above = [p for p in pts if p[0] > nbytes]
    if not below:
        return above[0][1], f"{name} {_fmt_size(above[0][0])} (nearest)"
    if not above:
        return below[-1][1], f"{name} {_fmt_size(below[-1][0])} (nearest)"
    (s0, v0), (s1, v1) = below[-1], above[0]
    w = (math.log2(nbytes) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
    return v0 + w * (v1 - v0), f"{name} {_fmt_size(s0)}..{_fmt_size(s1)} (log-size interp.)"


def floor_for(floors: Dict[str, Any], nbytes: int,
              kind: str = "gpu") -> Optional[Tuple[float, str]]:
    """(floor µs, which floor) for a cell of ``nbytes`` held to floor ``kind`` (FLOOR_KINDS), or
    None when the floors lack what that kind needs.

    "gpu": 8 B (and less): the cross-process flag floor; larger: the SM data floor at that size.
    "tcp": the tcp one-way floor (loopback, the faster receive method) at that size.
    "gpu+tcp": the sum of the two at that size (GPU->host, tcp, host->GPU).
    Between two measured sizes: linear interpolation in log2(size); outside the measured range:
    the nearest measured size."""
    if kind not in FLOOR_KINDS:
        raise ValueError(f"unknown floor kind {kind!r}; choose from {', '.join(FLOOR_KINDS)}")
    gpu = tcp = None
    if kind in ("gpu", "gpu+tcp"):
        if nbytes <= 8 and floors.get("cross_process_flag_us") is not None:
            gpu = (floors["cross_process_flag_us"], XP_FLOOR)
        elif nbytes > 8 and floors.get("data_floor_sm_us"):
            gpu = _interpolate(floors["data_floor_sm_us"], nbytes, DATA_FLOOR[0])
        if gpu is None:
            return None
    if kind in ("tcp", "gpu+tcp"):
        if not floors.get("tcp_one_way_us"):
            return None
        tcp = _interpolate(floors["tcp_one_way_us"], nbytes,
                           floors.get("tcp_one_way_name") or TCP_FLOOR)
    if gpu and tcp:
        return gpu[0] + tcp[0], f"{gpu[1]} + {tcp[1]}"
    return gpu or tcp


def row_transport(row: dict) -> Optional[str]:
    """The transport of a row's ranks ("shm", "tcp", "ib"; "shm" for rows that do not say)."""
    t = row.get("transport")
    return "shm" if t in (None, "", "auto") else t


def row_floor_kind(row: dict) -> Optional[str]:
    """The floor a row is held to: tcp rows by device ("gpu+tcp" for CUDA tensors, "tcp" for
    CPU tensors), other CUDA rows "gpu"; CPU rows not over tcp and ib rows have none."""
    transport, cuda = row_transport(row), row.get("device", "cuda") == "cuda"
    if transport == "tcp":
        return "gpu+tcp" if cuda else "tcp"
    return "gpu" if cuda and transport == "shm" else None


def annotate_rows(rows: List[dict], floors: Optional[Dict[str, Any]]) -> None:
    """Add floor_kind, floor_us, floor (which floor) and floor_ratio (median / floor) to every
    row with a median that has a floor (row_floor_kind) the floors provide."""
    if not floors:
        return
    for r in rows:
        kind = row_floor_kind(r)
        got = floor_for(floors, r["size_bytes"], kind) if kind and "median_us" in r else None
        if got:
            r["floor_kind"], (r["floor_us"], r["floor"]) = kind, got
            r["floor_ratio"] = r["median_us"] / got[0]


# --------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------

DECODE_MAX = 64 * 1024

DECODE_OPS = ["all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "send_recv"]

# Each target: the cells it covers (device, transport, world size, mode, ops, sizes), the largest
# allowed median / floor (the floor of row_floor_kind: "gpu" for shm, "gpu+tcp" for CUDA tensors
# over tcp, "tcp" for CPU tensors over tcp; max_ratio_two_cpus on hosts of at most 2 CPUs), and
# the paths on which it must hold (a path missing from the run makes the target N/A).
CUDA_TARGETS = [
    {"name": "all_reduce 8 B", "device": "cuda", "transport": "shm", "world_size": 2,
     "mode": "graph", "ops": ["all_reduce"], "sizes": [8], "max_ratio": 1.5,
     "paths": ["direct", "proxy"]},
    {"name": "all_reduce 64 KiB", "device": "cuda", "transport": "shm", "world_size": 2,
     "mode": "graph", "ops": ["all_reduce"], "sizes": [64 * 1024], "max_ratio": 1.5,
     "paths": ["direct", "proxy"]},
    {"name": "all_to_all_single, all_gather, reduce_scatter, send/recv <= 64 KiB",
     "device": "cuda", "transport": "shm", "world_size": 2, "mode": "graph", "ops": DECODE_OPS,
     "sizes": "decode", "max_ratio": 2.0, "paths": ["direct", "proxy"]},
]
# The tcp path: every tcp peer is served by the proxy.
TCP_TARGETS = [
    {"name": "all_reduce 8 B over tcp", "device": "cuda", "transport": "tcp", "world_size": 2,
     "mode": "graph", "ops": ["all_reduce"], "sizes": [8], "max_ratio": 1.5, "paths": ["proxy"]},
    {"name": "all_reduce 64 KiB over tcp", "device": "cuda", "transport": "tcp", "world_size": 2,
     "mode": "graph", "ops": ["all_reduce"], "sizes": [64 * 1024], "max_ratio": 1.5,
     "paths": ["proxy"]},
    {"name": "all_to_all_single, all_gather, reduce_scatter, send/recv <= 64 KiB over tcp",
     "device": "cuda", "transport": "tcp", "world_size": 2, "mode": "graph", "ops": DECODE_OPS,
     "sizes": "decode", "max_ratio": 2.0, "paths": ["proxy"]},
    {"name": "CPU tensors, all_reduce 8 B over tcp", "device": "cpu", "transport": "tcp",
     "world_size": 2, "mode": "eager", "ops": ["all_reduce"], "sizes": [8], "max_ratio": 2.0,
     "max_ratio_two_cpus": 2.5, "paths": ["proxy"]},
]


def default_configuration(row: dict) -> bool:
    """The backend as a user gets it: no RESIDENT_* setting and no backend option but the path
    and the transport. The targets are judged on these cells only; an A/B run's other variants
    are compared in the tables, not held to the targets."""
    return (row.get("backend", "resident") == "resident"
            and set(row.get("env_options") or {}) <= {"RESIDENT_TRANSPORT"}
            and set(row.get("pg_options") or {}) <= {"path", "transport"})


def evaluate_targets(rows: List[dict], floors: Optional[Dict[str, Any]],
                     sizes_run: Sequence[int], device: str = "cuda",
                     cpu_count: Optional[int] = None) -> List[Dict[str, Any]]:
    """One result per target of ``device`` (CUDA_TARGETS, then TCP_TARGETS): verdict (PASS /
    MISS / INCOMPLETE / N/A), per-path details and a text line, on the cells of the default
    configuration (default_configuration) over the target's transport, each held to its own
    floor (row_floor_kind). ``cpu_count``: this host's CPUs (default os.cpu_count()), for the
    targets with a limit of their own on hosts of at most 2 CPUs."""
    rows = [r for r in rows if default_configuration(r)]
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 0)
    out = []
    for t in [t for t in CUDA_TARGETS + TCP_TARGETS if t["device"] == device]:
        sizes = ([s for s in sizes_run if s <= DECODE_MAX] if t["sizes"] == "decode"
                 else list(t["sizes"]))
        limit = t["max_ratio"]
        if "max_ratio_two_cpus" in t and 0 < cpus <= 2:
            limit = t["max_ratio_two_cpus"]
        kind = "gpu" if t["transport"] == "shm" else ("gpu+tcp" if device == "cuda" else "tcp")
        what = (f"TARGET {device} {t['world_size']} ranks, {t['mode']}, {t['name']}: "
                f"median <= {limit:g}x floor" + ("" if kind == "gpu" else f" {kind}")
                + f" on paths {'+'.join(t['paths'])}"
                + (f" ({cpus} cpus)" if limit != t["max_ratio"] else ""))
        res: Dict[str, Any] = {**t, "sizes": sizes, "max_ratio": limit, "floor_kind": kind,
                               "paths_result": {}}
        if not floors:
            res.update(verdict="N/A", line=f"{what}: N/A (no --floors)")
            out.append(res)
            continue
        if not sizes:
            res.update(verdict="N/A", line=f"{what}: N/A (no such size in this run)")
            out.append(res)
            continue
        if floor_for(floors, sizes[0], kind) is None:
            res.update(verdict="N/A", line=f"{what}: N/A (--floors lacks the {kind} floor)")
            out.append(res)
            continue
        parts, verdicts = [], []
        for path in t["paths"]:
            cells = [r for r in rows if r.get("world_size") == t["world_size"]
                     and r.get("mode") == t["mode"] and r.get("path") == path
                     and row_transport(r) == t["transport"]
                     and r.get("device", "cuda") == device
                     and r.get("op") in t["ops"] and r.get("size_bytes") in sizes]
            if not cells:
                verdicts.append("N/A")
                parts.append(f"{path}: N/A (not run)")
                res["paths_result"][path] = {"verdict": "N/A"}
                continue
            missing = len(t["ops"]) * len(sizes) - len({(r["op"], r["size_bytes"]) for r in cells})
            bad = [r for r in cells if "median_us" not in r]
            wrong = [r for r in cells if r.get("check", "ok") not in ("ok", "skipped")]
            timed = [r for r in cells if "median_us" in r]
            ratios = [(r["median_us"] / floor_for(floors, r["size_bytes"], kind)[0], r)
                      for r in timed]
            over = [(x, r) for x, r in ratios if x > limit]
            # MISS: a cell over the limit or one that failed; INCOMPLETE: the measured cells are
            # within it, but some of the target's (op, size) cells were not in this run.
            v = "MISS" if over or bad else ("INCOMPLETE" if missing else "PASS")
            if wrong:
                v += " but INVALID: wrong results"
            verdicts.append(v)
            worst = max(ratios, key=lambda p: p[0]) if ratios else None
            detail = []
            if len(cells) == 1 and worst:
                r = worst[1]
                f_us, f_name = floor_for(floors, r["size_bytes"], kind)
                detail.append(f"{_fmt_us(r['median_us'])} µs = {worst[0]:.2f}x "
                              f"{f_name} ({_fmt_us(f_us)} µs)")
            elif worst:
                r = worst[1]
                detail.append(f"worst {r['op']} {_fmt_size(r['size_bytes'])} "
                              f"{_fmt_us(r['median_us'])} µs = {worst[0]:.2f}x")
                detail.append(f"{len(over)}/{len(ratios)} cells over")
            if bad or missing:
                detail.append(f"{len(bad) + missing} cell(s) without a result")
            if wrong:
                detail.append(f"{len(wrong)} cell(s) with wrong results")
            parts.append(f"{path}: {v} ({', '.join(detail)})")
            res["paths_result"][path] = {
                "verdict": v, "cells": len(cells), "over": len(over),
                "no_result": len(bad) + missing, "wrong": len(wrong),
                "worst_ratio": worst[0] if worst else None,
                "ratios": {f"{r['op']} {r['size_bytes']}": x for x, r in ratios}}
        if device == "cpu" and t["transport"] == "tcp":
            # The same op over shm in this run, held to the same floor: how much of the budget
            # the layers above the transport (torch's wrapper, the backend's op) take alone.
            shm = [r for r in rows if r.get("world_size") == t["world_size"]
                   and r.get("mode") == t["mode"] and row_transport(r) == "shm"
                   and r.get("device", "cuda") == "cpu" and r.get("op") in t["ops"]
                   and r.get("size_bytes") == sizes[0] and "median_us" in r]
            if shm:
                fastest = min(r["median_us"] for r in shm)
                ratio = fastest / floor_for(floors, sizes[0], kind)[0]
                res["shm_ratio"] = ratio
                parts.append(f"over shm in this run: {_fmt_us(fastest)} µs = {ratio:.2f}x")
        if all(v == "PASS" for v in verdicts):
            overall = "PASS"
        elif all(v == "N/A" for v in verdicts):
            overall = "N/A"
        elif any(v.startswith("MISS") or "INVALID" in v for v in verdicts):
            overall = "MISS"
        else:  # no path missed, but a path or some cells were not run
            overall = "INCOMPLETE"
        res.update(verdict=overall, line=f"{what}: {overall}  [{'; '.join(parts)}]")
        out.append(res)
    return out


# --------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------

def print_cuda_tables(rows: List[dict], world_sizes, modes, variants, ops, sizes,
                      floors: Optional[Dict[str, Any]], spread: bool, out=None) -> None:
    """One table per (world size, mode): µs per variant, the floor of each floor kind that a
    variant is held to (row_floor_kind: "gpu", or "gpu+tcp" for a variant over tcp), and
    median / its floor."""
    out = out or sys.stdout
    idx = {(r["world_size"], r.get("mode"), r.get("variant"), r["op"], r["size_bytes"]): r
           for r in rows}
    short = _short_names(variants)
    vkind = variant_floor_kinds(rows, variants)
    kinds = [k for k in FLOOR_KINDS if k in vkind.values()]
    for ws in world_sizes:
        for mode in modes:
            head = ["op", "size"]
            for v in variants:
                head.append(f"{short[v]} µs")
                if spread:
                    head.append("p10-p90")
            if floors:
                head += [f"{'' if k == 'gpu' else k + ' '}floor µs" for k in kinds]
                head += [f"{short[v]}/floor" for v in variants]
            lines, notes = [], set()
            for op in ops:
                if op == "send_recv" and ws < 2:
                    continue
                for size in sizes:
                    c = [op, _fmt_size(size)]
                    meds = {}
                    for v in variants:
                        got, med = common.latency_cells(idx.get((ws, mode, v, op, size)), size,
                                                        notes, spread)
                        c += got
                        if med is not None:
                            meds[v] = med
                    if floors:
                        fl = {k: floor_for(floors, size, k) for k in kinds}
                        c += [_fmt_us(fl[k][0]) if fl[k] else "-" for k in kinds]
                        c += [f"{meds[v] / fl[vkind[v]][0]:.2f}x"
                              if v in meds and fl.get(vkind[v]) else "-" for v in variants]
                    lines.append(c)
            names = "; ".join(f"{short[v]} = {v}" for v in variants if short[v] != v)
            print(f"\n== cuda, world size {ws}, mode {mode}: µs per op, median over "
                  f"repetitions, max over ranks" + ("; p10-p90 likewise" if spread else "")
                  + (f" ({names})" if names else ""), file=out)

            print_table(head, lines, notes, out)
    if floors:
        print_floor_legend(floors, {short[v]: vkind[v] for v in variants}, out)
    out.flush()


def variant_floor_kinds(rows: List[dict], variants: Sequence[str]) -> Dict[str, Optional[str]]:
    """variant -> the floor kind of its rows (row_floor_kind; the first row's, else None)."""
    kinds: Dict[str, Optional[str]] = {v: None for v in variants}
    for r in rows:
        v = r.get("variant", r.get("label"))
        if v in kinds and kinds[v] is None:
            kinds[v] = row_floor_kind(r)
    return kinds


def print_floor_legend(floors: Dict[str, Any], held: Dict[str, Optional[str]], out) -> None:
    """Which floor each variant is held to, and the floors' values."""
    print(f"\nfloors ({floors['path']}); each variant's floor: "
          + ", ".join(f"{v}: {k or 'none'}" for v, k in held.items()), file=out)
    if floors.get("cross_process_flag_us") is not None:
        print(f"  gpu: 8 B cells: {XP_FLOOR} {_fmt_us(floors['cross_process_flag_us'])} µs "
              f"one-way; larger cells: {DATA_FLOOR[0]}/{DATA_FLOOR[1]} (GPU->host->GPU by SM "
              f"stores/loads, per graph replay) at that size, interpolated in log2(size) "
              "between measured sizes "
              + ", ".join(f"{_fmt_size(int(k))}: {_fmt_us(v)}"
                          for k, v in floors["data_floor_sm_us"].items()), file=out)
    if floors.get("tcp_one_way_us"):
        name = floors.get("tcp_one_way_name") or TCP_FLOOR
        where = "two hosts" if name == TCP_HOSTS else "two processes"
        print(f"  tcp: {name} one-way (busy-polled TCP ping-pong between {where}, "
              "the faster receive method per size), interpolated likewise "
              + ", ".join(f"{_fmt_size(int(k))}: {_fmt_us(v)} "
                          f"({floors['tcp_one_way_variant'].get(k, '')})"
                          for k, v in floors["tcp_one_way_us"].items()), file=out)
        if "gpu+tcp" in held.values():
            print("  gpu+tcp: CUDA tensors over tcp, GPU->host + tcp + host->GPU = the gpu floor "
                  "+ the tcp floor at that size", file=out)
    elif any(k in ("tcp", "gpu+tcp") for k in held.values()):
        print("  (no tcp floor in --floors: give the JSON of benchmarks/floors/build/tcp_floor "
              "too, e.g. --floors floors.json --floors tcp_floors.json)", file=out)
    for w in floors.get("warnings", []):
        print(f"  WARNING: {w}", file=out)


def print_tcp_floor_table(rows: List[dict], world_sizes, variants: Sequence[str], ops, sizes,
                          floors: Dict[str, Any], out=None) -> None:
    """CPU runs: the variants over tcp beside the tcp one-way floor (median / floor)."""
    out = out or sys.stdout
    vkind = variant_floor_kinds(rows, variants)
    tcp_variants = [v for v in variants if vkind[v] == "tcp"]
    if not tcp_variants:
        return
    idx = {(r["world_size"], r.get("variant", r.get("label")), r["op"], r["size_bytes"]): r
           for r in rows}
    for ws in world_sizes:
        head = ["op", "size"] + [f"{v} µs" for v in tcp_variants] + ["tcp floor µs"]
        head += [f"{v}/floor" for v in tcp_variants]
        lines, notes = [], set()
        for op in ops:
            if op == "send_recv" and ws < 2:
                continue
            for size in sizes:
                c, meds = [op, _fmt_size(size)], {}
                for v in tcp_variants:
                    got, med = common.latency_cells(idx.get((ws, v, op, size)), size, notes, False)
                    c += got
                    if med is not None:
                        meds[v] = med
                f = floor_for(floors, size, "tcp")
                c.append(_fmt_us(f[0]) if f else "-")
                c += [f"{meds[v] / f[0]:.2f}x" if f and v in meds else "-" for v in tcp_variants]
                lines.append(c)
        print(f"\n== cpu over tcp, world size {ws}: µs per op (median, max over ranks) and "
              "ratio to the tcp one-way floor", file=out)
        print_table(head, lines, notes, out)
    print_floor_legend(floors, {v: vkind[v] for v in variants}, out)


def _short_names(variants: Sequence[str]) -> Dict[str, str]:
    """'resident:path=direct' -> 'direct' when every variant is of the same backend."""
    heads = {v.split(":", 1)[0] for v in variants}
    out = {}
    for v in variants:
        s = v.split(":", 1)[1] if len(heads) == 1 and ":" in v else v
        s = s.replace("path=", "")
        out[v] = s if s and list(out.values()).count(s) == 0 else v
    return out


