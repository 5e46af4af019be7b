"""The results of the interference benchmark (``python -m resident_pg.bench.interference``):
statistics of the samples, one summary row per (mode, condition, batch), the text table and
the JSON document. Imports no torch at module level."""

from __future__ import annotations

import datetime
import io
import os
import platform
import socket
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import common, report

SCHEMA = "resident_pg.bench_interference/1"


def stats(samples: Sequence[float]) -> Dict[str, float]:
    return {"median": common.percentile(samples, 50), "p10": common.percentile(samples, 10),
            "p90": common.percentile(samples, 90)}


def condition_names(sizes: Sequence[int]) -> List[str]:
    return ["baseline", "alone"] + [f"concurrent {common.fmt_size(s)}" for s in sizes]


def summarize(mode: str, per_rank: Dict[int, dict], batches: Sequence[int],
              sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per (condition, batch) of one mode from the ranks' raw results: GEMM median /
    p10 / p90 (max over the ranks that timed it), slowdown vs the baseline (max over ranks of
    the per-rank ratio), all_reduce latency concurrent and alone (max over ranks), the lowest
    overlap over ranks and replays, and whether every check passed."""
    rows = []
    timed = {r: v for r, v in per_rank.items() if v.get("times_gemm")}
    for cond in condition_names(sizes):
        size = None if not cond.startswith("concurrent") else sizes[condition_names(sizes).index(cond) - 2]
        for b in batches:
            row: Dict[str, Any] = {"mode": mode, "condition": cond, "batch": b, "size_bytes": size}
            meds, p10s, p90s, ratios, comm, alone, covs = [], [], [], [], [], [], []
            for r, v in timed.items():
                g = v["gemm"].get(cond, {}).get(str(b))
                base = v["gemm"].get("baseline", {}).get(str(b))
                if not g:
                    continue
                s = stats(g)
                meds.append(s["median"])
                p10s.append(s["p10"])
                p90s.append(s["p90"])
                if base:
                    ratios.append(s["median"] / stats(base)["median"])
            for r, v in per_rank.items():
                if size is None:
                    continue
                c = v.get("concurrent", {}).get(str(size), {}).get(str(b))
                if c:
                    comm.append(stats(c["per_op_us"])["median"])
                    covs.append(min(c["coverage"]))
                a = v.get("comm_alone", {}).get(str(size))
                if a:
                    alone.append(stats(a)["median"])
            if meds:
                row.update(gemm_median_us=max(meds), gemm_p10_us=max(p10s), gemm_p90_us=max(p90s))
            if ratios:
                row["vs_baseline"] = max(ratios)
            if comm:
                row["allreduce_us"] = max(comm)
                row["overlap_min"] = min(covs)
            if alone:
                row["allreduce_alone_us"] = max(alone)
            row["check"] = "ok" if all(not v.get("check_errors") for v in per_rank.values()) else "FAILED"
            rows.append(row)
    return rows


def format_table(rows: Sequence[Dict[str, Any]], title: str) -> str:
    """The rows as a text table (blank line between modes), with a legend."""
    fmt = common.fmt_us
    head = ["mode", "condition", "batch", "GEMM µs", "p10-p90", "vs baseline", "all_reduce µs",
            "alone µs", "overlap"]
    lines, notes = [], set()
    for r in rows:
        mark = ""
        if r.get("check") not in (None, "ok"):
            mark = "!"
            notes.add("!")
        if "overlap_min" in r and r["overlap_min"] < 0.95:
            notes.add("~")
        lines.append([
            r["mode"], r["condition"], r["batch"],
            (fmt(r["gemm_median_us"]) + mark) if "gemm_median_us" in r else "-",
            f"{fmt(r['gemm_p10_us'])}-{fmt(r['gemm_p90_us'])}" if "gemm_p10_us" in r else "",
            f"{r['vs_baseline']:.3f}x" if "vs_baseline" in r else "-",
            fmt(r["allreduce_us"]) if "allreduce_us" in r else "",
            fmt(r["allreduce_alone_us"]) if "allreduce_alone_us" in r else "",
            (f"{r['overlap_min'] * 100:.0f}%" + ("~" if r["overlap_min"] < 0.95 else ""))
            if "overlap_min" in r else "",
        ])
    out = io.StringIO()
    print(f"\n== {title}", file=out)
    report.print_table(head, lines, "", out)
    if "!" in notes:
        print("  ! a correctness check FAILED in this launch (see errors)", file=out)
    if "~" in notes:
        print("  ~ the all_reduces covered less than 95% of some GEMM replay", file=out)
    return out.getvalue()


STATISTIC = ("GEMM: per rank, median/p10/p90 over replays of (replay time / gemm_reps), max over "
             "ranks; vs_baseline: max over ranks of the per-rank median ratio; all_reduce: max "
             "over ranks of the per-rank median")


def write_json(path: str, config: Dict[str, Any], rows: Sequence[Dict[str, Any]],
               launches: Sequence[Dict[str, Any]], errors: Sequence[Dict[str, Any]], total: float,
               gpu: Optional[Dict[str, Any]], argv: Sequence[str], torch_version: str) -> None:
    """The rows, each launch's raw results, the errors, the configuration and the metadata of
    the run, written to `path` as report.write_json writes the ladder's (a reader never sees half
    a document)."""
    doc = {
        "schema": SCHEMA,
        "metadata": {
            "hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": sys.version.split()[0],
            "torch_version": torch_version, "gpu": gpu,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": report._git_info(), "loadavg": report._loadavg(),
            "command_line": [sys.executable, "-m", "resident_pg.bench.interference"] + list(argv),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RESIDENT_")},
            "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        },
        "config": {**config, "statistic": STATISTIC},
        "results": list(rows),
        "launches": [{**ln, "results": {str(r): v for r, v in ln["results"].items()}}
                     for ln in launches],
        "errors": list(errors),
        "total_s": total,
    }
    report.write_json(doc, path)
