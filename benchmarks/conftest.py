"""pytest plugin of the latency ladder: ``pytest benchmarks/`` runs resident_pg.bench's ladder
as parametrized cases (device x mode x world size x backend x op x size).

The ladder is multi-process: pytest-benchmark's fixture times a callable in this process, which
a collective over spawned ranks is not. So the rank processes run as the CLI runs them (one set
per (world size, backend, mode, round), started once for all the cases of that group, by
ladder.run), and each case hands its measured samples to pytest-benchmark's session as that
plugin's own Metadata/Stats: ``--benchmark-json``, ``--benchmark-save``,
``--benchmark-compare`` and its tables then work unchanged. docs/performance.md ("Benchmarks
under pytest") says how to run it; benchmarks/baselines/README.md how to gate a run.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from resident_pg.bench import cases, cli, common, ladder  # noqa: E402

CPU_BACKENDS = "resident,resident:transport=tcp,gloo"
CUDA_BACKENDS = "resident:path=direct,resident:path=proxy,resident:transport=tcp,nccl"
QUICK_SIZES = {"cpu": (8, 16384), "cuda": (8, 65536)}


def pytest_addoption(parser):
    g = parser.getgroup("resident", "resident_pg latency ladder (benchmarks/)")
    g.addoption("--resident-device", default="auto", metavar="LIST",
                help="devices: cpu, cuda or both [auto: cpu, plus cuda where available]")
    g.addoption("--resident-world-sizes", default=common.DEFAULT_WORLD_SIZES, metavar="LIST")
    g.addoption("--resident-backends-cpu", default=CPU_BACKENDS, metavar="LIST")
    g.addoption("--resident-backends-cuda", default=CUDA_BACKENDS, metavar="LIST",
                help="nccl runs only where each rank has its own GPU")
    g.addoption("--resident-sizes", default=common.DEFAULT_SIZES, metavar="LIST")
    g.addoption("--resident-ops", default="all", metavar="LIST")
    g.addoption("--resident-modes-cuda", default=common.DEFAULT_MODES["cuda"], metavar="LIST")
    g.addoption("--resident-rounds", type=int, default=None, metavar="N",
                help="launch every group N times, interleaved (the gate's noise band) "
                     "[1; with --resident-gate: 3]")
    g.addoption("--resident-floors", action="append", default=[], metavar="PATH",
                help="floors JSON of benchmarks/floors (as the CLI's --floors; may repeat)")
    g.addoption("--resident-ladder-args", default="", metavar="ARGS",
                help="more options of python -m resident_pg.bench, e.g. '--iters 0.3 --reps 7'")
    g.addoption("--resident-gate", default=None, metavar="PATH",
                help="baseline JSON (benchmarks/baselines/): fail a case whose ratio to its "
                     "reference exceeds the baseline's by more than the noise band")
    g.addoption("--resident-gate-min-band", type=float, default=0.10, metavar="FRACTION",
                help="smallest noise band of the gate [%(default)s]")
    g.addoption("--resident-ladder-json", default=None, metavar="DIR",
                help="also write each group's ladder document (schema resident_pg.bench/1)")


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: a small subset of the ladder (2 ranks, 2 sizes)")
    config.addinivalue_line("markers", "cuda: a case on CUDA tensors (skipped without CUDA)")
    config._resident_runs = LadderRuns(config)


def _devices(config):
    text = config.getoption("resident_device")
    if text == "auto":
        return ["cpu"] + (["cuda"] if _cuda_count() else [])
    devs = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in devs if d not in ("cpu", "cuda")]
    if bad or not devs:
        raise pytest.UsageError(f"--resident-device: unknown device {bad or text!r} (cpu, cuda)")
    return devs


def _cuda_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_fits(ws):
    import torch.distributed as dist
    return dist.is_nccl_available() and _cuda_count() >= ws


def case_params(config):
    """[(id, params, quick)] of the cases the options select."""
    try:
        wss = common.parse_int_list(config.getoption("resident_world_sizes"), "world size")
        sizes = common.parse_sizes(config.getoption("resident_sizes"))
        ops = common.parse_ops(config.getoption("resident_ops"))
        out = []
        for device in _devices(config):
            specs = config.getoption(f"resident_backends_{device}").split(",")
            variants = common.backend_labels([s.strip() for s in specs if s.strip()])
            modes = (["eager"] if device == "cpu" else
                     [m.strip() for m in config.getoption("resident_modes_cuda").split(",")])
            for ws in wss:
                for mode in modes:
                    for variant in variants:
                        if variant.split(":")[0] == "nccl" and not (device == "cuda"
                                                                     and _nccl_fits(ws)):
                            continue
                        for op in ops:
                            if op == "send_recv" and ws < 2:
                                continue
                            for size in sizes:
                                p = {"device": device, "mode": mode, "world_size": ws,
                                     "variant": variant, "op": op, "size": size}
                                quick = ws == 2 and size in QUICK_SIZES[device]
                                out.append((cases.case_id(device, mode, ws, variant, op, size),
                                            p, quick))
        return out
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_generate_tests(metafunc):
    if "ladder_case" not in metafunc.fixturenames:
        return
    params = []
    for cid, p, quick in case_params(metafunc.config):
        marks = [getattr(pytest.mark, p["device"])] if p["device"] == "cuda" else []
        if quick:
            marks.append(pytest.mark.quick)
        params.append(pytest.param(p, id=cid, marks=marks))
    metafunc.parametrize("ladder_case", params)


class LadderRuns:
    """One ladder run per (device, world size), started by its first case: all the selected
    cases of that group (backends, modes, ops, sizes) in one ladder.run, backends interleaved."""

    def __init__(self, config):
        self.config = config
        self.runs = {}       # (device, ws) -> {case id: result} or an exception text
        self.tables = []     # printed tables of each run, for the terminal summary
        self.verdicts = []   # the gate's verdicts
        self.baseline = None
        gate = config.getoption("resident_gate")
        if gate:
            try:
                self.baseline = cases.load_baseline(gate)
            except (OSError, ValueError) as e:
                raise pytest.UsageError(f"--resident-gate {gate}: {e}") from None

    def results(self, session, device, ws):
        key = (device, ws)
        if key not in self.runs:
            self.runs[key] = self._run(session, device, ws)
        return self.runs[key]

    def _run(self, session, device, ws):
        selected = [it.callspec.params["ladder_case"] for it in session.items
                    if hasattr(it, "callspec") and "ladder_case" in it.callspec.params]
        group = [p for p in selected if p["device"] == device and p["world_size"] == ws]

        def union(k):
            return list(dict.fromkeys(p[k] for p in group))
        cfg = self.config
        rounds = cfg.getoption("resident_rounds") or (3 if self.baseline else 1)
        specs = [s.strip() for s in cfg.getoption(f"resident_backends_{device}").split(",")
                 if s.strip()]
        variants = union("variant")
        labels = common.backend_labels(specs)
        backends = [s for s, lb in zip(specs, labels) if lb in variants]
        if device == "cpu" and "gloo" in labels and "gloo" not in backends:
            backends.append("gloo")   # the reference of the CPU cases
        argv = ["--device", device, "--world-sizes", str(ws), "--backends", ",".join(backends),
                "--mode", ",".join(union("mode")), "--ops", ",".join(union("op")),
                "--sizes", ",".join(str(s) for s in sorted(union("size"))),
                "--rounds", str(rounds)]
        for f in cfg.getoption("resident_floors"):
            argv += ["--floors", f]
        argv += shlex.split(cfg.getoption("resident_ladder_args"))
        out_dir = cfg.getoption("resident_ladder_json")
        args = cli.build_parser().parse_args(argv)
        plan = ladder.make_plan(args)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            doc = ladder.run(plan, argv)
        self.tables.append(f"--- {device}, {ws} ranks: python -m resident_pg.bench "
                           f"{shlex.join(argv)}\n{buf.getvalue()}")
        if out_dir:
            from resident_pg.bench import report
            report.write_json(doc, os.path.join(out_dir, f"ladder_{device}_ws{ws}.json"))
        return cases.case_results(doc)


@pytest.fixture(scope="session")
def ladder_runs(request):
    return request.config._resident_runs


if "pytest_benchmark" not in sys.modules:
    try:
        import pytest_benchmark  # noqa: F401
    except ImportError:
        @pytest.fixture
        def benchmark():
            """Without pytest-benchmark: the cases check and gate, nothing is written."""
            return None


def record(benchmark, cid, res):
    """Hands a case's samples to pytest-benchmark's session as its own Metadata/Stats."""
    if benchmark is None or getattr(benchmark, "disabled", False):
        return
    from pytest_benchmark.stats import Metadata
    p = res["row"]
    benchmark.group = f"{p['device']} {p['mode']} ws{p['world_size']} {p['op']} {p['size_bytes']}B"
    benchmark.extra_info.update(res["extra"])
    meta = Metadata(benchmark, iterations=res["extra"].get("batch") or 1,
                    options={"timer": "resident_pg.bench ladder (perf_counter_ns in the ranks)"})
    for s in res["samples_s"]:
        meta.stats.update(s)
    benchmark._mode = "resident_pg.bench ladder"   # the fixture counts as used, once
    benchmark.stats = meta
    benchmark._add_stats(meta)


def pytest_terminal_summary(terminalreporter, config):
    runs = getattr(config, "_resident_runs", None)
    if not runs or not runs.runs:
        return
    tr = terminalreporter
    tr.section("resident_pg ladder")
    for t in runs.tables:
        tr.write_line(t.rstrip())
    if runs.baseline is not None:
        bad = [v for v in runs.verdicts if v["regressed"]]
        compared = sum(1 for v in runs.verdicts if v["comparable"])
        tr.write_line(f"\ngate {config.getoption('resident_gate')}: {compared} cases "
                      f"compared, {len(bad)} regressed, {len(runs.verdicts) - compared} not "
                      f"comparable (failed)")
        if bad:
            tr.write_line(cases.format_gate_table(bad, "regressions:"))
