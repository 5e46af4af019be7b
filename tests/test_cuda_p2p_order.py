"""Call orders of send/recv on CUDA tensors: every order completes with the right data.

Two launch policies (RESIDENT_GPU_P2P_STREAM, see csrc/c10d/work_cuda.hpp): ``own``
launches every send/recv at once on a stream of its own per peer and direction; ``auto`` (the
default) does the same outside graph captures and launches lazily inside one: a *blocking*
send/recv (c10d's ``dist.send`` / ``dist.recv``: isend/irecv whose ``.wait()`` follows at
once, on the same stream) joins the capturing stream (programmatic dependent launch), and an
op not waited on at once (another call on the group, another Work's wait, ``is_completed()``,
the Work's destruction) goes on its own stream, joined back at ``wait()``.
Contract for both: ANY call order of isend/irecv completes (no deadlock) with correct data,
eagerly and in graphs.  The default path jobs run ``auto``; ``direct+own`` and
``proxy+own`` (2 and 4 ranks) run ``own``.

Cases (pairs (r, r^1) or a ring: recv from r-1, send to r+1; ws 2 and 4; both paths; one
spawned job per (ws, path), each case its own item, see cuda_harness.GpuJobCache):
 1. irecv, then isend, then both waits, on both ranks (8 B, 4 KiB, 1 MiB + 3 elements:
    many 64 KiB rounds, beyond the 2-round credit window). Kept first: as a process's first
    ops it caught the send kernel's lazy load waiting for the spinning recv;
 2. three 1 MiB + 3 isends before three irecvs on both ranks; waits in reverse;
 3. batch_isend_irecv([irecv, isend]) on every rank (ring), sizes as in 1;
 4. isend/irecv, then a checked float32 all_reduce (blocking or async), then the waits;
 5. an irecv polled with is_completed() until True (a deadline fails, never hangs);
 6. an isend whose Work is dropped unwaited (+ synchronize) against a blocking dist.recv;
 7. ops issued on one stream (the send's input written there), waited on another; and
    irecv / isend issued on two streams, waited on a third;
 8. blocking ping-pong of 8 B / 4 KiB / 64 KiB + a checked all_reduce, 20 iterations;
 9. a CUDA graph: blocking ping-pong (4 KiB) + irecv-first isend/irecv ring exchange
    waited inside the capture; side-stream warm-up, 5 replays of fresh data, each checked;
10. one direction's messages launched alternately on the own stream and on caller streams
    (isend, blocking send, isend; blocking send on s1 then isend on s2), so that their
    shared round order across streams is exercised;
11. an isend, then the host blocks until the peer has the data (a barrier through the test's
    store, not through resident), then its wait(); the peer: a blocking recv, a host copy of
    the data, the barrier. No resident call follows the isend before the barrier: it must
    have been launched when it was called (as an NCCL isend would just run);
12. a ring's irecv and isend, then the first launch of a kernel that no other case runs,
    then the waits: under CUDA's lazy module loading (torch's default) that launch loads the
    kernel's code, which waits for the process's running kernels (the ring's recv, waiting
    for the peer's send); a send not launched by then could not start until it ended, on
    both ranks at once (docs/op_mix.md).

Data: make_input with distinct keys; received data compared bitwise with the peer's input
regenerated independently; every sent buffer must be unmodified; receive buffers start as
sentinels.  CUDA p2p ignores tags (messages match in order per peer and direction), so
receives are always posted in the order of the peer's sends.  After the jobs no /dev/shm
entry named resident* may be left.  Dry run (RESIDENT_GPU_TESTS_DEVICE=cpu): the same bodies
on CPU tensors (another implementation: data, references and call orders only); streams
and synchronize() become no-ops and the "graph" is its step run on every replay.
"""

from __future__ import annotations

import contextlib
import time

import pytest

import cuda_harness as C
import dist_harness as H
from cuda_harness import dev, host, sentinel, sentinel_value
from dist_harness import compare_exact, compare_reduction, digest, make_input, reference_reduce

