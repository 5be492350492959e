"""The oracle tests: the course's vLLM facts against vLLM's own code, in the oracle environment.

They run with the interpreter of ``bin/vllm-env`` (vLLM's CPU build and this checkout of the course in
one environment), never in the course's own ``.venv``: ``bin/test`` runs them after the main suite,
and ``.vllm-venv/bin/python -m pytest -o addopts= tests/oracle`` runs them alone.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

from course.vllm_release import CPU_DISTRIBUTION, VLLM_VERSION


def pytest_report_header(config) -> str:
    return f"oracle: {CPU_DISTRIBUTION} {_installed_version()} (the course names {VLLM_VERSION})"


def _installed_version() -> str:
    try:
        return importlib.metadata.version(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@pytest.fixture(scope="session", autouse=True)
def installed_vllm():
    """The vLLM these tests read: the release the course names, or a clear failure saying what to do."""
    installed = _installed_version()
    if installed == "not installed":
        pytest.exit(
            "vLLM's CPU build is not installed in this interpreter: run the oracle tests with the environment "
            "bin/vllm-env builds (.vllm-venv/bin/python -m pytest -o addopts= tests/oracle)",
            returncode=2,
        )
    import vllm

    return vllm


# tests/oracle/sources reads a release's sources, not the installed build: test_newest_release.py (and
# bin/vllm-bump) run it in a process of its own with those sources first on the path.
collect_ignore = [] if os.environ.get("COURSE_VLLM_SOURCES_VERSION") else ["sources"]
