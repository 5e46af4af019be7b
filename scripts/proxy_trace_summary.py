"""Where a proxied op's time goes, from the proxy timelines of RESIDENT_GPU_PROXY_TRACE
(csrc/core/proxy/proxy_trace.hpp): one file per rank, times on the host's monotonic clock.

Ops: with --triggers-per-op N every N triggers popped make one op (exact when one op kind and
size ran: e.g. 1 for an 8 B all_reduce, 8 for 16 KiB of LL lines at 2 ranks, 64 for a 64 KiB
payload + flags all_reduce); without it a trigger popped after a gap longer than --gap-ns opens
a new op (back-to-back ops can merge). With --triggers-per-op the two ranks' op lists are aligned by
the shift that puts their first triggers closest; without it (the ranks may merge ops
differently) the GPU stage takes the latest peer op that ended before this rank's next trigger,
which is wrong when the ranks run out of phase by more than an op's proxy stage. Per op k and rank r:
  proxy stage   first trigger popped -> last write posted / flags raised (this proxy's work)
  spread        first -> last trigger popped (how far apart the GPU's blocks pushed, or how
                long the proxy took to pop and check them)
  gpu stage     the peer proxy's end of op k -> this rank's first trigger of op k+1: the
                peer data's read by this GPU, its reduction, the kernel's end, the next
                kernel's start, its stores and the trigger's trip to the proxy (over shm;
                over tcp it also holds the network: the peer's end is before its send)
  read to trigger  over tcp: this rank's last `received` of op k (the peer's data read into
                the inbox) -> its first trigger of op k+1: the GPU stage of a tcp op
  period        first trigger of op k -> of op k+1
Medians over the back-to-back ops (period under --max-period-us). Two ranks only.
Credits (send/recv: the proxy forwards one when this rank's receive has consumed a slot) are
counted per op but are not part of its stages: they follow the peer's op, up to a round trip
later, and would otherwise stretch the proxy stage of a ping-pong's op to its whole period.

Where the general collective kernel recorded its own timeline (<prefix>.rank<r>.<n>.gpu.tsv,
`%globaltimer` of thread 0 of each op's first and last block: kernel_stamps.cuh), the report's
"gpu" part gives per rank and block the medians of its phases: send (the previous kernel done ->
round 0 stored and handed to the proxy or the peer), wait (-> every partner's flags or lines
seen; reduce mode), reduce (-> received and reduced into the output), exit (-> the block done)
and boundary (the block done -> the next op's kernel done waiting for it, ops in time order).

The report's "timeline" puts both ranks' events (tcp's `sent` and `received` included) on rank
0's ops: per event, its median time after the op's first trigger on rank 0 (ops opened by a gap
as above, the later three quarters of the run): each rank's first and last trigger popped and
every other event by its occurrence in the op, those seen in more than half of the ops.

usage: python3 scripts/proxy_trace_summary.py PREFIX [--triggers-per-op N] [--gap-ns N]
       [--json OUT]
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


# Events counted per op but not part of its stages, and the op's field that counts them.
COUNTED = {"credit": "credits", "sent": "sends", "received": "recvs", "readable": "readables"}


def segment(events, gap_ns, per_op):
    ops, cur, last, pops = [], None, None, 0
    for e in events:
        if e[1] in COUNTED:
            if cur is not None:
                cur[COUNTED[e[1]]] += 1
            continue
        is_pop = e[1].startswith("pop_")
        if is_pop:
            opens = pops % per_op == 0 if per_op else (last is None or e[0] - last > gap_ns)
            if opens or cur is None:
                cur = {"first_pop": e[0], "last_pop": e[0], "end": e[0], "pops": 0, "posted": 0,
                       "credits": 0, "sends": 0, "recvs": 0, "readables": 0}
                ops.append(cur)
            cur["pops"] += 1
            cur["last_pop"] = e[0]
            pops += 1
        if cur is not None:
            cur["end"] = max(cur["end"], e[0])
            cur["posted"] += e[1] == "posted"
        last = e[0]
    return ops


GPU_POINTS = ("waited", "sent", "flags", "received", "exit")
GPU_PHASES = {"send": ("waited", "sent"), "wait": ("sent", "flags"),
              "reduce": ("flags", "received"), "exit": ("received", "exit")}


def gpu_phases(path):
    """Per block (first, last): median µs of each GPU_PHASES phase and of the boundary."""
    rows = {0: [], 1: []}
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            fields = [int(x) for x in line.split("\t")]
            rows[fields[1]].append(dict(zip(GPU_POINTS, fields[2:])))
    out = {}
    for block, ops in rows.items():
        ops.sort(key=lambda o: o["waited"])
        phases = {k: [] for k in list(GPU_PHASES) + ["boundary"]}
        for i, o in enumerate(ops):
            for name, (a, b) in GPU_PHASES.items():
                if o[a] and o[b] and o[b] >= o[a]:
                    phases[name].append(o[b] - o[a])
            if i + 1 < len(ops) and o["exit"] and ops[i + 1]["waited"] >= o["exit"]:
                phases["boundary"].append(ops[i + 1]["waited"] - o["exit"])
        out["first" if block == 0 else "last"] = {
            "ops": len(ops), "median_us": {k: med(v) for k, v in phases.items()}}
    return out


def med(xs):
    return round(statistics.median(xs) / 1000.0, 3) if xs else None


def best_shift(a, b):
    """The shift s for which b[k + s] is closest to a[k] (first triggers), |s| <= 4."""
    lo, hi = len(a) // 4, min(len(a), len(b)) * 3 // 4
    scores = []
    for s in range(-4, 5):
        d = [abs(b[k + s]["first_pop"] - a[k]["first_pop"])
             for k in range(max(lo, -s), min(hi, len(b) - s))]
        if d:
            scores.append((statistics.median(d), s))
    return min(scores)[1] if scores else 0


def timeline(ranks, gap_ns):
    """Median offsets of both ranks' events from the first trigger of rank 0's ops (µs)."""
    ops0 = segment(sorted(ranks[0]), gap_ns, 0)
    starts = [o["first_pop"] for o in ops0[len(ops0) // 4:-1]]  # the last op may be cut short
    per_op = [[] for _ in starts]
    for r, evs in ranks.items():
        for t, ev, _peer, _n in evs:
            k = bisect.bisect_right(starts, t) - 1
            if 0 <= k < len(starts) and (k + 1 < len(starts) or t < ops0[-1]["first_pop"]):
                per_op[k].append((t - starts[k], r, ev))
    offsets = {}
    for evs in per_op:
        seen, pops = {}, {}
        for dt, r, ev in sorted(evs):
            if ev.startswith("pop_"):
                pops[r] = (pops.get(r, (dt,))[0], dt)  # (first, last)
                continue
            n = seen.get((r, ev), 0)
            seen[(r, ev)] = n + 1
            offsets.setdefault((r, ev, n), []).append(dt)
        for r, (first, last) in pops.items():
            offsets.setdefault((r, "first_pop", 0), []).append(first)
            offsets.setdefault((r, "last_pop", 0), []).append(last)
    rows = [{"rank": r, "event": ev, "occurrence": n, "median_us": med(v), "ops": len(v)}
            for (r, ev, n), v in offsets.items() if len(v) * 2 > len(starts)]
    return sorted(rows, key=lambda x: x["median_us"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--triggers-per-op", type=int, default=0)
    ap.add_argument("--gap-ns", type=int, default=1500)
    ap.add_argument("--max-period-us", type=float, default=200.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    found = sorted(glob.glob(args.prefix + ".rank*.tsv"))
    files = [f for f in found if not f.endswith(".gpu.tsv")]
    gpu_files = [f for f in found if f.endswith(".gpu.tsv")]
    ranks = {}
    for path in files:
        r = int(path[len(args.prefix) + 5:].split(".")[0])
        ranks.setdefault(r, []).extend(load(path))
    if sorted(ranks) != [0, 1]:
        raise SystemExit(f"need the timelines of ranks 0 and 1, found {sorted(ranks)}")
    ops = {r: segment(sorted(ev), args.gap_ns, args.triggers_per_op) for r, ev in ranks.items()}
    # ops[1][k + shift] is rank 1's op k (counted ops only: gap-split lists need not match)
    shift = best_shift(ops[0], ops[1]) if args.triggers_per_op else 0
    aligned = {0: ops[0][max(0, -shift):], 1: ops[1][max(0, shift):]}
    n = min(len(aligned[0]), len(aligned[1]))
    report = {"files": files, "triggers_per_op": args.triggers_per_op, "gap_ns": args.gap_ns,
              "shift": shift, "ranks": {}}
    for r in (0, 1):
        mine, peer = aligned[r], aligned[1 - r]
        peer_ends = sorted(o["end"] for o in ops[1 - r])
        rows = {"period": [], "proxy_stage": [], "trigger_spread": [], "gpu_stage": [],
                "read_to_trigger": []}
        received = sorted(e[0] for e in ranks[r] if e[1] == "received")
        pops, posts, credits = [], [], []
        for k in range(n - 1):
            period = mine[k + 1]["first_pop"] - mine[k]["first_pop"]
            if period > args.max_period_us * 1000:
                continue
            rows["period"].append(period)
            rows["proxy_stage"].append(mine[k]["end"] - mine[k]["first_pop"])
            rows["trigger_spread"].append(mine[k]["last_pop"] - mine[k]["first_pop"])
            if args.triggers_per_op:
                rows["gpu_stage"].append(mine[k + 1]["first_pop"] - peer[k]["end"])
            else:
                i = bisect.bisect_left(peer_ends, mine[k + 1]["first_pop"]) - 1
                if i >= 0:
                    rows["gpu_stage"].append(mine[k + 1]["first_pop"] - peer_ends[i])
            j = bisect.bisect_left(received, mine[k + 1]["first_pop"]) - 1
            if j >= 0 and received[j] > mine[k]["first_pop"]:
                rows["read_to_trigger"].append(mine[k + 1]["first_pop"] - received[j])
            pops.append(mine[k]["pops"])
            posts.append(mine[k]["posted"])
            credits.append(mine[k]["credits"])
        report["ranks"][r] = {
            "ops": len(ops[r]), "back_to_back": len(rows["period"]),
            "median_us": {k: med(v) for k, v in rows.items()},
            "median_pops_per_op": statistics.median(pops) if pops else None,
            "median_posts_per_op": statistics.median(posts) if posts else None,
            "median_credits_per_op": statistics.median(credits) if credits else None}
    if gpu_files:
        report["gpu"] = {int(p[len(args.prefix) + 5:].split(".")[0]): gpu_phases(p)
                         for p in gpu_files}
    report["timeline"] = timeline(ranks, args.gap_ns)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
