"""Resource leaks (resident): /dev/shm segments and threads.

* After a normal exit, and after a rank is SIGKILLed (the others erroring out),
  no /dev/shm entry whose name starts with "resident" may remain that was not
  there before the test.  Segments visible while the job runs must be mode 0600.
* The number of OS threads (/proc/self/task) after destroy_process_group returns
  to the number before init_process_group.
* torch.distributed's _abort_process_group (a subgroup, then the world) releases threads and
  /dev/shm entries as destroy does, and the process can initialise again.
"""

from __future__ import annotations

import os
import time

import pytest

import dist_harness as H
from dist_harness import compare_exact, compare_reduction, make_input, reference_reduce

pytestmark = pytest.mark.resident_only

MiB = 1 << 20


def _exercise(rank, ws, tag):
    """Small and large collectives, async ops, p2p and a subgroup."""
    import torch
    import torch.distributed as dist

    errs = []
    for n in (1, 4099, 2 * MiB // 4 + 1):
        inputs = [make_input(f"leak/{tag}/{n}", r, n, "float32") for r in range(ws)]
        t = inputs[rank].clone()
        dist.all_reduce(t)
        errs += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs, "SUM",
                                  "float32", f"{tag} all_reduce n={n}")
    inputs = [make_input(f"leak/{tag}/ag", r, MiB // 4, "float32") for r in range(ws)]
    out = torch.empty(ws * (MiB // 4))
    w = dist.all_gather_into_tensor(out, inputs[rank].clone(), async_op=True)
    w.wait()
    errs += compare_exact(out, torch.cat(inputs), f"{tag} async all_gather")
    peer = (rank + 1) % ws
    src = (rank - 1) % ws
    buf = torch.empty(1000)
    wr = dist.irecv(buf, src=src, tag=4)
    dist.isend(make_input(f"leak/{tag}/p2p", rank, 1000, "float32"), dst=peer, tag=4).wait()
    wr.wait()
    errs += compare_exact(buf, make_input(f"leak/{tag}/p2p", src, 1000, "float32"), f"{tag} p2p")
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        t = inputs[rank][:100].clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sub)
        errs += compare_exact(t, reference_reduce([x[:100] for x in inputs[:2]], "MAX", "float32"),
                              f"{tag} subgroup")
    dist.barrier()
    return errs


# --------------------------------------------------------------------------
# /dev/shm
# --------------------------------------------------------------------------


def _shm_normal_job(rank, ws):
    errs = _exercise(rank, ws, "shm")
    seen = H.list_shm()
    import torch.distributed as dist

    dist.barrier()  # nobody tears down before everyone has looked
    return {"errors": errs, "seen": seen, "uid": os.getuid()}


def _check_modes(results):
    problems = []
    for r, res in enumerate(results):
        for name, (mode, uid, _size) in res["seen"].items():
            if mode != 0o600:
                problems.append(f"rank {r} saw /dev/shm/{name} with mode {oct(mode)} (expected 0o600)")
            if uid != res["uid"]:
                problems.append(f"rank {r} saw /dev/shm/{name} owned by uid {uid}")
    return problems


def test_no_shm_leftover_after_normal_exit(shm_snapshot):
    results = H.run_ranks(_shm_normal_job, 3, timeout_s=120)
    problems = [f"rank {r}: {e}" for r, res in enumerate(results) for e in res["errors"]]
    problems += _check_modes(results)
    problems += H.shm_left_problems(shm_snapshot, "after a normal exit")
    assert not problems, "\n".join(problems)


def _shm_kill_job(rank, ws):
    import torch.distributed as dist

    errs = _exercise(rank, ws, "kill")
    seen = H.list_shm()
    dist.barrier()
    if rank == ws - 1:
        H.request_sigkill("shm leak test")
    t0 = time.monotonic()
    try:
        for _ in range(10):
            dist.all_reduce(make_input("leak/kill/after", rank, 2 * MiB // 4, "float32"))
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = f"{type(e).__name__}: {e}"
    return {"errors": errs, "seen": seen, "uid": os.getuid(), "raised": raised,
            "elapsed": time.monotonic() - t0}


def test_no_shm_leftover_after_sigkill(shm_snapshot):
    ws = 3
    outcomes = H.run_ranks_collect(_shm_kill_job, ws, init_timeout_s=5, timeout_s=90,
                                   stop_when_done=list(range(ws - 1)), destroy_grace_s=15)
    # every process is gone by now (the harness joined or killed them)
    problems = []
    if outcomes[ws - 1].status != "killed":
        problems.append(f"rank {ws - 1} was not killed: {outcomes[ws - 1].describe()}")
    survivors = []
    for o in outcomes[:-1]:
        if o.status != "ok":
            problems.append(o.describe())
            continue
        survivors.append(o.value)
        problems += [f"rank {o.rank}: {e}" for e in o.value["errors"]]
        if o.value["raised"] is None:
            problems.append(f"rank {o.rank}: no error although rank {ws - 1} was SIGKILLed")
    problems += _check_modes(survivors)
    problems += H.shm_left_problems(shm_snapshot, f"after rank {ws - 1} was SIGKILLed")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# threads
# --------------------------------------------------------------------------


def _our_task_count():
    """Threads of this process, not counting the CUDA driver's helper threads ("cuda…"),
    which torch's lazy CUDA initialisation starts once per process and never stops."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("cuda"):
                    continue
        except OSError:
            continue
        n += 1
    return n


def _task_count_down_to(target, limit_s=5.0):
    """_our_task_count(), polled until it is at most `target` or `limit_s` passed."""
    deadline = time.monotonic() + limit_s
    n = _our_task_count()
    while n > target and time.monotonic() < deadline:
        time.sleep(0.05)
        n = _our_task_count()
    return n


def _threads_job(rank, ws, cycles):
    import torch.distributed as dist

    # warm torch up outside the measured window (lazy pools, allocators, ...)
    x = make_input("warm", rank, 1000, "float32")
    (x + x).sum().item()
    H.connect_store()
    report = []
    for c in range(cycles):
        before = _our_task_count()
        H.init_pg(prefix=f"threads{c}/")
        errs = _exercise(rank, ws, f"thr{c}")
        during = _our_task_count()
        dist.destroy_process_group()
        after = _task_count_down_to(before)
        names = []
        if after > before:
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        names.append(f.read().strip())
                except OSError:
                    pass
        report.append({"cycle": c, "before": before, "during": during, "after": after,
                       "errors": errs, "thread_names": names})
    return report


def test_threads_return_to_baseline_after_destroy():
    results = H.run_ranks(_threads_job, 2, args=(2,), init=False, timeout_s=120)
    problems = []
    for r, rep in enumerate(results):
        for c in rep:
            problems += [f"rank {r}: {e}" for e in c["errors"]]
            if c["after"] > c["before"]:
                problems.append(
                    f"rank {r} cycle {c['cycle']}: {c['before']} threads before init, {c['during']} "
                    f"while running, {c['after']} 5 s after destroy_process_group; "
                    f"threads now: {c['thread_names']}"
                )
    assert not problems, "\n".join(problems)


def _shm_init_kill_job(rank, ws, before, init_timeout_s, late_rank_joins):
    """Rank 2 joins late: while ranks 0 and 1 wait inside init_process_group (their
    segments exist and are still named), rank 2 checks the modes, has rank 0 SIGKILLed,
    then tries to join (or, with late_rank_joins=False, never joins).  The ranks that
    are left must fail, and nothing may stay in /dev/shm."""
    import torch.distributed as dist

    seen = {}
    if rank == ws - 1:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen = {k: v for k, v in H.list_shm().items() if k not in before}
            if len(seen) >= ws - 1:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        seen = {k: v for k, v in H.list_shm().items() if k not in before}
        H.request_kill_of(0, "killed inside init_process_group")
        time.sleep(1.0)
        if not late_rank_joins:
            return {"seen": seen, "uid": os.getuid(), "raised": "(never joined)", "elapsed": 0.0}
    t0 = time.monotonic()
    try:
        H.init_pg(timeout_s=init_timeout_s)
        dist.all_reduce(make_input("leak/initkill", rank, 1000, "float32"))
        raised = None
    except Exception as e:  # noqa: BLE001
        raised = f"{type(e).__name__}: {e}"
    return {"seen": seen, "uid": os.getuid(), "raised": raised, "elapsed": time.monotonic() - t0}


@pytest.mark.slow
@pytest.mark.parametrize("late_rank_joins", [True, False], ids=["late-rank-joins", "late-rank-never-joins"])
def test_no_shm_leftover_after_sigkill_during_init(shm_snapshot, late_rank_joins):
    ws = 3
    init_timeout_s = 10
    outcomes = H.run_ranks_collect(_shm_init_kill_job, ws,
                                   args=(shm_snapshot, init_timeout_s, late_rank_joins),
                                   init=False, init_timeout_s=init_timeout_s, timeout_s=120,
                                   store_timeout_s=init_timeout_s + 5,
                                   stop_when_done=[1, 2], destroy_grace_s=15)
    problems = []
    if outcomes[0].status != "killed":
        problems.append(f"rank 0 was not killed: {outcomes[0].describe()}")
    for o in outcomes[1:]:
        if o.status != "ok":
            problems.append(o.describe())
        elif o.value["raised"] is None:
            problems.append(f"rank {o.rank}: no error although rank 0 was SIGKILLed")
    late = outcomes[ws - 1].value if outcomes[ws - 1].status == "ok" else None
    if late is not None:
        problems += _check_modes([late])
    problems += H.shm_left_problems(shm_snapshot, "after rank 0 was SIGKILLed inside init")
    assert not problems, "\n".join(problems) + "\n" + "\n".join(
        f"rank {o.rank}: {o.value!r}" for o in outcomes if o.value is not None)


# --------------------------------------------------------------------------
# abort (torch.distributed.distributed_c10d._abort_process_group)
# --------------------------------------------------------------------------


def _abort_job(rank, ws):
    """A subgroup aborted while the world group lives on and the subgroup object is still
    referenced (its threads go at once: abort(), not garbage collection, released them; ops on
    it then fail with a clear error; the world still works), then the whole world aborted:
    threads and /dev/shm entries return to where they were before init, and a new world can be
    initialised afterwards."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    x = make_input("warm", rank, 1000, "float32")
    (x + x).sum().item()
    H.connect_store()
    out = {"errors": [], "cycles": []}
    for c in range(2):
        before = _our_task_count()
        H.init_pg(prefix=f"abort{c}/")
        out["errors"] += _exercise(rank, ws, f"abort{c}")
        before_sub = _our_task_count()
        sub = dist.new_group(list(range(ws)))
        t = make_input(f"abort/sub{c}", rank, 257, "int64")
        dist.all_reduce(t, group=sub)
        with_sub = _our_task_count()
        _abort_process_group(sub)  # `sub` stays referenced: only abort() can release it
        after_sub = _task_count_down_to(before_sub)
        if after_sub > before_sub:
            out["errors"].append(f"cycle {c}: {before_sub} threads before the subgroup, {with_sub} "
                                 f"with it, {after_sub} 5 s after its _abort_process_group()")
        out.setdefault("sub_threads", []).append((before_sub, with_sub, after_sub))
        try:
            dist.all_reduce(make_input("abort/after", rank, 8, "float32"), group=sub)
            out["errors"].append(f"cycle {c}: all_reduce on an aborted subgroup did not raise")
        except Exception as e:  # noqa: BLE001
            out.setdefault("after_abort", f"{type(e).__name__}: {e}")
        t = make_input(f"abort/world{c}", rank, 4099, "float32")
        dist.all_reduce(t)  # the world group is not aborted
        inputs = [make_input(f"abort/world{c}", r, 4099, "float32") for r in range(ws)]
        out["errors"] += compare_reduction(t, reference_reduce(inputs, "SUM", "float32"), inputs,
                                           "SUM", "float32", f"cycle {c}: world after sub abort")
        dist.barrier()  # nobody aborts the world while a peer still uses it
        _abort_process_group()
        after = _task_count_down_to(before)
        out["cycles"].append({"before": before, "after": after,
                              "initialized": dist.is_initialized()})
    return out


def test_abort_process_group_releases_everything(shm_snapshot):
    results = H.run_ranks(_abort_job, 2, init=False, destroy=False, timeout_s=120)
    problems = []
    for r, res in enumerate(results):
        problems += [f"rank {r}: {e}" for e in res["errors"]]
        if "after_abort" not in res:
            problems.append(f"rank {r}: no error from an op on the aborted subgroup")
        for c, cyc in enumerate(res["cycles"]):
            if cyc["after"] > cyc["before"]:
                problems.append(f"rank {r} cycle {c}: {cyc['before']} threads before init, "
                                f"{cyc['after']} 5 s after _abort_process_group()")
            if cyc["initialized"]:
                problems.append(f"rank {r} cycle {c}: still initialised after the world's abort")
    problems += H.shm_left_problems(shm_snapshot, "after _abort_process_group()")
    assert not problems, "\n".join(problems)
    # the error names the problem (printed for the log; its text is the backend's)
    print("op on an aborted subgroup:", results[0]["after_abort"])
    print("threads before the subgroup / with it / after its abort:", results[0]["sub_threads"])
