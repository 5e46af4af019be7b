"""Rank-side helpers of the persistent-mode GPU suite (tests/test_cuda_persistent.py): one
collective on static device buffers checked against independent references (OpCall, OpProg,
run_checked), the resident kernel's status (pstatus, wait_status, status_problems,
expect_served), bounded waits (bounded, device_sync_problems) and the per-item report of a job
(Report). Imported by the rank processes, so it holds no pytest items."""

from __future__ import annotations

import threading
import time

import cuda_harness as C
from cuda_harness import dev, host, kind_for, reduce_op, sentinel, sentinel_value
from dist_harness import (
    a2a_split,
    compare_exact,
    compare_reduction,
    digest,
    make_input,
    reference_reduce,
)

STATUS_KEYS = {"enabled": bool, "installed": bool, "running": bool, "queued": bool,
               "launches": int, "exits": int,
               "served": int, "graph_slots_used": int, "slots": int, "blocks": int}
DEFAULT_BLOCKS, DEFAULT_SLOTS = 4, 1024
OPS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_gather_into_tensor",
       "all_gather", "gather", "scatter", "broadcast", "all_to_all_single",
       "all_to_all_single_uneven", "all_to_all")
# Items that check the resident kernel itself: skipped in the dry run (CPU tensors).
SUITE_GPU_ONLY = {"status_before_first_op", "served_counts_ops", "graph_slots_stable",
                  "synchronize_returns", "status_before_destroy", "synchronize_after_destroy",
                  "idle_exit", "relaunch_counts"}  # test_cuda_persistent.py
NEVER_IDLE_GPU_ONLY = {"first_launch_of_a_kernel", "kernel_never_left"}  # ..._never_idle.py
GPU_ONLY = SUITE_GPU_ONLY | NEVER_IDLE_GPU_ONLY

# --------------------------------------------------------------------------
# Inside a rank: one collective on static buffers, checked against references
# --------------------------------------------------------------------------


