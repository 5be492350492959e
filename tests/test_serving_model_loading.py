"""``course serve --model`` serves the model it was asked for, or fails saying why.

A local model folder loads whatever the Hub settings say (with ``HF_HUB_OFFLINE=1`` the loader used
to fall back to the tiny model and serve it under the tiny model's name); a model that cannot be
loaded is an error naming it and the stand-in, unless the fallback is asked for.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from course import models


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved model that is not the tiny one (another seed: other weights)."""
    return models.save_tiny_model(tmp_path_factory.mktemp("models") / "my-model", seed=7)


@pytest.fixture
def hub_off(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_local_folder_loads_whatever_the_hub_settings(folder, hub_off, capsys):
    lm = models.load_model(str(folder), device="cpu")
    assert lm.name == str(folder) and "local folder" in lm.source, lm.describe()
    saved = models.build_tiny_model(seed=7)
    ids = saved.random_ids(1, 8)
    with torch.inference_mode():
        assert torch.equal(lm.model(input_ids=ids).logits, saved.model(input_ids=ids).logits)
    assert models.TINY_NAME not in capsys.readouterr().out


def test_a_model_that_cannot_be_loaded_is_an_error_naming_both(hub_off, tmp_path, capsys):
    for name in ("someone/no-such-model", str(tmp_path)):  # a Hub id with the Hub off; a folder with no model
        with pytest.raises(models.ModelUnavailable) as raised:
            models.load_model(name, device="cpu")
        message = str(raised.value)
        assert name in message and models.TINY_NAME in message and "--allow-fallback" in message, message
    lm = models.load_model("someone/no-such-model", device="cpu", fallback=True)  # asked for: allowed, and said
    out = capsys.readouterr().out
    assert lm.name == models.TINY_NAME and "someone/no-such-model" in out and "HF_HUB_OFFLINE is set" in out, out


def test_a_hub_failure_for_a_named_model_is_an_error(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(name, device, dtype=None, source=None):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(models, "load_hub_model", unreachable)
    with pytest.raises(models.ModelUnavailable, match="org/model was asked for but cannot be loaded: could not load"):
        models.load_model("org/model", device="cpu")
    assert models.load_model(device="cpu", allow_hub=True, verbose=False).name == models.TINY_NAME  # the runtime's pick


def _serve(arguments: list[str], env: dict) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "course.cli", "serve", "--port", str(port), "--threads", "1"]
    command += ["--engine-core", "thread", *arguments]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return process, port


def test_course_serve_serves_the_folder_or_fails_naming_both(folder):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process, port = _serve(["--model", str(folder)], env)
    try:
        deadline, ids = time.monotonic() + 120, None
        while ids is None:
            assert process.poll() is None, process.stdout.read()[-2000:]
            assert time.monotonic() < deadline, "course serve did not start"
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                ids = [card["id"] for card in reply.json()["data"]]
            except httpx.HTTPError:
                time.sleep(0.3)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert ids == [str(folder)], ids
    process, _ = _serve(["--model", "someone/no-such-model"], env)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 1, out[-2000:]
    assert "someone/no-such-model" in out and models.TINY_NAME in out and "Traceback" not in out, out[-2000:]
