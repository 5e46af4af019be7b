"""Where a proxied op's time goes, from the proxy timelines of RESIDENT_GPU_PROXY_TRACE
(csrc/core/proxy_trace.hpp): one file per rank, times on the host's monotonic clock.

An op, as one rank's proxy sees it, is a run of events that no trigger popped after a gap longer
than --gap-ns interrupts; for
2 ranks and back-to-back ops (a replayed graph) each op k yields, per rank r:
  proxy stage   first trigger popped -> last write posted / flags raised (this proxy's work)
  spread        first -> last trigger popped (how far apart the GPU's blocks pushed)
  gpu stage     the peer proxy's end of op k -> this rank's first trigger of op k+1: the
                peer data's read by this GPU, its reduction, the kernel's end, the next
                kernel's start, its stores and the trigger's trip to the proxy
  period        first trigger of op k -> of op k+1
Medians over the back-to-back ops (period under --max-period-us).

usage: python3 scripts/proxy_trace_summary.py PREFIX [--gap-ns N] [--json OUT]
"""

import argparse
import bisect
import glob
import json
import statistics


def load(path):
    events = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            t, ev, peer, nbytes = line.split("\t")
            events.append((int(t), ev, int(peer), int(nbytes)))
    return events


def segment(events, gap_ns):
    ops, cur, last = [], [], None
    for e in events:
        # Only a trigger opens an op: posts and flags end the pass that popped them.
        if last is not None and e[0] - last > gap_ns and cur and e[1].startswith("pop_"):
            ops.append(cur)
            cur = []
        cur.append(e)
        last = e[0]
    if cur:
        ops.append(cur)
    out = []
    for op in ops:
        pops = [e for e in op if e[1].startswith("pop_")]
        if not pops:
            continue
        out.append({
            "first_pop": pops[0][0], "last_pop": pops[-1][0], "end": op[-1][0],
            "pops": len(pops), "posted": sum(1 for e in op if e[1] == "posted"),
            "bytes": sum(e[3] for e in op if e[1] == "posted"),
            "flag_raises": sum(1 for e in op if e[1] == "flags")})
    return out


def med(xs):
    return round(statistics.median(xs) / 1000.0, 3) if xs else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--gap-ns", type=int, default=1500)
    ap.add_argument("--max-period-us", type=float, default=200.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    files = sorted(glob.glob(args.prefix + ".rank*.tsv"))
    ranks = {}
    for path in files:
        r = int(path[len(args.prefix) + 5:].split(".")[0])
        ops = segment(load(path), args.gap_ns)
        ranks.setdefault(r, []).extend(ops)
    report = {"files": files, "gap_ns": args.gap_ns, "ranks": {}}
    for r, ops in sorted(ranks.items()):
        ops.sort(key=lambda o: o["first_pop"])
        peer_ends = sorted(o["end"] for p, po in ranks.items() if p != r for o in po)
        stage, spread, gpu, period, pops, posted = [], [], [], [], [], []
        for k in range(len(ops) - 1):
            per = ops[k + 1]["first_pop"] - ops[k]["first_pop"]
            if per > args.max_period_us * 1000:
                continue
            period.append(per)
            stage.append(ops[k]["end"] - ops[k]["first_pop"])
            spread.append(ops[k]["last_pop"] - ops[k]["first_pop"])
            pops.append(ops[k]["pops"])
            posted.append(ops[k]["posted"])
            # the latest peer op end before this rank's next first trigger
            i = bisect.bisect_left(peer_ends, ops[k + 1]["first_pop"]) - 1
            if i >= 0:
                gpu.append(ops[k + 1]["first_pop"] - peer_ends[i])
        report["ranks"][r] = {
            "ops": len(ops), "back_to_back": len(period),
            "median_us": {"period": med(period), "proxy_stage": med(stage),
                          "trigger_spread": med(spread), "gpu_stage": med(gpu)},
            "median_pops_per_op": statistics.median(pops) if pops else None,
            "median_posts_per_op": statistics.median(posted) if posted else None}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
