"""Runs torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in the
torch wheel) against a backend on CPU, and checks the outcome against the expected list.

    python tests/torch_suite_driver.py --backend resident --world-size 2      # what CI runs (and 3)
    python tests/torch_suite_driver.py --backend gloo --world-size 3 --no-check  # the baseline
    python tests/torch_suite_driver.py --compare --world-size 2   # both, counts side by side
    python tests/torch_suite_driver.py -k 'all_reduce|barrier'    # a subset (regex on names)

The suite is driven as torch's test/distributed/test_distributed_spawn.py drives it (BACKEND,
WORLD_SIZE, TEMP_DIR, INIT_METHOD in the environment), except for the backend name: the
upstream driver accepts only gloo, nccl and ucc. The suite picks tests by comparing BACKEND
with backend names when it is imported ("Only gloo backend supports timeouts", "get_future is
only supported on mpi, nccl and gloo", ...) and inside test bodies (gloo takes the CPU model
in the DDP tests). resident serves CPU tensors with gloo's semantics, so for backend resident
the suite is imported as for gloo, its module-level BACKEND then compares equal to "gloo" and
to "resident" (while every group it creates is a resident group), and resident joins its
profiling allow-lists. Where resident differs from gloo, the test runs and fails, and the
expected list (tests/torch_suite_expected.py) says why.

Each test runs its ranks in fresh processes (forked from this driver by default: importing the
suite takes seconds per process; ``--start-method spawn`` is upstream's way). The driver
prints one line per test and the counts, writes every outcome to ``--json``, and exits 1 when
an outcome disagrees with the expected list: a test outside the list failed or skipped for an
unexpected reason, or a listed failure passed (the list must stay true).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEST_TIMEOUT_S = 120  # per test, all ranks; upstream's default is 300


class ResidentAsGloo(str):
    """The suite's BACKEND for a resident run: the string "resident", equal to "gloo" too, so
    that the suite's name checks inside test bodies take gloo's (CPU) branches."""

    _ALIASES = ("gloo", "resident")

    def __eq__(self, other):
        return isinstance(other, str) and str(other) in self._ALIASES

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def lower(self):
        return "resident"

    def upper(self):
        return "RESIDENT"

    def __str__(self):
        return "resident"


def _setup_environment(backend: str, world_size: int) -> None:
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(DEFAULT_TEST_TIMEOUT_S))
    if "TEMP_DIR" not in os.environ:  # the suite's setUp makes a fresh one per test
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch_suite_")
        os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
    # The tests that initialise again (test_barrier_timeout_global) need a file:// method, as
    # in upstream's file-init job; the ranks of each test rendezvous through their own file.
    os.environ.setdefault("INIT_METHOD",
                          "file://" + os.path.join(os.environ["TEMP_DIR"], "shared_init_file"))
    # Imported with gloo's name for a resident run: the decorators evaluate BACKEND at import.
    os.environ["BACKEND"] = "gloo" if backend == "resident" else backend


def load_suite(backend: str, world_size: int, profiler_events: bool = True):
    """Imports the suite for `backend` and returns (module, test class). Without
    `profiler_events` resident stays off the suite's profiling allow-lists, so that the tests
    that also check profiler events check only the results (a diagnosis aid)."""
    _setup_environment(backend, world_size)
    import torch
    import torch.distributed as dist

    if backend == "resident":
        import resident_pg  # noqa: F401 - registers the backend (also without the entry point)
    from torch.testing._internal.distributed import distributed_test as suite

    os.environ["BACKEND"] = backend  # tests that read it at run time see the real name
    if backend == "resident":
        suite.BACKEND = ResidentAsGloo("resident")
    if backend == "resident" and profiler_events:
        for allow_list in (suite.PROFILING_SUPPORTED_BACKENDS,
                           suite.CUDA_PROFILING_SUPPORTED_BACKENDS,
                           suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
            allow_list.append("resident")
    start_method = os.environ.get("TORCH_SUITE_START_METHOD", "fork")

    class TorchSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context(start_method).Process)

    TorchSuite.__name__ = TorchSuite.__qualname__ = f"TorchSuite{backend.capitalize()}"
    globals()[TorchSuite.__name__] = TorchSuite  # spawned ranks find the class by this name
    assert dist.is_available()
    return suite, TorchSuite


def all_test_names(cls) -> list:
    return sorted(n for n in dir(cls) if n.startswith("test_"))


class Recorder(unittest.TextTestResult):
    """Keeps each test's outcome, time and message."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _record(self, test, status, message=""):
        name = test.id().split(".")[-1]
        self.outcomes[name] = {"status": status, "seconds": round(time.monotonic() - self._t0, 2),
                               "message": message}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "pass", "an expected failure of the suite itself")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success of a test the suite marks expectedFailure")


def run_tests(cls, names: list, stream) -> dict:
    known = set(all_test_names(cls))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"not tests of the suite: {unknown}")
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(stream=stream, verbosity=2, resultclass=Recorder)
    result = runner.run(suite)
    return result.outcomes


