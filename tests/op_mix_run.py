"""Running op-mix plans (op_mix.py) inside the ranks, and the parent side shared by
test_op_mix.py (CPU) and test_cuda_op_mix.py (CUDA).

Inside a rank, :func:`run_modes` goes through the job's modes; for each it sets the mode's
environment, creates the default group, runs every seed and destroys the group. A seed
(:func:`run_seed`) creates its subgroups, runs its steps (each op filled, issued sync or async,
async Works waited in an order of this rank's own, some through ``get_future()`` or polled with
``is_completed()``, every output checked), then the graph phase: the plan's graph ops are run
once eagerly (the warm-up, checked), captured (``Hooks.capture``; on the CPU the capture is the
step itself, run again on each replay), and replayed with fresh inputs copied into the captured
buffers, checked after each replay. The first exception ends the mode: the group may be broken.

Parent side: :class:`OpMixJobs` runs one spawned job per (world size[, mode]) with exactly the
(mode, seed) items pytest selected, and turns each into a failure message that names the seed,
step, op, dtype, size, group and rank, and how to rerun that seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import traceback

import pytest

import dist_harness as H
import op_mix
import op_mix_plan

WAIT_STYLES = ("wait", "wait", "wait", "future", "future", "poll")


class Hooks:
    """Device-specific parts of the graph phase; these are the CPU's: no capture."""

    # How long a waited Work may still take to report is_completed(): 0 for resident's Works,
    # which report it before their future completes; another backend's (a hand-off's gloo) may
    # complete its future first.
    settle_s = 0.0

    def warm(self, fn):
        fn()

    def capture(self, fn):
        return fn

    def agree(self, tag, rank, ws, ok):
        return ok

    def finish(self):
        pass


# --------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------


def _apply_env(env: dict) -> dict:
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    dist.set_debug_level_from_env()
    return saved


def _restore_env(saved: dict) -> None:
    import torch.distributed as dist

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    dist.set_debug_level_from_env()


def run_modes(rank, ws, job: dict, hooks: Hooks) -> dict:
    """job: {"modes": [(mode id, env)], "seeds": [...], "steps": int, "device": the tensors'
    device, "caps": "cpu" | "cuda" (whose plans), "timeout_s": the groups' timeout}.
    Returns {"<mode>/<seed>": the result of run_seed}."""
    import torch.distributed as dist

    caps = op_mix_plan.CPU_CAPS if job["caps"] == "cpu" else op_mix_plan.CUDA_CAPS
    caps = dataclasses.replace(caps, resident_ops=H.BACKEND == "resident")
    out = {}
    for mode_id, env in job["modes"]:
        saved = _apply_env(env)
        broken = None
        try:
            H.init_pg(prefix=f"opmix/{mode_id}/", timeout_s=job["timeout_s"])
            out[f"{mode_id}/backend"] = _backend_name(job["device"])
            for seed in job["seeds"]:
                if broken is not None:
                    out[f"{mode_id}/{seed}"] = {"not_run": broken}
                    continue
                plan = op_mix.make_plan(seed, ws, caps, job["steps"])
                res = run_seed(rank, plan, mode_id, job["device"], hooks, job["timeout_s"])
                out[f"{mode_id}/{seed}"] = res
                if res["fatal"]:
                    broken = (f"not run: seed {seed} failed on this rank before it "
                              "(the group may be broken)")
        except Exception as e:  # noqa: BLE001  (group creation)
            for seed in job["seeds"]:
                out.setdefault(f"{mode_id}/{seed}", {"not_run": f"mode {mode_id}: {_exc(e)}"})
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001
                for seed in job["seeds"]:
                    res = out.get(f"{mode_id}/{seed}")
                    if res is not None and "problems" in res:
                        res["problems"].append(f"destroy_process_group: {_exc(e)}")
            _restore_env(saved)
        # Every rank leaves the mode before any starts the next, also after an error that
        # some ranks saw only at the group timeout: a failure stays in its mode's items.
        try:
            _store_barrier(f"opmix/done/{mode_id}", rank, ws, 3 * job["timeout_s"] + 60)
        except Exception as e:  # noqa: BLE001  (a rank that never left the mode)
            # What this rank saw of the mode, which is otherwise lost with its result.
            seen = [f"seed {k.split('/', 1)[1]}: {v.get('fatal') or (v.get('problems') or [])[:3]}"
                    for k, v in out.items() if k.startswith(f"{mode_id}/") and isinstance(v, dict)
                    and (v.get("fatal") or v.get("problems"))]
            raise RuntimeError(f"mode {mode_id}: a rank did not leave the mode ({e}); on rank "
                               f"{rank}: " + ("; ".join(seen) or "no failure")) from e
    return out


