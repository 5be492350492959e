"""Issue 14 item 5: no decode step of the server, nor of anything the serving helpers run on their
threads, runs with autograd on (a graph per step costs memory and time for nothing)."""

from __future__ import annotations

import httpx
import torch
from fastapi import FastAPI

from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.runner import observe_forward
from course.serving.testing import chatty_tiny_model


def test_no_forward_pass_of_the_server_runs_with_gradients():
    lm = chatty_tiny_model(seed=8)
    modes = []
    handle = observe_forward(lm.model, lambda _: modes.append(torch.is_grad_enabled()))  # the lean runner's passes
    try:
        with BackgroundServer(create_app(engine=Engine(lm, max_model_len=256), model_name="m")) as server:
            body = {"model": "m", "prompt": "abc", "max_tokens": 5, "ignore_eos": True}
            assert httpx.post(server.base_url + "/completions", json=body, timeout=30).status_code == 200
            body["stream"] = True
            assert "[DONE]" in httpx.post(server.base_url + "/completions", json=body, timeout=30).text
    finally:
        handle()
    assert len(modes) >= 10 and not any(modes), modes


def test_helper_threads_start_without_autograd():
    app = FastAPI()

    @app.get("/async-mode")  # an async route runs on the server's own thread
    async def async_mode():
        return {"grad": torch.is_grad_enabled()}

    with BackgroundServer(app) as server:
        assert httpx.get(server.url + "/async-mode", timeout=10).json() == {"grad": False}

    async def coroutine():
        return torch.is_grad_enabled()

    assert run_sync(coroutine()) is False
    assert torch.is_grad_enabled(), "the caller's own thread is left as it was"