def check_against_expected(backend: str, world_size: int, outcomes: dict) -> list:
    """Disagreements between the outcomes and the expected list (empty: all as expected)."""
    from torch_suite_expected import expected_for, skip_is_expected

    problems = []
    for name, o in sorted(outcomes.items()):
        exp = expected_for(name, backend, world_size)
        if o["status"] == "fail":
            if exp is None or exp.status != "fail":
                first = o["message"].strip().splitlines()[-1:] or [""]
                problems.append(f"{name}: failed and is not listed as an expected failure "
                                f"({first[0][:300]})")
        elif o["status"] == "pass":
            if exp is not None and exp.status == "fail":
                problems.append(f"{name}: passed but is listed as an expected failure "
                                f"({exp.reason}); remove it from tests/torch_suite_expected.py")
        elif o["status"] == "skip":
            if not skip_is_expected(o["message"]):
                problems.append(f"{name}: skipped for a reason the expected list does not "
                                f"accept: {o['message'][:200]}")
    return problems


def counts(outcomes: dict) -> dict:
    c = {"pass": 0, "fail": 0, "skip": 0}
    for o in outcomes.values():
        c[o["status"]] += 1
    return c


def _main_single(args) -> int:
    sys.path.insert(0, HERE)
    _, cls = load_suite(args.backend, args.world_size, args.profiler_events)
    names = all_test_names(cls)
    if args.k:
        names = [n for n in names if re.search(args.k, n)]
    t0 = time.monotonic()
    saved_stdout = None
    if args.log:  # the suite's prints and the ranks' output too: they inherit these descriptors
        log_file = open(args.log, "w")
        sys.stdout.flush()
        saved_stdout = os.dup(sys.stdout.fileno())
        os.dup2(log_file.fileno(), sys.stdout.fileno())
        os.dup2(log_file.fileno(), sys.stderr.fileno())
    outcomes = run_tests(cls, names, sys.stderr)
    if saved_stdout is not None:
        sys.stdout.flush()
        os.dup2(saved_stdout, sys.stdout.fileno())
    elapsed = time.monotonic() - t0
    problems = check_against_expected(args.backend, args.world_size, outcomes) if args.check else []
    c = counts(outcomes)
    for name in sorted(outcomes):
        o = outcomes[name]
        print(f"{o['status'].upper():5s} {name} ({o['seconds']:.1f} s)"
              + (f": {o['message'][:120]}" if o["status"] == "skip" else ""))
    print(f"{args.backend} world size {args.world_size}{' -k ' + args.k if args.k else ''}: "
          f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped in {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size, "k": args.k,
                       "seconds": round(elapsed, 1), "counts": c,
                       "outcomes": outcomes, "problems": problems}, f, indent=1)
    if problems:
        print(f"{len(problems)} outcome(s) disagree with tests/torch_suite_expected.py:")
        for p in problems:
            print("  " + p)
        return 1
    return 0


def _main_compare(args) -> int:
    """Runs the selection for resident and for gloo (each in its own process) and prints the
    counts side by side, with the tests whose outcome differs."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("gloo", "resident"):
            out = os.path.join(tmp, f"{backend}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend,
                   "--world-size", str(args.world_size), "--json", out, "--log", os.path.join(tmp, f"{backend}.log")]
            if args.k:
                cmd += ["-k", args.k]
            if backend == "gloo":
                cmd += ["--no-check"]
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
            with open(out) as f:
                results[backend] = json.load(f)
    g, r = results["gloo"], results["resident"]
    print(f"world size {args.world_size}{' -k ' + args.k if args.k else ''}:")
    for backend, res in (("gloo", g), ("resident", r)):
        c = res["counts"]
        print(f"  {backend:9s} {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped "
              f"({res['seconds']:.0f} s)")
    diff = sorted(n for n in g["outcomes"]
                  if g["outcomes"][n]["status"] != r["outcomes"].get(n, {}).get("status"))
    print(f"  {len(diff)} test(s) with different outcomes:")
    for n in diff:
        print(f"    {n}: gloo {g['outcomes'][n]['status']}, resident "
              f"{r['outcomes'].get(n, {}).get('status')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if r["problems"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="resident", choices=("resident", "gloo"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-k", default="", help="only tests whose name matches this regex")
    p.add_argument("--json", default="", help="write the outcomes here")
    p.add_argument("--log", default="", help="the suite's and the ranks' output (default: stderr)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="report only; do not compare with the expected list")
    p.add_argument("--compare", action="store_true", help="run gloo and resident, compare")
    p.add_argument("--no-profiler-events", dest="profiler_events", action="store_false",
                   help="resident: leave the suite's profiler-event checks out (implies "
                        "--no-check), to see whether those tests' results are right")
    p.add_argument("--start-method", default=os.environ.get("TORCH_SUITE_START_METHOD", "fork"),
                   choices=("fork", "spawn"))
    args = p.parse_args(argv)
    os.environ["TORCH_SUITE_START_METHOD"] = args.start_method
    if not args.profiler_events:
        args.check = False
        os.environ["TORCH_SUITE_PROFILER_EVENTS"] = "0"  # for ranks started with spawn
    if args.world_size < 2:
        p.error("--world-size must be at least 2")
    return _main_compare(args) if args.compare else _main_single(args)


if __name__ == "__mp_main__":
    # A rank started with --start-method spawn imports this file again: define the test class
    # it is asked to run, with the environment the driver left.
    sys.path.insert(0, HERE)
    load_suite(os.environ["BACKEND"], int(os.environ["WORLD_SIZE"]),
               os.environ.get("TORCH_SUITE_PROFILER_EVENTS", "1") == "1")

if __name__ == "__main__":
    sys.exit(main())
