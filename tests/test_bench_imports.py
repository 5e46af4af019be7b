"""The import structure of resident_pg.bench: every module imports alone in a fresh interpreter
(a circle between two modules shows up as an ImportError of a partly initialised module when
the second one is imported first), the modules' imports of each other form no circle, and no
module falls back from a package import to a top-level one (``except ImportError``)."""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO, "resident_pg", "bench")
MODULES = sorted(f[:-3] for f in os.listdir(BENCH_DIR)
                 if f.endswith(".py") and f not in ("__init__.py", "__main__.py"))


def _sibling_imports(name):
    """The bench modules that module `name` imports (relative or absolute, at any depth)."""
    with open(os.path.join(BENCH_DIR, name + ".py")) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                found.update(a.name for a in node.names)
            elif node.level == 1:
                found.add(node.module.split(".")[0])
            elif node.module and node.module.startswith("resident_pg.bench."):
                found.add(node.module.split(".")[2])
            elif node.module == "resident_pg.bench":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("resident_pg.bench."):
                    found.add(a.name.split(".")[2])
    return found & set(MODULES)


def test_the_package_has_the_modules_by_job():
    assert {"cli", "ladder", "rank", "ops", "report", "cuda", "common",
            "interference"} <= set(MODULES)
    for old in ("bench.py", "bench_common.py", "bench_cuda.py", "bench_rank.py"):
        assert not os.path.exists(os.path.join(REPO, "resident_pg", old)), old


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_alone(name):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", f"import resident_pg.bench.{name}"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_no_import_circle():
    graph = {m: _sibling_imports(m) for m in MODULES}
    # the graph sees both forms of relative import (so an empty result is not vacuous)
    assert {"common", "cuda", "ops"} <= graph["rank"] and "report" in graph["cuda"], graph
    assert graph["common"] == set(), graph["common"]

    def reaches(start, goal, seen):
        for n in graph[start]:
            if n == goal:
                return True
            if n not in seen:
                seen.add(n)
                if reaches(n, goal, seen):
                    return True
        return False

    circles = [m for m in MODULES if reaches(m, m, set())]
    assert not circles, {m: sorted(graph[m]) for m in circles}


def test_no_fallback_imports():
    offenders = []
    for name in MODULES + ["__init__", "__main__"]:
        path = os.path.join(BENCH_DIR, name + ".py")
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Try):
                caught = [h.type for h in node.handlers if h.type is not None]
                names = {getattr(t, "id", None) for t in caught} | {
                    getattr(e, "id", None) for t in caught if isinstance(t, ast.Tuple)
                    for e in t.elts}
                imports = any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
                if imports and names & {"ImportError", "ModuleNotFoundError"}:
                    offenders.append(f"{name}.py:{node.lineno}")
            if isinstance(node, ast.If) and "__package__" in ast.unparse(node.test):
                offenders.append(f"{name}.py:{node.lineno} (if __package__)")
    assert not offenders, offenders