def _backend_name(device) -> str:
    """The default group's backend for the device, and what it wraps (debug mode DETAIL)."""
    import torch
    import torch.distributed as dist

    b = dist.group.WORLD._get_backend(torch.device(device))
    inner = getattr(b, "wrapped_pg", None)
    return type(b).__name__ + (f"({type(inner).__name__})" if inner is not None else "")


def _store_barrier(tag, rank, ws, timeout_s) -> None:
    """A barrier through the parent's TCPStore (never through the backend under test)."""
    import datetime

    store = H.connect_store()
    store.set(f"{tag}/{rank}", b"1")
    store.wait([f"{tag}/{r}" for r in range(ws)], datetime.timedelta(seconds=timeout_s))


def _exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__, limit=-4))


def _done(w) -> bool:
    """Whether an async handle says it completed: a Work, a torch Future (what
    all_reduce_coalesced returns) or a coalescing manager (its Works)."""
    if hasattr(w, "works"):
        return all(_done(x) for x in w.works)
    return w.done() if hasattr(w, "done") else w.is_completed()


class _Seed:
    """One seed's run on this rank: what it found, and where it is (for the error text)."""

    def __init__(self, rank, plan, mode_id, device, hooks, timeout_s):
        self.rank, self.plan, self.mode, self.device = rank, plan, mode_id, device
        self.hooks, self.timeout_s = hooks, timeout_s
        self.problems, self.digests = [], {}
        self.handles = [None]  # the world: the default group
        self.cache = {}  # Member.cache of every op of the seed (dies with its subgroups)
        self.where = "creating the subgroups"
        self.ops = 0

    def member(self, spec, key, local):
        from op_mix_base import Member

        return Member(self.plan, spec, self.rank, self.handles[spec.group], self.device, key, local,
                      self.cache)

    def label(self, head, spec, op=None):
        g = self.plan.groups[spec.group]
        me = g.ranks.index(self.rank)
        return f"{head}: {spec.describe(self.plan.groups)} (group rank {me} of {len(g.ranks)})"

    def collect(self, label, op, tag):
        self.problems += [f"{label}: {e}" for e in op.check()]
        self.digests.update({f"{tag}/{k}": v for k, v in op.digests.items()})

    def wait(self, works, local):
        """Wait for (label, work) pairs in an order of this rank's own, each by one style."""
        import numpy as np

        for i in np.asarray(local.permutation(len(works)), dtype=int):
            label, w = works[int(i)]
            style = WAIT_STYLES[int(local.integers(len(WAIT_STYLES)))]
            if not hasattr(w, "get_future"):  # a coalescing manager or a Future: wait() only
                style = "wait"
            self.where = f"{label} (waiting: {style})"
            if style == "future":
                w.get_future().wait()
            elif style == "poll":
                deadline = time.monotonic() + self.timeout_s + 30
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"is_completed() still False {self.timeout_s + 30}s "
                                           "after the poll began (past the group timeout)")
                    time.sleep(0.0002)
                w.wait()
            else:
                w.wait()
            settle = time.monotonic() + self.hooks.settle_s
            while self.device == "cpu" and not _done(w) and time.monotonic() < settle:
                time.sleep(0.0002)
            if self.device == "cpu" and not _done(w):  # a CPU op is done once waited on
                self.problems.append(f"{label}: not completed after {style}")

    def step(self, step):
        import numpy as np

        from op_mix_ops import make_op

        local = np.random.default_rng([self.plan.seed, step.index, self.rank, 1])
        live = []
        for j, spec in enumerate(step.ops):
            if self.rank not in self.plan.groups[spec.group].ranks:
                continue
            label = self.label(f"step {step.index} [{step.mode}] op {j}", spec)
            self.where = label + " (filling)"
            op = make_op(spec, self.member(spec, f"opmix/{self.plan.seed}/{step.index}/{j}", local))
            op.fill("in")
            live.append((label, op, f"s{step.index}/o{j}"))
        pending = []
        for label, op, _tag in live:
            self.where = label
            self.ops += 1
            works = op.issue(step.mode != "sync")
            if step.mode == "async":
                self.wait([(label, w) for w in works], local)
            else:
                pending += [(label, w) for w in works]
        self.wait(pending, local)
        for label, op, tag in live:
            self.where = label + " (checking)"
            self.collect(label, op, tag)

    def graph(self):
        import numpy as np

        from op_mix_ops import make_op

        seed, rank = self.plan.seed, self.rank
        live = []
        for j, (spec, a) in enumerate(self.plan.graph):
            if rank not in self.plan.groups[spec.group].ranks:
                continue
            local = np.random.default_rng([seed, 1 << 20, rank, j])
            op = make_op(spec, self.member(spec, f"opmix/{seed}/graph/{j}", local))
            live.append((self.label(f"graph op {j} [{'async' if a else 'sync'}]", spec), op, a, j))

        def fill(key):
            for _label, op, _a, _j in live:
                op.fill(key)

        def run():
            pending = []
            for _label, op, a, _j in live:
                pending += op.issue(a)
            order = np.random.default_rng([seed, 1 << 21, rank]).permutation(len(pending))
            for i in order:
                pending[int(i)].wait()

        def check(when):
            for label, op, _a, j in live:
                self.collect(f"{label} {when}", op, f"graph/{j}/{when}")

        self.where = "graph phase: the warm-up (every graph op once, eagerly)"
        self.hooks.warm(lambda: (fill("warm"), run()))
        check("warm-up")
        self.where = "graph phase: the capture"
        ok, replay = True, None
        try:
            replay = self.hooks.capture(run)
        except Exception as e:  # noqa: BLE001
            ok = False
            self.problems.append(f"graph phase: the capture raised {_exc(e)}")
        if not self.hooks.agree(f"opmix/{self.mode}/{seed}/capture", rank, self.plan.ws, ok):
            if ok:
                self.problems.append("graph phase: the capture failed on another rank; no replay")
            return
        for i in range(self.plan.caps.graph_replays):
            self.where = f"graph phase: replay {i}"
            fill(f"replay{i}")
            replay()
            check(f"replay {i}")