pytestmark = C.module_marks()

# Plus each path with send/recv launched at once on their own streams (RESIDENT_GPU_P2P_STREAM=own),
# and, at 2 ranks, with round numbers that wrap (cuda_harness.PATH_KNOBS).
ALL_KEYS = [(ws, p) for ws in (2, 4) for p in C.PATHS + ("direct+own", "proxy+own")]
ALL_KEYS += [(2, "direct+wrap"), (2, "proxy+wrap")]
JOB_KEYS = [k for k in ALL_KEYS if k[0] in C.WORLD_SIZES]
SIZES = ("8B", "4KiB", "large")  # 8 B, 4 KiB, 1 MiB + 3 elements
POLL_DEADLINE_S = 60.0
PING_PONG_ITERS = 20
K_REPLAYS = 5

CASES = H.CaseRegistry()


def add(cid, fn, identical=False):  # identical: the digests (all_reduce results) agree
    CASES.add(cid, fn, identical=identical)


# ---- helpers ------------------------------------------------------------------


class _Msg:
    """One message of rank ``rank``: its device input, a sentinel receive buffer, checks."""

    def __init__(self, key, rank, lab, dt):
        self.key, self.rank, self.dt, self.n = key, rank, dt, C.n_elems(lab, dt)
        self.label = f"{key} n={self.n} {dt}"
        self.src = dev(make_input(key, rank, self.n, dt))
        self.buf = sentinel(self.n, dt)

    def received(self, peer, what="received"):
        return compare_exact(host(self.buf), make_input(self.key, peer, self.n, self.dt),
                             f"{self.label}: {what} from {peer}")

    def unmodified(self, t=None, what="sent buffer"):
        return compare_exact(host(self.src if t is None else t),
                             make_input(self.key, self.rank, self.n, self.dt),
                             f"{self.label}: {what} modified")

    def check(self, peer):
        """The receive buffer holds peer's input; the sent buffer is unmodified."""
        return self.received(peer) + self.unmodified()


def _all_reduce(rank, ws, key, async_op=False):
    """A checked 4099-element float32 SUM all_reduce on the world group: (errors, digests)."""
    import torch.distributed as dist

    ins = [make_input(key, r, 4099, "float32") for r in range(ws)]
    t = dev(ins[rank])
    w = dist.all_reduce(t, async_op=async_op)
    if async_op:
        w.wait()
    got = host(t)
    errs = compare_reduction(got, reference_reduce(ins, "SUM", "float32"), ins, "SUM", "float32",
                             f"all_reduce {key}")
    return errs, {key: digest(got)}


def _streams(k):  # k new CUDA streams (the dry run has none: k Nones)
    import torch

    return [torch.cuda.Stream() if C.ON_GPU else None for _ in range(k)]


def _on(stream):
    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _fork(*streams, join=False):
    """Each stream waits for the current one (its tensors are ready); join: the reverse."""
    import torch

    cur = torch.cuda.current_stream() if C.ON_GPU else None
    for s in streams:
        if s is not None and join:
            cur.wait_stream(s)
        elif s is not None:
            s.wait_stream(cur)


def _ring(rank, ws):  # (left, right): recv from left, send to right
    return (rank - 1) % ws, (rank + 1) % ws


# ---- 1-3: posting orders ----------------------------------------------------------


def _irecv_first(rank, ws):
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    for si, lab in enumerate(SIZES):
        m = _Msg(f"cuda/p2po/recv_first/{lab}", rank, lab, "float32")
        wr = dist.irecv(m.buf, src=p, tag=1 + si)
        wsend = dist.isend(m.src, dst=p, tag=1 + si)
        for w in ((wr, wsend) if si % 2 == 0 else (wsend, wr)):  # both wait orders
            w.wait()
        errs += m.check(p)
    return errs, {}


