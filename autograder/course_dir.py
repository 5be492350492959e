"""The folders of one nbgrader course directory, and the per-student flags the pipeline keeps there.

Folders (all git-ignored): ``submitted/<student>/<assignment>/`` (what collect wrote or nbgrader's
exchange delivered), ``autograded/`` and ``feedback/`` (nbgrader's), the gradebook (``gradebook.db``
or ``--db-url``), and ``grading/<assignment>/`` for the pipeline's own records: notebooks as
received, repair notes, flags, one result file and log per student, the exported CSV files.

A *flag* is a reason why a student needs manual grading that no sandbox found: a file of theirs that
could not be read, parsed or repaired, two submissions with the same time. Flagged students are
graded from what could be read (or get 0 when nothing could) and are marked for manual grading.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from autograder.config import RELEASE_DIRECTORY, SOURCE_DIRECTORY, repo_root

DB_URL_ENV = "AUTOGRADER_DB_URL"
_held: dict[Path, list] = {}  # lock file -> [open file, depth, owner thread]: re-entrant within one thread
_held_guard = threading.Lock()


class CourseBusy(RuntimeError):
    """Another autograder run is working on the same course directory."""


class Course:
    """Paths of one nbgrader course directory (default: this repository)."""

    def __init__(self, root: str | Path | None = None, db_url: str | None = None):
        self.root = Path(root or repo_root()).resolve()
        self.db_url = db_url or os.environ.get(DB_URL_ENV) or f"sqlite:///{self.root / 'gradebook.db'}"
        self.source_dir = self.root / SOURCE_DIRECTORY
        self.release_dir = self.root / RELEASE_DIRECTORY
        self.submitted = self.root / "submitted"
        self.autograded = self.root / "autograded"
        self.feedback = self.root / "feedback"
        self.grading = self.root / "grading"
        self.grading.mkdir(parents=True, exist_ok=True)
        ignore = self.grading / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# the grading pipeline's working files (student data): never committed\n*\n")

    def work(self, assignment: str) -> Path:
        folder = self.grading / assignment
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def release_notebooks(self, assignment: str) -> dict[str, Path]:
        """Notebook file name -> release notebook (the student version) of an assignment."""
        found = {path.name: path for path in sorted((self.release_dir / assignment).glob("*.ipynb"))}
        if not found:
            raise RuntimeError(
                f"no release notebooks in {self.release_dir / assignment}: run `autograder release {assignment}` first"
            )
        return found

    def submitted_notebooks(self, assignment: str, student: str) -> dict[str, Path]:
        """Notebook file name -> submitted file of one student (regular files only, never a link)."""
        folder = self.submitted / student / assignment
        return {
            name: folder / name
            for name in self.release_notebooks(assignment)
            if (folder / name).is_file() and not (folder / name).is_symlink()
        }

    def students(self, assignment: str) -> list[str]:
        """Students with a submitted notebook of ``assignment`` or a flag for it."""
        names = set(self.release_notebooks(assignment))
        found = {
            folder.parent.name
            for folder in self.submitted.glob(f"*/{assignment}")
            if folder.is_dir() and any((folder / name).is_file() for name in names)
        }
        return sorted(found | set(self.flags(assignment)))

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Hold the course's lock (``grading/.lock``) while ``what`` runs; a second run refuses.

        Two runs on one course would write the same submitted/, autograded/ and grading/ folders
        and the same gradebook rows, so the second one stops at once with a message saying who
        holds the course, whether it runs in another process or in another thread of this one
        (``flock`` alone cannot tell two threads apart). Nested use in one thread is allowed.
        """
        import fcntl

        path = self.grading / ".lock"
        with _held_guard:
            if path in _held and _held[path][2] == threading.get_ident():
                _held[path][1] += 1
            elif path in _held:
                raise CourseBusy(
                    f"another autograder run is using the course in {self.root} ({_held[path][3]}, in another "
                    "thread of this process); wait for it to finish, or grade a copy of the course in another folder"
                )
            else:
                handle = open(path, "a+")  # noqa: SIM115 (held until the outermost exit)
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    handle.seek(0)
                    owner = handle.read().strip() or "another process"
                    handle.close()
                    raise CourseBusy(
                        f"another autograder run is using the course in {self.root} ({owner}); wait for it to "
                        "finish, or grade a copy of the course in another folder"
                    ) from None
                handle.truncate(0)
                handle.write(f"pid {os.getpid()}: autograder {what}")
                handle.flush()
                _held[path] = [handle, 1, threading.get_ident(), f"autograder {what}"]
        try:
            yield
        finally:
            with _held_guard:
                _held[path][1] -= 1
                if _held[path][1] == 0:
                    _held.pop(path)[0].close()

    # --- flags: why a student needs manual grading ------------------------------------------------

    def _flags_path(self, assignment: str) -> Path:
        return self.work(assignment) / "flags.json"

    def flags(self, assignment: str) -> dict[str, dict[str, list[str]]]:
        """student -> step ("collect", "repair") -> reasons they need manual grading."""
        path = self._flags_path(assignment)
        return json.loads(path.read_text()) if path.is_file() else {}

    def set_flags(self, assignment: str, step: str, reasons: dict[str, list[str]], students: set[str]) -> None:
        """Replace ``step``'s flags of ``students`` (those it looked at) with ``reasons``."""
        flags = self.flags(assignment)
        for student in students | set(reasons):
            entry = flags.get(student, {})
            entry.pop(step, None)
            if reasons.get(student):
                entry[step] = list(reasons[student])
            if entry:
                flags[student] = entry
            else:
                flags.pop(student, None)
        self._flags_path(assignment).write_text(json.dumps(flags, indent=1, ensure_ascii=False))

    def flag_reasons(self, assignment: str, student: str) -> list[str]:
        """Every reason ``student`` needs manual grading before any grading ran, in step order."""
        entry = self.flags(assignment).get(student, {})
        return [reason for step in ("collect", "repair") for reason in entry.get(step, [])]

    # --- results --------------------------------------------------------------------------------

    def result_path(self, assignment: str, student: str) -> Path:
        return self.work(assignment) / "results" / f"{student}.json"

    def load_result(self, assignment: str, student: str) -> dict | None:
        path = self.result_path(assignment, student)
        return json.loads(path.read_text()) if path.is_file() else None
