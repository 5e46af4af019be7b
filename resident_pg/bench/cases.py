"""The ladder's cells as named benchmark cases (benchmarks/conftest.py), their reference, their
noise band and the regression gate against a per-machine baseline. Torch-free.

A case is one (device, mode, world size, backend variant, op, size) cell of a ladder run
(ladder.run's document). Its ratio is its median over the median of its reference in the
same run: the floor the ladder held it to (cuda.row_floor_kind, from ``--floors`` files measured
in the same job), else the baseline backend's cell of the same round (gloo on CPU tensors:
no floor program measures CPU tensors over shm). With several rounds (groups launched
A B A B ...) the ratio is the median of the per-round ratios and the noise band is their
relative range; with one round, the band is the relative p10-p90 spread of the samples.

The gate (``gate``) fails a case whose ratio exceeds the baseline's ratio by more than
max(noise band, min_band). Baselines are pytest-benchmark JSON files (``--benchmark-json``):
the gate reads each case's ``extra_info`` by name.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .cuda import row_floor_kind

TEST_NAME = "test_latency"


def case_id(device: str, mode: str, ws: int, variant: str, op: str, size: int) -> str:
    """'cpu-eager-ws2-resident-all_reduce-8B' (the pytest parameter id)."""
    return f"{device}-{mode}-ws{ws}-{variant}-{op}-{size}B"


def case_name(cid: str) -> str:
    return f"{TEST_NAME}[{cid}]"


def row_case_id(row: dict) -> str:
    return case_id(row["device"], row["mode"], row["world_size"], row["variant"], row["op"],
                   row["size_bytes"])


def _key(row: dict, variant: Optional[str] = None) -> tuple:
    return (row["world_size"], row["mode"], variant or row["variant"], row["op"],
            row["size_bytes"], row.get("round", 0))


def _reference(row: dict, by_key: Dict[tuple, dict],
               baseline: Optional[str]) -> Optional[tuple]:
    """(reference µs, reference name) of a row with a median, or None."""
    if row.get("floor_us"):
        # (ladder files written before rows recorded their floor kind: derived from the row)
        return row["floor_us"], f"floor {row.get('floor_kind') or row_floor_kind(row)}"
    if baseline and row["variant"] != baseline:
        ref = by_key.get(_key(row, baseline))
        if ref and ref.get("median_us"):
            return ref["median_us"], f"{baseline} (same run)"
    return None


def _slowest_samples_us(row: dict) -> List[float]:
    ranks = row.get("ranks") or {}
    r = ranks.get(str(row.get("slowest_rank")))
    return list(r["samples_us"]) if r else []


def case_results(doc: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """{case id: result} for every row of a ladder document. A result has "row" (the combined
    row), "samples_s" (per-op seconds: the slowest rank's samples of every round), "check",
    "error" (when the cell did not run) and "extra" (median_us, p10_us, p90_us, ratio,
    reference, reference_us, round_ratios, noise_band, rounds, path, transport, ...)."""
    cfg = doc["config"]
    baseline = cfg.get("baseline")
    by_round = doc.get("results_by_round") or [dict(r, round=0) for r in doc["results"]]
    ref_rows = {_key(r): r for r in by_round if "median_us" in r}
    rounds_of: Dict[str, List[dict]] = {}
    for r in by_round:
        rounds_of.setdefault(row_case_id(r), []).append(r)
    out: Dict[str, Dict[str, Any]] = {}
    for row in doc["results"]:
        cid = row_case_id(row)
        res: Dict[str, Any] = {"row": row, "check": row.get("check"), "samples_s": []}
        if "median_us" not in row:
            res["error"] = row.get("error", "no result")
            out[cid] = res
            continue
        ratios, refs, samples = [], [], []
        for rr in rounds_of.get(cid, []):
            if "median_us" not in rr:
                continue
            samples += _slowest_samples_us(rr)
            if "floor_us" in row and "floor_us" not in rr:  # the floor is the same every round
                rr = dict(rr, **{k: row[k] for k in ("floor_us", "floor_kind") if k in row})
            ref = _reference(rr, ref_rows, baseline)
            if ref:
                ratios.append(rr["median_us"] / ref[0])
                refs.append(ref)
        extra: Dict[str, Any] = {
            "median_us": row["median_us"], "p10_us": row["p10_us"], "p90_us": row["p90_us"],
            "rounds": row.get("rounds", 1), "batch": row.get("batch"),
            "actual_bytes": row.get("actual_bytes"), "path": row.get("path"),
            "transport": row.get("transport"), "check": row.get("check"),
        }
        spread = (row["p90_us"] - row["p10_us"]) / row["median_us"]
        if ratios:
            ratio = common._median(ratios)
            extra.update(ratio=ratio, reference=refs[0][1],
                         reference_us=common._median([r[0] for r in refs]),
                         round_ratios=ratios,
                         noise_band=((max(ratios) - min(ratios)) / ratio if len(ratios) > 1
                                     else spread),
                         noise_from="rounds" if len(ratios) > 1 else "p10-p90 of the samples")
        else:
            extra.update(ratio=None, reference=None, noise_band=spread)
        res["extra"] = extra
        res["samples_s"] = [s * 1e-6 for s in samples]
        out[cid] = res
    return out


def load_baseline(path: str) -> Dict[str, Dict[str, Any]]:
    """{case name: extra_info} of a baseline (a pytest-benchmark JSON of the ladder's cases).
    Raises ValueError naming the problem for a file that is not one."""
    with open(path) as f:
        doc = json.load(f)
    bench = doc.get("benchmarks") if isinstance(doc, dict) else None
    if not isinstance(bench, list):
        raise ValueError(f"{path}: no 'benchmarks' list (not a pytest-benchmark JSON file)")
    out = {}
    for b in bench:
        if isinstance(b, dict) and isinstance(b.get("extra_info"), dict) and "name" in b:
            out[b["name"]] = b["extra_info"]
    if not out:
        raise ValueError(f"{path}: no benchmark with extra_info (not a ladder baseline)")
    return out


def gate(name: str, extra: Dict[str, Any], baseline: Dict[str, Dict[str, Any]],
         min_band: float) -> Optional[Dict[str, Any]]:
    """The gate's verdict on one case: None when the baseline has no ratio for a case of that
    name; a dict with comparable False and why when this run's case has no ratio or one to
    another reference (a gate that compared nothing must not pass); else a dict with
    comparable True, ratio, baseline_ratio, band, limit and regressed (ratio > baseline
    ratio x (1 + max(noise band, min_band)))."""
    base = baseline.get(name)
    if not base or base.get("ratio") is None:
        return None
    if extra.get("ratio") is None or base.get("reference") != extra.get("reference"):
        got = (f"a ratio to {extra['reference']!r}" if extra.get("ratio") is not None
               else "no ratio (no floor or reference in this run: --resident-floors?)")
        return {"name": name, "comparable": False, "regressed": False,
                "why": f"{name}: the baseline has a ratio to {base.get('reference')!r}, this "
                       f"run {got}"}
    band = max(min_band, float(extra.get("noise_band") or 0.0))
    limit = base["ratio"] * (1.0 + band)
    return {"name": name, "comparable": True, "ratio": extra["ratio"],
            "baseline_ratio": base["ratio"],
            "band": band, "limit": limit, "reference": extra["reference"],
            "median_us": extra.get("median_us"), "baseline_median_us": base.get("median_us"),
            "regressed": extra["ratio"] > limit}


def format_gate_table(verdicts: Sequence[Dict[str, Any]], title: str) -> str:
    """The verdicts as a plain-text table (case, µs now and in the baseline, ratios, band)."""
    head = ["case", "µs", "baseline µs", "ratio", "baseline ratio", "band", "limit",
            "reference"]
    lines = [[v["name"], common.fmt_us(v.get("median_us")),
              common.fmt_us(v.get("baseline_median_us")), f"{v['ratio']:.3f}",
              f"{v['baseline_ratio']:.3f}", f"{100 * v['band']:.0f}%", f"{v['limit']:.3f}",
              v["reference"]] for v in verdicts]
    widths = [max(len(str(c[i])) for c in [head] + lines) for i in range(len(head))]
    fmt = lambda c: "  ".join(str(x).ljust(w) if i in (0, 7) else str(x).rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(c, widths)))
    return "\n".join([title, fmt(head), "  ".join("-" * w for w in widths)]
                     + [fmt(c) for c in lines])


def baseline_from_doc(doc: Dict[str, Any], note: str) -> Dict[str, Any]:
    """A pytest-benchmark JSON document (the gate's baseline format) from a ladder document
    (``python -m resident_pg.bench --json``): one entry per case with a median, its
    extra_info as the pytest cases record it, and stats over the slowest rank's samples."""
    meta = doc["metadata"]
    benches = []
    for cid, res in sorted(case_results(doc).items()):
        if "extra" not in res:
            continue
        s = sorted(res["samples_s"]) or [res["extra"]["median_us"] * 1e-6]
        n = len(s)
        mean = sum(s) / n
        q1, q3 = common.percentile(s, 25), common.percentile(s, 75)
        benches.append({
            "group": None, "name": case_name(cid),
            "fullname": f"benchmarks/test_ladder.py::{case_name(cid)}",
            "params": None, "param": cid, "extra_info": res["extra"], "options": {},
            "stats": {"min": s[0], "max": s[-1], "mean": mean,
                      "stddev": (sum((x - mean) ** 2 for x in s) / (n - 1)) ** 0.5 if n > 1
                      else 0.0,
                      "rounds": n, "median": common.percentile(s, 50), "iqr": q3 - q1,
                      "q1": q1, "q3": q3, "iqr_outliers": 0, "stddev_outliers": 0,
                      "outliers": "0;0", "ld15iqr": s[0], "hd15iqr": s[-1], "ops": 1.0 / mean,
                      "total": sum(s), "iterations": res["extra"].get("batch") or 1},
        })
    git = meta.get("git") or {}
    return {
        "machine_info": {"node": meta.get("hostname"), "processor": meta.get("processor"),
                         "python_version": meta.get("python"), "cpu": {"count":
                                                                        meta.get("cpu_count")},
                         "gpu": meta.get("gpu"), "torch_version": meta.get("torch_version")},
        "commit_info": {"id": git.get("commit"), "dirty": git.get("dirty"),
                        "tree": git.get("tree")},
        "benchmarks": benches, "datetime": meta.get("date"), "version": "5.2.3",
        "resident_baseline_note": note,
    }