def _three_sends_first(rank, ws):
    import torch.distributed as dist

    p = rank ^ 1
    msgs = [_Msg(f"cuda/p2po/three_sends/{j}", rank, "large", "int32") for j in range(3)]
    works = [dist.isend(m.src, dst=p, tag=10 + j) for j, m in enumerate(msgs)]
    works += [dist.irecv(m.buf, src=p, tag=10 + j) for j, m in enumerate(msgs)]
    for w in reversed(works):
        w.wait()
    return [e for m in msgs for e in m.check(p)], {}


def _batch_recv_first(rank, ws):
    import torch.distributed as dist

    errs = []
    left, right = _ring(rank, ws)
    for si, lab in enumerate(SIZES):
        m = _Msg(f"cuda/p2po/batch/{lab}", rank, lab, "bfloat16")
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, m.buf, left, tag=20 + si),
                                        dist.P2POp(dist.isend, m.src, right, tag=20 + si)])
        if len(works) != 2:
            errs.append(f"{lab}: batch_isend_irecv returned {len(works)} works, expected 2")
        for w in works:
            w.wait()
        errs += m.check(left)
    return errs, {}


# ---- 4-7: what ends an op's chance to be blocking ------------------------------------


def _collective_between(rank, ws):
    errs, digs = [], {}
    left, right = _ring(rank, ws)
    for si, (lab, dt, ar_async) in enumerate((("8B", "float32", False), ("4KiB", "int64", True),
                                              ("large", "bfloat16", False))):
        m = _Msg(f"cuda/p2po/coll/{lab}", rank, lab, dt)
        wr, wsend = C.ring_post(rank, m.src, right, m.buf, left, 30 + si)
        e, d = _all_reduce(rank, ws, f"cuda/p2po/coll/ar/{lab}", ar_async)
        errs += e
        digs.update(d)
        wsend.wait()
        wr.wait()
        errs += m.check(left)
    return errs, digs


def _poll_until(work, what, deadline):
    while not work.is_completed():
        if time.monotonic() > deadline:
            return [f"{what}: is_completed() still False after {POLL_DEADLINE_S:.0f}s of polling"]
        time.sleep(0.001)
    return []


def _polled_irecv(rank, ws):
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    for si, lab in enumerate(("8B", "4KiB", "large")):
        m = _Msg(f"cuda/p2po/poll/{lab}", rank, lab, "float16")
        wr = dist.irecv(m.buf, src=p, tag=40 + si)
        wsend = dist.isend(m.src, dst=p, tag=40 + si)  # the last call before the polls
        deadline = time.monotonic() + POLL_DEADLINE_S
        for w, what in ((wr, "irecv"), (wsend, "isend")):
            errs += _poll_until(w, f"{lab} {what}", deadline)
            if errs:
                return errs, {}  # a wait could hang: report instead
            w.wait()
        errs += m.check(p)
    return errs, {}


def _dropped_isend(rank, ws):
    import torch
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    for si, lab in enumerate(("4KiB", "large")):
        for sender in (0, 1):  # parity of the rank that sends (and drops its Work)
            m = _Msg(f"cuda/p2po/dropped/{lab}/{sender}", rank, lab, "uint8")
            tag = 50 + 2 * si + sender
            if rank % 2 == sender:
                w = dist.isend(m.src, dst=p, tag=tag)  # noqa: F841 (dropped unwaited)
                del w
                if C.ON_GPU:
                    torch.cuda.synchronize()
                errs += m.unmodified()
            else:
                dist.recv(m.buf, src=p, tag=tag)
                errs += m.received(p, "blocking recv of a dropped isend")
    return errs, {}


