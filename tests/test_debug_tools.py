"""torch's debugging tools on the resident backend, CPU tensors: the profilers, the sequence
numbers and TORCH_DISTRIBUTED_DEBUG=DETAIL (CUDA tensors: test_cuda_debug_tools.py).

Profilers (torch.profiler and torch.autograd.profiler, record_shapes=True): every op kind in
repeated sessions, sync and async, checked results, then the events each session must hold:
``resident:<op>``, one per call, async, with the op's input shapes. Ops that outlive their
session (finished, failed or aborted in a later one) must neither crash nor show up in the
later session. Sequence numbers: equal on every rank, counting the group's collectives only.
DETAIL: every op on the default group and on a subgroup through torch's ProcessGroupWrapper,
torch's own error for mismatched collectives, object collectives on a subgroup.
"""

from __future__ import annotations

import datetime

import pytest

import dist_harness as H
from profiled_ops import event_problems, events_of, gpu_annotation_problems, profiler, run_round

pytestmark = pytest.mark.resident_only

PROFILERS = ("autograd", "torch")


def _fail_on_errors(per_rank):
    problems = [f"rank {r}: {e}" for r, errs in enumerate(per_rank) for e in errs]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------
# Profilers
# --------------------------------------------------------------------------


def profiled_sessions_job(rank, ws, sessions, device="cpu", cuda_activity=False):
    """Every op in `sessions` profiling sessions per profiler and sync/async; then all-reduces of
    4 elements, each in a session of its own, then a session of the other profiler. With
    `cuda_activity` (CUDA tensors on a GPU) the profilers also trace the device, and each
    collective of a sync torch.profiler session must show on the GPU too: the profiler's
    annotation of the kernels launched inside the op's event."""
    import torch
    import torch.distributed as dist

    errs = []
    sub = dist.new_group([0, ws - 1]) if ws > 2 else None
    for kind in PROFILERS:
        for async_op in (False, True):
            for s in range(sessions):
                label = f"{kind} {'async' if async_op else 'sync'} session {s}"
                with profiler(kind, cuda=cuda_activity) as prof:
                    e1, exp = run_round(rank, ws, f"prof/{kind}/{async_op}/{s}", device=device,
                                        async_op=async_op)
                    errs += e1
                    if sub is not None and rank in (0, ws - 1):
                        e2, exp2 = run_round(rank, ws, f"sub/{kind}/{async_op}/{s}", device=device,
                                             async_op=async_op, group=sub)
                        errs += e2
                        for name, shapes in exp2.items():
                            exp.setdefault(name, []).extend(shapes)
                errs += event_problems(events_of(prof), exp, label)
                if cuda_activity and kind == "torch" and not async_op:
                    errs += gpu_annotation_problems(prof, exp, label)
    for i in range(5):
        t = torch.full((4,), float(rank + i), device=device)
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            dist.all_reduce(t)
        if t.tolist() != [float(sum(r + i for r in range(ws)))] * 4:
            errs.append(f"all_reduce in session {i}: {t.tolist()}")
        errs += event_problems(events_of(prof), {"resident:all_reduce": [[[4]]]}, f"short {i}")
    with profiler("torch") as prof:
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
    errs += event_problems(events_of(prof), {"resident:all_reduce": [[[4]]]}, "short torch")
    return errs


@pytest.mark.parametrize("ws", [2, 3])
def test_profiler_events_in_repeated_sessions(ws):
    # Python's own allocator would absorb a stray write into a freed block; malloc reports it.
    _fail_on_errors(H.run_ranks(profiled_sessions_job, ws, args=(3,), timeout_s=240,
                                env={"PYTHONMALLOC": "malloc"}))


def _outliving_ops_job(rank, ws):
    """Ops started in one session that end in another (or in none): waited, dropped, failed,
    aborted. Rank 1 is the late peer; the store orders the ranks."""
    import torch
    import torch.distributed as dist

    store = H.connect_store()
    errs = []
    data = torch.arange(6, dtype=torch.int64).reshape(2, 3)

    # 1. A recv posted in session A, matched and waited in session B.
    if rank == 0:
        got = torch.zeros(2, 3, dtype=torch.int64)
        with profiler("autograd") as a:
            work = dist.irecv(got, 1)
        with profiler("torch") as b:
            store.set("b1", "1")
            work.wait()
            t = torch.ones(3)
            dist.all_reduce(t)
        errs += H.compare_exact(got, data, "recv across sessions")
        errs += event_problems(events_of(a), {"resident:recv": [[[2, 3]]]}, "session A")
        errs += event_problems(events_of(b), {"resident:all_reduce": [[[3]]]}, "session B")
    else:
        store.wait(["b1"])
        dist.send(data, 0)
        dist.all_reduce(torch.ones(3))

    # 2. An async all_reduce started in a session, never waited, dropped during the next one.
    for i in range(3):
        with profiler("autograd"):
            work = dist.all_reduce(torch.ones(5), async_op=True)
        with profiler("autograd") as nxt:
            del work
            t = torch.ones(2)
            dist.all_reduce(t)
        errs += event_problems(events_of(nxt), {"resident:all_reduce": [[[2]]]}, f"dropped {i}")

    # 3. A failed op (its group's timeout passes) and an aborted one (its group is destroyed).
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    doomed = dist.new_group([0, 1])
    if rank == 0:
        with profiler("torch") as prof:
            try:
                dist.recv(torch.zeros(3), 1, group=short)
                errs.append("a recv nobody sent to did not fail")
            except RuntimeError:
                pass
        errs += event_problems(events_of(prof), {"resident:recv": [[[3]]]}, "failed recv")
        with profiler("torch") as prof:
            work = dist.irecv(torch.zeros(4), 1, group=doomed)
            dist.destroy_process_group(doomed)
            try:
                work.wait()
                errs.append("a recv of a destroyed group did not fail")
            except RuntimeError:
                pass
        errs += event_problems(events_of(prof), {"resident:recv": [[[4]]]}, "aborted recv")
        store.set("done3", "1")
    else:
        store.wait(["done3"], datetime.timedelta(seconds=60))
        dist.destroy_process_group(doomed)
    with profiler("torch") as prof:
        t = torch.full((3,), float(rank))
        dist.all_reduce(t)
    if t.tolist() != [float(sum(range(ws)))] * 3:
        errs.append(f"all_reduce after the failures: {t.tolist()}")
    errs += event_problems(events_of(prof), {"resident:all_reduce": [[[3]]]}, "after failures")
    return errs


