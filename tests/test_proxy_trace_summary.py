"""scripts/proxy_trace_summary.py on synthetic two-rank proxy timelines with known stages: per
op, a rank pops its triggers (random spacing), posts after a copy time, and its next op's first
trigger comes a known GPU time after the peer proxy's end of the op; rank 1 runs a random
offset behind. The medians it reports must be the ones built in; a lone rank is an error.
Optionally each rank forwards a credit between its ops (as a send/recv ping-pong does, long
after its own posts): it must be counted, not taken into the op's stages; and optionally each
rank has a tcp timeline whose last read of an op's data comes a known time before its next op:
the read-to-trigger stage."""

import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "proxy_trace_summary.py")


def write_timelines(prefix, rng, ops, per_op, spread_ns, copy_ns, gpu_ns, credit=False,
                    read_ns=0):
    """read_ns: each rank also has a tcp timeline (<prefix>.rank<r>.0.tcp.tsv) whose last
    `received` of an op comes read_ns before the rank's next op starts."""
    events = {0: [], 1: []}
    tcp = {0: [], 1: []}
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
            if credit:  # before this rank's next op (gpu_ns after the peer's end)
                events[r].append((t + gpu_ns // 2, "credit", 1 - r, 8))
        # A rank's next op starts gpu_ns after the peer proxy delivered this one.
        start = {0: end[1] + gpu_ns, 1: end[0] + gpu_ns}
        if read_ns:
            for r in (0, 1):
                tcp[r].append((start[r] - read_ns - 700, "received", 1 - r, 4096))
                tcp[r].append((start[r] - read_ns, "received", 1 - r, 61464))
    for r in (0, 1):
        for name, evs in ((f"{prefix}.rank{r}.0.tsv", events[r]),
                          (f"{prefix}.rank{r}.0.tcp.tsv", tcp[r])):
            if not evs:
                continue
            with open(name, "w") as f:
                f.write("# t_ns\tevent\tpeer\tbytes\t(dropped 0)\n")
                for t, ev, peer, nbytes in evs:
                    f.write(f"{t}\t{ev}\t{peer}\t{nbytes}\n")
    return offset


def test_summary_recovers_the_stages(tmp_path):
    rng = random.Random(20261130)
    gap_runs = 0
    for case in range(4):
        credit = case % 2 == 1
        per_op = rng.choice([2, 8, 64])
        spread = rng.randrange(200, 4000)
        copy = rng.randrange(500, 6000)
        gpu = rng.randrange(2000, 20000)
        read = rng.randrange(500, gpu - 800) if case >= 2 else 0  # a tcp timeline too
        prefix = str(tmp_path / f"cell{per_op}_{spread}_{case}")
        offset = write_timelines(prefix, rng, 200, per_op, spread, copy, gpu, credit, read)
        out = subprocess.run([sys.executable, SCRIPT, prefix, "--triggers-per-op", str(per_op)],
                             capture_output=True, text=True, timeout=60, check=True)
        report = json.loads(out.stdout)
        spread_q = (spread // (per_op - 1)) * (per_op - 1)
        for r in ("0", "1"):
            m = report["ranks"][r]["median_us"]
            assert report["ranks"][r]["median_pops_per_op"] == per_op
            assert report["ranks"][r]["median_credits_per_op"] == (1 if credit else 0)
            assert abs(m["trigger_spread"] - spread_q / 1000) < 0.002, (r, m)
            assert abs(m["proxy_stage"] - (spread_q + copy + 100) / 1000) < 0.002, (r, m)
            assert abs(m["gpu_stage"] - gpu / 1000) < 0.002, (r, m)
            if read:  # the last read of op k's data -> the first trigger of op k+1
                assert abs(m["read_to_trigger"] - read / 1000) < 0.002, (r, m)
                assert report["ranks"][r]["median_pops_per_op"] == per_op
            else:
                assert m["read_to_trigger"] is None, (r, m)
            # The ranks' offset persists and flips sign every op (each rank's op k+1 starts from
            # the other's op k): periods alternate around the mean by the offset.
            assert abs(m["period"] - (spread_q + copy + 100 + gpu) / 1000) <= offset / 1000 + 0.004
        # Ops found by gaps instead (the device stage's way): a gap longer than the triggers'
        # own spacing and shorter than the quiet time before the next op (gpu_ns less the ranks'
        # offset, either way); a credit inside that quiet time must not bridge it.
        step = spread // (per_op - 1)
        if step + 1 < gpu - offset - 10:
            gap = step + 1
            gap_runs += 1
            out = subprocess.run([sys.executable, SCRIPT, prefix, "--gap-ns", str(gap)],
                                 capture_output=True, text=True, timeout=60, check=True)
            report = json.loads(out.stdout)
            for r in ("0", "1"):
                m = report["ranks"][r]["median_us"]
                assert report["ranks"][r]["median_pops_per_op"] == per_op, (case, r)
                assert abs(m["proxy_stage"] - (spread_q + copy + 100) / 1000) < 0.002, (case, r, m)
            # The timeline: rank 0's own events at their built-in offsets from its op's first
            # trigger; rank 1's events are there too (those of each op window: rank 1's op starts
            # alternately before and after rank 0's here, so its pops fill every other window).
            at = {(x["rank"], x["event"], x["occurrence"]): x["median_us"]
                  for x in report["timeline"]}
            assert at[(0, "first_pop", 0)] == 0
            assert abs(at[(0, "last_pop", 0)] - spread_q / 1000) < 0.002, (case, at)
            assert abs(at[(0, "posted", 0)] - (spread_q + copy) / 1000) < 0.002, (case, at)
            assert abs(at[(0, "flags", 0)] - (spread_q + copy + 100) / 1000) < 0.002, (case, at)
            assert any(k[0] == 1 for k in at), (case, at)
    assert gap_runs >= 2  # the seed gives cases of both kinds, with and without credits



def test_summary_needs_both_ranks(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ranks 0 and 1" in out.stderr


def test_summary_reads_the_kernel_timeline(tmp_path):
    # Beside the proxy timelines, each rank's general-kernel stamps (.gpu.tsv): ops whose phases
    # are known, listed out of time order (the buffer is indexed by round number modulo its
    # size); the report's "gpu" part must give them back, and the file must not be taken for a
    # proxy timeline.
    rng = random.Random(20261203)
    prefix = str(tmp_path / "cell")
    write_timelines(prefix, rng, 50, 8, 1000, 2000, 5000)
    phases = {"send": 4900, "wait": 33000, "reduce": 4700, "exit": 600, "boundary": 1500}
    for r in (0, 1):
        rows = []
        t = 10_000_000 + r * 333
        for op in range(100):
            for block in (0, 1):
                waited = t + block * 20
                sent = waited + phases["send"]
                flags = sent + phases["wait"]
                received = flags + phases["reduce"]
                end = received + phases["exit"]
                rows.append((op, block, waited, sent, flags, received, end))
            # each block of the next op passes its wait `boundary` after its own block's end
            t = end - 20 + phases["boundary"]
        rng.shuffle(rows)
        with open(f"{prefix}.rank{r}.0.gpu.tsv", "w") as f:
            f.write("# op\tblock\twaited\tsent\tflags\treceived\texit\n")
            for row in rows:
                f.write("\t".join(str(x) for x in row) + "\n")
    out = subprocess.run([sys.executable, SCRIPT, prefix, "--triggers-per-op", "8"],
                         capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    assert not any(f.endswith(".gpu.tsv") for f in report["files"]), report["files"]
    assert report["ranks"]["0"]["median_pops_per_op"] == 8
    for r in ("0", "1"):
        for block in ("first", "last"):
            g = report["gpu"][r][block]
            assert g["ops"] == 100, g
            for name in ("send", "wait", "reduce", "exit"):
                assert abs(g["median_us"][name] - phases[name] / 1000) < 0.002, (r, block, g)
            assert abs(g["median_us"]["boundary"] - phases["boundary"] / 1000) < 0.002, g
