"""scripts/proxy_trace_summary.py on synthetic two-rank proxy timelines with known stages: per
op, a rank pops its triggers (random spacing), posts after a copy time, and its next op's first
trigger comes a known GPU time after the peer proxy's end of the op; rank 1 runs a random
offset behind. The medians it reports must be the ones built in; a lone rank is an error."""

import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "proxy_trace_summary.py")


def write_timelines(prefix, rng, ops, per_op, spread_ns, copy_ns, gpu_ns):
    events = {0: [], 1: []}
    offset = rng.randrange(0, 3000)
    start = {0: 1_000_000, 1: 1_000_000 + offset}
    for _ in range(ops):
        end = {}
        for r in (0, 1):
            t = start[r]
            for i in range(per_op):
                events[r].append((t, "pop_copy" if i % 2 == 0 else "pop_flag", 1 - r, 2048))
                if i + 1 < per_op:
                    t += spread_ns // (per_op - 1)
            t += copy_ns
            events[r].append((t, "posted", 1 - r, 2048 * per_op // 2))
            t += 100
            events[r].append((t, "flags", 1 - r, per_op // 2))
            end[r] = t
        # A rank's next op starts gpu_ns after the peer proxy delivered this one.
        start = {0: end[1] + gpu_ns, 1: end[0] + gpu_ns}
    for r in (0, 1):
        with open(f"{prefix}.rank{r}.0.tsv", "w") as f:
            f.write("# t_ns\tevent\tpeer\tbytes\t(dropped 0)\n")
            for t, ev, peer, nbytes in events[r]:
                f.write(f"{t}\t{ev}\t{peer}\t{nbytes}\n")
    return offset


def test_summary_recovers_the_stages(tmp_path):
    rng = random.Random(20261130)
    for _ in range(3):
        per_op = rng.choice([2, 8, 64])
        spread = rng.randrange(200, 4000)
        copy = rng.randrange(500, 6000)
        gpu = rng.randrange(2000, 20000)
        prefix = str(tmp_path / f"cell{per_op}_{spread}")
        offset = write_timelines(prefix, rng, 200, per_op, spread, copy, gpu)
        out = subprocess.run([sys.executable, SCRIPT, prefix, "--triggers-per-op", str(per_op)],
                             capture_output=True, text=True, timeout=60, check=True)
        report = json.loads(out.stdout)
        spread_q = (spread // (per_op - 1)) * (per_op - 1)
        for r in ("0", "1"):
            m = report["ranks"][r]["median_us"]
            assert report["ranks"][r]["median_pops_per_op"] == per_op
            assert abs(m["trigger_spread"] - spread_q / 1000) < 0.002, (r, m)
            assert abs(m["proxy_stage"] - (spread_q + copy + 100) / 1000) < 0.002, (r, m)
            assert abs(m["gpu_stage"] - gpu / 1000) < 0.002, (r, m)
            # The ranks' offset persists and flips sign every op (each rank's op k+1 starts from
            # the other's op k): periods alternate around the mean by the offset.
            assert abs(m["period"] - (spread_q + copy + 100 + gpu) / 1000) <= offset / 1000 + 0.004



def test_summary_needs_both_ranks(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ranks 0 and 1" in out.stderr
