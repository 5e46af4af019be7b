"""What runs inside a rank of the test harness (tests/dist_harness.py starts the ranks).

:data:`CTX` describes the job to the rank; :func:`connect_store` / :func:`init_pg` let a test do
its own (repeated) initialisation when the harness is told not to initialise (``init=False``);
:func:`request_sigkill` / :func:`request_kill_of` ask the parent to kill a rank. The backend under
test is ``RESIDENT_TEST_BACKEND`` (default ``"resident"``); whenever the backend string mentions
``resident``, the rank imports ``resident_pg`` before ``init_process_group``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import signal
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

import netns

BACKEND: str = os.environ.get("RESIDENT_TEST_BACKEND", "resident").strip() or "resident"
IS_RESIDENT: bool = BACKEND == "resident"


@dataclasses.dataclass
class RankContext:
    rank: int = -1
    world_size: int = 0
    backend: str = BACKEND
    store_port: Optional[int] = None
    rendezvous: str = "store"
    rdzv_port: Optional[int] = None
    init_timeout_s: float = 20.0
    store_timeout_s: float = 30.0
    conn: Any = None
    _store: Any = None
    _store_lock: Any = dataclasses.field(default_factory=threading.Lock)


CTX = RankContext()


def needs_resident_import(backend: str) -> bool:
    return "resident" in backend


def import_backend_module(backend: str) -> None:
    if needs_resident_import(backend):
        import resident_pg  # noqa: F401  (registers the backend)


def connect_store(timeout_s: Optional[float] = None):
    """A client of the parent's TCPStore (one per process, reused).

    The parent's store listens on every address; ``RESIDENT_TEST_STORE_HOST`` (default
    127.0.0.1) is the one ranks use, e.g. a bridge address when they run in network namespaces.
    """
    import torch.distributed as dist

    with CTX._store_lock:
        if CTX._store is None:
            if CTX.store_port is None:
                raise RuntimeError("harness: no parent store in this rendezvous mode")
            CTX._store = dist.TCPStore(
                os.environ.get("RESIDENT_TEST_STORE_HOST", "127.0.0.1"),
                CTX.store_port,
                None,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s or CTX.store_timeout_s),
            )
        return CTX._store


def init_pg(
    backend: Optional[str] = None,
    *,
    prefix: str = "",
    timeout_s: Optional[float] = None,
    rendezvous: Optional[str] = None,
) -> None:
    """init_process_group for this rank, as the harness would do it.

    ``prefix`` namespaces the parent's store so that the same process can
    initialise several times (each cycle must use a distinct prefix).
    """
    import torch.distributed as dist

    backend = backend or CTX.backend
    import_backend_module(backend)
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else CTX.init_timeout_s)
    rendezvous = rendezvous or CTX.rendezvous
    if rendezvous == "store":
        store = connect_store()
        if prefix:
            store = dist.PrefixStore(prefix, store)
        dist.init_process_group(
            backend, store=store, rank=CTX.rank, world_size=CTX.world_size, timeout=timeout
        )
    elif rendezvous == "tcp":
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{CTX.rdzv_port}",
            rank=CTX.rank,
            world_size=CTX.world_size,
            timeout=timeout,
        )
    elif rendezvous == "env":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(CTX.rdzv_port)
        os.environ["RANK"] = str(CTX.rank)
        os.environ["WORLD_SIZE"] = str(CTX.world_size)
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        raise ValueError(f"unknown rendezvous {rendezvous!r}")


def init_outcome_job(rank, ws):
    """A rank job that creates and destroys the default group; returns "no error" or the
    exception's type and message (for tests of how creation treats a setting)."""
    import torch.distributed as dist

    try:
        init_pg(CTX.backend)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return "no error"


def request_sigkill(note: str = "") -> None:
    """Ask the parent to SIGKILL this rank; never returns."""
    CTX.conn.send(("kill_me", CTX.rank, note))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(99)  # the parent did not kill us: make it visible


def request_kill_of(target_rank: int, note: str = "") -> None:
    """Ask the parent to SIGKILL another rank (returns at once)."""
    CTX.conn.send(("kill_rank", CTX.rank, target_rank, note))


def _set_pdeathsig() -> None:
    """Die with the parent (pytest killed -> no orphaned ranks)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def _enter_rank_netns(rank: int) -> None:
    """``RESIDENT_TEST_NETNS``: comma-separated namespaces by rank ('' stays put)."""
    spec = os.environ.get("RESIDENT_TEST_NETNS", "")
    names = spec.split(",") if spec else []
    if rank < len(names) and names[rank]:
        netns.enter(names[rank])


def _exc_fields(e: BaseException) -> tuple:
    return (
        type(e).__name__,
        isinstance(e, RuntimeError),
        isinstance(e, ValueError),
        str(e),
        "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    )


def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"resident_test_stack_{pid}.txt")


def _arm_stack_dump() -> None:
    """SIGUSR1 makes this rank write every thread's Python stack to _stack_file(pid): the
    parent asks for it before killing a rank that timed out, so the report says where it hung."""
    import faulthandler

    try:
        f = open(_stack_file(os.getpid()), "w")
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    except (OSError, ValueError, AttributeError):
        pass


def _rank_main(fn, rank, world_size, args, backend, store_port, rendezvous, rdzv_port,
               init_timeout_s, store_timeout_s, do_init, conn, do_destroy=True):
    _set_pdeathsig()
    CTX.rank = rank
    CTX.world_size = world_size
    CTX.backend = backend
    CTX.store_port = store_port
    CTX.rendezvous = rendezvous
    CTX.rdzv_port = rdzv_port
    CTX.init_timeout_s = init_timeout_s
    CTX.store_timeout_s = store_timeout_s
    CTX.conn = conn
    _arm_stack_dump()
    conn.send(("pid", rank, os.getpid()))
    try:
        _enter_rank_netns(rank)
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist

        import_backend_module(backend)
        if do_init:
            init_pg(backend)
        value = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - report everything
        conn.send(("error", rank) + _exc_fields(e))
        # Best effort: the group may be broken; the parent kills us if this hangs.
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            conn.send(("destroyed", rank, "ok", None))
        except BaseException as e2:  # noqa: BLE001
            conn.send(("destroyed", rank, "error", f"{type(e2).__name__}: {e2}"))
        conn.close()
        return
    try:
        conn.send(("result", rank, value))
    except Exception as e:  # unpicklable result
        conn.send(("error", rank) + _exc_fields(e))
        return
    if not do_destroy:
        # the rank leaves its groups as they are: a normal interpreter exit follows
        conn.send(("destroyed", rank, "skipped", None))
        conn.close()
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.send(("destroyed", rank, "ok", None))
    except BaseException as e:  # noqa: BLE001
        conn.send(("destroyed", rank, "error", "".join(traceback.format_exception(e))))
    conn.close()
