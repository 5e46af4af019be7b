"""The CUDA half of resident_pg.bench: ``--device cuda``, ``--mode graph``, ``--floors``.

Used by ``resident_pg/bench.py``'s rank side and report; it imports only bench_common (as
they do: as a package module, or as a top-level one when the bench runs as a plain script,
``python resident_pg/bench.py``).

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
* floors: :func:`load_floors` reads the JSON of ``benchmarks/floors/build/floors --json``;
  :func:`floor_for` gives the floor a cell is held to; :func:`cuda_target_lines` evaluates the
  targets of :data:`CUDA_TARGETS`; :func:`print_cuda_tables` prints µs and ratios to the floor.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__:
    from . import bench_common as common
else:  # run as a script: the siblings are top-level modules
    import bench_common as common  # type: ignore[no-redef]

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



def print_table(head: Sequence[Any], lines: List[Sequence[Any]], notes: str, out) -> None:
    """Prints a latency table (op and size left-aligned, numbers right-aligned, a blank line
    between ops) and the legend of the notes that occur. Shared by bench.py's CPU tables."""
    widths = [max(len(str(c[i])) for c in [head] + list(lines)) for i in range(len(head))]

    def fmt_row(c):
        return "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)
                         for i, (x, w) in enumerate(zip(c, widths)))
    print(fmt_row(head), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    prev = None
    for c in lines:
        if prev is not None and c[0] != prev:
            print("", file=out)
        prev = c[0]
        print(fmt_row(c), file=out)
    if "*" in notes:
        print("  * buffer rounded up (at least one float32 per rank / multiple of world "
              "size); see actual_bytes in the JSON", file=out)
    if "!" in notes:
        print("  ! correctness check FAILED for this cell (timing shown anyway)", file=out)

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


def load_floors(path: str) -> Dict[str, Any]:
    """The floors JSON (benchmarks/floors/build/floors --json PATH) plus the values used here.

    Returns {"path", "contents", "cross_process_flag_us", "gpu_cpu_gpu_flag_us",
    "data_floor_sm_us": {bytes (str): median µs}, "warnings": [...]}; raises ValueError if the
    file has no usable cross-process or data floor."""
    with open(path) as f:
        doc = json.load(f)
    return floors_from_doc(doc, os.path.abspath(path))


def floors_from_doc(doc: Any, path: str) -> Dict[str, Any]:
    """As load_floors, from the parsed JSON (e.g. a bench JSON's metadata.floors.contents)."""
    res = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(res, list):
        raise ValueError(f"{path}: no 'results' list (not a floors --json file?)")

    def ok_rows(name: str, variant: str = "") -> List[dict]:
        return [r for r in res if isinstance(r, dict) and r.get("name") == name
                and (r.get("variant") or "") == variant and r.get("ok") is True
                and isinstance(r.get("median_us"), (int, float)) and r["median_us"] > 0]

    # The lowest of the flag kinds measured (acquire/release, LL line): a floor is the fastest
    # way found, and the kernels signal with LL lines.
    xp = sorted(ok_rows(XP_FLOOR) + ok_rows(XP_FLOOR, "ll"), key=lambda r: r["median_us"])
    data = {int(r["bytes"]): float(r["median_us"]) for r in ok_rows(*DATA_FLOOR)}
    if not xp:
        raise ValueError(f"{path}: no passing '{XP_FLOOR}' row")
    if not data:
        raise ValueError(f"{path}: no passing '{DATA_FLOOR[0]}/{DATA_FLOOR[1]}' rows")
    warnings = []
    if "budget" in str(xp[0].get("note", "")) or xp[0]["median_us"] > 100:
        warnings.append(f"{XP_FLOOR} = {xp[0]['median_us']} µs ({xp[0].get('note', '')}): "
                        "measured without MPS? ratios to it are meaningless")
    g2c = ok_rows("gpu_cpu_gpu_flag")
    return {
        "path": path,
        "contents": doc,
        "cross_process_flag_us": float(xp[0]["median_us"]),
        "gpu_cpu_gpu_flag_us": float(g2c[0]["median_us"]) if g2c else None,
        "data_floor_sm_us": {str(k): data[k] for k in sorted(data)},
        "warnings": warnings,
    }


def floor_for(floors: Dict[str, Any], nbytes: int) -> Tuple[float, str]:
    """(floor µs, which floor) for a cell of ``nbytes``.

    8 B (and less): the cross-process flag floor.  Larger: the SM data floor at that size;
    between two measured sizes, linear interpolation in log2(size); outside the measured range,
    the nearest measured size."""
    if nbytes <= 8:
        return floors["cross_process_flag_us"], XP_FLOOR
    pts = sorted((int(k), v) for k, v in floors["data_floor_sm_us"].items())
    name = "data_floor_sm"
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


def annotate_rows(rows: List[dict], floors: Optional[Dict[str, Any]]) -> None:
    """Add floor_us, floor and floor_ratio (median / floor) to every row with a median."""
    if not floors:
        return
    for r in rows:
        if "median_us" not in r:
            continue
        f, kind = floor_for(floors, r["size_bytes"])
        r["floor_us"], r["floor"] = f, kind
        r["floor_ratio"] = r["median_us"] / f


# --------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------

DECODE_MAX = 64 * 1024

# Each target: the cells it covers (2 ranks, graph mode), the largest allowed median / floor,
# and the paths on which it must hold (a path missing from the run makes the target N/A).
CUDA_TARGETS = [
    {"name": "all_reduce 8 B", "world_size": 2, "mode": "graph", "ops": ["all_reduce"],
     "sizes": [8], "max_ratio": 1.5, "paths": ["direct", "proxy"]},
    {"name": "all_reduce 64 KiB", "world_size": 2, "mode": "graph", "ops": ["all_reduce"],
     "sizes": [64 * 1024], "max_ratio": 1.5, "paths": ["direct", "proxy"]},
    {"name": "all_to_all_single, all_gather, reduce_scatter, send/recv <= 64 KiB",
     "world_size": 2, "mode": "graph",
     "ops": ["all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "send_recv"],
     "sizes": "decode", "max_ratio": 2.0, "paths": ["direct", "proxy"]},
]


def default_configuration(row: dict) -> bool:
    """The backend as a user gets it: no RESIDENT_* setting and no backend option but the path.
    The targets are judged on these cells only; an A/B run's other variants are compared in
    the tables, not held to the targets."""
    return (row.get("backend", "resident") == "resident" and not row.get("env_options")
            and set(row.get("pg_options") or {}) <= {"path"})


def evaluate_targets(rows: List[dict], floors: Optional[Dict[str, Any]],
                     sizes_run: Sequence[int]) -> List[Dict[str, Any]]:
    """One result per target: verdict (PASS / MISS / INCOMPLETE / N/A), per-path details and a
    text line, on the cells of the default configuration (default_configuration)."""
    rows = [r for r in rows if default_configuration(r)]
    out = []
    for t in CUDA_TARGETS:
        sizes = ([s for s in sizes_run if s <= DECODE_MAX] if t["sizes"] == "decode"
                 else list(t["sizes"]))
        what = (f"TARGET cuda {t['world_size']} ranks, {t['mode']}, {t['name']}: "
                f"median <= {t['max_ratio']:g}x floor on paths {'+'.join(t['paths'])}")
        res: Dict[str, Any] = {**t, "sizes": sizes, "paths_result": {}}
        if not floors:
            res.update(verdict="N/A", line=f"{what}: N/A (no --floors)")
            out.append(res)
            continue
        if not sizes:
            res.update(verdict="N/A", line=f"{what}: N/A (no such size in this run)")
            out.append(res)
            continue
        parts, verdicts = [], []
        for path in t["paths"]:
            cells = [r for r in rows if r.get("world_size") == t["world_size"]
                     and r.get("mode") == t["mode"] and r.get("path") == path
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
            ratios = [(r["median_us"] / floor_for(floors, r["size_bytes"])[0], r) for r in timed]
            over = [(x, r) for x, r in ratios if x > t["max_ratio"]]
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
                detail.append(f"{_fmt_us(r['median_us'])} µs = {worst[0]:.2f}x "
                              f"{floor_for(floors, r['size_bytes'])[1]} "
                              f"({_fmt_us(floor_for(floors, r['size_bytes'])[0])} µs)")
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
    """One table per (world size, mode): µs per variant, the floor, and median / floor."""
    out = out or sys.stdout
    idx = {(r["world_size"], r.get("mode"), r.get("variant"), r["op"], r["size_bytes"]): r
           for r in rows}
    short = _short_names(variants)
    for ws in world_sizes:
        for mode in modes:
            head = ["op", "size"]
            for v in variants:
                head.append(f"{short[v]} µs")
                if spread:
                    head.append("p10-p90")
            if floors:
                head.append("floor µs")
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
                        f, _ = floor_for(floors, size)
                        c.append(_fmt_us(f))
                        c += [f"{meds[v] / f:.2f}x" if v in meds else "-" for v in variants]
                    lines.append(c)
            names = "; ".join(f"{short[v]} = {v}" for v in variants if short[v] != v)
            print(f"\n== cuda, world size {ws}, mode {mode}: µs per op, median over "
                  f"repetitions, max over ranks" + ("; p10-p90 likewise" if spread else "")
                  + (f" ({names})" if names else ""), file=out)

            print_table(head, lines, notes, out)
    if floors:
        print(f"\nfloors ({floors['path']}): 8 B cells: {XP_FLOOR} "
              f"{_fmt_us(floors['cross_process_flag_us'])} µs one-way; larger cells: "
              f"{DATA_FLOOR[0]}/{DATA_FLOOR[1]} (GPU->host->GPU by SM stores/loads, per graph "
              f"replay) at that size, interpolated in log2(size) between measured sizes "
              + ", ".join(f"{_fmt_size(int(k))}: {_fmt_us(v)}"
                          for k, v in floors["data_floor_sm_us"].items()), file=out)
        for w in floors.get("warnings", []):
            print(f"  WARNING: {w}", file=out)
    out.flush()


def _short_names(variants: Sequence[str]) -> Dict[str, str]:
    """'resident:path=direct' -> 'direct' when every variant is of the same backend."""
    heads = {v.split(":", 1)[0] for v in variants}
    out = {}
    for v in variants:
        s = v.split(":", 1)[1] if len(heads) == 1 and ":" in v else v
        s = s.replace("path=", "")
        out[v] = s if s and list(out.values()).count(s) == 0 else v
    return out