def _stream_switch(rank, ws):
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    s1, s2, s3 = _streams(3)
    for si, (lab, dt) in enumerate((("4KiB", "float64"), ("large", "float16"))):
        # (a) issued on s1, the send's input written on s1 just before; both waited on s2
        m = _Msg(f"cuda/p2po/streams/a/{lab}", rank, lab, dt)
        staged = sentinel(m.n, dt)
        _fork(s1, s2)
        with _on(s1):
            staged.copy_(m.src)
            wr = dist.irecv(m.buf, src=p, tag=60 + si)
            wsend = dist.isend(staged, dst=p, tag=60 + si)
        with _on(s2):
            wr.wait()
            wsend.wait()
        if s2 is not None:
            s2.synchronize()
        errs += m.check(p) + m.unmodified(staged, "staged send buffer")
        # (b) irecv issued on s1, isend on s2, both waited on s3
        m = _Msg(f"cuda/p2po/streams/b/{lab}", rank, lab, dt)
        _fork(s1, s2, s3)
        with _on(s1):
            wr = dist.irecv(m.buf, src=p, tag=70 + si)
        with _on(s2):
            wsend = dist.isend(m.src, dst=p, tag=70 + si)
        with _on(s3):
            wsend.wait()
            wr.wait()
        if s3 is not None:
            s3.synchronize()
        errs += m.check(p)
    return errs, {}


def _mixed_launches(rank, ws):
    """Per direction, five messages whose kernels alternate between the own stream and
    caller streams; each direction in turn (the other rank receives in a mirrored pattern)."""
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    s1, s2 = _streams(2)
    for sender in (0, 1):
        ms = [_Msg(f"cuda/p2po/mixed/{sender}/{j}", rank, lab, "float32")
              for j, lab in enumerate(("large", "4KiB", "large", "4KiB", "large"))]
        t = 80 + 5 * sender
        _fork(s1, s2)
        if rank % 2 == sender:
            wa = dist.isend(ms[0].src, dst=p, tag=t)  # own (the next call launches it)
            dist.send(ms[1].src, dst=p, tag=t + 1)  # caller, after it
            wc = dist.isend(ms[2].src, dst=p, tag=t + 2)  # own (wa's wait launches it)
            wa.wait()
            wc.wait()
            with _on(s1):
                dist.send(ms[3].src, dst=p, tag=t + 3)  # caller s1
            with _on(s2):
                we = dist.isend(ms[4].src, dst=p, tag=t + 4)
            we.wait()  # a stream switch before the wait: own stream, after s1's send
        else:
            dist.recv(ms[0].buf, src=p, tag=t)  # caller
            wb = dist.irecv(ms[1].buf, src=p, tag=t + 1)  # own
            dist.recv(ms[2].buf, src=p, tag=t + 2)  # caller, after it
            wb.wait()
            with _on(s1):
                wd = dist.irecv(ms[3].buf, src=p, tag=t + 3)  # own
            with _on(s2):
                dist.recv(ms[4].buf, src=p, tag=t + 4)  # caller s2, after it
            wd.wait()
            _fork(s2, join=True)
        for m in ms:
            errs += m.unmodified() if rank % 2 == sender else m.received(p)
    return errs, {}


# ---- 8: the blocking fast path, eagerly ----------------------------------------------


def _ping_pong(rank, ws):
    errs, digs, p = [], {}, rank ^ 1
    for i in range(PING_PONG_ITERS):
        for si, (lab, dt) in enumerate((("8B", "float32"), ("4KiB", "bfloat16"), ("64KiB", "int64"))):
            m = _Msg(f"cuda/p2po/pingpong/{i}/{lab}", rank, lab, dt)
            tag = 100 + 3 * i + si
            C.pair_exchange(rank, p, m.src, m.buf, tag)
            errs += m.check(p)
        e, d = _all_reduce(rank, ws, f"cuda/p2po/pingpong/{i}/ar")
        errs += e
        digs.update(d)
    return errs, digs


# ---- 11: the host blocks on the peer between an isend and its wait --------------------


def _host_waits_on_peer(rank, ws):
    import torch.distributed as dist

    errs, p = [], rank ^ 1
    for si, lab in enumerate(("8B", "large")):
        for sender in (0, 1):  # parity of the rank that sends
            m = _Msg(f"cuda/p2po/hostwait/{lab}/{sender}", rank, lab, "int64")
            tag = 60 + 2 * si + sender
            if rank % 2 == sender:
                w = dist.isend(m.src, dst=p, tag=tag)
                if not C.store_agree(f"p2p_order/hostwait/{lab}/{sender}", rank, ws, True):
                    errs.append(f"{lab}: a receiver failed before the barrier")
                w.wait()
                errs += m.unmodified()
            else:
                dist.recv(m.buf, src=p, tag=tag)
                got = m.received(p, "blocking recv, read by the host before the barrier")
                errs += got
                C.store_agree(f"p2p_order/hostwait/{lab}/{sender}", rank, ws, not got)
            if errs:
                return errs, {}
    return errs, {}


