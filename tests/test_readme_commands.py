"""The README's two commands are the ones CI runs, verbatim."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ci_commands():
    lines = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    return [l for l in lines if l.strip() and not l.startswith(("#", "set ", "cd ", "export "))]


def test_ci_runs_the_readme_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    readme_lines = {l.strip() for b in blocks for l in b.splitlines()}
    cmds = _ci_commands()
    assert len(cmds) == 2, cmds
    for cmd in cmds:
        assert cmd.strip() in readme_lines, f"README lacks the CI command: {cmd}"


def test_cpp_sources_are_clang_formatted():
    import shutil
    import subprocess

    import pytest

    if shutil.which("clang-format") is None:
        pytest.skip("clang-format not installed (the set-up command installs it)")
    files = []
    # Each folder with its subfolders (csrc/core/transport/ib and the other concept folders).
    for d in ("csrc", "kernels", "tests/cpp", "benchmarks/floors", "benchmarks/probes"):
        for top, _, names in sorted(os.walk(os.path.join(ROOT, d))):
            files += [os.path.join(top, f) for f in sorted(names)
                      if f.endswith((".cpp", ".hpp", ".cu", ".cuh", ".h"))]
    assert os.path.join(ROOT, "csrc", "core", "transport", "ib", "ib_transport.cpp") in files
    bad = [f for f in files
           if subprocess.run(["clang-format", "--dry-run", "-Werror", f],
                             capture_output=True).returncode != 0]
    assert not bad, f"not clang-formatted (run clang-format -i): {bad}"
