"""The source drift tests: the facts the course states for its newest vLLM release, against that release's
own Python code, which does not run on this machine (no CUDA build imports here).

They run in the oracle environment with the release's sources from PyPI first on the path (vLLM's Python
files import beside the oracle's dependencies; code whose module needs CUDA is compiled from the source
file instead, :func:`source_function`). ``tests/oracle/test_newest_release.py`` runs them so from the
oracle stage of ``bin/test``; ``bin/vllm-bump VERSION`` runs them against a newer release to list the facts
it moves. By hand::

    PYTHONPATH=.vllm-sources/vllm-0.34.0 COURSE_VLLM_SOURCES_VERSION=0.34.0 \\
        .vllm-venv/bin/python -m pytest -o addopts= tests/oracle/sources
"""

from __future__ import annotations

import os

import pytest

from course.vllm_release import GPU_VLLM_VERSION

# The release whose sources are on the path: the course's newest, or the one bin/vllm-bump checks.
SOURCES_VERSION = os.environ.get("COURSE_VLLM_SOURCES_VERSION", GPU_VLLM_VERSION)


@pytest.fixture(scope="session", autouse=True)
def installed_vllm():
    """The vLLM these tests read: the release's sources, not the oracle's installed CPU build."""
    import vllm

    if vllm.__version__ != SOURCES_VERSION:
        pytest.exit(
            f"tests/oracle/sources read vLLM {SOURCES_VERSION}'s sources, but `import vllm` found {vllm.__version__} "
            f"({vllm.__file__}): run them through tests/oracle/test_newest_release.py or bin/vllm-bump, which put "
            "the sources first on PYTHONPATH",
            returncode=2,
        )
    return vllm
