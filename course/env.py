"""Runtime detection and the setup that every notebook's first cell runs.

The repository URL that Colab installs from is configured here and nowhere else: the
notebooks' setup cells are rendered from :func:`bootstrap_cell_source` (``autograder release``
rewrites them, and a test checks that they agree).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# --- the one place that says where the course lives -------------------------------------------
# VERSION is the course's release (pyproject.toml reads it from here). Colab's setup cell installs
# the library from the git tag REPO_REF, and `autograder check` downloads the hidden tests from the
# same tag, so a learner's notebook and the tests that grade it come from one release. Cutting a
# release (docs/maintainers.md, "Cutting a release"): bump VERSION, run `autograder release`, commit, tag.
VERSION = "0.1.0"
REPO_URL = "https://github.com/llm-serving-course/llm-serving-course"
REPO_REF = f"v{VERSION}"
DIST_NAME = "llm-serving-course"

# What to do when the install in Colab fails: the setup cell prints this (it runs before the course
# can be imported), and so does install_course_in_colab().
INSTALL_FIX = (
    "Installing the course library failed (pip's last lines are above). Check the runtime's internet "
    "access (Runtime > Disconnect and delete runtime, then reconnect) and rerun the setup cell; if it still "
    f"fails, report the lines above at {REPO_URL}/issues."
)

# Oldest versions the course code is tested with. transformers 5.15 (Colab's since August 2026) is the
# first whose DeepSeek-V3 cache stores MLA's latent, which module 4 checks the calculator against;
# 5.0-5.14 store full per-head keys and values there (tests/test_colab_install.py runs the checks on 5.15).
MIN_PYTHON = (3, 11)
MIN_VERSIONS = {"torch": "2.4", "transformers": "5.15", "numpy": "1.26", "matplotlib": "3.8"}

# What the library imports at run time, by distribution name; used when the course itself is
# not installed as a distribution (imported from a clone), else its declared requirements win.
RUNTIME_DISTRIBUTIONS = (
    "torch",
    "transformers",
    "tokenizers",
    "numpy",
    "matplotlib",
    "tqdm",
    "packaging",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "httpx",
    "openai",
    "prometheus_client",
)

# Environment that keeps notebook output clean: progress bars and library warnings go to
# stderr, and stderr in a graded cell would cost points under nbgrader.
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_ETAG_TIMEOUT": "10",
}


class UnsupportedRuntimeError(RuntimeError):
    """The runtime cannot run the course; the message names the fix."""


@dataclass(frozen=True)
class RuntimeInfo:
    """What this runtime is, as printed by :func:`setup`."""

    python: str
    torch: str | None
    transformers: str | None
    device: str  # "cuda" or "cpu": where the course's measurements run
    device_name: str
    threads: int
    colab: bool
    quick: bool

    def summary(self) -> str:
        where = "Colab" if self.colab else platform.system() or "local"
        mode = "quick mode (smaller sweeps)" if self.quick else "full mode"
        return (
            f"Python {self.python} | torch {self.torch} | transformers {self.transformers} | "
            f"device: {self.device} ({self.device_name}, {self.threads} CPU threads) | {where} | {mode}"
        )


def in_colab() -> bool:
    """True inside Google Colab (its kernel imports ``google.colab`` at start)."""
    return "google.colab" in sys.modules


def quick_mode() -> bool:
    """True when notebooks should use their small sweeps: under tests and while autograding.

    ``COURSE_QUICK=1`` switches it on explicitly; nbgrader sets ``NBGRADER_EXECUTION`` while
    it autogrades or validates, and grading should not repeat minute-long measurements.
    """
    flag = os.environ.get("COURSE_QUICK", "").strip().lower()
    if flag in {"1", "true", "yes", "on"}:
        return True
    if flag in {"0", "false", "no", "off"}:
        return False
    return bool(os.environ.get("NBGRADER_EXECUTION"))


def pip_spec(extra: str = "colab") -> str:
    """The pip requirement that installs the course library from its repository."""
    return f"{DIST_NAME}[{extra}] @ git+{REPO_URL}@{REPO_REF}"


def bootstrap_cell_source() -> str:
    """Source of the first code cell of every notebook (the same everywhere).

    It needs no course code to run, so it can install the course where it is missing (Colab);
    locally the course is already installed by ``bin/lab`` and the cell only calls setup(). In
    Colab it installs only what Colab lacks: every dependency's floor is one Colab's packages meet
    (a test checks this against Colab's published package list), and the running torch is named
    as a requirement so pip can never replace it. A failed install ends in the course's fix
    message, not in a subprocess traceback.
    """
    return (
        "# SETUP: run this cell first. In Colab it installs the course library and nothing that Colab\n"
        "# already has (its torch, transformers and widgets stay); elsewhere it only checks the runtime.\n"
        "import importlib.metadata, importlib.util, subprocess, sys\n"
        'if "google.colab" in sys.modules and importlib.util.find_spec("course") is None:\n'
        f'    course_spec = "{pip_spec()}"\n'
        '    keep_torch = "torch==" + importlib.metadata.version("torch")\n'
        '    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", course_spec, keep_torch],\n'
        "                         capture_output=True, text=True)\n"
        "    if pip.returncode != 0:\n"
        '        print("\\n".join((pip.stderr or pip.stdout).strip().splitlines()[-8:]), file=sys.stderr)\n'
        f"        raise RuntimeError({INSTALL_FIX!r}) from None\n"
        "import course\n"
        "runtime = course.setup()"
    )


def installed_version(distribution: str) -> str | None:
    """Version string of an installed distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problems(versions: dict[str, str | None], python: tuple[int, int]) -> list[str]:
    """Problems that stop the course from running, each naming its fix; empty when all is well.

    Args:
        versions: distribution name -> installed version (None = missing).
        python: (major, minor) of the interpreter.
    """
    from packaging.version import Version

    fix_suffix = " (in Colab, then use Runtime > Restart session)" if in_colab() else ""
    problems = []
    if python < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        problems.append(
            f"Python {python[0]}.{python[1]} is too old: the course needs Python {need} or newer. "
            f"Create the environment with a newer Python (bin/lab picks python3.11+ automatically)."
        )
    for name, floor in MIN_VERSIONS.items():
        have = versions.get(name)
        if have is None:
            problems.append(f"{name} is not installed: run `pip install '{name}>={floor}'`{fix_suffix}.")
        elif Version(have).release < Version(floor).release:
            problems.append(
                f"{name} {have} is older than {floor}, the oldest the course supports: "
                f"run `pip install -U '{name}>={floor}'`{fix_suffix}."
            )
    return problems


def runtime_requirements() -> list[str]:
    """Distribution names the course needs at run time on this platform (no extras)."""
    try:
        declared = importlib.metadata.requires(DIST_NAME) or []
    except importlib.metadata.PackageNotFoundError:
        return list(RUNTIME_DISTRIBUTIONS)
    from packaging.requirements import Requirement

    names = []
    for line in declared:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(requirement.name)
    return names


def _missing_distributions() -> list[str]:
    return [name for name in runtime_requirements() if installed_version(name) is None]


def install_course_in_colab() -> None:
    """pip-install the course library from REPO_URL, keeping Colab's own torch.

    The running torch version is pinned through a constraints file, so pip can neither
    upgrade nor replace it (a CUDA torch reinstall costs minutes and breaks the session).
    """
    torch_version = installed_version("torch")
    command = [sys.executable, "-m", "pip", "install", "-q", pip_spec()]
    with tempfile.NamedTemporaryFile("w", suffix="-constraints.txt", delete=False) as pins:
        if torch_version:
            pins.write(f"torch=={torch_version}\n")
    command += ["--constraint", pins.name]
    print(f"Installing the course library from {REPO_URL}@{REPO_REF} (torch stays at {torch_version})...")
    result = subprocess.run(command, capture_output=True, text=True)
    os.unlink(pins.name)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise UnsupportedRuntimeError(f"pip exit code {result.returncode}:\n{tail}\n{INSTALL_FIX}")
    importlib.invalidate_caches()


def _apply_quiet_environment() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules:  # the env var is only read at import time
        sys.modules["transformers"].utils.logging.set_verbosity_error()


def cpu_name() -> str:
    """The processor's model name where the OS tells it (Linux), else its architecture."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.machine() or "CPU"


def runtime_info() -> RuntimeInfo:
    """Detect the runtime (imports torch)."""
    import torch

    if torch.cuda.is_available():
        device, device_name = "cuda", torch.cuda.get_device_name(0)
    else:
        device, device_name = "cpu", cpu_name()
    return RuntimeInfo(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=installed_version("transformers"),
        device=device,
        device_name=device_name,
        threads=torch.get_num_threads(),
        colab=in_colab(),
        quick=quick_mode(),
    )


def setup(*, seed: int = 0, verbose: bool = True) -> RuntimeInfo:
    """Prepare this runtime for a course notebook and say what it is.

    Locally this installs nothing. In Colab it installs the course library (with the
    dependencies Colab lacks) when something is missing, never touching torch. Then it checks
    the versions, quiets library logging, seeds torch and prints one line about the runtime.

    Raises:
        UnsupportedRuntimeError: with the fix in its message, when a version is too old or a
            dependency is missing.
    """
    if in_colab() and _missing_distributions():
        install_course_in_colab()
        if still_missing := _missing_distributions():
            raise UnsupportedRuntimeError(
                f"The course library was installed but {', '.join(still_missing)} cannot be found: "
                "use Runtime > Restart session, then rerun the setup cell."
            )
    versions = {name: installed_version(name) for name in MIN_VERSIONS}
    problems = version_problems(versions, sys.version_info[:2])
    if problems:
        raise UnsupportedRuntimeError("This runtime cannot run the course:\n- " + "\n- ".join(problems))
    _apply_quiet_environment()

    import torch

    torch.manual_seed(seed)
    from course import grading, plotting

    plotting.use_course_style()
    grading.announce_passing_tests()
    info = runtime_info()
    if verbose:
        print(info.summary())
    return info
