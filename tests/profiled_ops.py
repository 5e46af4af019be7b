"""One round of every op kind on seeded random data, checked against independent references,
and what a profiler must report for it: shared by the profiler and debug-mode tests
(test_debug_tools.py, test_cuda_debug_tools.py).

:func:`run_round` issues each op once (sync, or async and then waited in reverse order) on a
group's members and returns the problems found in the results plus the events the round must
leave in a profiler: ``{event name: [input_shapes of each call]}``, the names and shapes the
resident backend reports (named like gloo's, ``resident:<op>``; the op's input tensors).
Integers throughout, so every result compares bitwise.
"""

from __future__ import annotations

from dist_harness import compare_exact, make_input, reference_reduce

DT = "int64"


def profiler(kind: str, cuda: bool = False):
    """A profiler context of one of the two APIs users have: "autograd" or "torch"."""
    import torch

    if kind == "autograd":
        return torch.autograd.profiler.profile(record_shapes=True,
                                               use_device="cuda" if cuda else None)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, record_shapes=True)


def events_of(prof) -> list:
    """The profiler's events on the host (the CPU side; GPU annotations are separate)."""
    import torch
    from torch.autograd import DeviceType

    evs = prof.events() if isinstance(prof, torch.profiler.profile) else prof.function_events
    return [e for e in evs if e.device_type == DeviceType.CPU]


def event_problems(events, expected: dict, label: str, prefix: str = "resident:") -> list:
    """Each expected name: one async event per call, with the call's input shapes (any order);
    no other event with the prefix."""
    errs = []
    got = {}
    for e in events:
        if e.name.startswith(prefix):
            got.setdefault(e.name, []).append(e)
    for name in sorted(set(got) | set(expected)):
        evs, want = got.get(name, []), expected.get(name, [])
        if len(evs) != len(want):
            errs.append(f"{label}: {len(evs)} '{name}' events, expected {len(want)}")
            continue
        shapes = sorted(repr([list(s) for s in e.input_shapes]) for e in evs)
        if shapes != sorted(repr(w) for w in want):
            errs.append(f"{label}: '{name}' input_shapes {shapes}, expected {sorted(map(repr, want))}")
        errs += [f"{label}: '{name}' event is not async" for e in evs if not e.is_async]
    return errs


def gpu_annotation_problems(prof, expected: dict, label: str) -> list:
    """A torch.profiler session with CUDA activity: each collective's event must also be on the
    GPU, where the profiler annotates the kernels launched inside a user-scope event with its
    name. (Not send/recv, whose kernel may be launched after the call returns, nor barrier, a
    host-side op.)"""
    from torch.autograd import DeviceType

    on_gpu = {e.name for e in prof.events() if e.device_type == DeviceType.CUDA}
    return [f"{label}: no GPU-side '{name}' (the kernels launched inside the event)"
            for name in sorted(expected)
            if name not in ("resident:send", "resident:recv", "resident:barrier")
            and name not in on_gpu]


def _fill(key, r, shape, device):
    n = 1
    for s in shape:
        n *= s
    return make_input(key, r, n, DT).reshape(shape).to(device, copy=True)


