"""The course's nbgrader configuration, in one place.

One nbgrader course directory serves students and instructors alike: the sources are
``solutions/``, the student notebooks ``modules/``; submissions, autograded copies, feedback
and the gradebook live in working folders that git ignores.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from pathlib import Path

from traitlets.config import Config

COURSE_ID = "llm-serving"
SOURCE_DIRECTORY = "solutions"
RELEASE_DIRECTORY = "modules"
# Per-cell limit while grading; the slowest cell of any module takes seconds in quick mode.
CELL_TIMEOUT_S = 300
# A test fails only by raising. Warnings and logs from torch, transformers, numpy or the
# learner's own prints go to stderr, and nbgrader would score any stderr output as a failure:
# every stderr output is dropped before scoring.
IGNORED_STDERR = r"[\s\S]"


def ensure_tools_on_path() -> None:
    """Put this interpreter's scripts folder on PATH: nbgrader runs `alembic` to create a gradebook,
    and a virtual environment used without activation would not find it."""
    import os
    import sys

    scripts = os.path.dirname(sys.executable)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def repo_root() -> Path:
    """The repository (= nbgrader course) root."""
    return Path(__file__).resolve().parents[1]


_nbgrader_app = threading.Lock()


@contextlib.contextmanager
def nbgrader_app() -> Iterator[None]:
    """Run one nbgrader app (generate_assignment, generate_feedback) in this process, console output swallowed.

    Its converters ``os.chdir`` into the course root and back, and the output is swallowed by
    swapping ``sys.stdout``/``sys.stderr``: both are one per process, so two apps at once in two
    threads (two ``grade()`` calls generating their templates) would run in each other's folder,
    return into a temporary folder already deleted (FileNotFoundError) and leave the process
    printing into a StringIO. One process-wide lock runs them one at a time.
    """
    with _nbgrader_app, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def configure(c: Config, root: str | Path | None = None, db_url: str | None = None) -> Config:
    """Fill an nbgrader config object (``get_config()`` in nbgrader_config.py, or a new one)."""
    root = Path(root or repo_root()).resolve()
    c.CourseDirectory.root = str(root)
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.source_directory = SOURCE_DIRECTORY
    c.CourseDirectory.release_directory = RELEASE_DIRECTORY
    if db_url:
        c.CourseDirectory.db_url = db_url
    c.Execute.timeout = CELL_TIMEOUT_S
    c.IgnorePattern.enabled = True
    c.IgnorePattern.pattern = IGNORED_STDERR
    c.OverwriteCells.add_missing_cells = True  # deleted test cells come back and still count
    c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
    return c


def nbgrader_config(root: str | Path | None = None, db_url: str | None = None) -> Config:
    """A fresh nbgrader config for the course at ``root``."""
    return configure(Config(), root, db_url)


def assignments(root: str | Path | None = None) -> list[str]:
    """Assignment ids: the folders of solutions/ that hold notebooks, in module order."""
    source = Path(root or repo_root()) / SOURCE_DIRECTORY
    return sorted(p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))
