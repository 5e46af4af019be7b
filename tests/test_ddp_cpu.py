"""DistributedDataParallel on resident with CPU tensors gives gloo's results (tests/ddp_equivalence.py
says how equal): DDP's own bucketed allreduce with 25 MB and 1 MB buckets, and torch's
allreduce and fp16-compression comm hooks, which go through Work.get_future()."""

from __future__ import annotations

import pytest

import dist_harness as H
import ddp_equivalence as E

pytestmark = pytest.mark.resident_only  # the comparison itself runs gloo beside resident


@pytest.mark.parametrize("ws", (2, 3), ids=lambda w: f"ws{w}")
def test_ddp_matches_gloo(ws):
    results = {}
    for backend in ("resident", "gloo"):
        results[backend] = H.run_ranks(E.job, ws, args=(E.CONFIGS,), backend=backend,
                                       timeout_s=240, init_timeout_s=60)
    for config, (n, rel) in E.differences(results["resident"], results["gloo"]).items():
        print(f"ws{ws} {config}: {n} parameters differ from gloo's, max relative difference {rel:.3g}")
    problems = E.problems(results["resident"], results["gloo"], ws)
    assert not problems, "\n".join(problems)
