"""The bench in a launcher's processes: ``torchrun ... -m resident_pg.bench``, on one host or
several (the way to measure between hosts).

Started by a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun, or
any launcher of ``init_method="env://"``), the bench spawns nothing: each process is one rank
of the launcher's world size and runs every group (backend variant, mode, round) in ladder.run's
order, each on a fresh process group under its own prefix of the launcher's store. Rank 0 also
prints the tables and writes the JSON; the other ranks hand it their results through the store.
A group cannot be relaunched here: an op that fails or times out (the group's timeout, the
larger of ``--timeout`` and 60 s) is recorded and its larger sizes are skipped, and a rank
that makes no progress for 30 s more than that exits (the launcher then ends the job).

The CUDA device of a rank is LOCAL_RANK (as torchrun numbers a host's ranks). send/recv is
timed between ranks 0 and 1: with one process per host, between hosts.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from . import common
from . import rank as rank_side

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Launch:
    """This process's place in the launcher's world, and the launcher's store."""
    rank: int
    world_size: int
    local_rank: int
    store: Any
    hosts: Dict[int, str]   # rank -> host name and network namespace (_host)

    def key(self, group: int, name: str) -> str:
        return f"resident_pg.bench/{group}/{name}"


def launched() -> bool:
    """True in a process of a launcher (all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)."""
    return all(os.environ.get(k) for k in _ENV)


def join(timeout_s: float) -> Launch:
    """Connects to the launcher's store (env://) and learns every rank's host."""
    import torch.distributed as dist
    store, rank, world_size = next(dist.rendezvous(
        "env://", timeout=datetime.timedelta(seconds=timeout_s)))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    store.set(f"resident_pg.bench/host/{rank}", _host())
    hosts = {r: store.get(f"resident_pg.bench/host/{r}").decode() for r in range(world_size)}
    return Launch(rank, world_size, local_rank, store, hosts)


def _host() -> str:
    """This process's host: its name, and its network namespace where that can be read (network
    namespaces of one machine, the tests' stand-in for hosts, share the name)."""
    try:
        return f"{socket.gethostname()} {os.readlink('/proc/self/ns/net')}"
    except OSError:
        return socket.gethostname()


class LaunchedGroupRun(common.GroupRecord):
    """One group's ladder in this process (one rank of it); on rank 0 also what every rank
    measured."""

    def __init__(self, ws, backend, label, cells, cfg, args, launch: Launch, group: int):
        super().__init__(ws, backend, label, cells, cfg, args)
        self.launch, self.group = launch, group

    def skip(self, reason: Optional[str]) -> Optional[str]:
        """Rank 0 decides whether the group runs (its reason to skip it, or None) and every rank
        learns that decision; returns it."""
        lc, key = self.launch, self.launch.key(self.group, "skip")
        if lc.rank == 0:
            lc.store.set(key, reason or "")
        else:
            lc.store.wait([key], datetime.timedelta(seconds=self.cfg["timeout"]))
            reason = lc.store.get(key).decode() or None
        return super().skip(reason)

    def run(self) -> None:
        import torch.distributed as dist
        lc = self.launch
        messages: List[list] = []
        phase = rank_side.Phase()
        saved = {k: os.environ.get(k) for k in self.cfg.get("env") or {}}
        os.environ.update(self.cfg.get("env") or {})   # a variant's upper-case options
        t0 = time.time()
        watchdog = _Watchdog(self.cfg["timeout"] + 30, lc.rank, self.label, phase)

        def post(m) -> None:
            messages.append(list(m))
            watchdog.progress()
        try:
            rank_side.run_ladder(
                lc.rank, self.ws, self.backend,
                lambda: dist.PrefixStore(lc.key(self.group, "g"), lc.store), self.cells, self.cfg,
                post, phase, device_rank=lc.local_rank)
        except Exception as e:  # recorded; the next group still runs
            messages.append(["fatal", lc.rank, f"[{phase.name}] {type(e).__name__}: {e}\n"
                             + traceback.format_exc(limit=8)])
            _destroy_default_group()
        finally:
            watchdog.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        lc.store.set(lc.key(self.group, f"report/{lc.rank}"), json.dumps(messages))
        if lc.rank == 0:
            self._gather(time.time() - t0)

    def _gather(self, wall_s: float) -> None:
        lc = self.launch
        info: Dict[str, Any] = {"attempt": 0, "cells": len(self.cells), "status": "ok",
                                "wall_s": wall_s, "in_progress": None}
        fatal: Dict[int, str] = {}
        for r in range(self.ws):
            key = lc.key(self.group, f"report/{r}")
            try:
                lc.store.wait([key], datetime.timedelta(seconds=self.cfg["timeout"]))
                messages = json.loads(lc.store.get(key))
            except Exception as e:  # a rank that never reported
                fatal[r] = f"no report within {self.cfg['timeout']:.0f} s ({type(e).__name__})"
                continue
            for m in messages:
                self.take(r, m)
                kind = m[0]
                if kind == "ready" and r == 0:
                    info["startup_s"] = m[2]
                elif kind == "start":
                    info["in_progress"] = m[2]
                elif kind == "done" and r == 0:
                    info["in_progress"] = None
                    info["ladder_s"] = m[2]
                elif kind == "fatal":
                    fatal[r] = m[2]
        if fatal:
            r0 = min(fatal)
            info["status"] = "crashed"
            info["error"] = f"rank {r0}: {fatal[r0]}"
            stuck = info["in_progress"]
            if stuck is not None:   # reported with that cell, as GroupRun does
                self.cell_errors.setdefault(stuck, {})[-1] = info["error"]
            else:
                self.errors.append({"attempt": 0, "status": "crashed", "error": info["error"]})
        self.launches.append(info)


class _Watchdog:
    """Ends the process when a group makes no progress for `limit_s` (a backend that hangs
    past its own timeout): a spawned group's parent would kill and relaunch it, here nobody
    else can. The launcher then ends the job."""

    def __init__(self, limit_s: float, rank: int, label: str, phase: "rank_side.Phase") -> None:
        self.limit_s, self.rank, self.label, self.phase = limit_s, rank, label, phase
        self.last = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="bench-watchdog", daemon=True)
        self.thread.start()

    def progress(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.done.wait(1.0):
            idle = time.monotonic() - self.last
            if idle > self.limit_s:
                print(f"resident_pg.bench: rank {self.rank}: group {self.label!r} made no "
                      f"progress for {idle:.0f} s (in {self.phase.name}); exiting",
                      file=sys.stderr, flush=True)
                os._exit(3)


def follow(groups, args, launch: Launch) -> None:
    """A rank other than 0: runs its part of every group of ladder._groups that rank 0 runs."""
    for n, ws, _rnd, _mode, spec, label0, _label, cells, gcfg in groups:
        g = LaunchedGroupRun(ws, spec[0], label0, cells, gcfg, args, launch, n)
        if not g.skip(None):
            g.run()


def _destroy_default_group() -> None:
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # the next group needs none; say why this one stayed
        common._log(f"resident_pg.bench: destroy_process_group after an error: {e}")
