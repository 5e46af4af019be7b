"""Per-op latency against message size (log-log) from resident_pg.bench JSON files, with floors.

    python benchmarks/plot_latency.py BENCH.json [BENCH.json ...] [--floors FLOORS.json] \
        -o latency.png

One subplot per (world size, op): a row per world size, a column per op.  One line per
(path or backend, mode) -- e.g. "resident direct, graph" -- with its p10-p90 band; cells whose
correctness check failed are marked with a red x, cells without a result are left out.  The
floors (benchmarks/floors) are dashed: the SM data floor (N bytes GPU->host->GPU) over size, and
the cross-process flag floor (the 8 B floor) as a horizontal line; the tcp one-way floor
(benchmarks/floors/build/tcp_floor), when the floors hold it, dash-dotted over size.  They come
from --floors, else from the first bench JSON that embeds them (metadata.floors.contents,
written by --floors).

Needs matplotlib (present on the GPU machine); without it the script says so and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP_ORDER = ["all_reduce", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
            "send_recv"]


def _bench_cuda():
    sys.path.insert(0, REPO)
    from resident_pg.bench import cuda
    return cuda


def series_name(row: dict, cfg: dict, multi_device: bool) -> str:
    """'resident direct, graph' for a resident variant with a path, else 'LABEL, mode'."""
    base = row.get("variant") or row.get("label") or row.get("backend", "?")
    if row.get("backend") == "resident" and row.get("path"):
        base = f"resident {row['path']}"
    name = f"{base}, {row.get('mode') or cfg.get('mode', 'eager')}"
    if multi_device:
        name += f" [{row.get('device') or cfg.get('device', 'cpu')}]"
    return name


def collect(docs: List[dict]) -> Dict[Tuple[int, str], Dict[str, List[dict]]]:
    """(world size, op) -> series name -> points sorted by size:
    {"size", "median", "p10", "p90", "check_ok"}; rows without a median are left out."""
    devices = {d.get("config", {}).get("device", "cpu") for d in docs}
    out: Dict[Tuple[int, str], Dict[str, List[dict]]] = {}
    for d in docs:
        cfg = d.get("config", {})
        for r in d.get("results", []):
            if "median_us" not in r:
                continue
            s = out.setdefault((r["world_size"], r["op"]), {}).setdefault(
                series_name(r, cfg, len(devices) > 1), [])
            s.append({"size": r["size_bytes"], "median": r["median_us"],
                      "p10": r.get("p10_us", r["median_us"]),
                      "p90": r.get("p90_us", r["median_us"]),
                      "check_ok": r.get("check", "ok") in ("ok", "skipped")})
    for per_op in out.values():
        for pts in per_op.values():
            pts.sort(key=lambda p: p["size"])
    return out


def find_floors(docs: List[dict], path) -> Optional[Dict[str, Any]]:
    """The floors of --floors (a path or a list of them), else those a bench JSON embeds."""
    bc = _bench_cuda()
    if path:
        return bc.load_floors(path)
    for d in docs:
        f = d.get("metadata", {}).get("floors") or {}
        if isinstance(f.get("contents"), dict):
            return bc.floors_from_doc(f["contents"], f.get("path", "?"))
    return None


def _fmt_size(n: float) -> str:
    n = int(n)
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _title(docs: List[dict], paths: List[str]) -> str:
    m = docs[0].get("metadata", {})
    git = (m.get("git") or {}).get("commit") or "?"
    gpu = (m.get("gpu") or {}).get("name")
    return (f"resident_pg latency per op (median, p10-p90 band), {', '.join(map(os.path.basename, paths))}"
            f"\n{m.get('hostname', '?')}{' ' + gpu if gpu else ''}, torch {m.get('torch_version', '?')}, "
            f"{m.get('date', '?')}, commit {git[:12]}")


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_latency.py: matplotlib is not installed in this Python "
              f"({sys.executable}); install it (pip install matplotlib) or plot on the GPU "
              "machine, where it is available.  Nothing was written.", file=sys.stderr)
        raise SystemExit(2) from None
    return plt


def plot(docs: List[dict], paths: List[str], floors: Optional[Dict[str, Any]], out: str,
         world_sizes: Optional[List[int]] = None, ops: Optional[List[str]] = None) -> None:
    plt = _pyplot()
    data = collect(docs)
    wss = world_sizes or sorted({k[0] for k in data})
    present = {k[1] for k in data}
    opl = ops or [o for o in OP_ORDER if o in present] + sorted(present - set(OP_ORDER))
    if not wss or not opl:
        raise SystemExit("plot_latency.py: no results with a median in the input files")
    names = sorted({n for per in data.values() for n in per})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    all_sizes = sorted({p["size"] for per in data.values() for pts in per.values() for p in pts})
    fig, axes = plt.subplots(len(wss), len(opl), figsize=(4.2 * len(opl), 3.4 * len(wss) + 1.0),
                             squeeze=False, sharex=True)
    for i, ws in enumerate(wss):
        for j, op in enumerate(opl):
            ax = axes[i][j]
            for name, pts in sorted(data.get((ws, op), {}).items()):
                xs = [p["size"] for p in pts]
                ax.plot(xs, [p["median"] for p in pts], marker="o", ms=3.5, lw=1.4,
                        color=colors[name], label=name)
                ax.fill_between(xs, [p["p10"] for p in pts], [p["p90"] for p in pts],
                                color=colors[name], alpha=0.15, lw=0)
                bad = [p for p in pts if not p["check_ok"]]
                if bad:
                    ax.plot([p["size"] for p in bad], [p["median"] for p in bad], "x", color="red",
                            ms=8, mew=2, label="wrong result" if (i, j) == (0, 0) else None)
            if floors and floors.get("data_floor_sm_us"):
                ds = sorted((int(k), v) for k, v in floors["data_floor_sm_us"].items())
                ax.plot([s for s, _ in ds], [v for _, v in ds], "--", color="black", lw=1.1,
                        label="floor: data GPU->host->GPU (SM)")
                ax.axhline(floors["cross_process_flag_us"], ls=":", color="dimgray", lw=1.1,
                           label="floor: cross-process flag (8 B)")
            if floors and floors.get("tcp_one_way_us"):
                ts = sorted((int(k), v) for k, v in floors["tcp_one_way_us"].items())
                ax.plot([s for s, _ in ts], [v for _, v in ts], "-.", color="tab:brown", lw=1.1,
                        label="floor: tcp one-way (loopback)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{op}, {ws} ranks", fontsize=10)
            if j == 0:
                ax.set_ylabel("µs per op (one-way for send_recv)")
            if i == len(wss) - 1:
                ax.set_xlabel("message size")
            if all_sizes:
                ax.set_xticks(all_sizes)
                ax.set_xticklabels([_fmt_size(s) for s in all_sizes], rotation=45, fontsize=7)
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lb in zip(*ax.get_legend_handles_labels()):
            if lb not in handles:
                handles[lb] = h
                labels.append(lb)
    h = fig.get_figheight()  # inches; the top 1 inch holds the title (2 lines) and the legend
    fig.suptitle(_title(docs, paths), fontsize=10, y=1.0 - 0.05 / h, va="top")
    fig.legend([handles[lb] for lb in labels], labels, loc="upper center",
               ncol=min(len(labels), 6), fontsize=9, bbox_to_anchor=(0.5, 1.0 - 0.5 / h))
    fig.tight_layout(rect=(0, 0, 1, 1.0 - 1.0 / h))
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", nargs="+", help="JSON files written by resident_pg.bench --json")
    ap.add_argument("--floors", action="append",
                    help="floors JSON (benchmarks/floors/build/floors --json and/or "
                         "build/tcp_floor --json; repeat for both); default: the floors "
                         "embedded in a bench JSON, if any")
    ap.add_argument("--no-floors", action="store_true", help="do not draw the floors")
    ap.add_argument("-o", "--out", default="latency.png", help="PNG to write [%(default)s]")
    ap.add_argument("--world-sizes", help="comma list (default: all in the files)")
    ap.add_argument("--ops", help="comma list (default: all in the files)")
    args = ap.parse_args(argv)
    _pyplot()  # fail fast, before reading anything
    docs = []
    for p in args.bench_json:
        with open(p) as f:
            docs.append(json.load(f))
    floors = None if args.no_floors else find_floors(docs, args.floors)
    wss = [int(x) for x in args.world_sizes.split(",")] if args.world_sizes else None
    ops = [x.strip() for x in args.ops.split(",")] if args.ops else None
    plot(docs, args.bench_json, floors, args.out, wss, ops)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
