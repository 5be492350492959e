"""``autograder collect``: put submissions from an LMS download (zip or folder) where nbgrader wants them.

LMS downloads name files after students in their own ways (Moodle: a folder per student
``Jane Doe_12345_assignsubmission_file_/``; Canvas: ``doejane_12345_6789012_prefill_decode.ipynb``;
a plain folder per student), and students name notebooks in theirs (``Copy of prefill_decode.ipynb``,
``prefill_decode (1).ipynb``, ``Untitled3.ipynb``). The student id comes from the path through a
regular expression with a named group ``student`` (presets below, or your own). Which assignment
and notebook a file is comes from its *content*: the marker comments of its graded cells are matched
against every release notebook, so a renamed notebook still lands in the right place. A file name
is only used when a notebook has no markers left.

Each accepted notebook is copied unchanged to ``submitted/<student>/<assignment>/<notebook>.ipynb``
(the canonical name, with a ``timestamp.txt``) and, as received, to
``grading/<assignment>/received/<student>/``. Everything that could not be matched is listed in
the report (``grading/collect-report.json``) with the reason.
"""

from __future__ import annotations

import io
import json
import re
import unicodedata
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath

from autograder import repair

PRESETS = {
    "moodle": r"^(?:[^/]*/)*?(?P<student>[^/]+?)_\d+_assign(?:submission|feedback)_(?:file|onlinetext)_?/",
    "canvas": r"(?:^|/)(?P<student>[a-z0-9]+)_(?:late_)?\d+_\d+_[^/]+$",
    "folder": r"^(?P<student>[^/]+)/",
    "file": r"(?:^|/)(?P<student>[A-Za-z0-9.]+)[_ -][^/]+$",
}
AUTO_ORDER = ("moodle", "canvas", "folder", "file")
MAX_FILE_BYTES = 100 * 2**20
MIN_MARKER_SHARE = 0.3  # a notebook must carry this share of a release notebook's graded cells to match it


@dataclass
class Entry:
    """One file of the input and what became of it."""

    source: str  # path inside the zip or folder
    student: str | None = None
    assignment: str | None = None
    notebook: str | None = None
    path: str | None = None  # where it was written (submitted/...)
    reason: str = ""  # why it was not collected, or how it was matched


@dataclass
class CollectReport:
    collected: list[Entry] = field(default_factory=list)
    unmatched: list[Entry] = field(default_factory=list)
    superseded: list[Entry] = field(default_factory=list)  # older duplicates of a collected notebook

    def to_json(self) -> dict:
        return {
            key: [asdict(entry) for entry in getattr(self, key)] for key in ("collected", "unmatched", "superseded")
        }

    def table(self) -> str:
        lines = [
            f"collected {len(self.collected)} notebook(s) of {len({e.student for e in self.collected})} student(s)"
        ]
        for entry in self.collected:
            lines.append(
                f"  {entry.student:20s} {entry.assignment}/{entry.notebook}  <- {entry.source}  ({entry.reason})"
            )
        if self.superseded:
            lines.append(f"ignored {len(self.superseded)} older duplicate(s):")
            lines += [f"  {e.source}  ({e.reason})" for e in self.superseded]
        if self.unmatched:
            lines.append(f"could not match {len(self.unmatched)} file(s):")
            lines += [f"  {e.source}: {e.reason}" for e in self.unmatched]
        return "\n".join(lines)


