"""Parent-side helpers of the persistent-mode GPU suites (tests/test_cuda_persistent*.py): run a
job's ranks once per (job, world size, environment) and cache the outcomes, turn one item of a
job's per-rank reports into a pytest verdict, and check that the ranks' processes exited.
The rank-side helpers are in persistent_harness.py."""

from __future__ import annotations

import time

import pytest

import cuda_harness as C
import dist_harness as H

EXIT_LIMIT_S = 10.0 * C.TIME_SCALE  # a rank's process exits within this after its teardown
# The persistent mode with the defaults unless a job sets a knob (None: removed from the
# ranks' environment).
PERSISTENT = {"RESIDENT_GPU_PERSISTENT": "1",
              "RESIDENT_GPU_PERSISTENT_IDLE_US": None, "RESIDENT_GPU_PERSISTENT_BLOCKS": None,
              "RESIDENT_GPU_PERSISTENT_SLOTS": None, "RESIDENT_GPU_CHUNK_BYTES": None,
              "RESIDENT_GPU_PERSISTENT_GRAPHS": None}

_JOBS: dict = {}


def run_job(name, fn, ws, env, timeout_s, **kw):
    """Runs job `fn` on `ws` ranks with `env` once per session (later calls get the cache)."""
    key = (name, ws, tuple(sorted(env.items(), key=lambda kv: kv[0])))
    if key not in _JOBS:
        before = set(H.list_shm())
        t0 = time.monotonic()
        outcomes = H.run_ranks_collect(fn, ws, env=env, init=False, init_timeout_s=20,
                                       timeout_s=timeout_s * C.TIME_SCALE,
                                       exit_grace_s=EXIT_LIMIT_S + 2, **kw)
        left = H.new_shm_entries(before)
        if left:
            H.remove_shm(left)
        _JOBS[key] = {"outcomes": outcomes, "shm_left": left, "wall_s": time.monotonic() - t0}
    return _JOBS[key]


def describe(outcomes):
    return "\n".join(o.describe() for o in outcomes)


def check_item(job, item, what):
    """Fails (or skips) the pytest item `item` of `job` from its ranks' reports; results of
    the item that do not depend on the rank must agree across ranks."""
    outcomes = job["outcomes"]
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        pytest.fail(f"the {what} job failed as a whole:\n{describe(outcomes)}", pytrace=False)
    values = [o.value for o in outcomes]
    if all(item in v["skipped"] for v in values):
        pytest.skip(values[0]["skipped"][item])
    problems = []
    for r, v in enumerate(values):
        if item not in v["items"]:
            problems.append(f"rank {r}: did not run")
        problems += [f"rank {r}: {e}" for e in v["items"].get(item, [])]
    if not problems:
        d0 = values[0]["digests"].get(item, {})
        for r in range(1, len(values)):
            for k, dg in d0.items():
                if values[r]["digests"][item].get(k) != dg:
                    problems.append(f"{k}: rank {r} result {values[r]['digests'][item].get(k)} "
                                    f"differs from rank 0 result {dg}")
    if problems:
        info = {r: v["info"] for r, v in enumerate(values) if v["info"]}
        pytest.fail(f"{item} ({what}):\n" + "\n".join(problems[:40])
                    + (f"\ninfo: {info}" if info else ""), pytrace=False)


def exit_problems(job, ranks, destroyed=True):
    """The ranks' processes tore down (or skipped it) and exited by themselves, code 0, in time."""
    problems = []
    want = "ok" if destroyed else "skipped"
    for o in job["outcomes"]:
        if o.rank not in ranks:
            continue
        if o.status != "ok":
            problems.append(o.describe())
            continue
        if o.destroy_status != want:
            problems.append(f"rank {o.rank}: teardown {o.destroy_status} (expected {want}) "
                            f"{o.destroy_message or ''}")
        if o.exited_at_s is None or o.exitcode != 0:
            problems.append(f"rank {o.rank}: its process did not exit by itself with code 0 within "
                            f"{EXIT_LIMIT_S + 2:.0f}s of its teardown (exit code {o.exitcode})")
        elif o.exit_delay_s > EXIT_LIMIT_S:
            problems.append(f"rank {o.rank}: its process exited {o.exit_delay_s:.1f}s after its "
                            f"teardown (limit {EXIT_LIMIT_S:.0f}s)")
    if job["shm_left"]:
        problems.append(f"left in /dev/shm: {sorted(job['shm_left'])}")
    return problems


def judge(job, item, what, ranks, exit_item="process_exit", destroyed=True):
    """One pytest item of a job: `exit_item` checks that the ranks' processes tore down (or
    skipped it, `destroyed` False) and exited (exit_problems); any other item, the ranks'
    reports (check_item)."""
    if item == exit_item:
        problems = exit_problems(job, ranks, destroyed)
        assert not problems, f"{what}:\n" + "\n".join(problems)
        return
    check_item(job, item, what)
