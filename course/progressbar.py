"""Progress bars for notebook cells that take more than a few seconds.

One place for the course's bar style: tqdm's notebook widget where ipywidgets works (plain text
elsewhere), and ``leave=False`` so a finished bar disappears and the cell's output is its results.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterable[T]:
    """``items``, shown as a progress bar labelled ``description`` while a loop runs over them."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, total=total, leave=False)
