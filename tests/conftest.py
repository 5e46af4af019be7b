"""pytest configuration for the resident_pg test suite.

Backend under test: env var RESIDENT_TEST_BACKEND (default "resident"); set it to
"gloo" to run the suite against gloo.  Tests of resident-only behaviour carry the
``resident_only`` marker and are skipped for any other backend.
"""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_harness  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped when torch.cuda.is_available() is False)")
    config.addinivalue_line("markers", "slow: long-running test")
    config.addinivalue_line(
        "markers",
        "resident_only: tests behaviour specific to the resident backend "
        "(skipped when RESIDENT_TEST_BACKEND is not 'resident')",
    )


def pytest_report_header(config):
    return f"resident_pg tests: backend under test = {dist_harness.BACKEND!r} (RESIDENT_TEST_BACKEND)"


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA device (torch.cuda.is_available() is False)")
    skip_res = pytest.mark.skip(
        reason=f"resident-only behaviour; backend under test is {dist_harness.BACKEND!r}"
    )
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(skip_gpu)
        if "resident_only" in item.keywords and not dist_harness.IS_RESIDENT:
            item.add_marker(skip_res)


_IMPORT_CHECK = {}


@pytest.fixture(autouse=True, scope="session")
def _backend_importable():
    """Fail fast (once, without spawning ranks) if resident_pg cannot be imported."""
    if dist_harness.IS_RESIDENT and "result" not in _IMPORT_CHECK:
        p = subprocess.run(
            [sys.executable, "-c", "import resident_pg, torch.distributed as d; print(d.Backend.backend_list)"],
            capture_output=True, text=True, timeout=120,
        )
        _IMPORT_CHECK["result"] = (p.returncode, p.stdout + p.stderr)
    yield


@pytest.fixture(autouse=True)
def _require_backend(_backend_importable):
    if dist_harness.IS_RESIDENT:
        rc, out = _IMPORT_CHECK["result"]
        if rc != 0:
            pytest.fail(
                "RESIDENT_TEST_BACKEND=resident but `import resident_pg` fails "
                "(set RESIDENT_TEST_BACKEND=gloo to test the harness against gloo):\n" + out[-3000:],
                pytrace=False,
            )


@pytest.fixture
def shm_snapshot():
    """Names of /dev/shm entries starting with 'resident' before the test."""
    return set(dist_harness.list_shm())


def pytest_runtest_logreport(report):
    """With RESIDENT_TESTS_FAIL_LOG set, each failure's text is appended to that file as it
    happens, not only in pytest's summary: a run cut off by a time bound (the GPU machine's
    stages) still shows why its tests failed."""
    path = os.environ.get("RESIDENT_TESTS_FAIL_LOG")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n\n")