def test_ops_outliving_their_profiling_session():
    _fail_on_errors(H.run_ranks(_outliving_ops_job, 2, timeout_s=120,
                                env={"PYTHONMALLOC": "malloc"}))


# --------------------------------------------------------------------------
# Sequence numbers and TORCH_DISTRIBUTED_DEBUG=DETAIL
# --------------------------------------------------------------------------


def _seq_agreement(pg, rank, ws, tag, members, expected=None) -> list:
    """Every member's sequence number through the store: all equal (and `expected`)."""
    store = H.connect_store()
    try:
        seq = pg._get_sequence_number_for_group()
    except RuntimeError as e:
        # Before torch 2.14 a ProcessGroup forwards this only to the backends it knows by type
        # ("ProcessGroup custom does not yet support sequence numbers"): ask the backend itself.
        if "does not yet support sequence numbers" not in str(e):
            raise
        import torch

        seq = pg._get_backend(torch.device(_DEVICE[0]))._get_sequence_number_for_group()
    store.set(f"seq/{tag}/{rank}", str(seq))
    seqs = [int(store.get(f"seq/{tag}/{r}")) for r in members]
    errs = []
    if len(set(seqs)) != 1:
        errs.append(f"{tag}: sequence numbers differ across ranks {members}: {seqs}")
    if expected is not None and seq != expected:
        errs.append(f"{tag}: sequence number {seq}, expected {expected}")
    return errs


_DEVICE = ["cpu"]  # the device of the job's tensors (a rank runs one debug_job)


def debug_job(rank, ws, level, device="cpu"):
    import torch
    import torch.distributed as dist

    _DEVICE[0] = device
    errs = []
    if dist.get_debug_level() != getattr(dist.DebugLevel, level):
        errs.append(f"debug level {dist.get_debug_level()}, expected {level}")
    world = dist.group.WORLD
    members = [0, ws - 1] if ws > 2 else [0, 1]  # not contiguous at 3 ranks
    sub = dist.new_group(members)
    backend = world._get_backend(torch.device(device))
    name = type(backend).__name__
    inner = type(backend.wrapped_pg).__name__ if level == "DETAIL" else name
    want = "_ProcessGroupWrapper" if level == "DETAIL" else "ProcessGroupResident"
    if name != want or inner != "ProcessGroupResident":
        errs.append(f"{level}: the group's backend is {name} around {inner}")
    errs += _seq_agreement(world, rank, ws, "start", range(ws), expected=0)

    collectives = 0
    for i, async_op in enumerate((False, True)):
        e, exp = run_round(rank, ws, f"dbg/{level}/{i}", device=device, async_op=async_op)
        errs += e
        collectives += sum(len(v) for k, v in exp.items() if k not in ("resident:send", "resident:recv"))
        if rank in members:
            errs += run_round(rank, ws, f"dbgsub/{level}/{i}", device=device, async_op=async_op,
                              group=sub)[0]
    errs += _seq_agreement(world, rank, ws, "world", range(ws), expected=collectives)
    if rank in members:
        errs += _seq_agreement(sub, rank, ws, "sub", members)
        objs = [None] * len(members)
        dist.all_gather_object(objs, {"rank": rank, "text": "x" * (rank + 1)}, group=sub)
        if objs != [{"rank": r, "text": "x" * (r + 1)} for r in members]:
            errs.append(f"all_gather_object on the subgroup: {objs}")
        errs += _seq_agreement(sub, rank, ws, "sub/objects", members)
    objs = [None] * ws
    dist.all_gather_object(objs, rank * 10)
    if objs != [r * 10 for r in range(ws)]:
        errs.append(f"all_gather_object: {objs}")

    if level == "DETAIL":
        # Shapes differ on the last rank, then the op: torch's wrapper names the mismatch on every
        # rank before the backend runs anything, and the group keeps working.
        last = rank == ws - 1
        def ones(n):
            return torch.ones(n, device=device)

        for what, fn in (("shape", lambda: dist.all_reduce(ones(5 if last else 4))),
                         ("op", lambda: dist.broadcast(ones(4), 0) if last
                          else dist.all_reduce(ones(4)))):
            try:
                fn()
                errs.append(f"mismatched {what}: no error")
            except RuntimeError as e:
                if "Detected mismatch between collectives on ranks" not in str(e):
                    errs.append(f"mismatched {what}: {str(e)[:300]}")
        errs += _seq_agreement(world, rank, ws, "after mismatch", range(ws))
    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t)
    if t.tolist() != [float(sum(range(1, ws + 1)))] * 3:
        errs.append(f"{level}: all_reduce at the end: {t.tolist()}")
    return errs


@pytest.mark.parametrize("level", ["OFF", "INFO", "DETAIL"])
@pytest.mark.parametrize("ws", [2, 3])
def test_debug_levels_and_sequence_numbers(ws, level):
    _fail_on_errors(H.run_ranks(debug_job, ws, args=(level,), timeout_s=180,
                                env={"TORCH_DISTRIBUTED_DEBUG": level}))
