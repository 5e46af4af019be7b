"""Builds a standalone C++ program of the repository (a floor or a probe) for its test: g++
(or $CXX) with warnings as errors; the test is skipped where there is no compiler."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def build_cxx(tmp_path_factory, src, name):
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    exe = str(tmp_path_factory.mktemp(name) / name)
    subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-pthread", "-o", exe, src],
                   check=True, timeout=300)
    return exe
