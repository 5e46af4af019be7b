"""Multi-process harness for the `resident` torch.distributed backend tests.

The backend under test is a module-level choice: ``RESIDENT_TEST_BACKEND``
(default ``"resident"``).  With ``RESIDENT_TEST_BACKEND=gloo`` the same tests run
against gloo, which is how the suite is developed while the extension is not
built.  Whenever the backend string mentions ``resident``, every rank imports
``resident_pg`` before ``init_process_group``.

Entry points (parent side):

* :func:`run_ranks` -- strict: every rank must return normally and tear down
  cleanly; any rank exception is re-raised in the parent as :class:`RanksFailed`
  naming the rank and carrying its traceback text.  The parent never hangs: after
  ``timeout_s`` every child is SIGKILLed and :class:`RanksFailed` is raised.
* :func:`run_ranks_collect` -- fault-tolerant: returns one :class:`RankOutcome`
  per rank (result, exception text, exit code, whether it was killed, ...).
  A rank may ask the parent to SIGKILL it (:func:`request_sigkill`), or die by
  itself (``os._exit``).

What runs inside a rank (:data:`CTX`, :func:`connect_store`, :func:`init_pg`,
:func:`request_sigkill`) is in rank_process.py; deterministic data and the independent
(numpy / float64) references in reference_data.py; many cases in one job (:class:`CaseRegistry`,
:class:`JobCache`) in case_jobs.py. This module re-exports them, so that a test module imports
one name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

from rank_process import _rank_main, _stack_file  # what the parent starts in a rank, and asks of it
from rank_process import (  # noqa: F401  (the rank side, re-exported for the test modules)
    BACKEND,
    CTX,
    IS_RESIDENT,
    connect_store,
    import_backend_module,
    init_outcome_job,
    init_pg,
    request_kill_of,
    request_sigkill,
)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "resident"

_ENV_LOCK = threading.Lock()


# --------------------------------------------------------------------------
# Parent-side result types
# --------------------------------------------------------------------------


class RanksFailed(AssertionError):
    """Raised in the parent when one or more ranks failed (or the job timed out)."""

    def __init__(self, message: str, outcomes: Optional[list] = None):
        super().__init__(message)
        self.outcomes = outcomes or []


@dataclasses.dataclass
class RankOutcome:
    rank: int
    pid: Optional[int] = None
    # "ok"      fn returned a value
    # "error"   fn (or init) raised; exc_* fields set
    # "died"    the process exited without reporting (os._exit, crash)
    # "killed"  the parent SIGKILLed it (on request, or because of a timeout)
    # "timeout" the overall timeout passed before it reported (it was then killed)
    status: str = "pending"
    value: Any = None
    exc_type: Optional[str] = None
    exc_is_runtime_error: bool = False
    exc_is_value_error: bool = False
    message: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None
    # seconds from the parent's start of the job to the rank's report
    reported_at_s: Optional[float] = None
    # teardown (destroy_process_group) after the result was sent
    destroy_status: str = "not-run"  # "ok", "error", "not-run", "hung", "skipped" (destroy=False)
    destroy_message: Optional[str] = None
    kill_requested: bool = False
    # the Python stacks of a rank that had not reported when the parent killed it (at the job's
    # timeout, or after another rank's error): it was asked for them before the kill
    stack_at_kill: Optional[str] = None
    # seconds from the parent's start of the job to when the parent saw the rank's pipe close
    # (after its teardown) and saw the process exit by itself (None: it did not, or not seen)
    closed_at_s: Optional[float] = None
    exited_at_s: Optional[float] = None

    @property
    def exit_delay_s(self) -> Optional[float]:
        """Seconds between the end of the rank's teardown (pipe closed) and its process exit."""
        if self.closed_at_s is None or self.exited_at_s is None:
            return None
        return max(0.0, self.exited_at_s - self.closed_at_s)

    def describe(self) -> str:
        head = f"rank {self.rank} (pid {self.pid}): {self.status}"
        if self.status == "error":
            head += f" -- {self.exc_type}: {self.message}"
            if self.traceback:
                head += "\n" + _indent(self.traceback)
        elif self.status in ("died", "killed", "timeout"):
            head += f" (exitcode {self.exitcode})"
            if self.stack_at_kill:
                lines = self.stack_at_kill.splitlines()
                head += "\n  its stacks when killed (last 40 lines):\n" + _indent("\n".join(lines[-40:]))
        if self.destroy_status not in ("ok", "not-run"):
            head += f"\n  destroy_process_group: {self.destroy_status} {self.destroy_message or ''}"
        return head


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


