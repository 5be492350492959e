"""course.setup(): locally a no-op that reports the runtime; in Colab it installs the course
(torch untouched); on an unsupported runtime it fails with the fix in the message."""

import subprocess
import sys
import types

import pytest

import course
from course import env


@pytest.fixture
def fake_colab(monkeypatch):
    """Pretend to be a Colab kernel: it has google.colab imported."""
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert env.in_colab()


@pytest.fixture
def pip_calls(monkeypatch):
    """Intercept subprocess.run; record each command and the constraints it passed to pip."""
    calls = []
    real_run = subprocess.run

    def fake_run(command, *args, **kwargs):
        if "pip" not in command:
            return real_run(command, *args, **kwargs)
        constraints = None
        if "--constraint" in command:
            with open(command[command.index("--constraint") + 1]) as handle:
                constraints = handle.read()
        calls.append({"command": list(command), "constraints": constraints})
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    return calls


def test_setup_locally_installs_nothing_and_reports_the_runtime(capsys, pip_calls):
    info = course.setup()
    out = capsys.readouterr().out
    assert pip_calls == []
    assert f"Python {info.python}" in out and f"torch {info.torch}" in out and "device: cpu" in out
    assert info.quick  # the test suite runs notebooks in quick mode
    assert not info.colab


def test_setup_cell_in_colab_installs_the_course_from_the_configured_repository(
    fake_colab, pip_calls, monkeypatch, capsys
):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "course" else real_find_spec(name, *a)
    )
    namespace: dict = {}
    exec(env.bootstrap_cell_source(), namespace)  # the exact first cell of every notebook

    torch_version = env.installed_version("torch")
    install = pip_calls[0]["command"]
    assert install[:5] == [sys.executable, "-m", "pip", "install", "-q"]
    assert env.pip_spec() in install and env.REPO_URL in env.pip_spec()
    assert f"torch=={torch_version}" in install, "Colab's torch must be pinned, never replaced"
    assert len(pip_calls) == 1, "nothing was missing after the install, so setup() must not pip again"
    assert namespace["runtime"].colab
    assert "Colab" in capsys.readouterr().out


def test_setup_in_colab_installs_missing_dependencies_and_pins_torch(fake_colab, pip_calls, monkeypatch):
    real = env.installed_version
    monkeypatch.setattr(env, "installed_version", lambda name: None if name == "tqdm" else real(name))
    with pytest.raises(env.UnsupportedRuntimeError, match="tqdm cannot be found.*Restart session"):
        course.setup()  # tqdm stays "missing" after the fake pip call
    # ... but the install was attempted, from the repository, with torch held at its version.
    call = pip_calls[0]
    assert env.pip_spec() in call["command"]
    assert call["constraints"].strip() == f"torch=={real('torch')}"


def test_failed_colab_install_names_the_fix(fake_colab, monkeypatch):
    monkeypatch.setattr(env, "_missing_distributions", lambda: ["tqdm"])
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(a[0], 1, "", "Could not resolve host: github.com"),
    )
    with pytest.raises(env.UnsupportedRuntimeError, match="internet access.*rerun the setup cell"):
        env.install_course_in_colab()


def test_old_transformers_is_refused_with_the_command_that_fixes_it(monkeypatch):
    real = env.installed_version
    monkeypatch.setattr(env, "installed_version", lambda name: "4.46.0" if name == "transformers" else real(name))
    with pytest.raises(env.UnsupportedRuntimeError) as err:
        course.setup()
    message = str(err.value)
    assert "transformers 4.46.0 is older than 5.15" in message
    assert "pip install -U 'transformers>=5.15'" in message


def test_in_colab_the_fix_mentions_restarting_the_session(fake_colab):
    problems = env.version_problems(
        {"torch": "2.1.0", "transformers": "5.15.0", "numpy": "2.1.3", "matplotlib": "3.10"}, (3, 13)
    )
    assert len(problems) == 1 and "torch 2.1.0 is older than 2.4" in problems[0] and "Restart session" in problems[0]


def test_missing_package_and_old_python_are_reported():
    problems = env.version_problems(
        {"torch": None, "transformers": "5.24.0", "numpy": "2.0", "matplotlib": "3.9"}, (3, 10)
    )
    assert any("Python 3.10 is too old" in p for p in problems)
    assert any("torch is not installed: run `pip install 'torch>=2.4'`" in p for p in problems)


def test_colab_versions_of_aug_2026_are_supported():
    # googlecolab/backend-info: Python 3.13, torch 2.11.0+cu128, transformers 5.15.0, numpy 2.1.3
    versions = {"torch": "2.11.0+cu128", "transformers": "5.15.0", "numpy": "2.1.3", "matplotlib": "3.10.0"}
    assert env.version_problems(versions, (3, 13)) == []


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, False),
        ({"COURSE_QUICK": "1"}, True),
        ({"NBGRADER_EXECUTION": "autograde"}, True),
        ({"NBGRADER_EXECUTION": "autograde", "COURSE_QUICK": "0"}, False),
    ],
)
def test_quick_mode(monkeypatch, variables, expected):
    monkeypatch.delenv("COURSE_QUICK", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    assert env.quick_mode() is expected


def test_runtime_requirements_come_from_the_installed_distribution():
    names = env.runtime_requirements()
    assert {"torch", "transformers", "fastapi", "openai"} <= set(names)
    assert "nbgrader" not in names and "jupyterlab" not in names  # extras are not runtime needs