# ---- 12: a kernel's first launch between a ring's issue and its waits ---------------


def _first_launches():
    """One torch op per size that nothing else in these tests runs (float64 polynomials)."""
    import torch

    return (lambda x: torch.special.chebyshev_polynomial_t(x, 3),
            lambda x: torch.special.hermite_polynomial_h(x, 2),
            lambda x: torch.special.laguerre_polynomial_l(x, 4))


def _first_launch_between(rank, ws):
    import torch
    import torch.distributed as dist

    errs = []
    left, right = _ring(rank, ws)
    for si, (lab, first) in enumerate(zip(SIZES, _first_launches())):
        m = _Msg(f"cuda/p2po/first_launch/{lab}", rank, lab, "float64")
        x = torch.linspace(-1.0, 1.0, 257, dtype=torch.float64, device=m.buf.device)
        wr = dist.irecv(m.buf, src=left, tag=70 + si)
        wsend = dist.isend(m.src, dst=right, tag=70 + si)
        y = first(x)  # its first launch in this process: a module load under lazy loading
        wr.wait()
        wsend.wait()
        errs += m.received(left) + m.unmodified()
        ref = first(x.cpu())
        if not torch.allclose(y.cpu(), ref, rtol=1e-12, atol=1e-12):
            errs.append(f"{lab}: the op launched between the ring's issue and its waits "
                        f"differs from the CPU's result")
        if errs:
            return errs, {}
    return errs, {}


# ---- 9: the same inside a CUDA graph ------------------------------------------------


class _GraphProg:
    """Static tensors; fill (fresh inputs, outside the graph), step (captured), check."""

    name = "p2p_order_graph"

    def __init__(self, rank, ws):
        self.rank, self.partner = rank, rank ^ 1
        self.left, self.right = _ring(rank, ws)
        self.n_pp = C.n_elems("4KiB", "float32")
        self.n_x = C.n_elems("64KiB", "float32") + 5  # more than one 64 KiB slot
        self.pp_send, self.pp_recv = sentinel(self.n_pp, "float32"), sentinel(self.n_pp, "float32")
        self.x_send, self.x_recv = sentinel(self.n_x, "int32"), sentinel(self.n_x, "int32")

    def fill(self, key):
        self.key = f"cuda/p2po/graph/{key}"
        self.pp_send.copy_(dev(make_input(self.key + "/pp", self.rank, self.n_pp, "float32")))
        self.x_send.copy_(dev(make_input(self.key + "/x", self.rank, self.n_x, "int32")))
        self.pp_recv.fill_(sentinel_value("float32"))
        self.x_recv.fill_(sentinel_value("int32"))

    def step(self):
        import torch.distributed as dist

        C.pair_exchange(self.rank, self.partner, self.pp_send, self.pp_recv, 7)
        wr = dist.irecv(self.x_recv, src=self.left, tag=8)
        wsend = dist.isend(self.x_send, dst=self.right, tag=8)
        wr.wait()
        wsend.wait()

    def check(self, label):
        errs, r = [], self.rank
        for what, t, src, dt in (("ping-pong recv", self.pp_recv, self.partner, "float32"),
                                 ("irecv", self.x_recv, self.left, "int32"),
                                 ("ping-pong send buffer", self.pp_send, r, "float32"),
                                 ("isend buffer", self.x_send, r, "int32")):
            name = "pp" if "ping" in what else "x"
            errs += compare_exact(host(t), make_input(f"{self.key}/{name}", src, t.numel(), dt),
                                  f"{label}: {what} (rank {src}'s data)")
        return errs, {}