def student_id(text: str) -> str:
    """A safe nbgrader student id from a name or login: ASCII letters, digits, '.', '_' and '-'."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", ascii_text.strip()).strip("._-").lower()
    return slug[:64]


def compile_pattern(pattern: str) -> list[re.Pattern]:
    """The student-id expressions to try: a preset name, "auto", or a regex with a named group 'student'."""
    if pattern == "auto":
        return [re.compile(PRESETS[name], re.IGNORECASE) for name in AUTO_ORDER]
    if pattern in PRESETS:
        return [re.compile(PRESETS[pattern], re.IGNORECASE)]
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"--pattern {pattern!r} is not a valid regular expression: {err}") from None
    if "student" not in compiled.groupindex:
        raise ValueError(f"--pattern {pattern!r} needs a named group for the student id, e.g. '^(?P<student>[^/]+)/'")
    return [compiled]


def find_student(path: str, patterns: list[re.Pattern]) -> str | None:
    for compiled in patterns:
        match = compiled.search(path)
        if match and match.group("student") and student_id(match.group("student")):
            return student_id(match.group("student"))
    return None


def iter_files(source: Path) -> Iterator[tuple[str, bytes | None, datetime, str]]:
    """(relative path, content or None when too large, modification time, problem) of every file."""
    source = Path(source)
    if source.is_file() and zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as archive:
            yield from _iter_zip(archive, "", 0)
    elif source.is_dir():
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source).as_posix()
            if _skipped(rel):
                continue
            mtime = datetime.fromtimestamp(path.stat().st_mtime)
            if rel.lower().endswith(".zip") and zipfile.is_zipfile(path):
                with zipfile.ZipFile(path) as archive:
                    yield from _iter_zip(archive, rel[:-4] + "/", 1)
            elif path.stat().st_size > MAX_FILE_BYTES:
                yield rel, None, mtime, "file too large"
            else:
                yield rel, path.read_bytes(), mtime, ""
    else:
        raise FileNotFoundError(f"{source} is neither a zip file nor a folder of submissions")


def _skipped(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return any(part.startswith(".") or part == "__MACOSX" for part in parts)


def _iter_zip(archive: zipfile.ZipFile, prefix: str, depth: int) -> Iterator[tuple[str, bytes | None, datetime, str]]:
    for info in archive.infolist():
        if info.is_dir() or _skipped(info.filename):
            continue
        rel = prefix + info.filename
        mtime = datetime(*info.date_time)
        if info.file_size > MAX_FILE_BYTES:
            yield rel, None, mtime, "file too large"
        elif info.filename.lower().endswith(".zip") and depth < 2:
            try:
                with zipfile.ZipFile(io.BytesIO(archive.read(info))) as inner:
                    yield from _iter_zip(inner, rel[:-4] + "/", depth + 1)
            except zipfile.BadZipFile:
                yield rel, None, mtime, "a damaged zip file"
        else:
            yield rel, archive.read(info), mtime, ""


def release_index(root: Path, assignment_ids: list[str]) -> dict[tuple[str, str], set[str]]:
    """(assignment, notebook file name) -> grade_ids of its release notebook (modules/)."""
    from autograder.config import RELEASE_DIRECTORY
    from autograder.notebooks import read

    index = {}
    for assignment in assignment_ids:
        folder = Path(root) / RELEASE_DIRECTORY / assignment
        for path in sorted(folder.glob("*.ipynb")):
            index[(assignment, path.name)] = repair.marked_ids(read(path))
    return index


def _normalised_name(name: str) -> str:
    stem = PurePosixPath(name).name.lower()
    stem = re.sub(r"\.ipynb$", "", stem)
    stem = re.sub(r"^copy of ", "", stem)
    stem = re.sub(r"\s*\(\d+\)$|-\d+$", "", stem)
    return stem


def match_notebook(nb, name: str, index: dict[tuple[str, str], set[str]]) -> tuple[tuple[str, str] | None, str]:
    """The (assignment, notebook) a submitted notebook is, and how it was decided."""
    found = repair.marked_ids(nb)
    scored = sorted(
        ((len(found & ids) / len(ids), key) for key, ids in index.items() if ids), key=lambda item: -item[0]
    )
    if scored and scored[0][0] >= MIN_MARKER_SHARE:
        share, key = scored[0]
        return key, f"matched by {share:.0%} of its graded cells"
    if not found:
        stem = _normalised_name(name)
        by_name = [key for key in index if Path(key[1]).stem.lower() in stem]
        if len(by_name) == 1:
            return by_name[0], "matched by file name (no graded cells recognised)"
    return None, "does not look like any assignment's notebook (too few of its graded cells found)"


def collect(
    source: Path,
    root: Path,
    assignment_ids: list[str],
    pattern: str = "auto",
    progress: bool = False,
) -> CollectReport:
    """Copy the notebooks in ``source`` (zip or folder) into ``root``'s submitted/ folder."""
    from autograder.pipeline import Course

    course = Course(root)
    patterns = compile_pattern(pattern)
    index = release_index(root, assignment_ids)
    if not index:
        raise RuntimeError(
            f"no release notebooks for {', '.join(assignment_ids)} in {course.release_dir}: "
            "run `autograder release` first"
        )
    report = CollectReport()
    chosen: dict[tuple[str, str, str], tuple[datetime, Entry, bytes]] = {}
    files = list(iter_files(source))
    if progress:
        from tqdm import tqdm

        files = tqdm(files, desc="collect", unit="file")
    for rel, content, mtime, problem in files:
        entry = Entry(source=rel)
        if not rel.lower().endswith(".ipynb"):
            entry.reason = problem or "not a notebook (.ipynb)"
            report.unmatched.append(entry)
            continue
        if content is None:
            entry.reason = problem
            report.unmatched.append(entry)
            continue
        entry.student = find_student(rel, patterns)
        if not entry.student:
            entry.reason = "no student id in the path (adjust --pattern)"
            report.unmatched.append(entry)
            continue
        try:
            nb = repair.read_submission(content)
        except repair.UnreadableNotebook as err:
            entry.reason = str(err)
            report.unmatched.append(entry)
            continue
        key, how = match_notebook(nb, rel, index)
        if key is None:
            entry.reason = how
            report.unmatched.append(entry)
            continue
        entry.assignment, entry.notebook, entry.reason = key[0], key[1], how
        slot = (entry.student, *key)
        if slot in chosen:
            older, newer = sorted([chosen[slot], (mtime, entry, content)], key=lambda item: item[0])
            older[1].reason = f"older than {newer[1].source}"
            report.superseded.append(older[1])
            chosen[slot] = newer
        else:
            chosen[slot] = (mtime, entry, content)

    for (student, assignment, notebook), (mtime, entry, content) in sorted(chosen.items()):
        target = course.submitted / student / assignment / notebook
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        (target.parent / "timestamp.txt").write_text(mtime.strftime("%Y-%m-%d %H:%M:%S.%f"))
        received = course.work(assignment) / "received" / student / notebook
        received.parent.mkdir(parents=True, exist_ok=True)
        received.write_bytes(content)
        (received.parent / f"{notebook}.source").write_text(entry.source)
        entry.path = str(target.relative_to(course.root))
        report.collected.append(entry)
    (course.grading / "collect-report.json").write_text(json.dumps(report.to_json(), indent=1))
    return report


def received_name(course, assignment: str, student: str, notebook: str) -> str | None:
    """The file name a notebook had when it was collected (None when it was not collected by us)."""
    marker = course.work(assignment) / "received" / student / f"{notebook}.source"
    return marker.read_text() if marker.is_file() else None
