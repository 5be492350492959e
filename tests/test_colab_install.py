"""Colab: the setup cell installs only what Colab lacks, fails with the course's fix, and is pinned.

* The setup cell, run as in Colab with an install that fails, prints the course's fix message
  (not pip's CalledProcessError traceback). Offline and fast.
* Notebooks, README badges and the hidden-test download all use one release tag, v<VERSION>.
* ``check_colab()``'s download, offline, says what to do instead of ending in a bare URLError.
* Behind ``COURSE_TEST_COLAB_INSTALL=1`` (it downloads about 150 MB from PyPI the first time and
  takes a few minutes): a virtual environment holding Colab's published package versions
  (tests/fixtures/colab/pip-freeze.txt) gets ``pip install --dry-run --report`` of what the setup
  cell installs, and nothing that Colab ships may change. Skipped when PyPI is unreachable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from course import env

ROOT = Path(__file__).resolve().parents[1]
COLAB_FREEZE = Path(__file__).parent / "fixtures" / "colab" / "pip-freeze.txt"
# Colab's torch is a CPU/CUDA wheel from download.pytorch.org, not PyPI: the fake environment gets
# its metadata only (enough for pip to see it installed), at Colab's version.
COLAB_TORCH = "2.11.0+cpu"


def colab_packages() -> dict[str, str]:
    """Normalised name -> version of every package in Colab's published list that has a version."""
    packages = {}
    for line in COLAB_FREEZE.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            packages[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return packages


def test_setup_cell_failure_prints_the_course_fix_not_a_traceback():
    """Issue 11: a failing install in Colab ends in the fix message, without CalledProcessError."""
    source = env.bootstrap_cell_source().replace(env.pip_spec(), "llm-serving-course @ file:///nonexistent/course")
    fake_colab = (
        "import importlib.util, sys, types\n"
        "sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'course' else real(name, *a)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", fake_colab + source],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert result.returncode != 0
    assert env.INSTALL_FIX in result.stderr, result.stderr[-2000:]
    assert "CalledProcessError" not in result.stderr and "nonexistent" in result.stderr, result.stderr[-2000:]


def test_notebooks_badges_and_hidden_tests_use_one_release_tag(monkeypatch):
    """The setup cells install from v<VERSION>, the badges open v<VERSION>, check downloads v<VERSION>."""
    import course
    from autograder import check, notebooks

    assert env.REPO_REF == f"v{env.VERSION}" == f"v{course.__version__}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "course.env.VERSION"}
    for path in sorted(ROOT.glob("*/*/*.ipynb")):
        if path.parts[-3] not in ("solutions", "modules"):
            continue
        first = next(c for c in notebooks.read(path).cells if c.cell_type == "code")
        assert f'@{env.REPO_REF}"' in first.source, f"{path.relative_to(ROOT)}: setup cell not at {env.REPO_REF}"
    from autograder.release import colab_badge_pattern

    refs = set(colab_badge_pattern().findall((ROOT / "README.md").read_text()))
    assert refs == {env.REPO_REF}, f"README's Colab badges open {refs}, not the release tag {env.REPO_REF}"

    asked = []

    def offline(url, timeout):
        asked.append(url)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(check.DownloadFailed) as err:
        check.download_course(cache=Path("/nonexistent-cache"))
    assert asked == [f"{env.REPO_URL}/archive/{env.REPO_REF}.tar.gz"]
    message = str(err.value)
    assert "internet access" in message and "source=" in message and "name resolution" in message


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10):
            return True
    except OSError:
        return False


@pytest.mark.skipif(
    os.environ.get("COURSE_TEST_COLAB_INSTALL") != "1",
    reason="downloads Colab's package versions from PyPI; set COURSE_TEST_COLAB_INSTALL=1 (README, Testing)",
)
def test_colab_install_changes_nothing_that_colab_ships(tmp_path):
    """In an environment with Colab's versions, the setup cell's install adds the course and nothing else."""
    if not _pypi_reachable():
        pytest.skip("PyPI is unreachable from this machine")
    colab = colab_packages()
    venv = tmp_path / "colab"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    constraints = tmp_path / "colab-constraints.txt"
    constraints.write_text("\n".join(f"{name}=={version}" for name, version in colab.items() if name != "torch"))
    # Everything the course imports at run time, at Colab's versions (their dependencies too).
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0] for req in declared["dependencies"]]
    needed += [re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0] for req in declared["optional-dependencies"]["colab"]]
    needed = [name for name in needed if name != "torch"]
    missing = [name for name in needed if re.sub(r"[-_.]+", "-", name).lower() not in colab]
    assert not missing, f"the course needs {missing}, which Colab does not ship: the setup cell would add them"
    subprocess.run([*pip, "install", "-c", str(constraints), *needed], check=True, timeout=1200)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    torch_info = Path(purelib) / f"torch-{COLAB_TORCH}.dist-info"
    torch_info.mkdir()
    (torch_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {COLAB_TORCH}\n")
    (torch_info / "INSTALLER").write_text("pip\n")
    (torch_info / "RECORD").write_text("")

    # What the setup cell runs, with this checkout in place of the git URL.
    report = tmp_path / "report.json"
    course_spec = env.pip_spec().replace(f"git+{env.REPO_URL}@{env.REPO_REF}", ROOT.as_uri())
    subprocess.run(
        [*pip, "install", "--dry-run", "--report", str(report), course_spec, f"torch=={COLAB_TORCH}"],
        check=True,
        timeout=600,
    )
    installs = {
        re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    changed = {name: (colab[name], version) for name, version in installs.items() if name in colab}
    assert not changed, f"the setup cell would change what Colab ships (Colab's version, new version): {changed}"
    assert set(installs) == {env.DIST_NAME}, f"the setup cell would add more than the course: {installs}"

    # The course's widgets work with Colab's ipywidgets 7.7.1 (module 4's explorer).
    subprocess.run([*pip, "install", "--no-deps", str(ROOT)], check=True, timeout=600)
    probe = (
        "from course import kv\n"
        "view = kv.explorer('Llama-3-8B', context=8192, batch=8, gpu='L4', interactive=True)\n"
        "assert type(view).__name__ == 'interactive', view\n"
        "import ipywidgets; print(ipywidgets.__version__)\n"
    )
    result = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "Agg"}, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith(colab["ipywidgets"]), result.stdout
