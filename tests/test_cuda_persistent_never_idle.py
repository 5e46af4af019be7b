"""The resident kernel that never leaves (RESIDENT_GPU_PERSISTENT_IDLE_US=0) and lazy module
loading.  A kernel that CUDA loads lazily (CUDA_MODULE_LOADING=LAZY, which PyTorch sets when it
is unset) is loaded at its first launch, and that load waits for the kernels running in the
context: behind a resident kernel that never leaves it waits forever (under MPS it ended in an
illegal memory access instead; H200, benchmarks/RESULTS.md, session 17).  So the mode refuses
IDLE_US=0 under lazy loading with an error that says what to do, and works under eager loading.

Jobs (2 ranks, direct path, each spawned once; every check is its own pytest item):

* lazy: IDLE_US=0, CUDA_MODULE_LOADING=LAZY: the first CUDA collective raises ValueError naming
  RESIDENT_GPU_PERSISTENT_IDLE_US and CUDA_MODULE_LOADING=EAGER, and no resident kernel was
  launched; destroy_process_group() returns and the processes exit.
* eager: IDLE_US=0, CUDA_MODULE_LOADING=EAGER: eager collectives on random data correct against
  independent references; a graph captured without a device synchronize (torch.cuda.graph's
  would wait for the resident kernel forever) replayed with fresh inputs correct; then a kernel
  this process never launched before (torch.cuda._sleep's) is launched while the resident
  kernel spins and completes within SYNC_LIMIT_S; the kernel never left (one launch, no exit);
  destroy_process_group() stops it (torch.cuda.synchronize() returns afterwards) and the
  processes exit with code 0.
"""

from __future__ import annotations

import pytest

import cuda_harness as C
from persistent_harness import (
    NEVER_IDLE_GPU_ONLY,
    OpCall,
    OpProg,
    Report,
    bounded,
    destroy_items,
    note_progress,
    pstatus,
    run_checked,
    served,
    start_stuck_reporter,
)
from persistent_jobs import PERSISTENT, judge, run_job

pytestmark = C.module_marks()

SYNC_LIMIT_S = 5.0 * C.TIME_SCALE
DESTROY_LIMIT_S = 20.0 * C.TIME_SCALE
K_REPLAYS = 3
LAZY_ITEMS = ("first_op_refused", "nothing_launched", "process_exit")
EAGER_ITEMS = ("collectives_eager", "graph_replays", "first_launch_of_a_kernel",
               "kernel_never_left", "destroy_returns", "synchronize_after_destroy", "process_exit")


def _calls(rank, ws, tag):
    return [OpCall("all_reduce", "float32", 1024, rank, ws, key=f"never/{tag}/0"),
            OpCall("all_to_all_single", "int64", ws * 33, rank, ws, key=f"never/{tag}/1"),
            OpCall("all_gather_into_tensor", "bfloat16", 2048, rank, ws, key=f"never/{tag}/2")]


