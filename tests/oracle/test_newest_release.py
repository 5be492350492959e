"""The newest release (vLLM 0.34.0 today, :data:`course.vllm_release.NEWEST`), checked without running it.

No CPU build of it exists that starts here, so the course checks its facts against its Python sources
from the official wheel on PyPI (downloaded once into ``.vllm-sources/``, ignored by git; skipped, saying
so, when PyPI cannot be reached):

* the files the course cites are byte-identical to the wheel's RECORD (``vllm-0.34.0-sources.json``, as
  ``vllm-0.32.0-sources.json`` is for the runnable release), and every path the course cites is in the
  manifest of one of its two releases;
* the source drift tests (``tests/oracle/sources/``) pass against that release's code, in a process of
  their own with its sources first on the path (this session has the runnable release imported).
"""

from __future__ import annotations

import json
import sys

import pytest

from course import vllm_bump
from course.vllm_release import GPU_VLLM_VERSION, VLLM_VERSION

MANIFEST = vllm_bump.manifest_path(GPU_VLLM_VERSION)


@pytest.fixture(scope="module")
def sources():
    """The newest release's sources (the folder holding ``vllm/``), downloaded on first use."""
    try:
        return vllm_bump.fetch_sources(GPU_VLLM_VERSION)
    except vllm_bump.SourcesUnavailable as err:
        pytest.skip(f"vLLM {GPU_VLLM_VERSION}'s facts were NOT checked against its sources: {err}")


def _manifest(version: str) -> dict[str, str]:
    return json.loads(vllm_bump.manifest_path(version).read_text())["files"]


def test_the_manifest_is_the_official_wheels_record(sources):
    record = vllm_bump.record(sources)
    for path, expected in _manifest(GPU_VLLM_VERSION).items():
        assert record.get(path) == expected, f"{path}: the manifest differs from the wheel's RECORD"


def test_the_cited_files_read_are_the_official_ones(sources):
    for path, expected in _manifest(GPU_VLLM_VERSION).items():
        assert vllm_bump.record_hash((sources / path).read_bytes()) == expected, f"{path} differs from the wheel"


def test_every_cited_path_is_in_a_named_releases_manifest(sources):
    """A path cited for the newest release only (the extensible KV cache's) must be in its manifest."""
    cited = set(vllm_bump.citations(()))
    named = set(_manifest(VLLM_VERSION)) | set(_manifest(GPU_VLLM_VERSION))
    in_newest = {path for path in cited if (sources / path).exists()}
    assert in_newest <= set(_manifest(GPU_VLLM_VERSION)), (
        f"add to {MANIFEST.name} (bin/vllm-bump {GPU_VLLM_VERSION} --write-manifest): "
        f"{sorted(in_newest - set(_manifest(GPU_VLLM_VERSION)))}"
    )
    assert cited <= named, f"cited in neither named release: {sorted(cited - named)}"


def test_the_newest_releases_facts_against_its_own_code(sources):
    """tests/oracle/sources with vLLM 0.34.0's sources first on the path (bin/vllm-bump runs the same)."""
    result = vllm_bump.run_source_drift_tests(GPU_VLLM_VERSION, python=sys.executable)
    assert result.returncode == 0, (
        f"vLLM {GPU_VLLM_VERSION}'s own code disagrees with the course: {result.summary}\n"
        + "\n".join(result.failed)
        + "\n"
        + result.output[-4000:]
    )
