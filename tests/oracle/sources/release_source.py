"""Functions and constants compiled from the release's own source files, for the source drift tests."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path


def source_function(path: str, name: str, cls: str | None = None, namespace: dict | None = None):
    """A function (or a class's method, decorators dropped) compiled from the release's own source file,
    for code whose module does not import without CUDA (``vllm/platforms/cuda.py``, most attention
    backends), so that a test still runs vLLM's code, not a copy of it."""
    import vllm

    source = (Path(vllm.__file__).parent.parent / path).read_text()
    body = ast.parse(source).body
    if cls is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == cls).body
    node = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)
    text = textwrap.dedent(ast.get_source_segment(source, node))
    scope = dict(namespace or {})
    exec(compile("from __future__ import annotations\n" + text, path, "exec"), scope)  # noqa: S102
    return scope[name]


def source_constant(path: str, name: str, namespace: dict | None = None):
    """A module-level constant of the release's source file, its expression evaluated in ``namespace``
    (e.g. ``KV_CACHE_MARGIN_FLOOR_BYTES`` with a stand-in platform)."""
    import vllm

    source = (Path(vllm.__file__).parent.parent / path).read_text()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return eval(compile(ast.Expression(node.value), path, "eval"), dict(namespace or {}))  # noqa: S307
    raise LookupError(f"{name} is not assigned at module level in {path}")
