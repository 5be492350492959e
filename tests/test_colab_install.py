"""Colab: the setup cell installs only what Colab lacks, fails with the course's fix, and is pinned.

* The setup cell, run as in Colab with an install that fails, prints the course's fix message
  (not pip's CalledProcessError traceback). Offline and fast.
* Notebooks, README badges and the hidden-test download all use one release tag, v<VERSION>.
* ``check_colab()``'s download, offline, says what to do instead of ending in a bare URLError.
* Behind ``COURSE_TEST_COLAB_INSTALL=1`` (it downloads about 150 MB from PyPI the first time and
  takes a few minutes per image): a virtual environment holding the package versions of a Colab
  image (tests/fixtures/colab/pip-freeze-*.txt) gets ``pip install --dry-run --report`` of what the
  setup cell installs. On today's image (August 2026, transformers 5.15) nothing that Colab ships may
  change; on January 2026's (transformers 4.57: before 5.15 transformers' DeepSeek-V3 cache holds
  full per-head keys and values, not MLA's latent that module 4 checks) only the transformers stack
  may be upgraded. And the course's model and KV tests and module 4 pass with the oldest
  transformers it supports (5.15). Skipped when PyPI is unreachable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from course import env

ROOT = Path(__file__).resolve().parents[1]
COLAB_IMAGES = sorted((Path(__file__).parent / "fixtures" / "colab").glob("pip-freeze-*.txt"))
# What the setup cell may change per image: nothing on an image with a supported transformers; on
# an image from before transformers 5.15 the transformers stack (5.x needs huggingface_hub 1.x). The
# fake environment holds only what the course needs, so what an upgrade pulls in beyond that (the
# hub's own command-line dependencies) is not judged: Colab has those already.
# Measured on 2026-12-01: January's image also gets newer click, hf-xet and idna, which today's
# huggingface_hub needs.
MAY_CHANGE = {
    "pip-freeze-2026-01": {"transformers", "huggingface-hub", "tokenizers", "safetensors", "click", "hf-xet", "idna"}
}
# The oldest transformers the course supports, with the huggingface_hub Colab ships beside it (August 2026).
OLDEST_SUPPORTED = ["transformers==5.15.0", "huggingface-hub==1.27.0", "tokenizers==0.22.2"]
RUN_SLOW = pytest.mark.skipif(
    os.environ.get("COURSE_TEST_COLAB_INSTALL") != "1",
    reason="downloads Colab's package versions from PyPI; set COURSE_TEST_COLAB_INSTALL=1 (docs/maintainers.md)",
)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def colab_packages(freeze: Path) -> dict[str, str]:
    """Normalised name -> version of every package in a Colab image's published list.

    Packages installed from a URL (Colab's torch wheels from download.pytorch.org) get the version
    in the wheel's file name.
    """
    packages = {}
    for line in freeze.read_text().splitlines():
        pinned = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        wheel = re.match(r"^([A-Za-z0-9_.\-]+) @ \S+/[A-Za-z0-9_.]+-([^-/]+)-[^/]+\.whl$", line)
        if pinned:
            packages[normalise(pinned.group(1))] = pinned.group(2)
        elif wheel:
            packages[normalise(wheel.group(1))] = urllib.parse.unquote(wheel.group(2))
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


@RUN_SLOW
@pytest.mark.parametrize("freeze", COLAB_IMAGES, ids=lambda path: path.stem)
def test_colab_install_changes_nothing_that_colab_ships(freeze, tmp_path):
    """With a Colab image's package versions, the setup cell's install adds the course and changes nothing else."""
    if not _pypi_reachable():
        pytest.skip("PyPI is unreachable from this machine")
    colab = colab_packages(freeze)
    colab_torch = colab["torch"]  # a CPU/CUDA wheel from download.pytorch.org: metadata only, below
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
    missing = [name for name in needed if normalise(name) not in colab]
    assert not missing, f"the course needs {missing}, which Colab does not ship: the setup cell would add them"
    subprocess.run([*pip, "install", "-c", str(constraints), *needed], check=True, timeout=1200)
    listing = [python, "-m", "pip", "--disable-pip-version-check", "list", "--format=json"]
    listed = subprocess.run(listing, capture_output=True, text=True, check=True).stdout
    present = {normalise(item["name"]): item["version"] for item in json.loads(listed)}
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    torch_info = Path(purelib) / f"torch-{colab_torch}.dist-info"
    torch_info.mkdir()
    (torch_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {colab_torch}\n")
    (torch_info / "INSTALLER").write_text("pip\n")
    (torch_info / "RECORD").write_text("")

    # What the setup cell runs, with this checkout in place of the git URL.
    report = tmp_path / "report.json"
    course_spec = env.pip_spec().replace(f"git+{env.REPO_URL}@{env.REPO_REF}", ROOT.as_uri())
    subprocess.run(
        [*pip, "install", "--dry-run", "--report", str(report), course_spec, f"torch=={colab_torch}"],
        check=True,
        timeout=600,
    )
    installs = {
        normalise(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    changed = {name: (present[name], version) for name, version in installs.items() if name in present}
    allowed = MAY_CHANGE.get(freeze.stem)
    if allowed is None:  # an image the course supports as it is: only the course is installed
        assert not changed, f"the setup cell would change what Colab ships (Colab's version, new version): {changed}"
        assert set(installs) == {env.DIST_NAME}, f"the setup cell would add more than the course: {sorted(installs)}"
    else:
        unexpected = {name: versions for name, versions in changed.items() if name not in allowed}
        assert not unexpected, f"the setup cell would change more than the transformers stack: {unexpected}"
        assert "transformers" in changed, "an image older than the transformers floor must get it upgraded"

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


@RUN_SLOW
def test_the_course_runs_with_the_oldest_transformers_it_supports(tmp_path):
    """The transformers floor is real: the model and KV tests and module 4 pass with transformers 5.15."""
    if not _pypi_reachable():
        pytest.skip("PyPI is unreachable from this machine")
    assert OLDEST_SUPPORTED[0] == f"transformers=={env.MIN_VERSIONS['transformers']}.0"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers>={env.MIN_VERSIONS['transformers']}" in [d.split("#")[0].strip() for d in declared]
    target = tmp_path / "oldest-transformers"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *OLDEST_SUPPORTED],
        check=True,
        timeout=600,
    )
    run_env = {**os.environ, "PYTHONPATH": str(target)}
    probe = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        env=run_env,
    )
    assert probe.stdout.strip() == OLDEST_SUPPORTED[0].split("==")[1], probe.stderr[-2000:]
    tests = [ROOT / "tests" / "test_models.py", ROOT / "tests" / "test_kv.py", ROOT / "solutions" / "m4_kv_calculator"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *map(str, tests)],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=ROOT,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:]