# --------------------------------------------------------------------------
# Threads and shared-memory entries (leak checks); all_to_all split sizes
# --------------------------------------------------------------------------


def task_count() -> int:
    """Number of OS threads of this process (/proc/self/task)."""
    return len(os.listdir("/proc/self/task"))


def list_shm(prefix: str = SHM_PREFIX) -> dict:
    """{name: (mode & 0o777, uid, size)} for /dev/shm entries starting with prefix."""
    out = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            continue
        out[name] = (st.st_mode & 0o777, st.st_uid, st.st_size)
    return out


def new_shm_entries(before, settle_s: float = 3.0) -> dict:
    """/dev/shm resident* entries not in `before`, waiting up to settle_s for them to go."""
    deadline = time.monotonic() + settle_s
    while True:
        new = {k: v for k, v in list_shm().items() if k not in before}
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.1)


def shm_left_problems(before, when: str) -> list:
    """["left in /dev/shm <when>: [...]"] for the resident* entries not in `before` (removed, so
    that later runs start clean), or []."""
    new = new_shm_entries(before)
    if not new:
        return []
    remove_shm(new)
    return [f"left in /dev/shm {when}: {sorted(new)}"]


def remove_shm(names) -> None:
    """Remove what a failing test left behind, so later runs start clean."""
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


