"""resident_pg.bench.cases on synthetic ladder documents: the reference of each case (the floor,
else gloo's cell of the same round), the ratio as the median of the per-round ratios, the noise
band, the gate's verdicts and the baseline written from a ladder document."""

import json
import random

from resident_pg.bench import cases


def _row(variant, rnd, median, floor=None, ws=2, op="all_reduce", size=8):
    r = {"world_size": ws, "backend": variant.split(":")[0], "label": variant, "device": "cpu",
         "mode": "eager", "variant": variant, "op": op, "size_bytes": size, "round": rnd,
         "median_us": median, "p10_us": median * 0.9, "p90_us": median * 1.2, "check": "ok",
         "batch": 10, "slowest_rank": 1,
         "ranks": {"0": {"samples_us": [median * 0.95] * 3},
                   "1": {"samples_us": [median, median * 1.1, median * 0.9]}}}
    if floor:
        r.update(floor_us=floor, floor_kind="tcp", transport="tcp")
    return r


def _doc(by_round):
    combined = {}
    for r in by_round:
        combined.setdefault(cases.row_case_id(r), []).append(r)
    results = []
    for rs in combined.values():
        meds = sorted(r["median_us"] for r in rs)
        results.append(dict(rs[0], median_us=meds[len(meds) // 2], rounds=len(rs)))
    return {"config": {"baseline": "gloo"}, "metadata": {"git": {"commit": "c"}, "date": "d"},
            "results": results, "results_by_round": by_round}


def test_ratio_reference_and_band():
    rng = random.Random(7)
    gloo = [rng.uniform(150, 250) for _ in range(3)]
    res = [rng.uniform(50, 80) for _ in range(3)]
    rows = ([_row("gloo", i, g) for i, g in enumerate(gloo)]
            + [_row("resident", i, m) for i, m in enumerate(res)]
            + [_row("resident:transport=tcp", i, 90.0, floor=30.0) for i in range(3)])
    out = cases.case_results(_doc(rows))
    ratios = sorted(m / g for m, g in zip(res, gloo))
    e = out["cpu-eager-ws2-resident-all_reduce-8B"]["extra"]
    assert e["reference"] == "gloo (same run)"
    assert abs(e["ratio"] - ratios[1]) < 1e-12
    assert abs(e["noise_band"] - (ratios[2] - ratios[0]) / ratios[1]) < 1e-12
    assert len(out["cpu-eager-ws2-resident-all_reduce-8B"]["samples_s"]) == 9  # slowest rank x 3
    t = out["cpu-eager-ws2-resident:transport=tcp-all_reduce-8B"]["extra"]
    assert t["reference"] == "floor tcp" and abs(t["ratio"] - 3.0) < 1e-12
    assert t["noise_band"] == 0.0
    assert out["cpu-eager-ws2-gloo-all_reduce-8B"]["extra"]["ratio"] is None  # its own reference


def test_gate_verdicts():
    base = {"test_latency[x]": {"ratio": 2.0, "reference": "floor gpu", "median_us": 4.0}}
    ok = cases.gate("test_latency[x]", {"ratio": 2.15, "reference": "floor gpu",
                                        "noise_band": 0.02}, base, 0.10)
    assert ok["regressed"] is False and abs(ok["limit"] - 2.2) < 1e-12
    bad = cases.gate("test_latency[x]", {"ratio": 2.3, "reference": "floor gpu",
                                         "noise_band": 0.12, "median_us": 4.6}, base, 0.10)
    assert bad["regressed"] is True and abs(bad["limit"] - 2.24) < 1e-12
    table = cases.format_gate_table([bad], "regressions:")
    assert "test_latency[x]" in table and "2.300" in table and "12%" in table
    assert cases.gate("test_latency[y]", {"ratio": 9.0, "reference": "floor gpu"}, base, 0.1) is None
    other = cases.gate("test_latency[x]", {"ratio": 9.0, "reference": "gloo (same run)"},
                       base, 0.1)
    assert other["comparable"] is False and "'floor gpu'" in other["why"]
    none = cases.gate("test_latency[x]", {"ratio": None, "reference": None}, base, 0.1)
    assert none["comparable"] is False and "no ratio" in none["why"]
    assert ok["comparable"] is True and bad["comparable"] is True


def test_round_rows_without_floor_take_the_cells_floor():
    # A ladder of several rounds whose per-round rows were not annotated with the floor: each
    # round's ratio is to the cell's floor (the same every round), not missing.
    rows = [_row("resident:transport=tcp", i, m) for i, m in enumerate((60.0, 90.0, 75.0))]
    doc = _doc(rows)
    doc["results"][0].update(floor_us=30.0, floor_kind="tcp")
    e = cases.case_results(doc)["cpu-eager-ws2-resident:transport=tcp-all_reduce-8B"]["extra"]
    assert e["reference"] == "floor tcp" and e["round_ratios"] == [2.0, 3.0, 2.5]
    assert abs(e["ratio"] - 2.5) < 1e-12


def test_baseline_round_trip(tmp_path):
    rows = [_row("gloo", 0, 200.0), _row("resident", 0, 50.0)]
    doc = cases.baseline_from_doc(_doc(rows), "synthetic")
    p = tmp_path / "b.json"
    p.write_text(json.dumps(doc))
    base = cases.load_baseline(str(p))
    e = base["test_latency[cpu-eager-ws2-resident-all_reduce-8B]"]
    assert abs(e["ratio"] - 0.25) < 1e-12
    st = next(b for b in doc["benchmarks"] if b["param"].endswith("resident-all_reduce-8B"))
    assert abs(st["stats"]["median"] - 50e-6) < 1e-15 and st["stats"]["rounds"] == 3


def test_load_baseline_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"schema": "resident_pg.bench/1", "results": []}))
    try:
        cases.load_baseline(str(p))
    except ValueError as e:
        assert "benchmarks" in str(e)
    else:
        raise AssertionError("no error")
