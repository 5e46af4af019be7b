"""Builds and runs the torch-free core's C++ unit tests (tests/cpp/*.cpp) with g++ -std=c++17.

They need no torch: this proves csrc/core builds on its own, in the language standard the
project promises, and exercises the FIFO, reductions and the communicator with threads as ranks.
"""

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every source under csrc/core, its concept folders included (transport/, transport/ib/, proxy/).
CORE = sorted(glob.glob(os.path.join(ROOT, "csrc", "core", "**", "*.cpp"), recursive=True))
TESTS = sorted(glob.glob(os.path.join(ROOT, "tests", "cpp", "test_*.cpp")))
CXX = os.environ.get("CXX", "g++")
# Extra compiler and linker flags, e.g. the sanitizers of scripts/sanitize_cpu_suite.sh.
EXTRA_FLAGS = os.environ.get("RESIDENT_TEST_CXXFLAGS", "").split()


@pytest.fixture(scope="module")
def core_objects(tmp_path_factory):
    if shutil.which(CXX) is None:
        pytest.skip(f"{CXX} not found")
    out = tmp_path_factory.mktemp("core")
    objs = []
    procs = []
    for src in CORE:
        obj = out / (os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
        cmd = [CXX, "-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
               *EXTRA_FLAGS, "-I", os.path.join(ROOT, "csrc"), "-c", src, "-o", str(obj)]
        procs.append((src, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
        objs.append(str(obj))
        if len(procs) >= 2:
            _finish(procs.pop(0))
    for p in procs:
        _finish(p)
    return out, objs


def _finish(item):
    src, proc = item
    _, err = proc.communicate()
    assert proc.returncode == 0, f"compiling {src} failed:\n{err}"


@pytest.mark.parametrize("test_src", TESTS, ids=[os.path.basename(t)[:-4] for t in TESTS])
def test_core_unit(core_objects, test_src):
    out, objs = core_objects
    exe = out / os.path.basename(test_src)[:-4]
    build = subprocess.run(
        [CXX, "-std=c++17", "-O1", "-g", "-Wall", *EXTRA_FLAGS, "-I", os.path.join(ROOT, "csrc"), "-I",
         os.path.join(ROOT, "tests", "cpp"), test_src, *objs, "-lpthread", "-lrt", "-ldl", "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{exe.name} failed:\n{run.stdout}\n{run.stderr}"
    assert "ok" in run.stdout
