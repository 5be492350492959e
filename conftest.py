"""Test-suite settings for tests/ and the notebooks in solutions/: quick mode for notebooks, a
headless matplotlib, no model hub, tools on PATH, and a report of each notebook's execution time."""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# Before anything imports course, torch or matplotlib: kernels started by nbval and nbgrader
# inherit this environment.
os.environ["COURSE_QUICK"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the machines have no model hub; never wait for one
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

ROOT = Path(__file__).resolve().parent

_notebook_seconds: dict[str, float] = defaultdict(float)

# The library's own tests, which run no notebook, start no server process and grade nothing: the
# inner loop for a maintainer changing course/ (`bin/test -m fast`, well under a minute). Listed
# here rather than marked in each file so that a new library test module is added in one place.
FAST_MODULES = {
    "test_grading_helpers.py",
    "test_hardware_geometry_roofline.py",
    "test_kv.py",
    "test_kv_properties.py",
    "test_sim.py",
    "test_sim_properties.py",
    "test_trace_metrics.py",
    "test_workload.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: a library test (no notebook, server or grading run); bin/test -m fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.fspath.basename in FAST_MODULES:
            item.add_marker("fast")


def pytest_runtest_setup(item):
    item._course_started = time.perf_counter()


def pytest_runtest_teardown(item):
    started = getattr(item, "_course_started", None)
    if started is not None and item.fspath.ext == ".ipynb":
        _notebook_seconds[os.path.relpath(str(item.fspath), ROOT)] += time.perf_counter() - started


def pytest_terminal_summary(terminalreporter):
    if not _notebook_seconds:
        return
    terminalreporter.section("notebook execution times (quick mode, COURSE_QUICK=1)")
    for path, seconds in sorted(_notebook_seconds.items()):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
