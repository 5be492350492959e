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

# The tests that take a few seconds per module and run no notebook, grade nothing and serve from no
# other process: the inner loop for a maintainer changing course/, course/serving/, course/sim/,
# course/kv/, autograder/ or benchmarks/ (`bin/test -m fast`, under a minute on a quiet 2-core machine;
# README, "For maintainers"). The serving ones drive the engine by hand or serve it from a thread of
# the test process; test_cli.py runs the console scripts' --help and one engine-core process that
# refuses a bad argument at once. Listed here rather than marked in each file so that a module is
# added in one place.
FAST_MODULES = {
    "test_autograder_cli.py",
    "test_autograder_collect_repair.py",
    "test_benchmark_processes.py",
    "test_capacity.py",
    "test_cli.py",
    "test_cuda_graphs.py",
    "test_diagrams.py",
    "test_env.py",
    "test_grading_helpers.py",
    "test_hardware_geometry_roofline.py",
    "test_kv.py",
    "test_kv_properties.py",
    "test_kv_releases.py",
    "test_kv_vllm.py",
    "test_models.py",
    "test_prose_model.py",
    "test_quantize.py",
    "test_serving_aborts.py",
    "test_serving_admission.py",
    "test_serving_engine.py",
    "test_serving_grad.py",
    "test_serving_runner.py",
    "test_serving_sampling.py",
    "test_sim.py",
    "test_sim_cost.py",
    "test_sim_disagg.py",
    "test_sim_fidelity_replay.py",
    "test_sim_fleet.py",
    "test_sim_parallel.py",
    "test_sim_properties.py",
    "test_sim_rules.py",
    "test_sim_speculative.py",
    "test_trace_metrics.py",
    "test_vllm_lab.py",
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