def run_round(rank, ws, key: str, device: str = "cpu", async_op: bool = False, group=None):
    """Every op once on `group` (default: the world). Returns (problems, expected events)."""
    import torch
    import torch.distributed as dist

    members = list(range(ws)) if group is None else dist.get_process_group_ranks(group)
    n = len(members)
    me = members.index(rank)
    glob = members.__getitem__  # group rank -> global rank
    root = len(key) % n
    errs, expected, pending = [], {}, []

    def host(t):
        return t.detach().to("cpu")

    def dev(t):  # a copy: ops write their tensors in place, the references stay intact
        return t.to(device, copy=True)

    def issue(name, shapes, fn, check):
        expected.setdefault(name, []).append(shapes)
        work = fn()
        if async_op:
            pending.append((name, work, check))
        else:
            check()

    def same(got, ref, what):
        errs.extend(compare_exact(host(got), ref, f"{key} {what}"))

    ins = [_fill(f"{key}/ar", r, (3, 4), "cpu") for r in range(n)]
    t_ar = dev(ins[me])
    issue("resident:all_reduce", [[3, 4]],
          lambda: dist.all_reduce(t_ar, group=group, async_op=async_op),
          lambda: same(t_ar, reference_reduce(ins, "SUM", DT), "all_reduce"))

    src = _fill(f"{key}/bc", root, (7,), "cpu")
    t_bc = dev(src) if me == root else torch.zeros(7, dtype=torch.int64, device=device)
    issue("resident:broadcast", [[7]],
          lambda: dist.broadcast(t_bc, glob(root), group=group, async_op=async_op),
          lambda: same(t_bc, src, "broadcast"))

    ins_r = [_fill(f"{key}/rd", r, (2, 3), "cpu") for r in range(n)]
    t_rd = dev(ins_r[me])
    issue("resident:reduce", [[2, 3]],
          lambda: dist.reduce(t_rd, glob(root), group=group, async_op=async_op),
          lambda: same(t_rd, reference_reduce(ins_r, "SUM", DT), "reduce") if me == root else None)

    ins_g = [_fill(f"{key}/ag", r, (5,), "cpu") for r in range(n)]
    outs_g = [torch.zeros(5, dtype=torch.int64, device=device) for _ in range(n)]
    issue("resident:all_gather", [[5]],
          lambda: dist.all_gather(outs_g, dev(ins_g[me]), group=group, async_op=async_op),
          lambda: [same(o, ins_g[i], f"all_gather[{i}]") for i, o in enumerate(outs_g)])

    ins_t = [_fill(f"{key}/agt", r, (6,), "cpu") for r in range(n)]
    out_t = torch.zeros(6 * n, dtype=torch.int64, device=device)
    issue("resident:all_gather_into_tensor", [[6]],
          lambda: dist.all_gather_into_tensor(out_t, dev(ins_t[me]), group=group,
                                              async_op=async_op),
          lambda: same(out_t, torch.cat(ins_t), "all_gather_into_tensor"))

    ins_rs = [_fill(f"{key}/rs", r, (7 * n,), "cpu") for r in range(n)]
    out_rs = torch.zeros(7, dtype=torch.int64, device=device)
    issue("resident:reduce_scatter_tensor", [[7 * n]],
          lambda: dist.reduce_scatter_tensor(out_rs, dev(ins_rs[me]), group=group,
                                             async_op=async_op),
          lambda: same(out_rs, reference_reduce(ins_rs, "SUM", DT)[7 * me:7 * me + 7],
                       "reduce_scatter_tensor"))

    ins_a = [_fill(f"{key}/a2a", r, (2 * n, 3), "cpu") for r in range(n)]
    out_a = torch.zeros(2 * n, 3, dtype=torch.int64, device=device)
    issue("resident:all_to_all_single", [[2 * n, 3]],
          lambda: dist.all_to_all_single(out_a, dev(ins_a[me]), group=group,
                                         async_op=async_op),
          lambda: same(out_a, torch.cat([ins_a[p][2 * me:2 * me + 2] for p in range(n)]),
                       "all_to_all_single"))

    ins_ga = [_fill(f"{key}/ga", r, (4,), "cpu") for r in range(n)]
    outs_ga = [torch.zeros(4, dtype=torch.int64, device=device) for _ in range(n)] if me == root else None
    issue("resident:gather", [[4]],
          lambda: dist.gather(dev(ins_ga[me]), outs_ga, dst=glob(root), group=group,
                              async_op=async_op),
          lambda: [same(o, ins_ga[i], f"gather[{i}]") for i, o in enumerate(outs_ga or [])])

    parts = [_fill(f"{key}/sc", i, (5,), "cpu") for i in range(n)]
    out_sc = torch.zeros(5, dtype=torch.int64, device=device)
    issue("resident:scatter", [[5]] * n if me == root else [],
          lambda: dist.scatter(out_sc, [dev(p) for p in parts] if me == root else None,
                               src=glob(root), group=group, async_op=async_op),
          lambda: same(out_sc, parts[me], "scatter"))

    # A ring: even group ranks send first, odd ones receive first (no order can block).
    right, left = glob((me + 1) % n), glob((me - 1) % n)
    msg = _fill(f"{key}/p2p", me, (2, 2), device)
    got = torch.zeros(2, 2, dtype=torch.int64, device=device)
    want = _fill(f"{key}/p2p", (me - 1) % n, (2, 2), "cpu")
    if n > 1:
        steps = [("send", lambda: dist.isend(msg, right, group=group) if async_op
                  else dist.send(msg, right, group=group), lambda: None),
                 ("recv", lambda: dist.irecv(got, left, group=group) if async_op
                  else dist.recv(got, left, group=group), lambda: same(got, want, "recv"))]
        for what, fn, check in (steps if me % 2 == 0 else steps[::-1]):
            issue(f"resident:{what}", [[2, 2]], fn, check)

    issue("resident:barrier", [], lambda: dist.barrier(group=group, async_op=async_op), lambda: None)

    for name, work, check in reversed(pending):
        work.wait()
        check()
    return errs, expected


def merged(*expectations) -> dict:
    out = {}
    for exp in expectations:
        for name, shapes in exp.items():
            out.setdefault(name, []).extend(shapes)
    return out
