"""Persistent mode (RESIDENT_GPU_PERSISTENT=1): a resident kernel per communicator runs every
collective of at most RESIDENT_GPU_CHUNK_BYTES (64 KiB) per peer, handed over by stream memory
operations; larger collectives and send/recv still launch a kernel per op.  The semantics must
be those of the default mode; ``persistent_status()`` of the group's CUDA backend shows what
the resident kernel did (enabled, installed, running, queued, launches, exits, served,
graph_slots_used, slots, blocks).

Jobs (each one spawned job; every check of a job is its own pytest item):

* main, per (world size 2 / 4 / 8, RESIDENT_PATH direct / proxy), default knobs (graphs: a
  kernel node per captured collective, RESIDENT_GPU_PERSISTENT_GRAPHS=kernel), and once more
  at 2 ranks, direct, with RESIDENT_GPU_PERSISTENT_GRAPHS=resident (captured collectives go to
  the resident kernel too):
  - status_before_first_op: enabled, not installed before the first CUDA op;
  - collectives_eager: all_reduce, reduce_scatter(_tensor), reduce, all_gather(_into_tensor),
    gather, scatter, all_to_all_single (even, uneven), all_to_all, broadcast x float32,
    bfloat16, int64 x 8 B, 4 KiB, 64 KiB, plus all_reduce with every reduce op for float32 and
    int32, against independent references (bitwise for integers and data movement);
  - served_counts_ops: the resident kernel's served count grew by at least the number of those
    ops (they really went through it), blocks 4 and slots 1024 (the defaults);
  - large_fallback_interleaved: 1 MiB all_reduce and all_to_all_single (a kernel per op)
    issued back to back with small ones (resident kernel) on one stream, all correct;
  - async_op_wait: async_op=True ops in flight together, waited in reverse order, then checked;
  - graph_*: two graphs of different collectives (one with async ops waited inside the
    capture), warmed up on a side stream, replayed 5x interleaved with each other and with
    eager ops, fresh inputs copied into the static inputs before each replay; graphs=kernel:
    the replays' collectives do not go through the resident kernel (served grows by the eager
    ones only) and take no graph slot; graphs=resident: they do, and graph_slots_used grows at
    capture and not across replays;
  - synchronize_returns: torch.cuda.synchronize() returns within SYNC_LIMIT_S (the resident
    kernel idles out) and the kernel is then reported not running;
  - process_exit: every rank tears down (destroy_process_group), its process exits with code 0
    within EXIT_LIMIT_S, and no /dev/shm resident* entry is left.
* destroy (2 ranks): RESIDENT_GPU_PERSISTENT_IDLE_US=30 s (the kernel stays), _BLOCKS=2,
  _SLOTS=256: the knobs show in the status, the kernel is running before
  destroy_process_group(), destroy returns, torch.cuda.synchronize() returns right after it
  (destroy stopped the kernel), and the process exits promptly; the same again with
  torch.distributed's _abort_process_group() in place of destroy_process_group().
* idle (2 ranks): RESIDENT_GPU_PERSISTENT_IDLE_US=20 ms: after each op the kernel leaves by
  itself (running becomes False within IDLE_WAIT_S, exits grows); the next eager op relaunches
  it (launches grows) and is correct; a graph replay in between runs its own kernel nodes
  (correct, nothing relaunched: launches does not grow); a subgroup made with
  pg_options={"gpu_persistent": "0"} is not persistent; the ranks then return WITHOUT
  destroy_process_group and their processes must still exit promptly with code 0.
* timeout (2 ranks): subgroups with a 3 s timeout on the direct and the proxy path; rank 1
  skips an all_reduce; rank 0's device work completes, the error surfaces on the host naming
  rank 1 within the timeout plus ERROR_SLACK_S, and rank 0's process exits promptly.

Helpers (one collective checked against references, status polling, the per-item report):
tests/persistent_harness.py; running a job once and judging its items: tests/persistent_jobs.py.
The resident kernel that never leaves (IDLE_US=0) and lazy module loading:
tests/test_cuda_persistent_never_idle.py.

Dry run (RESIDENT_GPU_TESTS_DEVICE=cpu, see cuda_harness): the same jobs on CPU tensors; the
checks of the resident kernel itself (status, served counts, idle exit, synchronize) are
skipped, the data, references and process exits are still checked.
"""

