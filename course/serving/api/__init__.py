"""The OpenAI-compatible front end of the serving stack and its operator features (vLLM's
``vllm/entrypoints/openai/``), apart from the engine in :mod:`course.serving`.

* :mod:`course.serving.api.protocol`: the wire format: request validation into
  :class:`~course.serving.sampler.SamplingParams`, error bodies, SSE chunks;
* :mod:`course.serving.api.server`: ``create_app()``, the FastAPI routes (completions, chat, models,
  health, metrics) over any :class:`~course.serving.engine_client.EngineClient`;
* :mod:`course.serving.api.operator`: what an operator adds around the routes: the API key,
  ``X-Request-Id``, the access log, the request-size and waiting-queue limits;
* :mod:`course.serving.api.prometheus`: ``/metrics`` under vLLM's metric names;
* :mod:`course.serving.api.background`: ``BackgroundServer`` (uvicorn in a thread, any free port),
  ``run_sync``, and the limits every client connection is held to, which the HTTP protocol of
  :mod:`course.serving.api.http_limits` enforces;
* :mod:`course.serving.api.cli`: ``course serve`` and ``course bench``.

The engine never imports from here: the dependency runs one way, front end to engine.
"""