def a2a_split(src: int, dst: int, m: int, variant: str) -> int:
    """Elements src sends to dst in all_to_all_single: even, or uneven with zeros."""
    if variant == "even":
        return m
    if variant == "rank0_sends_nothing" and src == 0:
        return 0
    if (src + 2 * dst) % 3 == 0:
        return 0
    return ((src * 5 + dst * 3) % 7 + 1) * m


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _collect_stack(proc, wait_s: float = 1.0) -> Optional[str]:
    """Ask a live rank for its stacks (rank_process._arm_stack_dump); the dump's text, or None."""
    path = _stack_file(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except (ProcessLookupError, OSError):
        return None
    # The dump is written by a C handler within milliseconds: read once its size settles.
    deadline = time.monotonic() + wait_s
    size = -1
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            now = os.path.getsize(path)
        except OSError:
            return None
        if now > 0 and now == size:
            break
        size = now
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def reserve_port() -> socket.socket:
    """A socket bound to a free port, not listening, with SO_REUSEADDR: while it stays open, the
    port is skipped by the kernel's choice of ephemeral ports (so no outgoing connection of another
    job takes it), yet rank 0's store, which sets SO_REUSEADDR too, can still listen on it. A port
    merely looked up and released could be taken before rank 0 binds it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


@contextlib.contextmanager
def _patched_environ(env: Optional[dict]):
    """Children inherit os.environ at spawn time; set `env` only around start()."""
    if not env:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = str(v)
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _kill(proc) -> None:
    try:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, OSError, ValueError):
        pass


def _run(
    fn: Callable,
    world_size: int,
    *,
    args: Sequence = (),
    backend: Optional[str],
    timeout_s: float,
    env: Optional[dict],
    init_timeout_s: float,
    init: bool,
    rendezvous: str,
    strict: bool,
    stop_when_done: Optional[Sequence[int]] = None,
    destroy_grace_s: float = 15.0,
    error_grace_s: float = 10.0,
    store_timeout_s: Optional[float] = None,
    destroy: bool = True,
    exit_grace_s: float = 5.0,
) -> list:
    import torch.distributed as dist

    backend = backend or BACKEND
    if store_timeout_s is None:
        store_timeout_s = max(init_timeout_s, 30)
    ctx = mp.get_context("spawn")
    child_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    child_env.update(env or {})

    store = None
    store_port = None
    rdzv_port = None
    rdzv_reservation = None
    if rendezvous == "store":
        store = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=store_timeout_s),
        )
        store_port = store.port
    else:
        rdzv_reservation = reserve_port()
        rdzv_port = rdzv_reservation.getsockname()[1]

    outcomes = [RankOutcome(rank=r) for r in range(world_size)]
    procs = []
    conns = {}
    t0 = time.monotonic()
    try:
        with _patched_environ(child_env):
            for r in range(world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_rank_main,
                    args=(fn, r, world_size, tuple(args), backend, store_port, rendezvous,
                          rdzv_port, init_timeout_s, store_timeout_s, init, send_end, destroy),
                    name=f"rank{r}",
                    daemon=True,
                )
                p.start()
                send_end.close()
                procs.append(p)
                conns[recv_end] = r
                outcomes[r].pid = p.pid

        def note_exit(r: int) -> None:
            o = outcomes[r]
            if o.exited_at_s is None and procs[r].exitcode is not None:
                o.exitcode = procs[r].exitcode
                o.exited_at_s = time.monotonic() - t0

        deadline = t0 + timeout_s
        first_error_at = None
        timed_out = False
        destroy_deadline = None

        while conns:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if strict and first_error_at is not None and now - first_error_at > error_grace_s:
                break
            if stop_when_done is not None and all(
                outcomes[r].status != "pending" for r in stop_when_done
            ):
                if destroy_deadline is None:
                    destroy_deadline = now + destroy_grace_s
                if all(outcomes[r].destroy_status != "not-run" or outcomes[r].status in ("died", "killed")
                       for r in stop_when_done) or now > destroy_deadline:
                    break
            ready = mpc.wait(list(conns), timeout=0.1)
            for c in ready:
                r = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    o = outcomes[r]
                    o.closed_at_s = time.monotonic() - t0
                    procs[r].join(timeout=exit_grace_s)
                    o.exitcode = procs[r].exitcode
                    note_exit(r)
                    if o.status == "pending":
                        o.status = "killed" if o.kill_requested else "died"
                        o.reported_at_s = time.monotonic() - t0
                        if strict and first_error_at is None:
                            first_error_at = time.monotonic()
                    elif o.destroy_status == "not-run" and o.status in ("ok", "error"):
                        o.destroy_status = "died"
                    continue
                kind = msg[0]
                o = outcomes[r]
                if kind == "pid":
                    o.pid = msg[2]
                elif kind == "result":
                    o.status = "ok"
                    o.value = msg[2]
                    o.reported_at_s = time.monotonic() - t0
                elif kind == "error":
                    (o.exc_type, o.exc_is_runtime_error, o.exc_is_value_error,
                     o.message, o.traceback) = msg[2:]
                    o.status = "error"
                    o.reported_at_s = time.monotonic() - t0
                    if first_error_at is None:
                        first_error_at = time.monotonic()
                elif kind == "destroyed":
                    o.destroy_status = msg[2]
                    o.destroy_message = msg[3]
                elif kind == "kill_me":
                    o.kill_requested = True
                    _kill(procs[r])
                elif kind == "kill_rank":
                    target = msg[2]
                    outcomes[target].kill_requested = True
                    _kill(procs[target])
        if stop_when_done is not None and not timed_out:
            # let ranks that finished their teardown exit by themselves (atexit cleanup)
            exit_deadline = time.monotonic() + exit_grace_s
            for r in stop_when_done:
                if outcomes[r].destroy_status in ("ok", "error", "skipped"):
                    if outcomes[r].closed_at_s is None:
                        outcomes[r].closed_at_s = time.monotonic() - t0  # teardown reported
                    procs[r].join(timeout=max(0.0, exit_deadline - time.monotonic()))
                    note_exit(r)
        # Anything still pending is killed.
        for r, p in enumerate(procs):
            o = outcomes[r]
            note_exit(r)  # exited by itself before this point
            if p.is_alive():
                if o.status == "pending":  # where it was: hung, or still at work
                    o.stack_at_kill = _collect_stack(p)
                _kill(p)
                if o.status == "pending":
                    o.status = "timeout" if timed_out else "killed"
                elif o.destroy_status == "not-run":
                    o.destroy_status = "hung"
        for p in procs:
            p.join(timeout=10)
        for r, p in enumerate(procs):
            if outcomes[r].exitcode is None:
                outcomes[r].exitcode = p.exitcode
            if outcomes[r].status == "pending":
                outcomes[r].status = "died"
    finally:
        for p in procs:
            _kill(p)
        for p in procs:
            p.join(timeout=10)
            with contextlib.suppress(OSError, TypeError):
                os.unlink(_stack_file(p.pid))
        for c in list(conns):
            c.close()
        del store
        if rdzv_reservation is not None:
            rdzv_reservation.close()

    if strict:
        bad = [o for o in outcomes if o.status != "ok"
               or o.destroy_status not in (("ok",) if destroy else ("skipped",))]
        if bad or timed_out:
            elapsed = time.monotonic() - t0
            lines = [
                f"{len(bad)} of {world_size} ranks failed (backend={backend!r}, "
                f"elapsed {elapsed:.1f}s, timeout {timeout_s}s{', TIMED OUT' if timed_out else ''}):"
            ]
            # errors first: the root cause is usually the first rank that raised
            for o in sorted(bad, key=lambda o: (o.status != "error", o.reported_at_s or 1e9)):
                lines.append(o.describe())
            raise RanksFailed("\n".join(lines), outcomes)
    return outcomes


def run_ranks(
    fn: Callable,
    world_size: int,
    *,
    args: Sequence = (),
    backend: Optional[str] = None,
    timeout_s: float = 60,
    env: Optional[dict] = None,
    init_timeout_s: float = 20,
    init: bool = True,
    rendezvous: str = "store",
    store_timeout_s: Optional[float] = None,
    error_grace_s: float = 10.0,
    destroy: bool = True,
    exit_grace_s: float = 5.0,
) -> list:
    """Run fn(rank, world_size, *args) in world_size spawned ranks; return results by rank.

    ``init_timeout_s`` is the ``timeout=`` given to ``init_process_group`` (it
    bounds rendezvous and collectives).  ``rendezvous`` is ``"store"`` (a
    TCPStore hosted by the parent), ``"tcp"`` (``tcp://127.0.0.1:port``) or
    ``"env"`` (``env://`` with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE).
    ``init=False`` leaves initialisation to fn (see :func:`init_pg`).
    ``store_timeout_s`` (default max(init_timeout_s, 30)) is the timeout of the
    ranks' TCPStore clients, i.e. of store waits during rendezvous.  Once a rank
    has failed, the others get ``error_grace_s`` to finish before they are killed.
    ``destroy=False``: a rank that returned does not call destroy_process_group; its
    process just exits (a normal interpreter exit, groups still alive).  After its
    teardown, a rank's process gets ``exit_grace_s`` to exit by itself (see
    RankOutcome.exit_delay_s); it is killed after that.
    Raises :class:`RanksFailed` if any rank raised, died, or failed to tear down,
    or if ``timeout_s`` passed (all children are then SIGKILLed).
    """
    outcomes = _run(fn, world_size, args=args, backend=backend, timeout_s=timeout_s, env=env,
                    init_timeout_s=init_timeout_s, init=init, rendezvous=rendezvous, strict=True,
                    store_timeout_s=store_timeout_s, error_grace_s=error_grace_s,
                    destroy=destroy, exit_grace_s=exit_grace_s)
    return [o.value for o in outcomes]


def job_errors(outcomes) -> list:
    """Of run_ranks_collect's outcomes whose values are {"errors": [...]}: each rank that did
    not finish, and the errors each finished rank listed."""
    found = []
    for o in outcomes:
        if o.status != "ok":
            found.append(o.describe())
        else:
            found += [f"rank {o.rank}: {e}" for e in o.value["errors"]]
    return found


def run_ranks_collect(
    fn: Callable,
    world_size: int,
    *,
    args: Sequence = (),
    backend: Optional[str] = None,
    timeout_s: float = 60,
    env: Optional[dict] = None,
    init_timeout_s: float = 20,
    init: bool = True,
    rendezvous: str = "store",
    stop_when_done: Optional[Sequence[int]] = None,
    destroy_grace_s: float = 15.0,
    store_timeout_s: Optional[float] = None,
    destroy: bool = True,
    exit_grace_s: float = 5.0,
) -> list:
    """Like :func:`run_ranks` but never raises for rank failures: one RankOutcome per rank.

    A rank may die (``os._exit``) or ask to be SIGKILLed (:func:`request_sigkill`).
    With ``stop_when_done=[ranks]`` the job ends (remaining ranks SIGKILLed) as soon
    as those ranks have reported and finished (or failed) their teardown, waiting at
    most ``destroy_grace_s`` for the teardown.
    """
    return _run(fn, world_size, args=args, backend=backend, timeout_s=timeout_s, env=env,
                init_timeout_s=init_timeout_s, init=init, rendezvous=rendezvous, strict=False,
                stop_when_done=stop_when_done, destroy_grace_s=destroy_grace_s,
                store_timeout_s=store_timeout_s, destroy=destroy, exit_grace_s=exit_grace_s)


# --------------------------------------------------------------------------
# Deterministic data and independent references: tests/reference_data.py (re-exported)
# --------------------------------------------------------------------------

from reference_data import (  # noqa: E402,F401
    BOOL_OPS,
    COMPLEX_DTYPE_NAMES,
    FLOAT_DTYPE_NAMES,
    INT_DTYPE_NAMES,
    bits,
    compare_exact,
    compare_reduction,
    count_parts,
    digest,
    is_float_name,
    itemsize,
    make_input,
    reference_reduce,
    rng_for,
    seed_of,
    tdtype,
    to_np,
)


from case_jobs import (  # noqa: E402,F401  (re-exported for the test modules)
    CaseRegistry,
    JobCache,
    case_problems,
    execute_cases,
    expect_error,
)