class OpCall:
    """One collective on static DEVICE buffers.  ``fill(key)`` writes fresh inputs (every rank
    regenerates every rank's data) and poisons the outputs; ``issue(async_op)`` calls the op
    (returns its Work or None); ``check(label)`` -> (errors, digests of rank-independent
    results).  Sizes follow test_cuda_collectives: ``n`` is the tensor each rank contributes
    (all_reduce, reduce, broadcast, all_gather, gather), the chunk each rank receives
    (scatter), or each rank's whole input (reduce_scatter, all_to_all)."""

    def __init__(self, op, dt, n, rank, ws, red="SUM", root=None, group=None, key=None):
        assert op in OPS, op
        self.op, self.dt, self.n, self.rank, self.ws, self.red = op, dt, n, rank, ws, red
        self.root = ws - 1 if root is None else root % ws
        self.group = group
        self.kind = kind_for(red, dt)
        reduces = op in ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter")
        self.desc = f"{op}{f'[{red}]' if reduces else ''} {dt} n={n}" + (
            f" root={self.root}" if op in ("reduce", "broadcast", "gather", "scatter") else "")
        self._alloc()
        if key is not None:
            self.fill(key)

    def _alloc(self):
        op, n, ws, dt, rank = self.op, self.n, self.ws, self.dt, self.rank
        if op in ("all_reduce", "reduce", "broadcast"):
            self.t = sentinel(n, dt)
        elif op in ("reduce_scatter_tensor", "reduce_scatter"):
            self.c = max(1, n // ws)
            self.out = sentinel(self.c, dt)
            if op == "reduce_scatter_tensor":
                self.src = sentinel(ws * self.c, dt)
            else:
                self.srcs = [sentinel(self.c, dt) for _ in range(ws)]
        elif op in ("all_gather_into_tensor", "all_gather", "gather"):
            self.src = sentinel(n, dt)
            if op == "all_gather_into_tensor":
                self.out = sentinel(ws * n, dt)
            elif op == "all_gather" or rank == self.root:
                self.outs = [sentinel(n, dt) for _ in range(ws)]
            else:
                self.outs = None
        elif op == "scatter":
            self.out = sentinel(n, dt)
            self.srcs = [sentinel(n, dt) for _ in range(ws)] if rank == self.root else None
        elif op in ("all_to_all_single", "all_to_all_single_uneven", "all_to_all"):
            if op == "all_to_all_single":
                m = max(1, n // ws)
                self.splits = [[m] * ws for _ in range(ws)]
            elif op == "all_to_all_single_uneven":
                m = max(1, n // (4 * ws))
                self.splits = [[a2a_split(s, d, m, "uneven") for d in range(ws)] for s in range(ws)]
            else:
                m = max(1, n // (4 * ws))
                self.splits = [[((s * 5 + d * 3) % 7 + 1) * m for d in range(ws)] for s in range(ws)]
            if op == "all_to_all":
                self.srcs = [sentinel(self.splits[rank][d], dt) for d in range(ws)]
                self.outs = [sentinel(self.splits[s][rank], dt) for s in range(ws)]
            else:
                self.src = sentinel(sum(self.splits[rank]), dt)
                self.out = sentinel(sum(self.splits[s][rank] for s in range(ws)), dt)

    def fill(self, key):
        op, n, ws, dt, rank, kind = self.op, self.n, self.ws, self.dt, self.rank, self.kind
        sv = sentinel_value(dt)

        def gen(name, r, count):
            return make_input(f"{key}/{name}", r, count, dt, kind)

        if op in ("all_reduce", "reduce", "broadcast"):
            self.inputs = [gen("x", r, n) for r in range(ws)]
            self.t.copy_(dev(self.inputs[rank]))
        elif op == "reduce_scatter_tensor":
            self.inputs = [gen("x", r, ws * self.c) for r in range(ws)]
            self.src.copy_(dev(self.inputs[rank]))
            self.out.fill_(sv)
        elif op == "reduce_scatter":
            self.inputs = [[gen(f"x{d}", r, self.c) for d in range(ws)] for r in range(ws)]
            for d in range(ws):
                self.srcs[d].copy_(dev(self.inputs[rank][d]))
            self.out.fill_(sv)
        elif op in ("all_gather_into_tensor", "all_gather", "gather"):
            self.inputs = [gen("x", r, n) for r in range(ws)]
            self.src.copy_(dev(self.inputs[rank]))
            for o in ([self.out] if op == "all_gather_into_tensor" else (self.outs or [])):
                o.fill_(sv)
        elif op == "scatter":
            self.inputs = [gen(f"x{d}", self.root, n) for d in range(ws)]
            if self.srcs is not None:
                for d in range(ws):
                    self.srcs[d].copy_(dev(self.inputs[d]))
            self.out.fill_(sv)
        elif op == "all_to_all":
            self.inputs = [[gen(f"x{d}", s, self.splits[s][d]) for d in range(ws)] for s in range(ws)]
            for d in range(ws):
                self.srcs[d].copy_(dev(self.inputs[rank][d]))
            for o in self.outs:
                o.fill_(sv)
        else:  # all_to_all_single(_uneven)
            self.inputs = [gen("x", s, sum(self.splits[s])) for s in range(ws)]
            self.src.copy_(dev(self.inputs[rank]))
            self.out.fill_(sv)

    def issue(self, async_op=False):
        import torch.distributed as dist

        op, a, g, ro = self.op, async_op, self.group, reduce_op(self.red)
        if op == "all_reduce":
            return dist.all_reduce(self.t, op=ro, group=g, async_op=a)
        if op == "reduce":
            return dist.reduce(self.t, dst=self._global(self.root), op=ro, group=g, async_op=a)
        if op == "broadcast":
            return dist.broadcast(self.t, src=self._global(self.root), group=g, async_op=a)
        if op == "reduce_scatter_tensor":
            return dist.reduce_scatter_tensor(self.out, self.src, op=ro, group=g, async_op=a)
        if op == "reduce_scatter":
            return dist.reduce_scatter(self.out, self.srcs, op=ro, group=g, async_op=a)
        if op == "all_gather_into_tensor":
            return dist.all_gather_into_tensor(self.out, self.src, group=g, async_op=a)
        if op == "all_gather":
            return dist.all_gather(self.outs, self.src, group=g, async_op=a)
        if op == "gather":
            return dist.gather(self.src, gather_list=self.outs, dst=self._global(self.root), group=g,
                               async_op=a)
        if op == "scatter":
            return dist.scatter(self.out, scatter_list=self.srcs, src=self._global(self.root), group=g,
                                async_op=a)
        if op == "all_to_all":
            return dist.all_to_all(self.outs, self.srcs, group=g, async_op=a)
        if op == "all_to_all_single":
            return dist.all_to_all_single(self.out, self.src, group=g, async_op=a)
        return dist.all_to_all_single(
            self.out, self.src, output_split_sizes=[self.splits[s][self.rank] for s in range(self.ws)],
            input_split_sizes=self.splits[self.rank], group=g, async_op=a)

    def _global(self, group_rank):
        import torch.distributed as dist

        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def check(self, label=""):
        import torch

        op, ws, dt, rank, red, ins = self.op, self.ws, self.dt, self.rank, self.red, self.inputs
        lab = f"{label} {self.desc}".strip()
        errs, digs = [], {}
        if op == "all_reduce":
            got = host(self.t)
            errs += compare_reduction(got, reference_reduce(ins, red, dt), ins, red, dt, lab)
            digs[lab] = digest(got)
        elif op == "reduce":
            if rank == self.root:
                errs += compare_reduction(host(self.t), reference_reduce(ins, red, dt), ins, red, dt, lab)
        elif op == "broadcast":
            got = host(self.t)
            errs += compare_exact(got, ins[self.root], lab)
            digs[lab] = digest(got)
        elif op in ("reduce_scatter_tensor", "reduce_scatter"):
            c = self.c
            if op == "reduce_scatter_tensor":
                chunks = [x[rank * c:(rank + 1) * c] for x in ins]
                errs += compare_exact(host(self.src), ins[rank], f"{lab}: input modified")
            else:
                chunks = [ins[r][rank] for r in range(ws)]
            errs += compare_reduction(host(self.out), reference_reduce(chunks, red, dt), chunks, red, dt,
                                      lab)
        elif op in ("all_gather_into_tensor", "all_gather"):
            got = host(self.out) if op == "all_gather_into_tensor" else torch.cat(
                [host(o) for o in self.outs])
            errs += compare_exact(got, torch.cat(ins), lab)
            errs += compare_exact(host(self.src), ins[rank], f"{lab}: input modified")
            digs[lab] = digest(got)
        elif op == "gather":
            if rank == self.root:
                for r in range(ws):
                    errs += compare_exact(host(self.outs[r]), ins[r], f"{lab} slot {r}")
        elif op == "scatter":
            errs += compare_exact(host(self.out), ins[rank], lab)
        elif op == "all_to_all":
            for s in range(ws):
                errs += compare_exact(host(self.outs[s]), ins[s][rank], f"{lab} from {s}")
        else:
            sp = self.splits
            ref = torch.cat([ins[s][sum(sp[s][:rank]):sum(sp[s][:rank + 1])] for s in range(ws)])
            errs += compare_exact(host(self.out), ref, lab)
            errs += compare_exact(host(self.src), ins[rank], f"{lab}: input modified")
        return errs, digs


def run_checked(calls, label, async_op=False):
    """Issue every call (in order, back to back), wait for async Works in reverse order, then
    check each.  Returns (errors, digests)."""
    errs, digs, works = [], {}, []
    for c in calls:
        w = c.issue(async_op)
        if async_op:
            if w is None:
                errs.append(f"{label} {c.desc}: async_op=True returned None instead of a Work")
            else:
                works.append(w)
    for w in reversed(works):
        w.wait()
    for c in calls:
        e, d = c.check(label)
        errs += e
        digs.update(d)
    return errs, digs


class OpProg:
    """A graph program of OpCalls (for cuda_harness.warm_up_on_side_stream / capture_replay):
    ``step`` issues every call, the async ones first-to-last and waited last-to-first inside
    the step (so inside the capture too)."""

    def __init__(self, name, calls, async_flags=None):
        self.name, self.calls = name, calls
        self.async_flags = list(async_flags or [False] * len(calls))

    def fill(self, key):
        for i, c in enumerate(self.calls):
            c.fill(f"pers/graph/{self.name}/{key}/{i}")

    def step(self):
        works = [c.issue(a) for c, a in zip(self.calls, self.async_flags)]
        for w, a in reversed(list(zip(works, self.async_flags))):
            if a:
                w.wait()

    def check(self, label):
        errs, digs = [], {}
        for c in self.calls:
            e, d = c.check(label)
            errs += e
            digs.update(d)
        return errs, digs


# --------------------------------------------------------------------------
# Inside a rank: status, bounded waits, the per-item report
# --------------------------------------------------------------------------


def pstatus(group=None):
    """persistent_status() of the group's CUDA backend (no reference to it is kept)."""
    import torch
    import torch.distributed as dist

    g = dist.group.WORLD if group is None else group
    return dict(g._get_backend(torch.device("cuda")).persistent_status())


def wait_status(pred, limit_s, group=None):
    """Poll pstatus() until pred(status) holds or limit_s passed: (last status, held)."""
    deadline = time.monotonic() + limit_s
    while True:
        st = pstatus(group)
        if pred(st):
            return st, True
        if time.monotonic() > deadline:
            return st, False
        time.sleep(0.002)


def status_problems(st, blocks=DEFAULT_BLOCKS, slots=DEFAULT_SLOTS):
    """An installed, enabled group's status: every key, of its type; the knobs as configured."""
    errs = []
    for k, typ in STATUS_KEYS.items():
        if k not in st:
            errs.append(f"persistent_status() has no {k!r}: {st}")
        elif not isinstance(st[k], typ) or (typ is int and isinstance(st[k], bool)):
            errs.append(f"persistent_status()[{k!r}] is {st[k]!r}, expected {typ.__name__}")
    if st.get("enabled") is not True or st.get("installed") is not True:
        errs.append(f"expected enabled and installed after a CUDA op: {st}")
    if st.get("blocks") != blocks or st.get("slots") != slots:
        errs.append(f"blocks {st.get('blocks')} / slots {st.get('slots')}, expected {blocks} / {slots}")
    return errs


def served(st):
    return st.get("served", 0)


def expect_served(s0, count, what, errs, limit_s=2.0, group=None):
    """served grew by at least `count` since status s0 (polled: the counter may trail the op)."""
    st, ok = wait_status(lambda s: served(s) - served(s0) >= count, limit_s, group)
    if not ok:
        errs.append(f"{what}: served grew by {served(st) - served(s0)} for {count} collectives of "
                    f"at most 64 KiB per peer (did they go through the resident kernel?) {st}")
    return st


def bounded(fn, limit_s):
    """fn() in a daemon thread, waited for at most limit_s: (returned, {"value"|"exc", "s"})."""
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["exc"] = C.exc_text(e)
        box["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit_s)
    return not th.is_alive(), box


def device_sync_problems(what, limit_s):
    """torch.cuda.synchronize() of this rank's device must return within limit_s."""
    import torch

    index = torch.cuda.current_device()
    done, box = bounded(lambda: torch.cuda.synchronize(index), limit_s)
    if not done:
        return [f"{what}: torch.cuda.synchronize() did not return within {limit_s:.0f}s"]
    if "exc" in box:
        return [f"{what}: torch.cuda.synchronize() raised {box['exc']}"]
    return []


def destroy_items(rep, destroy_limit_s, sync_limit_s, abort=False):
    """destroy_process_group() (abort: torch.distributed's _abort_process_group() of the
    world), bounded by destroy_limit_s, then two items of `rep`: "destroy_returns" (it returned
    without raising; its duration goes to rep.info) and "synchronize_after_destroy" (the device
    synchronizes within sync_limit_s afterwards: no resident kernel left spinning)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    teardown = _abort_process_group if abort else dist.destroy_process_group
    name = f"{teardown.__name__}()"
    done, box = bounded(teardown, destroy_limit_s)

    def destroyed(errs, digs):
        if not done:
            errs.append(f"{name} did not return within {destroy_limit_s:.0f}s")
        elif "exc" in box:
            errs.append(f"{name} raised {box['exc']}")
        rep.info["destroy_s"] = box.get("s")

    rep.run("destroy_returns", destroyed)
    rep.run("synchronize_after_destroy",
            lambda errs, digs: errs.extend(device_sync_problems(f"after {name}", sync_limit_s)))


_progress = {"t": time.monotonic(), "what": "start"}


def note_progress(what):
    """Marks progress (for start_stuck_reporter): what the rank is about to do."""
    _progress["t"] = time.monotonic()
    _progress["what"] = what


def _dump_native_stacks():
    """The native (C++) stacks of this process's threads, from cuda-gdb attached for a moment
    (the GPU machine has no gdb; cuda-gdb also debugs host code), to stderr. Where a Python
    stack cannot say which CUDA or driver call a thread waits in. Does nothing without it."""
    import os
    import shutil
    import subprocess
    import sys

    tool = shutil.which("cuda-gdb")
    if tool is None:
        return
    try:
        out = subprocess.run(
            [tool, "-p", str(os.getpid()), "-batch", "-nx", "-ex", "set pagination off",
             "-ex", "thread apply all bt 25"],
            capture_output=True, text=True, timeout=60).stdout
    except Exception as e:  # noqa: BLE001
        out = f"cuda-gdb failed: {e!r}"
    frames = [ln for ln in out.splitlines() if ln.startswith(("Thread", "#"))]
    print("NATIVE STACKS\n" + "\n".join(frames[:160]), file=sys.stderr, flush=True)


def start_stuck_reporter(after_s=10.0, every_s=5.0):
    """A daemon thread that, while the rank makes no progress (note_progress) for after_s,
    prints what it was doing and the resident kernel's status to stderr every every_s, so
    that a rank killed at its job's timeout shows the hand-off's state in its last lines."""
    import sys
    import threading

    def loop():
        dumped = False
        while True:
            time.sleep(every_s)
            idle = time.monotonic() - _progress["t"]
            if idle > after_s:
                try:
                    st = pstatus()
                except Exception as e:  # noqa: BLE001
                    st = f"pstatus() raised {e!r}"
                print(f"STUCK {idle:.0f} s in {_progress['what']}: {st}", file=sys.stderr,
                      flush=True)
                if not dumped:
                    dumped = True
                    _dump_native_stacks()

    threading.Thread(target=loop, daemon=True, name="stuck-reporter").start()


class Report:
    """Per-item errors, digests (compared across ranks by the parent), skips and info."""

    def __init__(self):
        self.items, self.digests, self.skipped, self.info = {}, {}, {}, {}

    def run(self, name, fn):
        """fn(errs, digs); an exception is recorded as an error of the item."""
        errs = self.items.setdefault(name, [])
        digs = self.digests.setdefault(name, {})
        note_progress(name)
        if name in GPU_ONLY and not C.ON_GPU:
            self.skipped[name] = "checks the resident kernel: needs CUDA (dry run)"
            return None
        try:
            return fn(errs, digs)
        except Exception as e:  # noqa: BLE001
            errs.append(f"raised {C.exc_text(e)}")
            return None

    def result(self):
        return {"items": self.items, "digests": self.digests, "skipped": self.skipped,
                "info": self.info}