def _capture_without_device_sync(step):
    """``step`` captured into a CUDA graph on a side stream; a callable that replays it on the
    current stream.  Not torch.cuda.graph: it synchronizes the device on entry, which waits
    for the resident kernel, and with IDLE_US=0 that never leaves until the group goes."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            step()
        finally:
            g.capture_end()
    side.synchronize()
    return g.replay


def lazy_job(rank, ws):
    import torch.distributed as dist

    C.setup_rank(rank, ws)
    rep = Report()

    def refused(errs, digs):
        try:
            run_checked(_calls(rank, ws, "lazy")[:1], "")
        except ValueError as e:
            text = str(e)
            for want in ("RESIDENT_GPU_PERSISTENT_IDLE_US=0", "CUDA_MODULE_LOADING=EAGER"):
                if want not in text:
                    errs.append(f"the error does not name {want}: {text}")
            return
        except Exception as e:  # noqa: BLE001
            errs.append(f"expected ValueError, got {C.exc_text(e)}")
            return
        if C.ON_GPU:
            errs.append("IDLE_US=0 under lazy module loading: the first CUDA collective ran")

    def launched(errs, digs):
        st = pstatus()
        rep.info["status"] = st
        if st.get("launches", 0) != 0 or st.get("running"):
            errs.append(f"a resident kernel was launched although the group refused: {st}")

    rep.run("first_op_refused", refused)
    rep.run("nothing_launched", launched)
    done, box = bounded(dist.destroy_process_group, DESTROY_LIMIT_S)
    if not done or "exc" in box:
        rep.items["nothing_launched"].append(f"destroy_process_group(): {box or 'did not return'}")
    return rep.result()


def eager_job(rank, ws):
    import torch

    C.setup_rank(rank, ws)
    rep = Report()
    box = {}
    if C.ON_GPU:
        start_stuck_reporter()  # a hang names its step and the kernel's status on stderr

    def eager(errs, digs):
        for i in range(2):
            e, d = run_checked(_calls(rank, ws, f"eager{i}"), f"round {i}")
            errs += e
            digs.update(d)

    def graphs(errs, digs):
        prog = OpProg("pN", _calls(rank, ws, "graph"))
        e, d = C.warm_up_on_side_stream(prog)
        errs += e
        digs.update(d)
        replay = _capture_without_device_sync(prog.step) if C.ON_GPU else prog.step
        # Kept until the group is gone, as in the interference benchmark (which passed on the
        # H200 with IDLE_US=0): whether destroying a graph waits for the running kernels is
        # not established.
        box["graph"] = replay
        for i in range(K_REPLAYS):
            note_progress(f"graph_replays {i}")
            prog.fill(f"never/replay/{i}")
            replay()
            e, d = prog.check(f"replay {i}")
            errs += e
            digs.update(d)

    def first_launch(errs, digs):
        if not C.ON_GPU:
            return
        box["before"] = pstatus()

        def launch_and_wait():
            torch.cuda._sleep(1000)  # never launched before in this process
            torch.cuda.current_stream().synchronize()

        done, b = bounded(launch_and_wait, SYNC_LIMIT_S)
        if not done:
            errs.append(f"a kernel's first launch while the resident kernel spins did not "
                        f"complete within {SYNC_LIMIT_S:.0f}s")
        elif "exc" in b:
            errs.append(f"a kernel's first launch while the resident kernel spins raised {b['exc']}")

    def never_left(errs, digs):
        st = pstatus()
        rep.info["status_before_destroy"] = st
        if st.get("launches") != 1 or st.get("exits") != 0 or st.get("running") is not True:
            errs.append(f"with IDLE_US=0 the kernel should run since its one launch: {st}")
        if served(st) < 6:
            errs.append(f"the eager ops did not go through the resident kernel: {st}")

    rep.run("collectives_eager", eager)
    rep.run("graph_replays", graphs)
    rep.run("first_launch_of_a_kernel", first_launch)
    rep.run("kernel_never_left", never_left)
    destroy_items(rep, DESTROY_LIMIT_S, SYNC_LIMIT_S)
    box.clear()
    return rep.result()


def _env(loading):
    return {**PERSISTENT, **C.path_env("direct"), "RESIDENT_GPU_PERSISTENT_IDLE_US": "0",
            "CUDA_MODULE_LOADING": loading}


@pytest.mark.skipif(C.DRY_RUN, reason="module loading concerns CUDA kernels: needs CUDA")
@pytest.mark.parametrize("item", LAZY_ITEMS)
def test_never_idle_refused_under_lazy_loading(item):
    judge(run_job("never-lazy", lazy_job, 2, _env("LAZY"), timeout_s=60), item,
          "IDLE_US=0, CUDA_MODULE_LOADING=LAZY", range(2))


@pytest.mark.parametrize("item", EAGER_ITEMS)
def test_never_idle_under_eager_loading(item):
    judge(run_job("never-eager", eager_job, 2, _env("EAGER"), timeout_s=120), item,
          "IDLE_US=0, CUDA_MODULE_LOADING=EAGER", range(2))


def test_never_idle_gpu_only_items_exist():
    assert NEVER_IDLE_GPU_ONLY <= set(EAGER_ITEMS) | set(LAZY_ITEMS)