def run_seed(rank, plan, mode_id, device, hooks, timeout_s) -> dict:
    import torch.distributed as dist

    s = _Seed(rank, plan, mode_id, device, hooks, timeout_s)
    t0 = time.monotonic()
    fatal = None
    try:
        for g in plan.groups[1:]:
            h = dist.new_group(list(g.ranks))
            s.handles.append(h if rank in g.ranks else None)
        for step in plan.steps:
            s.step(step)
        s.graph()
        s.where = "waiting for the device"
        hooks.finish()
        s.where = "the closing barrier (before the subgroups are destroyed)"
        dist.barrier()
        s.where = "destroying the subgroups"
        for h in s.handles[1:]:
            if h is not None:
                dist.destroy_process_group(h)
    except Exception as e:  # noqa: BLE001
        fatal = f"{s.where}: raised {_exc(e)}"
    return {"problems": s.problems, "digests": s.digests, "fatal": fatal, "ops": s.ops,
            "seconds": time.monotonic() - t0,
            "plan": hashlib.sha256(plan.text().encode()).hexdigest()[:16]}


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def problems_of(per_rank, key) -> list:
    """Every rank's problems with the run ``key`` ("<mode>/<seed>"), fatal ones first, then
    outputs that must be alike on the members of a group but are not."""
    out, fatal = [], []
    for r, res in enumerate(per_rank):
        v = res.get(key)
        if v is None:
            out.append(f"rank {r}: the run did not happen")
        elif "not_run" in v:
            out.append(f"rank {r}: {v['not_run']}")
        else:
            if v["fatal"]:
                fatal.append(f"rank {r}: {v['fatal']}")
            elif v["ops"] == 0:
                out.append(f"rank {r}: ran no op")
            out += [f"rank {r}: {p}" for p in v["problems"]]
    runs = [(r, res[key]) for r, res in enumerate(per_rank) if "plan" in res.get(key, {})]
    plans = {v["plan"] for _r, v in runs}
    if len(plans) > 1:
        out.append(f"the ranks built different plans from the seed: {sorted(plans)}")
    if not out and not fatal:
        first = {}
        for r, v in runs:
            for k, d in v["digests"].items():
                r0, d0 = first.setdefault(k, (r, d))
                if d != d0:
                    out.append(f"{k}: rank {r} got {d}, rank {r0} got {d0} (must be bitwise alike)")
    return fatal + out