from __future__ import annotations

import datetime
import gc
import time

import pytest

import cuda_harness as C
import dist_harness as H
from persistent_harness import (
    SUITE_GPU_ONLY,
    OPS,
    OpCall,
    OpProg,
    Report,
    destroy_items,
    device_sync_problems,
    expect_served,
    note_progress,
    pstatus,
    run_checked,
    served,
    start_stuck_reporter,
    status_problems,
    wait_status,
)
from persistent_jobs import PERSISTENT, describe as _describe, exit_problems as _exit_problems
from persistent_jobs import judge, run_job as _job

pytestmark = C.module_marks()


SIZES = ("8B", "4KiB", "64KiB")  # all at most 64 KiB per peer: the resident kernel's
DTYPES = ("float32", "bfloat16", "int64")
FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INT_OPS = FLOAT_OPS + ("BAND", "BOR", "BXOR")
K_REPLAYS = 5

SYNC_LIMIT_S = 5.0 * C.TIME_SCALE      # torch.cuda.synchronize() with the mode on
IDLE_WAIT_S = 5.0                      # an idle kernel (20 ms idle time) must have left by then
DESTROY_LIMIT_S = 20.0 * C.TIME_SCALE  # destroy_process_group() must return within this
GROUP_TIMEOUT_S = 3
ERROR_SLACK_S = 12.0 * C.TIME_SCALE    # the timeout error surfaces within timeout + this

MAIN_KEYS = [(ws, p, "kernel") for ws in (2, 4, 8) for p in C.PATHS if ws in C.WORLD_SIZES]
if 2 in C.WORLD_SIZES:
    MAIN_KEYS.append((2, "direct", "resident"))
MAIN_ITEMS = ("status_before_first_op", "collectives_eager", "served_counts_ops",
              "large_fallback_interleaved", "async_op_wait", "graph_warm_up_and_capture",
              "graph_replays", "graph_slots_stable", "synchronize_returns", "process_exit")
DESTROY_ITEMS = ("results", "status_before_destroy", "destroy_returns", "synchronize_after_destroy",
                 "process_exit")
IDLE_ITEMS = ("relaunch_results", "idle_exit", "relaunch_counts", "synchronize_returns",
              "pg_option_disables", "process_exit_without_destroy")


# --------------------------------------------------------------------------
# The jobs (rank side)
# --------------------------------------------------------------------------


def _matrix(rank, ws):
    """(op, dtype, size label, n, reduce op, root) of the eager matrix."""
    out = []
    for op in OPS:
        for dt in DTYPES:
            for si, lab in enumerate(SIZES):
                out.append((op, dt, lab, C.n_elems(lab, dt), "SUM", (si + 1) % ws))
    for dt, reds in (("float32", FLOAT_OPS), ("int32", INT_OPS)):
        for red in reds:
            for lab in SIZES:
                if (dt, red) != ("float32", "SUM"):
                    out.append(("all_reduce", dt, lab, C.n_elems(lab, dt), red, 0))
    return out


