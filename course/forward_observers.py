"""Observers of the forward passes the course's lean runner makes (:class:`course.serving.runner.LlamaRunner`).

The lean runner computes a Llama model's layers itself instead of calling ``model.forward()``, so torch's forward
hooks never see its passes. A tool that watches passes (``course.grading.DecodeProbe`` in module 2's tests,
``course.serving.testing.ForwardLog``) registers here as well; the runner calls every observer of its model
before each pass. It lives apart from the runner so that the grading helpers can watch a model without importing
the serving stack.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

# per model: the model's weights are shared by every runner built over it, so its observers are too
_OBSERVERS: weakref.WeakKeyDictionary[Any, list[Callable[[Any], None]]] = weakref.WeakKeyDictionary()


def forward_observers(model: Any) -> list[Callable[[Any], None]]:
    """The live list of ``model``'s observers (a runner keeps it: observers added later are seen)."""
    return _OBSERVERS.setdefault(model, [])


def observe_forward(model: Any, callback: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``callback(input_ids)`` (a (rows, new) tensor) before every forward pass the lean runner makes over
    ``model``'s weights; returns the function that stops it.

    Passes that do go through the model (``course.serving.runner.TransformersRunner``) reach its torch hooks
    only, so a tool that registers both is never told of one pass twice.
    """
    callbacks = forward_observers(model)
    callbacks.append(callback)

    def remove() -> None:
        if callback in callbacks:
            callbacks.remove(callback)

    return remove