class OpMixJobs:
    """One spawned job per (ws,) or, with ``per_mode``, per (ws, mode), running the (mode, seed)
    items pytest selected; ``job_fn(rank, ws, job)`` runs in each rank."""

    def __init__(self, job_fn, test_name, test_file, device, *, per_mode, timeout_s,
                 group_timeout_s=30, spawn_env=None, caps=None, modes=None):
        self.job_fn, self.test_name, self.test_file = job_fn, test_name, test_file
        self.device, self.per_mode, self.caps = device, per_mode, caps or device
        self.timeout_s, self.group_timeout_s = timeout_s, group_timeout_s
        self.spawn_env = spawn_env or (lambda env: {})
        # [(mode id, environment)]; default: the product of op_mix.MODE_AXES
        self.modes = dict(op_mix.modes() if modes is None else modes)
        self.results = {}

    def _selected(self, key, session):
        out = set()
        for it in session.items:
            if getattr(it, "originalname", None) != self.test_name or not hasattr(it, "callspec"):
                continue
            p = it.callspec.params
            if p.get("ws") == key[0] and (not self.per_mode or p.get("mode") == key[1]):
                out.add((p["mode"], p["seed"]))
        return out

    def get(self, key, session):
        if key not in self.results:
            sel = self._selected(key, session)
            mode_ids = [m for m in self.modes if any(s[0] == m for s in sel)]
            seeds = sorted({s[1] for s in sel})
            job = {"modes": [(m, self.modes[m]) for m in mode_ids], "seeds": seeds,
                   "steps": op_mix.default_steps(), "device": self.device, "caps": self.caps,
                   "timeout_s": self.group_timeout_s}
            env = self.spawn_env(self.modes[key[1]]) if self.per_mode else {}
            t0 = time.monotonic()
            try:
                per_rank = H.run_ranks(self.job_fn, key[0], args=(job,), init=False, env=env,
                                       timeout_s=self.timeout_s(len(mode_ids) * len(seeds)),
                                       init_timeout_s=self.group_timeout_s)
                self.results[key] = (per_rank, None, time.monotonic() - t0)
            except H.RanksFailed as e:
                self.results[key] = (None, str(e), time.monotonic() - t0)
        return self.results[key]

    def rerun(self, ws, mode, seed) -> str:
        steps = os.environ.get("RESIDENT_OPMIX_STEPS")
        env = f"RESIDENT_OPMIX_SEEDS={seed}" + (f" RESIDENT_OPMIX_STEPS={steps}" if steps else "")
        return (f"rerun: {env} python -m pytest -q {self.test_file} -k 'ws{ws}-{mode}-seed'\n"
                f"the plan: python tests/op_mix.py --seed {seed} --ws {ws} --device {self.caps}"
                + (f" --steps {steps}" if steps else ""))

    def check(self, ws, mode, seed, session):
        key = (ws, mode) if self.per_mode else (ws,)
        per_rank, job_err, _wall = self.get(key, session)
        head = f"op mix seed {seed}, {ws} ranks, mode {mode}, {self.device} tensors"
        if job_err is not None:
            pytest.fail(f"{head}: the job failed as a whole\n{self.rerun(ws, mode, seed)}\n"
                        f"{job_err}", pytrace=False)
        problems = problems_of(per_rank, f"{mode}/{seed}")
        if problems:
            pytest.fail(f"{head}: {len(problems)} problems\n{self.rerun(ws, mode, seed)}\n"
                        + "\n".join(problems[:30]), pytrace=False)
