"""Many cases in one spawned job: a registry of checks that run inside every rank, and the
pytest side that runs one job per world size with exactly the cases pytest selected."""

from __future__ import annotations

import time
import traceback

from rank_process import BACKEND, IS_RESIDENT


class Case:
    """A check run inside every rank: fn(rank, ws) -> (errors, digests).

    ``digests`` (a dict) must be identical on all ranks when ``identical`` is set.
    """

    def __init__(self, cid, fn, resident_only=False, identical=True, min_ws=2):
        self.id = cid
        self.fn = fn
        self.resident_only = resident_only
        self.identical = identical
        self.min_ws = min_ws


class CaseRegistry(dict):
    def add(self, cid, fn, resident_only=False, identical=True, min_ws=2):
        assert cid not in self, cid
        self[cid] = Case(cid, fn, resident_only, identical, min_ws)

    def case(self, cid, resident_only=False, identical=True, min_ws=2):
        def deco(fn):
            self.add(cid, fn, resident_only, identical, min_ws)
            return fn

        return deco

    def runnable(self, ws):
        return [c.id for c in self.values()
                if (IS_RESIDENT or not c.resident_only) and ws >= c.min_ws]


def execute_cases(registry, ids, rank, ws) -> dict:
    """Run the cases `ids` in order inside a rank; exceptions are recorded per case."""
    out = {}
    for cid in ids:
        t0 = time.monotonic()
        try:
            errs, digs = registry[cid].fn(rank, ws)
            out[cid] = {"errors": list(errs), "digests": dict(digs or {}), "exc": None}
        except Exception as e:  # noqa: BLE001
            out[cid] = {"errors": [], "digests": {},
                        "exc": f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=8)}
        out[cid]["seconds"] = time.monotonic() - t0
    return out


def case_problems(per_rank, registry, cid) -> list:
    problems = []
    for r, res in enumerate(per_rank):
        rc = res.get(cid)
        if rc is None:
            problems.append(f"rank {r}: case did not run")
            continue
        if rc["exc"]:
            problems.append(f"rank {r} raised {rc['exc']}")
        for e in rc["errors"]:
            problems.append(f"rank {r}: {e}")
    if registry[cid].identical and not problems:
        d0 = per_rank[0][cid]["digests"]
        for r in range(1, len(per_rank)):
            dr = per_rank[r][cid]["digests"]
            for k in d0:
                if dr.get(k) != d0[k]:
                    problems.append(f"{k}: rank {r} result {dr.get(k)} differs from rank 0 result {d0[k]}")
    return problems


class JobCache:
    """Runs one spawned job per world size with exactly the cases pytest selected."""

    def __init__(self, registry, job_fn, test_name, timeout_s=300, init_timeout_s=60, env=None):
        self.registry = registry
        self.job_fn = job_fn
        self.test_name = test_name
        self.timeout_s = timeout_s
        self.init_timeout_s = init_timeout_s
        self.env = env  # extra environment of the ranks (may be set before the first get)
        self.results = {}

    def get(self, ws, session):
        if ws not in self.results:
            selected = {
                it.callspec.params["cid"]
                for it in session.items
                if getattr(it, "originalname", None) == self.test_name
                and hasattr(it, "callspec")
                and it.callspec.params.get("ws") == ws
            }
            ids = [c for c in self.registry.runnable(ws) if c in selected]
            from dist_harness import RanksFailed, run_ranks  # the parent side imports this module

            try:
                per_rank = run_ranks(self.job_fn, ws, args=(ids,), timeout_s=self.timeout_s,
                                     init_timeout_s=self.init_timeout_s, env=self.env)
                self.results[ws] = (per_rank, None)
            except RanksFailed as e:
                self.results[ws] = (None, str(e))
        return self.results[ws]

    def check(self, cid, ws, session):
        import pytest

        c = self.registry[cid]
        if c.resident_only and not IS_RESIDENT:
            pytest.skip(f"not supported by {BACKEND!r}; promised by resident")
        if ws < c.min_ws:
            pytest.skip(f"needs world size >= {c.min_ws}")
        per_rank, job_err = self.get(ws, session)
        if job_err is not None:
            pytest.fail(f"the ws={ws} job of {self.test_name} failed as a whole:\n{job_err}", pytrace=False)
        problems = case_problems(per_rank, self.registry, cid)
        if problems:
            pytest.fail(f"{cid} ws={ws}:\n" + "\n".join(problems[:40]), pytrace=False)


def expect_error(results, label, fn, fragment, exc=ValueError):
    """Calls ``fn`` and records in ``results[label]`` "ok" when it raised ``exc`` with
    ``fragment`` in its message, else what happened instead."""
    try:
        fn()
        results[label] = f"no error (expected {exc.__name__} containing {fragment!r})"
    except exc as e:
        results[label] = "ok" if fragment in str(e) else f"{exc.__name__} without {fragment!r}: {e}"
    except Exception as e:  # noqa: BLE001
        results[label] = f"{type(e).__name__} instead of {exc.__name__}: {e}"
