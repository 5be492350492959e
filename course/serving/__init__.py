"""Module 2's serving stack: a continuous-batching engine, an OpenAI-compatible server, a load client.

* :mod:`course.serving.engine_core`: ``EngineCore``, prefill once, then batched decode steps with the KV cache;
  requests join and leave between steps (continuous batching); one ``step()``, no thread of its own (vLLM V1's
  ``EngineCore``). Its parts: ``scheduler`` (the waiting queue, aborts, the admission rule), ``batch_cache``
  (the left-padded batch KV cache), ``sampler`` (``SamplingParams`` and the per-row sampler), ``request`` (a
  request, its events and its ``FinishReason``), ``runner`` (one forward pass: a lean Llama-family runner, or
  the ``transformers`` model's own).
* :mod:`course.serving.engine`: ``Engine``, the core's in-process client (it steps the core on a thread of
  this process, or lets the caller step it by hand).
* :mod:`course.serving.engine_process`: ``EngineProcess``, the core's multiprocess client (the core in a
  child process, vLLM V1's ``EngineCoreProc``), which ``course serve`` uses by default.
* :mod:`course.serving.engine_client`: ``EngineClient``, what the server needs from an engine (both
  engines implement it), and ``checked_prompt``, the one check of a prompt, which both run in ``submit``;
  :mod:`course.serving.messages`: the typed messages between the server and the engine core process.
* :mod:`course.serving.api`: the OpenAI-compatible front end and its operator features (vLLM's
  ``vllm/entrypoints/openai/``), which the engine files never import: ``api.server`` (``create_app()``, the
  FastAPI server: completions, chat, models, health, Prometheus metrics, with vLLM's SSE framing, 400
  errors and abort on disconnect), ``api.protocol`` (validates requests, formats responses),
  ``api.operator`` (API key, request ids, access log, limits), ``api.prometheus``, ``api.background``
  (``BackgroundServer``: uvicorn in a thread, any free port; ``run_sync`` for notebooks and tests) and
  ``api.cli`` (``course serve``, ``course bench``).
* :mod:`course.serving.client`: a load client for any OpenAI-compatible server that writes
  :class:`~course.trace.RequestTrace` records (``course bench``).

Submodules are imported lazily so ``import course.serving`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine",
    "EngineCore": "engine_core",
    "EngineProcess": "engine_process",
    "SamplingParams": "sampler",
    "create_app": "api.server",
    "BackgroundServer": "api.background",
    "run_sync": "api.background",
    "IncrementalDetokenizer": "detok",
    "PromptBuilder": "client",
    "run_load": "client",
    "stream_request": "client",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"course.serving.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'course.serving' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