def _graph_progs(rank, ws):
    a = OpProg("pA", [
        OpCall("all_reduce", "bfloat16", 2048, rank, ws),
        OpCall("all_gather_into_tensor", "float32", 1031, rank, ws),
        OpCall("all_to_all_single", "int64", ws * 257, rank, ws),
        OpCall("reduce_scatter_tensor", "float32", ws * 2053, rank, ws),
        OpCall("broadcast", "int64", 4099 // 8, rank, ws, root=ws - 1),
    ])
    b = OpProg("pB", [
        OpCall("all_reduce", "int32", 1031, rank, ws, red="MAX"),
        OpCall("reduce", "float32", 1024, rank, ws, root=0),
        OpCall("all_gather", "bfloat16", 64, rank, ws),
        OpCall("scatter", "int64", 515, rank, ws, root=0),
        OpCall("gather", "float32", 777, rank, ws, root=ws - 1),
        OpCall("all_to_all", "int32", 4 * ws * 16, rank, ws),
        OpCall("all_to_all_single_uneven", "bfloat16", 4 * ws * 37, rank, ws),
        OpCall("all_reduce", "float32", 4099, rank, ws, red="AVG"),
        OpCall("reduce_scatter", "int64", ws * 300, rank, ws),
    ], async_flags=[False] * 7 + [True, True])
    return a, b


def _eager_between(rank, ws, i):
    return [OpCall("all_reduce", "float32", 4099, rank, ws, key=f"pers/between/{i}/ar"),
            OpCall("all_to_all_single_uneven", "int32", 4 * ws * 11, rank, ws,
                   key=f"pers/between/{i}/a2a")]


def main_job(rank, ws):
    import os

    C.setup_rank(rank, ws)
    rep = Report()
    state = {}
    graphs_resident = os.environ.get("RESIDENT_GPU_PERSISTENT_GRAPHS", "kernel") == "resident"

    def status_first(errs, digs):
        st = pstatus()
        rep.info["status_before_first_op"] = st
        if st.get("enabled") is not True or st.get("installed") is not False:
            errs.append(f"before the first CUDA op: expected enabled True, installed False: {st}")

    def eager(errs, digs):
        count = 0
        for op, dt, lab, n, red, root in _matrix(rank, ws):
            c = OpCall(op, dt, n, rank, ws, red=red, root=root, key=f"pers/eager/{op}/{red}/{dt}/{lab}")
            note_progress(f"collectives_eager {op} {red} {dt} {lab}")
            e, d = run_checked([c], lab)
            errs += e
            digs.update(d)
            count += 1
        state["eager_ops"] = count

    def served_counts(errs, digs):
        st = expect_served({}, state.get("eager_ops", 1), "eager matrix", errs)
        rep.info["status_after_eager"] = st
        errs += status_problems(st)
        if st.get("launches", 0) < 1:
            errs.append(f"no launch of the resident kernel recorded: {st}")

    def large(errs, digs):
        big = C.n_elems("large", "float32")
        calls = [OpCall("all_reduce", "bfloat16", 2048, rank, ws, key="pers/large/0"),
                 OpCall("all_reduce", "float32", big, rank, ws, key="pers/large/1"),
                 OpCall("all_gather_into_tensor", "int64", 8192, rank, ws, key="pers/large/2"),
                 OpCall("all_to_all_single", "float32", big, rank, ws, key="pers/large/3"),
                 OpCall("reduce_scatter_tensor", "float32", 2, rank, ws, key="pers/large/4")]
        s0 = pstatus() if C.ON_GPU else {}
        e, d = run_checked(calls, "interleaved")
        errs += e
        digs.update(d)
        if C.ON_GPU:
            expect_served(s0, 3, "small ops between 1 MiB ones", errs)

    def async_ops(errs, digs):
        calls = [OpCall(op, dt, C.n_elems(lab, dt), rank, ws, key=f"pers/async/{i}")
                 for i, (op, dt, lab) in enumerate((
                     ("all_reduce", "float32", "4KiB"), ("all_gather_into_tensor", "bfloat16", "8B"),
                     ("reduce_scatter_tensor", "int64", "64KiB"), ("broadcast", "float32", "64KiB"),
                     ("all_to_all_single_uneven", "int64", "4KiB"), ("reduce", "bfloat16", "4KiB"),
                     ("all_to_all", "float32", "4KiB"), ("scatter", "int64", "8B")))]
        s0 = pstatus() if C.ON_GPU else {}
        e, d = run_checked(calls, "8 in flight", async_op=True)
        errs += e
        digs.update(d)
        one = OpCall("all_reduce", "int64", 512, rank, ws, red="MAX", key="pers/async/one")
        e, d = run_checked([one], "alone", async_op=True)
        errs += e
        digs.update(d)
        if C.ON_GPU:
            expect_served(s0, len(calls) + 1, "async ops", errs)

    progs, replays = _graph_progs(rank, ws), {}

    def graph_capture(errs, digs):
        import torch

        side = torch.cuda.Stream() if C.ON_GPU else None
        for p in progs:
            e, d = C.warm_up_on_side_stream(p, side)
            errs += e
            digs.update(d)
        state["slots_before"] = pstatus() if C.ON_GPU else {}
        for p in progs:
            ok = True
            try:
                replays[p.name] = C.capture_replay(p.step)
            except Exception as e:  # noqa: BLE001
                ok = False
                errs.append(f"capturing {p.name} raised {C.exc_text(e)}")
            if not C.store_agree(f"pers/capture/{p.name}", rank, ws, ok):
                replays.pop(p.name, None)
                errs.append(f"{p.name}: capture failed on some rank; not replayed")
        state["slots_captured"] = pstatus() if C.ON_GPU else {}

    def graph_replays(errs, digs):
        if len(replays) != len(progs):
            errs.append(f"not replayed: captured only {sorted(replays)}")
            return
        a, b = progs
        s0 = pstatus() if C.ON_GPU else {}
        for i in range(K_REPLAYS):
            a.fill(f"r{i}")
            b.fill(f"r{i}")  # fresh data into the static inputs, outside the graphs
            replays["pA"]()
            between = _eager_between(rank, ws, i)
            between[0].issue(False)
            replays["pB"]()
            w = between[1].issue(True)
            w.wait()
            for p in progs:
                e, d = p.check(f"{p.name} replay {i}")
                errs += e
                digs.update(d)
            for c in between:
                e, d = c.check(f"eager after replay {i}")
                errs += e
                digs.update(d)
        if C.ON_GPU:
            eager_between = 2
            per = len(a.calls) + len(b.calls) + eager_between
            if graphs_resident:
                state["slots_replayed"] = expect_served(s0, K_REPLAYS * per, "graph replays", errs)
            else:
                expect_served(s0, K_REPLAYS * eager_between, "eager ops between replays", errs)
                time.sleep(0.2)  # a graph op served by the resident kernel would show by now
                st = pstatus()
                if served(st) - served(s0) != K_REPLAYS * eager_between:
                    errs.append(f"with RESIDENT_GPU_PERSISTENT_GRAPHS=kernel, served grew by "
                                f"{served(st) - served(s0)} across {K_REPLAYS} replays; only the "
                                f"{K_REPLAYS * eager_between} eager ops between them are the "
                                f"resident kernel's: {st}")
                state["slots_replayed"] = st

    def graph_slots(errs, digs):
        before, cap = state.get("slots_before"), state.get("slots_captured")
        after = state.get("slots_replayed") or pstatus()
        if not before or not cap:
            errs.append("no status around the capture (capture item failed)")
            return
        used = [s.get("graph_slots_used") for s in (before, cap, after)]
        rep.info["graph_slots_used"] = used
        if not graphs_resident:
            if used[1] != used[0] or used[2] != used[0]:
                errs.append(f"with RESIDENT_GPU_PERSISTENT_GRAPHS=kernel the captures took graph "
                            f"slots: before / after capture / after replays: {used}")
            return
        if not (isinstance(used[1], int) and isinstance(used[0], int) and used[1] > used[0]):
            errs.append(f"graph_slots_used before capture / after capture: {used[0]} / {used[1]} "
                        f"(the captured collectives took no graph slot?)")
        if used[2] != used[1]:
            errs.append(f"graph_slots_used grew across {K_REPLAYS} replays and eager ops: "
                        f"{used[1]} after capture, {used[2]} after the replays")

    def sync(errs, digs):
        errs += device_sync_problems("with the default idle time", SYNC_LIMIT_S)
        st, ok = wait_status(lambda s: s.get("running") is False and s.get("queued") is False, 1.0)
        if not ok:
            errs.append(f"after torch.cuda.synchronize() the kernel is reported running: {st}")

    if C.ON_GPU:
        start_stuck_reporter()
    rep.run("status_before_first_op", status_first)
    rep.run("collectives_eager", eager)
    rep.run("served_counts_ops", served_counts)
    rep.run("large_fallback_interleaved", large)
    rep.run("async_op_wait", async_ops)
    rep.run("graph_warm_up_and_capture", graph_capture)
    rep.run("graph_replays", graph_replays)
    rep.run("graph_slots_stable", graph_slots)
    rep.run("synchronize_returns", sync)
    if C.ON_GPU:
        rep.info["status_before_destroy"] = pstatus()
    replays.clear()
    return rep.result()  # the harness destroys the group; the parent checks the exit


def destroy_job(rank, ws, how="destroy"):
    """IDLE_US=30 s, BLOCKS=2, SLOTS=256: the kernel stays on the GPU until destroy (how
    "destroy": destroy_process_group; "abort": _abort_process_group)."""
    C.setup_rank(rank, ws)
    rep = Report()

    def results(errs, digs):
        calls = [OpCall("all_reduce", "float32", 1024, rank, ws, key="pers/destroy/0"),
                 OpCall("all_gather_into_tensor", "bfloat16", 2048, rank, ws, key="pers/destroy/1"),
                 OpCall("all_to_all_single", "int64", 8192, rank, ws, key="pers/destroy/2")]
        e, d = run_checked(calls, "")
        errs += e
        digs.update(d)

    def before(errs, digs):
        st = expect_served({}, 3, "three ops", errs)
        errs += status_problems(st, blocks=2, slots=256)
        st, ok = wait_status(lambda s: s.get("running") is True, 1.0)
        rep.info["status_before_destroy"] = st
        if not ok:
            errs.append(f"with RESIDENT_GPU_PERSISTENT_IDLE_US=30000000 the kernel is not running "
                        f"a moment after the ops: {st}")

    rep.run("results", results)
    rep.run("status_before_destroy", before)
    gc.collect()
    destroy_items(rep, DESTROY_LIMIT_S, SYNC_LIMIT_S, abort=how == "abort")
    return rep.result()


def idle_job(rank, ws):
    """IDLE_US=20 ms: idle exits and relaunches; returns without destroy_process_group."""
    import torch.distributed as dist

    C.setup_rank(rank, ws)
    rep = Report()
    prog = OpProg("pI", [OpCall("all_reduce", "float32", 1024, rank, ws),
                         OpCall("all_gather_into_tensor", "int64", 1, rank, ws),
                         OpCall("reduce_scatter_tensor", "bfloat16", 32768, rank, ws)])
    st = {"last": pstatus() if C.ON_GPU else {}}
    box = {}
    if C.ON_GPU:
        start_stuck_reporter()

    def warm_and_capture(errs, digs):
        e, d = C.warm_up_on_side_stream(prog)
        errs += e
        digs.update(d)
        ok = True
        try:
            box["replay"] = C.capture_replay(prog.step)
        except Exception as e:  # noqa: BLE001
            ok = False
            errs.append(f"capture raised {C.exc_text(e)}")
        if not C.store_agree("pers/idle/capture", rank, ws, ok):
            box.pop("replay", None)
            errs.append("capture failed on some rank: no graph replays")

    rep.run("relaunch_results", warm_and_capture)
    st["launched"] = True  # the warm-up's eager ops ran on an instance
    for i in range(4):
        # Odd cycles replay the graph, whose collectives are kernel nodes of their own
        # (RESIDENT_GPU_PERSISTENT_GRAPHS=kernel, the default): nothing to relaunch.
        graph = i % 2 == 1 and "replay" in box

        def idle(errs, digs):
            s, ok = wait_status(lambda s: s.get("running") is False and s.get("queued") is False,
                                IDLE_WAIT_S)
            if not ok:
                errs.append(f"cycle {i}: the kernel is still running {IDLE_WAIT_S:.0f}s after the "
                            f"last op with RESIDENT_GPU_PERSISTENT_IDLE_US=20000: {s}")
            elif st["launched"] and s.get("exits", 0) <= st["last"].get("exits", 0):
                errs.append(f"cycle {i}: not running, but exits did not grow: before the last ops "
                            f"{st['last']}, now {s}")
            elif not st["launched"] and s.get("exits", 0) != st["last"].get("exits", 0):
                errs.append(f"cycle {i}: exits changed across a graph replay, which should not "
                            f"have run an instance: before {st['last']}, now {s}")
            st["idle"] = s

        def ops(errs, digs):
            if not graph:
                calls = [OpCall("all_reduce", "bfloat16", 2048, rank, ws, key=f"pers/idle/{i}/0"),
                         OpCall("all_to_all_single", "float32", 4096, rank, ws, key=f"pers/idle/{i}/1")]
                e, d = run_checked(calls, f"cycle {i} eager")
            else:
                prog.fill(f"idle{i}")
                box["replay"]()
                e, d = prog.check(f"cycle {i} graph replay")
            errs += e
            digs.update(d)

        def relaunched(errs, digs):
            s = pstatus()
            if graph and s.get("launches", 0) != st["idle"].get("launches", 0):
                errs.append(f"cycle {i}: a graph replay (kernel nodes of its own) relaunched the "
                            f"resident kernel: idle {st['idle']}, after {s}")
            if not graph and s.get("launches", 0) <= st["idle"].get("launches", 0):
                errs.append(f"cycle {i}: the op after the idle exit completed, but launches did not "
                            f"grow: idle {st['idle']}, after {s}")

        rep.run("idle_exit", idle)
        if C.ON_GPU:
            # the next idle exit is one more than this if the ops below relaunch the kernel
            st["last"] = st.get("idle", st["last"])
        rep.run("relaunch_results", ops)
        rep.run("relaunch_counts", relaunched)
        st["launched"] = not graph
    rep.run("synchronize_returns",
            lambda errs, digs: errs.extend(device_sync_problems("with a 20 ms idle time",
                                                                SYNC_LIMIT_S)))

    def option_off(errs, digs):
        g0 = dist.new_group(list(range(ws)), backend="resident", pg_options={"gpu_persistent": "0"})
        c = OpCall("all_reduce", "float32", 1024, rank, ws, group=g0, key="pers/idle/opt")
        e, d = run_checked([c], "pg_options gpu_persistent=0")
        errs += e
        digs.update(d)
        if C.ON_GPU:
            s = pstatus(g0)
            rep.info["option_off_status"] = s
            if s.get("enabled") is not False or s.get("installed") is not True:
                errs.append(f"a group made with pg_options={{'gpu_persistent': '0'}} (environment "
                            f"RESIDENT_GPU_PERSISTENT=1): expected enabled False, installed True: {s}")
            if served(s) != 0:
                errs.append(f"... and its resident kernel served ops: {s}")

    rep.run("pg_option_disables", option_off)
    box.clear()
    return rep.result()  # no destroy_process_group: the process just exits


def timeout_job(rank, ws):
    """Two 3 s subgroups (direct, proxy); rank 1 never joins rank 0's all_reduce on them."""
    import torch
    import torch.distributed as dist

    import resident_pg

    C.setup_rank(rank, ws)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    groups = {path: dist.new_group(list(range(ws)), backend="resident", timeout=timeout,
                                   pg_options={"path": path})
              for path in C.PATHS}
    warm = {}
    for path, g in groups.items():
        for i in range(2):
            C.check_all_reduce(rank, ws, f"pers/tmo/warm/{path}/{i}", g)
        if C.ON_GPU:
            warm[path] = wait_status(lambda s: served(s) >= 2, 2.0, g)[0]
    if C.ON_GPU:
        torch.cuda.synchronize()
    store = H.connect_store()
    if rank != 0:
        store.wait(["pers_timeout/done"], datetime.timedelta(seconds=120))
        return {"role": "absent", "warm": warm}
    out = {"warm": warm, "phases": {}}
    try:
        for path, g in groups.items():
            peers = resident_pg.describe(g, device=C.DEVICE)["peers"]
            res = C.timeout_phase(rank, ws, g)
            res["paths"] = sorted({v["path"] for p, v in peers.items() if p != rank})
            out["phases"][path] = res
            if res.get("stuck"):
                break
        return out
    finally:
        store.set("pers_timeout/done", b"1")


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------

def _main(ws, path, graphs):
    env = {**PERSISTENT, **C.path_env(path)}
    if graphs == "resident":
        env["RESIDENT_GPU_PERSISTENT_GRAPHS"] = "resident"
    return _job("main", main_job, ws, env, timeout_s=120)


@pytest.mark.parametrize("ws,path,graphs", MAIN_KEYS,
                         ids=[f"ws{w}-{p}" + ("" if g == "kernel" else "-rgraphs")
                              for w, p, g in MAIN_KEYS])
@pytest.mark.parametrize("item", MAIN_ITEMS)
def test_persistent(item, ws, path, graphs):
    judge(_main(ws, path, graphs), item, f"ws={ws} path={path} graphs={graphs}", range(ws))


def _destroy(how):
    env = {**PERSISTENT, **C.path_env("direct"), "RESIDENT_GPU_PERSISTENT_IDLE_US": "30000000",
           "RESIDENT_GPU_PERSISTENT_BLOCKS": "2", "RESIDENT_GPU_PERSISTENT_SLOTS": "256"}
    return _job(f"destroy-{how}", destroy_job, 2, env, timeout_s=90, args=(how,))


@pytest.mark.parametrize("how", ("destroy", "abort"))
@pytest.mark.parametrize("item", DESTROY_ITEMS)
def test_persistent_destroy(item, how):
    judge(_destroy(how), item, f"{how} (idle 30 s, 2 blocks, 256 slots)", range(2))


def _idle():
    env = {**PERSISTENT, **C.path_env("direct"), "RESIDENT_GPU_PERSISTENT_IDLE_US": "20000"}
    return _job("idle", idle_job, 2, env, timeout_s=90, destroy=False)


@pytest.mark.parametrize("item", IDLE_ITEMS)
def test_persistent_idle_exit_and_relaunch(item):
    judge(_idle(), item, "idle (20 ms idle time, no destroy_process_group)", range(2),
          exit_item="process_exit_without_destroy", destroyed=False)


def _timeout():
    env = {**PERSISTENT, **C.path_env("direct")}
    job = _job("timeout", timeout_job, 2, env, timeout_s=120, stop_when_done=[0], destroy_grace_s=15)
    o = job["outcomes"][0]
    if o.status != "ok":
        pytest.fail(f"rank 0 did not get through the timeout job:\n{_describe(job['outcomes'])}",
                    pytrace=False)
    return job, o.value


def _phase(path):
    job, v = _timeout()
    if path not in v["phases"]:
        pytest.fail(f"the {path} phase did not run (the GPU was stuck in an earlier phase):\n"
                    f"{_describe(job['outcomes'])}", pytrace=False)
    res = v["phases"][path]
    if res["paths"] != [path]:
        pytest.fail(f"the subgroup made with pg_options={{'path': {path!r}}} reports paths "
                    f"{res['paths']}", pytrace=False)
    return res, _describe(job["outcomes"])


@pytest.mark.skipif(C.DRY_RUN, reason="checks the resident kernel: needs CUDA")
@pytest.mark.parametrize("path", C.PATHS)
def test_timeout_warm_up_went_through_resident_kernel(path):
    _, v = _timeout()
    st = v["warm"].get(path, {})
    assert st.get("enabled") is True and served(st) >= 2, (
        f"the {path} subgroup's two warm-up all_reduces (16 KiB) did not go through the "
        f"resident kernel: {st}")


@pytest.mark.skipif(C.DRY_RUN, reason="device-side behaviour needs CUDA")
@pytest.mark.parametrize("path", C.PATHS)
def test_timeout_gpu_does_not_hang(path):
    v, desc = _phase(path)
    gpu, _ = C.device_timeout_problems(v, desc, GROUP_TIMEOUT_S + ERROR_SLACK_S, "skipped the all_reduce")
    assert not gpu, "\n".join(gpu)


@pytest.mark.parametrize("path", C.PATHS)
def test_timeout_error_surfaces_naming_peer(path):
    v, desc = _phase(path)
    _, host = C.device_timeout_problems(v, desc, GROUP_TIMEOUT_S + ERROR_SLACK_S, "skipped the all_reduce")
    assert not host, "\n".join(host)


def test_timeout_process_exits_promptly():
    job, _ = _timeout()
    problems = [p for p in _exit_problems(job, [0]) if not p.startswith("left in /dev/shm")]
    assert not problems, "\n".join(problems)


def test_persistent_case_tables_are_sane():
    m = _matrix(0, 2)
    assert {x[0] for x in m} == set(OPS)
    assert len(m) == len(OPS) * len(DTYPES) * len(SIZES) + (4 + 8) * len(SIZES)
    for op, dt, lab, n, red, root in m:
        assert n * H.itemsize(dt) <= 65536, (op, dt, lab, n)
    assert SUITE_GPU_ONLY <= set(MAIN_ITEMS) | set(DESTROY_ITEMS) | set(IDLE_ITEMS)
