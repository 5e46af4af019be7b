"""Aggregation and output of resident_pg.bench (parent side): rows per cell from the ranks'
results, the median over rounds, the latency tables, the target line and the run metadata."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

from . import common

fmt_us = common.fmt_us



# --------------------------------------------------------------------------
# aggregation and output
# --------------------------------------------------------------------------

# The tags ladder.py puts on every row of a group (what it ran on); a row combined over rounds
# keeps them all, so that its floor and targets follow its transport as a one-round row's do.
TAG_KEYS = ("device", "mode", "variant", "path", "path_configured", "transport",
            "transport_configured", "pg_options", "env_options")


def aggregate(group: Any, tags: Optional[Dict[str, Any]] = None) -> List[dict]:
    """One row per cell of a finished bench.GroupRun; `tags` (device, mode, variant, path,
    ...) are copied into each."""
    rows = []
    for cid, op, size in group.cells:
        per_rank = group.results.get(cid, {})
        errs = group.cell_errors.get(cid, {})
        row: Dict[str, Any] = {
            "world_size": group.ws, "backend": group.backend, "label": group.label,
            **(tags or {}), "op": op, "size_bytes": size,
        }
        if per_rank and not errs:
            ranks = sorted(per_rank)
            r0 = per_rank[ranks[0]]
            row.update({
                "median_us": max(per_rank[r]["median_us"] for r in ranks),
                "p10_us": max(per_rank[r]["p10_us"] for r in ranks),
                "p90_us": max(per_rank[r]["p90_us"] for r in ranks),
                "slowest_rank": max(ranks, key=lambda r: per_rank[r]["median_us"]),
                "actual_bytes": r0["actual_bytes"],
                "batch": r0["batch"], "reps": r0["reps"],
                "check": next((per_rank[r]["check"] for r in ranks
                               if per_rank[r]["check"] != "ok"), "ok"),
                "ranks": {str(r): per_rank[r] for r in ranks},
            })
        elif errs:
            row["error"] = _first_error(errs)
        else:
            row["error"] = (group.skip_reason or
                            "not run (earlier failure of this op or of the group)")
        rows.append(row)
    return rows


def combine_rounds(rows: List[dict], rounds: int) -> List[dict]:
    """One row per (world size, label, op, size): median over rounds of each statistic.

    With one round the rows are returned as they are (plus round_medians_us)."""
    by_key: Dict[tuple, List[dict]] = {}
    for r in rows:
        by_key.setdefault((r["world_size"], r["label"], r["op"], r["size_bytes"]), []).append(r)
    out = []
    for key, rs in by_key.items():
        ok = [r for r in rs if "median_us" in r]
        if rounds == 1 and len(rs) == 1:
            row = dict(rs[0])
            row.pop("round", None)
        elif not ok:
            row = {k: v for k, v in rs[0].items() if k not in ("round",)}
        else:
            row = {k: ok[0][k] for k in ("world_size", "backend", "label", *TAG_KEYS, "op",
                                         "size_bytes", "actual_bytes", "check") if k in ok[0]}
            for k in ("median_us", "p10_us", "p90_us"):
                row[k] = common._median([r[k] for r in ok])
            bad = [r["check"] for r in ok if r["check"] != "ok"]
            row["check"] = bad[0] if bad else "ok"
            errs = [r["error"] for r in rs if "error" in r]
            if errs:
                row["round_errors"] = errs
        row["rounds"] = len(ok)
        row["round_medians_us"] = [r["median_us"] for r in ok]
        out.append(row)
    return out


def _first_error(errs: Dict[int, str]) -> str:
    r = min(errs)
    who = "parent" if r < 0 else f"rank {r}"
    return f"{who}: {errs[r]}"


def print_table(head: Sequence[Any], lines: List[Sequence[Any]], notes: str, out) -> None:
    """Prints a latency table (op and size left-aligned, numbers right-aligned, a blank line
    between ops) and the legend of the notes that occur. Shared by the CPU, CUDA and interference tables."""
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


def print_tables(rows: List[dict], world_sizes, ops, sizes, labels, baseline,
                 spread: bool, rounds: int = 1, out=None) -> None:
    out = out or sys.stdout
    idx = {(r["world_size"], r["label"], r["op"], r["size_bytes"]): r for r in rows}
    others = [lb for lb in labels if lb != baseline] if baseline else []
    for ws in world_sizes:
        head = ["op", "size"]
        for lb in labels:
            head.append(f"{lb} µs")
            if spread:
                head.append("p10-p90")
            if rounds > 1:
                head.append("rounds")
        for lb in others:
            head += [f"{lb}/{baseline}", f"{baseline}/{lb}"]
        lines = []
        notes = set()
        for op in ops:
            for size in sizes:
                cells = [op, common.fmt_size(size)]
                meds = {}
                for lb in labels:
                    r = idx.get((ws, lb, op, size))
                    got, med = common.latency_cells(r, size, notes, spread)
                    cells += got
                    if med is None:
                        cells += [""] * int(rounds > 1)
                        continue
                    meds[lb] = med
                    if rounds > 1:
                        rm = r["round_medians_us"]
                        cells.append(f"{fmt_us(min(rm))}-{fmt_us(max(rm))} ({len(rm)})")
                for lb in others:
                    if lb in meds and baseline in meds and meds[lb] > 0 and meds[baseline] > 0:
                        cells += [f"{meds[lb] / meds[baseline]:.3f}",
                                  f"{meds[baseline] / meds[lb]:.2f}x"]
                    else:
                        cells += ["-", "-"]
                lines.append(cells)
        title = (f"world size {ws}: µs per op, median over repetitions, max over ranks"
                 + ("; p10-p90 likewise" if spread else "")
                 + (f"; median over {rounds} rounds (rounds: min-max of the round "
                    f"medians, rounds with a result)" if rounds > 1 else ""))
        print(f"\n== {title}", file=out)
        print_table(head, lines, notes, out)
    out.flush()


def target_line(rows: List[dict], labels: Sequence[str]) -> str:
    t = common.TARGET
    what = (f"TARGET {t['world_size']} ranks, {t['op']} {common.fmt_size(t['size'])}: "
            f"{t['baseline']}/{t['backend']} >= {t['min_speedup']:.0f}x")
    if t["backend"] not in labels or t["baseline"] not in labels:
        return f"{what}: N/A (needs backends {t['backend']} and {t['baseline']})"
    got = {}
    for r in rows:
        if (r["world_size"], r["op"], r["size_bytes"]) == (t["world_size"], t["op"], t["size"]) \
                and r["label"] in (t["backend"], t["baseline"]):
            got[r["label"]] = r
    missing = [lb for lb in (t["backend"], t["baseline"])
               if lb not in got or "median_us" not in got[lb]]
    if missing:
        return f"{what}: N/A (no result for {', '.join(missing)})"
    res, base = got[t["backend"]]["median_us"], got[t["baseline"]]["median_us"]
    speedup = base / res if res > 0 else float("inf")
    verdict = "PASS" if speedup >= t["min_speedup"] else "MISS"
    if got[t["backend"]].get("check", "ok") not in ("ok", "skipped"):
        verdict += " but INVALID: wrong results"
    return (f"{what}: {verdict}  ({t['baseline']} {fmt_us(base)} µs, {t['backend']} "
            f"{fmt_us(res)} µs, speed-up {speedup:.1f}x)")


def _worktree_tree(here: str) -> Optional[str]:
    """The git tree id of the files as they are (tracked and untracked, not ignored), through a
    scratch index, leaving the checkout's own index alone. A copy of a working tree whose HEAD is
    some older base (the GPU machine's) names the content that ran: the local commit with the
    same tree is `git log --format='%h %T' | grep <id>`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        for cmd in (["git", "read-tree", "HEAD"], ["git", "add", "-A", "."]):
            if subprocess.run(cmd, cwd=here, env=env, capture_output=True, timeout=60).returncode:
                return None
        out = subprocess.run(["git", "write-tree"], cwd=here, env=env, capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            return None
        return out.stdout.strip() or None


def _git_info() -> Dict[str, Any]:
    here = os.path.dirname(os.path.abspath(__file__))
    info: Dict[str, Any] = {"commit": None, "dirty": None, "tree": None}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
        st = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True,
                            text=True, timeout=10)
        if st.returncode == 0:
            info["dirty"] = bool(st.stdout.strip())
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        if top:
            info["tree"] = _worktree_tree(top)
    except Exception:
        pass
    return info


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _metadata(args, argv) -> Dict[str, Any]:
    import torch
    try:
        from importlib.metadata import version
        rpg_version = version("resident_pg")
    except Exception:
        rpg_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except Exception:
        affinity = None
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity_count": affinity,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "torch_version": torch.__version__,
        "torch_num_threads_parent": torch.get_num_threads(),
        "loadavg_start": _loadavg(),
        "resident_pg_version": rpg_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_info(),
        "command_line": (list(getattr(sys, "orig_argv", [])) if argv == sys.argv[1:]
                         else [sys.executable, "-m", "resident_pg.bench"] + list(argv)),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RESIDENT_")},
        "env_overrides": dict(args.env),
    }


def write_json(doc: Dict[str, Any], path: str) -> None:
    """Writes a run's document (ladder.run) to `path` atomically (a temporary file, renamed)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=True)
    os.replace(tmp, path)
    common._log(f"wrote {path}")
