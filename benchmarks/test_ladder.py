"""The latency ladder's cells as pytest cases (parametrized by benchmarks/conftest.py).

Each case checks the op's result (the ladder checks it on known values before timing, and in
graph mode replays a captured check), reports its median, p10, p90 and its ratio to its
reference in the same run (extra_info), and with ``--resident-gate`` fails when that ratio
exceeds the baseline's by more than the run's noise band. No case asserts an absolute time.
"""

import pytest

from conftest import record
from resident_pg.bench import cases


def test_latency(ladder_case, ladder_runs, benchmark, request):
    p = ladder_case
    if p["device"] == "cuda":
        import torch
        if not torch.cuda.is_available():
            pytest.skip("CUDA cases need a GPU (torch.cuda.is_available() is False)")
    results = ladder_runs.results(request.session, p["device"], p["world_size"])
    cid = cases.case_id(p["device"], p["mode"], p["world_size"], p["variant"], p["op"],
                        p["size"])
    res = results.get(cid)
    assert res is not None, f"the ladder produced no row for {cid}"
    assert "error" not in res, f"{cid}: {res['error']}"
    assert res["check"] == "ok", f"{cid}: wrong result: {res['check']}"
    record(benchmark, cid, res)
    if ladder_runs.baseline is not None:
        verdict = cases.gate(cases.case_name(cid), res["extra"], ladder_runs.baseline,
                             request.config.getoption("resident_gate_min_band"))
        if verdict:
            ladder_runs.verdicts.append(verdict)
            assert verdict["comparable"], verdict["why"]
            assert not verdict["regressed"], cases.format_gate_table([verdict], "regression:")