def _graph(rank, ws):
    errs = []
    prog = _GraphProg(rank, ws)
    errs += C.warm_up_on_side_stream(prog)[0]
    ok, replay = True, None
    try:
        replay = C.capture_replay(prog.step)  # dry run: prog.step, run eagerly
    except Exception as e:  # noqa: BLE001
        ok = False
        errs.append(f"capture raised {C.exc_text(e)}")
    if not C.store_agree("p2p_order/capture", rank, ws, ok):
        if ok:
            errs.append("the capture failed on another rank; not replayed")
        return errs, {}
    for i in range(K_REPLAYS):
        prog.fill(f"replay{i}")  # fresh data into the static inputs, outside the graph
        replay()
        errs += prog.check(f"replay {i}")[0]
    return errs, {}


add("irecv_first_then_isend[pair]", _irecv_first)
add("three_isends_before_irecvs[pair-1MiB]", _three_sends_first)
add("batch_isend_irecv_recv_first[ring]", _batch_recv_first)
add("all_reduce_between_issue_and_wait[ring]", _collective_between, identical=True)
add("irecv_polled_is_completed[pair]", _polled_irecv)
add("isend_work_dropped_peer_blocking_recv[pair]", _dropped_isend)
add("stream_switch_between_issue_and_wait[pair]", _stream_switch)
add("blocking_ping_pong_with_all_reduce[pair]", _ping_pong, identical=True)
add("cuda_graph_ping_pong_and_irecv_first[pair-ring]", _graph)
add("own_and_caller_stream_launches_one_direction[pair]", _mixed_launches)
add("isend_then_host_waits_on_peer[pair]", _host_waits_on_peer)
add("first_kernel_launch_between_ring_issue_and_waits[ring]", _first_launch_between)


# ---- the jobs and the per-case tests ------------------------------------------------


def cuda_p2p_order_job(rank, ws, case_ids):
    """The cases in order; after each, the ranks agree through the parent's store that it
    passed everywhere. Messages match by order per direction, so after a case failed on one
    rank (its posted ops possibly not drained) later cases would pair the wrong messages and
    hang: they are reported as not run instead. Each case's start goes to stderr, so that a
    job that times out shows where."""
    import sys

    C.setup_rank(rank, ws)
    out = {}
    for i, cid in enumerate(case_ids):
        print(f"[rank {rank}] p2p order case {cid}: start", file=sys.stderr, flush=True)
        out.update(H.execute_cases(CASES, [cid], rank, ws))
        ok = out[cid]["exc"] is None and not out[cid]["errors"]
        if not C.store_agree(f"p2p_order/{cid}", rank, ws, ok):
            for rest in case_ids[i + 1:]:
                out[rest] = {"errors": [f"not run: case {cid} failed on some rank (the ranks' "
                                        "message order may differ after it)"],
                             "digests": {}, "exc": None, "seconds": 0.0}
            break
    return out


JOBS = C.GpuJobCache(CASES, cuda_p2p_order_job, "test_cuda_p2p_order", timeout_s=120)


@pytest.mark.parametrize("cid,ws,path", [pytest.param(cid, ws, path, id=f"{cid}-ws{ws}-{path}")
                                         for ws, path in JOB_KEYS for cid in CASES])
def test_cuda_p2p_order(cid, ws, path, request):
    JOBS.check(cid, (ws, path), request.session)


@pytest.mark.parametrize("ws,path", JOB_KEYS, ids=[f"ws{w}-{p}" for w, p in JOB_KEYS])
def test_no_shm_left_after_p2p_order_job(ws, path, request):
    """After a normal job, no /dev/shm entry named resident* made during it may remain."""
    left, failed = JOBS.shm_left_after((ws, path), request.session,
                                       ["irecv_first_then_isend[pair]",
                                        "isend_work_dropped_peer_blocking_recv[pair]"])
    assert not left, (f"left in /dev/shm after the ws={ws} path={path} p2p-order job "
                      f"({'failed' if failed else 'normal exit'}): {sorted(left)}")
