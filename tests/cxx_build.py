"""Builds a standalone C++ program of the repository (a floor or a probe) for its test: g++
(or $CXX) with warnings as errors; the test is skipped where there is no compiler."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def build_cxx(tmp_path_factory, src, name, extra_sources=()):
    """`extra_sources`: library files the program links (csrc/ is on the include path)."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    exe = str(tmp_path_factory.mktemp(name) / name)
    subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-pthread", "-I", CSRC,
                    "-o", exe, src, *extra_sources], check=True, timeout=300)
    return exe
