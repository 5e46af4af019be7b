"""Estimate the share of a decode step that resident saves, from measured latency curves.

    python -m resident_pg.estimate tests/data/bench_cuda_ws2_h200_2026-11-29.json \\
        --resident path=direct,mode=graph --baseline-us 25
    python -m resident_pg.estimate ours.json --baseline nccl_net.json --compute-ms llama-3.1-8b=3.1

Inputs.  One or more benchmark JSON files of ``python -m resident_pg.bench`` (schema
``resident_pg.bench/1``: ``results`` rows with world_size, backend, label, variant, device,
mode, path, op, size_bytes, median_us).  ``--resident`` picks resident's curves by
``key=value`` pairs (keys: backend, variant, label, path, mode, device, world_size, file);
the baseline is a second selection in the same files (``--baseline path=proxy``), another
file (``--baseline nccl.json`` with ``--baseline-select``; a bench JSON, or a plain
``{"name": ..., "curves": {"all_reduce": [[bytes, us], ...], ...}}`` / ``{"points": [[bytes,
us], ...]}`` for every op), or a constant (``--baseline-us 25``).  A selection that matches
several curves (e.g. the direct and the proxy path, or eager and graph) is an error that lists
them: nothing is picked silently.  Every world size present in the resident selection is
estimated (TP / EP degree = world size), unless ``--world-size`` narrows it.

Curves.  Latency vs message size is interpolated linearly in log-log between measured sizes
(the bench's size convention: all_reduce = the tensor; all_to_all_single = the per-rank buffer,
i.e. all peers' chunks together; send_recv = one message, one way).  Outside the measured range
the estimate extrapolates and WARNS (the value is marked ``*``): below the smallest size the
smallest size's latency is used (small messages are latency-bound), above the largest the last
segment's log-log slope is extended.  ``--strict`` makes that an error.

Communication per decode step (ASSUMPTIONS, stated so they can be disputed):
  * TP (Llama-3.1-8B: 32 layers, hidden 4096; Llama-3.1-70B: 80 layers, hidden 8192): 2
    all-reduces per layer (after attention, after the MLP) of ``batch x hidden x bytes``;
    nothing else (embedding / logits gathers are ignored).
  * EP (Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts, top-8): per layer one dispatch and
    one combine, each approximated as ONE all_to_all in which a rank sends ``batch x top_k x
    hidden x bytes / world`` to every peer (``batch`` = tokens per rank, uniform routing; the
    rank's own share is counted as if sent).  ``--ep-approx a2a`` (default) reads the
    all_to_all_single curve at the per-rank buffer ``batch x top_k x hidden x bytes``;
    ``--ep-approx p2p`` reads the one-way send_recv curve at the per-peer size (an
    all-to-all taken as one round of concurrent point-to-point messages).
    ``--ep-layout padded`` uses resident_pg.moe's static layout instead: ``batch x
    min(top_k, experts/world)`` token slots per peer, plus a counts all_to_all per dispatch.
  * ``--bytes`` per element: 2 (bf16), for both TP and EP payloads.

Compute per decode step (what the communication is added to).  ``--compute-ms MODEL=MS`` or
``MODEL@BATCH=MS`` (repeatable) supplies it, e.g. measured with examples/tp_decode.py or
ep_decode.py (their "no-comm" step at the full layer count) or taken from your serving stack.
Otherwise a DEFAULT ASSUMPTION (memory-bound decode, labelled "assumed" in the table):
  time = bytes read per GPU / (``--hbm-gbps`` 4800 (H200) x ``--hbm-eff`` 0.6)
         + layers x ``--layer-overhead-us`` 10 (kernel floors of a CUDA-graphed layer)
  bytes read per GPU: TP: (weights read per token, embeddings excluded) / TP + KV cache of
  ``batch`` sequences of ``--context`` 2048 tokens / TP; EP: the dense (attention, router,
  logits) weights + the experts of this rank that at least one of the ``batch x world``
  tokens picks (uniform routing: ``L x (1 - (1 - top_k/experts)^(batch x world))``) + the KV
  cache of this rank's ``batch`` sequences.

Result per (model, batch): step = compute + n_comm x latency(size); saved = (step_baseline -
step_resident) / step_baseline, the fraction of the baseline's decode step that resident
removes.  A table is printed; ``--png`` writes a chart (matplotlib; skipped with a message
when it is not installed); ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

SCHEMA = "resident_pg.bench/1"
SELECT_KEYS = ("backend", "variant", "label", "path", "mode", "device", "world_size", "file")
BATCHES = (1, 8, 64)

# weights_read: parameters read per decode step (embedding table excluded, logits included)
MODELS: Dict[str, dict] = {
    "llama-3.1-8b": dict(kind="tp", layers=32, hidden=4096, kv_heads=8, head_dim=128,
                         weights_read=7.50e9),
    "llama-3.1-70b": dict(kind="tp", layers=80, hidden=8192, kv_heads=8, head_dim=128,
                          weights_read=69.5e9),
    "qwen3-30b-a3b": dict(kind="ep", layers=48, hidden=2048, kv_heads=4, head_dim=128,
                          experts=128, top_k=8, moe_intermediate=768,
                          dense_read=1.22e9),  # attention + router + norms + logits
}


class EstimateError(ValueError):
    pass


# --------------------------------------------------------------------------
# curves
# --------------------------------------------------------------------------

class Curve:
    """Latency (µs) vs message size (bytes), interpolated in log-log."""

    def __init__(self, name: str, points: Sequence[Tuple[float, float]]):
        pts = sorted((float(s), float(us)) for s, us in points)
        if not pts or any(s <= 0 or not us > 0 for s, us in pts):
            raise EstimateError(f"curve {name}: needs positive sizes and latencies, got {pts}")
        if len({s for s, _ in pts}) != len(pts):
            raise EstimateError(f"curve {name}: several latencies for one size: {pts}")
        self.name, self.points = name, pts

    def at(self, size: float) -> Tuple[float, str]:
        """(latency µs, "" | "below" | "above"): the flag says the value is extrapolated."""
        pts = self.points
        lo, hi = pts[0][0], pts[-1][0]
        if size < lo:
            return pts[0][1], "below"
        if size > hi:
            if len(pts) == 1:
                return pts[0][1], "above"
            (s0, u0), (s1, u1) = pts[-2], pts[-1]
            slope = math.log(u1 / u0) / math.log(s1 / s0)
            return u1 * (size / s1) ** slope, "above"
        for s0, u0 in pts:
            if s0 == size:
                return u0, ""  # a measured size: the measurement itself
        for (s0, u0), (s1, u1) in zip(pts, pts[1:]):
            if s0 < size < s1:
                f = math.log(size / s0) / math.log(s1 / s0)
                return math.exp(math.log(u0) + f * math.log(u1 / u0)), ""
        raise AssertionError("unreachable")


class ConstantCurve:
    def __init__(self, us: float):
        if not us > 0:
            raise EstimateError(f"--baseline-us must be > 0, got {us}")
        self.name, self.us, self.points = f"constant {us:g} us", us, []

    def at(self, size: float) -> Tuple[float, str]:
        return self.us, ""


def parse_selector(text: Optional[str]) -> Dict[str, str]:
    sel: Dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise EstimateError(f"selector {text!r}: {part!r} is not key=value")
        k, v = part.split("=", 1)
        k = {"ws": "world_size"}.get(k.strip(), k.strip())
        if k not in SELECT_KEYS:
            raise EstimateError(f"selector {text!r}: unknown key {k!r} (keys: "
                                f"{', '.join(SELECT_KEYS)})")
        sel[k] = v.strip()
    return sel


def _norm_row(r: dict, doc: dict, path: str) -> Optional[dict]:
    cfg = doc.get("config") or {}
    if not isinstance(r.get("median_us"), (int, float)) or not r["median_us"] > 0:
        return None
    if r.get("check", "ok") not in ("ok", None):
        return None
    return {"file": path, "world_size": int(r["world_size"]), "backend": r.get("backend", "?"),
            "label": r.get("label", r.get("backend", "?")),
            "variant": r.get("variant") or r.get("label") or r.get("backend", "?"),
            "device": r.get("device") or cfg.get("device") or "cpu",
            "mode": r.get("mode") or cfg.get("mode") or "eager",
            "path": r.get("path") or (r.get("pg_options") or {}).get("path") or "",
            "op": r["op"], "size_bytes": int(r["size_bytes"]), "median_us": float(r["median_us"])}


def load_rows(paths: Sequence[str]) -> List[dict]:
    """Rows of bench JSON files (schema resident_pg.bench/1) or of plain curve files."""
    rows: List[dict] = []
    for path in paths:
        try:
            opener = gzip.open if str(path).endswith(".gz") else open
            with opener(path, "rt") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise EstimateError(f"{path}: cannot read a JSON document: {e}") from None
        if isinstance(doc, dict) and isinstance(doc.get("results"), list):
            if doc.get("schema") not in (None, SCHEMA):
                print(f"warning: {path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}",
                      file=sys.stderr)
            rows += [n for n in (_norm_row(r, doc, path) for r in doc["results"]) if n]
        elif isinstance(doc, dict) and ("curves" in doc or "points" in doc):
            name = str(doc.get("name") or os.path.basename(path))
            curves = doc.get("curves") or {"*": doc["points"]}
            for op, pts in curves.items():
                for s, us in pts:
                    rows.append({"file": path, "world_size": int(doc.get("world_size", 0)),
                                 "backend": name, "label": name, "variant": name, "path": "",
                                 "device": str(doc.get("device", "")), "mode": "",
                                 "op": op, "size_bytes": int(s), "median_us": float(us)})
        else:
            raise EstimateError(f"{path}: neither a bench JSON ('results') nor a curve file "
                                f"('curves' or 'points')")
    return rows


def _matches(row: dict, sel: Dict[str, str]) -> bool:
    for k, v in sel.items():
        if k == "file":
            if v not in os.path.basename(row["file"]) and v != row["file"]:
                return False
        elif k == "world_size":
            if row["world_size"] not in (int(v), 0):  # 0: a curve file valid for any size
                return False
        elif str(row.get(k, "")) != v:
            return False
    return True


def curve_for(rows: List[dict], sel: Dict[str, str], op: str, ws: int, what: str) -> Curve:
    """The one curve of `op` at world size `ws` matching `sel`; errors on none or several."""
    got = [r for r in rows if r["op"] in (op, "*") and r["world_size"] in (ws, 0)
           and _matches(r, sel)]
    ident = {}
    for r in got:
        key = (r["file"], r["variant"], r["mode"], r["device"], r["world_size"])
        ident.setdefault(key, []).append(r)
    if not ident:
        raise EstimateError(f"{what}: no {op} rows at world size {ws} match {sel or '{}'}")
    if len(ident) > 1:
        names = "; ".join(f"variant={v} mode={m} device={d} path={rs[0]['path'] or '-'} "
                          f"[{os.path.basename(f)}]" for (f, v, m, d, _), rs in ident.items())
        raise EstimateError(f"{what}: {len(ident)} {op} curves at world size {ws} match "
                            f"{sel or '{}'}: {names}. Narrow the selection (e.g. "
                            f"path=direct,mode=graph).")
    (f, v, m, d, _), rs = next(iter(ident.items()))
    name = f"{v}{' ' + m if m else ''} ws={ws} [{os.path.basename(f)}]"
    return Curve(name, [(r["size_bytes"], r["median_us"]) for r in rs])


# --------------------------------------------------------------------------
# models: communication and compute per step
# --------------------------------------------------------------------------

def comm_plan(model: str, batch: int, world: int, a) -> List[Tuple[str, int, int]]:
    """[(op, size_bytes as the bench measures it, count per step)] for one decode step."""
    m = MODELS[model]
    if m["kind"] == "tp":
        return [("all_reduce", batch * m["hidden"] * a.bytes, 2 * m["layers"])]
    E, K, Hd, layers = m["experts"], m["top_k"], m["hidden"], m["layers"]
    if a.ep_layout == "padded":
        per_peer = batch * min(K, E // world) * Hd * a.bytes
        counts = (("send_recv", (E // world) * 8, layers) if a.ep_approx == "p2p" else
                  ("all_to_all_single", world * (E // world) * 8, layers))
    else:
        per_peer = batch * K * Hd * a.bytes / world
        counts = None
    if a.ep_approx == "p2p":
        plan = [("send_recv", max(1, round(per_peer)), 2 * layers)]
    else:
        plan = [("all_to_all_single", max(1, round(per_peer * world)), 2 * layers)]
    return plan + ([counts] if counts else [])


def assumed_compute_ms(model: str, batch: int, world: int, a) -> float:
    m = MODELS[model]
    kv = batch * a.context * 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * a.bytes
    if m["kind"] == "tp":
        read = (m["weights_read"] * a.bytes + kv) / world
    else:
        L = m["experts"] // world
        touched = L * (1 - (1 - m["top_k"] / m["experts"]) ** (batch * world))
        expert_bytes = 3 * m["hidden"] * m["moe_intermediate"] * m["layers"] * a.bytes
        read = m["dense_read"] * a.bytes + touched * expert_bytes + kv
    return read / (a.hbm_gbps * 1e9 * a.hbm_eff) * 1e3 + m["layers"] * a.layer_overhead_us / 1e3


def parse_compute(items: Sequence[str]) -> Dict[Tuple[str, Optional[int]], float]:
    out = {}
    for item in items or ():
        try:
            key, ms = item.split("=", 1)
            name, _, b = key.partition("@")
            name = name.strip().lower()
            if name not in MODELS:
                raise EstimateError(f"--compute-ms {item!r}: unknown model {name!r} "
                                    f"({', '.join(MODELS)})")
            out[(name, int(b) if b else None)] = float(ms)
        except ValueError as e:
            if isinstance(e, EstimateError):
                raise
            raise EstimateError(f"--compute-ms {item!r}: expected MODEL=MS or "
                                f"MODEL@BATCH=MS") from None
    return out


def estimate(rows: List[dict], a) -> Tuple[List[dict], List[str], Dict[str, object]]:
    """The table rows, the extrapolation warnings, and the curves used (for the chart)."""
    rsel = parse_selector(a.resident)
    if a.baseline_us is not None:
        base_rows, bsel = None, {}
    elif a.baseline and os.path.isfile(a.baseline):
        base_rows, bsel = load_rows([a.baseline]), parse_selector(a.baseline_select)
    elif a.baseline:
        base_rows, bsel = rows, parse_selector(a.baseline)
    else:
        raise EstimateError("no baseline: give --baseline SELECTOR|FILE or --baseline-us US")
    worlds = sorted({r["world_size"] for r in rows if _matches(r, rsel) and r["world_size"]})
    if a.world_size:
        worlds = [w for w in worlds if w == a.world_size]
    if not worlds:
        raise EstimateError(f"no resident rows match {rsel}"
                            + (f" at world size {a.world_size}" if a.world_size else ""))
    compute = parse_compute(a.compute_ms)
    models = [m.strip().lower() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise EstimateError(f"--models: unknown model {m!r} ({', '.join(MODELS)})")
    out, warnings, used = [], [], {}
    for ws in worlds:
        for model in models:
            for batch in a.batches:
                plan = comm_plan(model, batch, ws, a)
                lat_r = lat_b = 0.0
                flags, desc = [], []
                for op, size, n in plan:
                    cr = curve_for(rows, rsel, op, ws, "--resident")
                    cb = ConstantCurve(a.baseline_us) if base_rows is None else \
                        curve_for(base_rows, bsel, op, ws, "baseline")
                    used.setdefault(f"resident {op} ws={ws}", (cr, []))
                    used.setdefault(f"baseline {op} ws={ws}", (cb, []))
                    (ur, fr), (ub, fb) = cr.at(size), cb.at(size)
                    for who, fl, c in (("resident", fr, cr), ("baseline", fb, cb)):
                        if fl:
                            lo, hi = c.points[0][0], c.points[-1][0]
                            flags.append(who)
                            warnings.append(f"{model} batch {batch} ws={ws}: {op} at {size} B "
                                            f"is {fl} the measured range {lo:g}..{hi:g} B of "
                                            f"{who} curve {c.name}: extrapolated")
                    used[f"resident {op} ws={ws}"][1].append(size)
                    lat_r += n * ur
                    lat_b += n * ub
                    desc.append((op, size, n, ur, ub))
                key = (model, batch) if (model, batch) in compute else (model, None)
                if key in compute:
                    cms, src = compute[key], "given"
                else:
                    cms, src = assumed_compute_ms(model, batch, ws, a), "assumed"
                step_b, step_r = cms + lat_b / 1e3, cms + lat_r / 1e3
                out.append({"model": model, "kind": MODELS[model]["kind"], "world_size": ws,
                            "batch": batch, "comms": [dict(op=o, size_bytes=s, count=n,
                                                           resident_us=r, baseline_us=b)
                                                      for o, s, n, r, b in desc],
                            "compute_ms": cms, "compute_source": src,
                            "comm_resident_ms": lat_r / 1e3, "comm_baseline_ms": lat_b / 1e3,
                            "step_baseline_ms": step_b, "step_resident_ms": step_r,
                            "saved_fraction": (step_b - step_r) / step_b,
                            "extrapolated": sorted(set(flags))})
    if warnings and a.strict:
        raise EstimateError("extrapolation (--strict):\n  " + "\n  ".join(warnings))
    return out, warnings, used


# --------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------

def _fmt_size(n: float) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def format_table(res: List[dict]) -> str:
    head = ("model", "par", "batch", "main message", "ops/step", "resident us/op",
            "baseline us/op", "compute ms", "step base ms", "step res ms", "saved")
    lines = []
    for r in res:
        c = r["comms"][0]
        star_r = "*" if "resident" in r["extrapolated"] else ""
        star_b = "*" if "baseline" in r["extrapolated"] else ""
        ops = "+".join(str(x["count"]) for x in r["comms"])
        lines.append((r["model"], f"{r['kind'].upper()}{r['world_size']}", str(r["batch"]),
                      f"{c['op']} {_fmt_size(c['size_bytes'])}", ops,
                      f"{c['resident_us']:.2f}{star_r}", f"{c['baseline_us']:.2f}{star_b}",
                      f"{r['compute_ms']:.2f} {r['compute_source']}",
                      f"{r['step_baseline_ms']:.3f}", f"{r['step_resident_ms']:.3f}",
                      f"{100 * r['saved_fraction']:.1f}%"))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    fmt = " | ".join("{:<%d}" % w for w in widths)
    return "\n".join(l.rstrip() for l in [fmt.format(*head), "-+-".join("-" * w for w in widths)]
                      + [fmt.format(*l) for l in lines])


def write_png(path: str, res: List[dict], used: Dict[str, object], title: str) -> Optional[str]:
    """The chart, or None with a message when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the chart {path} "
              f"(pip install matplotlib)", file=sys.stderr)
        return None
    import textwrap

    def short(text: str, width: int = 70) -> str:
        return text if len(text) <= width else text[:width - 1] + "…"

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    for name, (curve, sizes) in sorted(used.items()):
        style = "-" if name.startswith("resident") else "--"
        label = short(f"{name}: {curve.name}")
        if curve.points:
            xs, ys = zip(*curve.points)
            ax1.plot(xs, ys, style, marker="o", label=label)
        else:
            ax1.axhline(curve.us, linestyle=style, color="gray", label=label)
        for s in sizes:
            ax1.axvline(s, color="lightgray", linewidth=0.6)
    ax1.set(xscale="log", yscale="log", xlabel="message size (bytes, bench convention)",
            ylabel="latency per op (µs)", title="latency curves (grey lines: sizes used)")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    labels = [f"{r['model']} {r['kind'].upper()}{r['world_size']} b{r['batch']}" for r in res]
    vals = [100 * r["saved_fraction"] for r in res]
    colors = ["tab:orange" if r["extrapolated"] else "tab:blue" for r in res]
    ax2.bar(range(len(res)), vals, color=colors)
    ax2.axhline(0, color="black", linewidth=0.6)
    ax2.set_xticks(range(len(res)), labels, fontsize=7, rotation=60, ha="right")
    ax2.set(ylabel="decode step saved (%)", title="step saved vs baseline (orange: extrapolated)")
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(prog="python -m resident_pg.estimate", description=doc[0],
                                epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="bench JSON files (python -m resident_pg.bench --json)")
    p.add_argument("--resident", default="backend=resident",
                   help="key=value,... selecting resident's curves (default backend=resident)")
    p.add_argument("--baseline", help="key=value,... selecting the baseline in FILES, or a JSON "
                   "file (bench JSON or curve file)")
    p.add_argument("--baseline-select", default="", help="selector inside --baseline FILE")
    p.add_argument("--baseline-us", type=float, help="constant baseline latency per op (µs)")
    p.add_argument("--world-size", type=int, help="only this world size (default: all)")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="batches (TP: sequences; EP: tokens per rank), default 1,8,64")
    p.add_argument("--bytes", type=int, default=2, help="bytes per element (default 2, bf16)")
    p.add_argument("--ep-approx", choices=("a2a", "p2p"), default="a2a",
                   help="EP all-to-all from the all_to_all_single curve (default) or one-way p2p")
    p.add_argument("--ep-layout", choices=("actual", "padded"), default="actual",
                   help="EP message: the routed tokens (default) or resident_pg.moe's padded slots")
    p.add_argument("--compute-ms", action="append", default=[], metavar="MODEL[@BATCH]=MS",
                   help="compute time per step; repeatable (default: the assumed model)")
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="assumed HBM GB/s (H200)")
    p.add_argument("--hbm-eff", type=float, default=0.6, help="assumed achieved fraction of it")
    p.add_argument("--context", type=int, default=2048, help="assumed KV tokens per sequence")
    p.add_argument("--layer-overhead-us", type=float, default=10.0,
                   help="assumed non-communication floor per layer (µs)")
    p.add_argument("--strict", action="store_true", help="extrapolation is an error")
    p.add_argument("--png", default="decode_estimate.png", help="chart path (default %(default)s)")
    p.add_argument("--no-png", action="store_true", help="do not write the chart")
    p.add_argument("--json", help="write the estimate rows here")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        rows = load_rows(a.files)
        res, warnings, used = estimate(rows, a)
    except EstimateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = (f"constant {a.baseline_us:g} us/op" if a.baseline_us is not None else
            f"{a.baseline}{' [' + a.baseline_select + ']' if a.baseline_select else ''}")
    title = (f"resident [{a.resident}] vs baseline [{base}]; {a.bytes} B/elem; EP: "
             f"{a.ep_approx}, {a.ep_layout} layout")
    print(title)
    for name, (curve, _) in sorted(used.items()):
        print(f"  {name}: {curve.name}")
    if any(r["compute_source"] == "assumed" for r in res):
        print(f"  compute 'assumed': memory-bound model, HBM {a.hbm_gbps:g} GB/s x {a.hbm_eff:g}, "
              f"context {a.context}, {a.layer_overhead_us:g} us/layer (see --help); replace "
              f"with --compute-ms")
    print(format_table(res))
    print("saved = (step_baseline - step_resident) / step_baseline; * = extrapolated")
    if any(r["kind"] == "ep" for r in res):
        print("EP message = the per-rank buffer of the all_to_all (all peers' chunks, the bench's "
              "size convention; send_recv with --ep-approx p2p: one peer's chunk)")
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not a.no_png and a.png:
        if write_png(a.png, res, used, title):
            print(f"wrote {a.png}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "rows": res, "warnings": warnings}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
