"""``autograder collect``: put submissions from an LMS download (zip or folder) where nbgrader wants them.

Who a file belongs to comes from its path (or, for Gradescope, from the export's
``submission_metadata.yml``). The rules are nbgrader collector plugins, one class per LMS preset, in
:mod:`autograder.plugins` (plain ``nbgrader zip_collect`` can load them too); they know the LMS
downloads' own formats and keep the LMS's user id, so two people with the same name never merge:

* Moodle: a folder (or file name prefix) ``Full Name_<participant id>_assignsubmission_file_``;
* Canvas: ``lastfirst[_LATE]_<user id>_<attachment id>_<file name>``;
* Blackboard: ``<assignment>_<username>_attempt_<YYYY-MM-DD-HH-MM-SS>_<file name>`` (the attempt's
  time is the submission time);
* Gradescope: ``submission_<id>/`` folders, mapped to the submitter (student id, else e-mail) and
  submission time by ``submission_metadata.yml``;
* a plain folder per student, or a file name prefix.

Student ids (:func:`student_id`) keep Unicode names (NFC-normalised, never transliterated) and are
lower case; an id with an LMS user id is ``<name>_<user id>``; an id without one gets a short hash
of the exact name whenever making it safe lost anything (case, spaces, punctuation, length), so
``Alice`` and ``alice`` stay two students.

Which assignment and notebook a file is comes from its *content*: the marker comments of its graded
cells are matched against every release notebook, so a renamed notebook still lands in the right
place. A file name is only used when a notebook has no markers left.

**Duplicates**: when one student has several files for one notebook, the one with the latest LMS
timestamp wins (the time in a Blackboard name or Gradescope's metadata, else the time stored in the
zip or the file's modification time); the others are listed as superseded. Two files with the same
latest time are a tie: the one whose path sorts last is graded, and the student is marked for
manual grading with both paths named, never resolved silently (and never by zip order).

Every entry of the input appears in the report (``grading/collect-report.json``): collected,
superseded, or skipped with the reason (not a notebook, a folder, a hidden or unsafe path, a
symbolic link (never followed), too large, damaged, unreadable). A student whose file could not be
read or parsed is marked for manual grading (``grading/<assignment>/flags.json``). Zip members are
read one at a time with a size bound per member and per archive, so no download can fill memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import unicodedata
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath

from autograder import repair
from autograder.course_dir import Course

GRADESCOPE_METADATA = "submission_metadata.yml"
MAX_FILE_BYTES = 100 * 2**20  # one member or file; a course notebook with outputs is a few MB
MAX_ARCHIVE_BYTES = 4 * 2**30  # everything read from one download, nested zips included
MAX_ZIP_DEPTH = 2
MAX_ID_CHARS = 64
MIN_MARKER_SHARE = 0.3  # a notebook must carry this share of a release notebook's graded cells to match it
NO_STUDENT = "no student id in the path (adjust --pattern)"
NOTEBOOKS = (".ipynb",)  # the files whose content is read (iter_files' ``keep``)


@dataclass
class Entry:
    """One entry of the input and what became of it."""

    source: str  # path inside the zip or folder
    student: str | None = None
    assignment: str | None = None
    notebook: str | None = None
    path: str | None = None  # where it was written (submitted/...)
    reason: str = ""  # why it was not collected, or how it was matched
    time: str | None = None  # the submission time used to order duplicates
    name: str | None = None  # the exact name (and LMS user id) the student id was made from


@dataclass
class CollectReport:
    collected: list[Entry] = field(default_factory=list)
    unmatched: list[Entry] = field(default_factory=list)  # skipped, with the reason
    superseded: list[Entry] = field(default_factory=list)  # older duplicates of a collected notebook
    manual: dict[str, list[str]] = field(default_factory=dict)  # student -> why they need manual grading

    def to_json(self) -> dict:
        data = {key: [asdict(e) for e in getattr(self, key)] for key in ("collected", "unmatched", "superseded")}
        data["manual"] = self.manual
        return data

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
        folders = [e for e in self.unmatched if e.reason == FOLDER]
        skipped = [e for e in self.unmatched if e.reason != FOLDER]
        if skipped:
            lines.append(f"skipped {len(skipped)} file(s):")
            lines += [f"  {e.source}: {e.reason}" for e in skipped]
        if folders:
            lines.append(f"({len(folders)} folder entries of the zip: listed in the report)")
        if self.manual:
            lines.append(f"{len(self.manual)} student(s) marked for manual grading:")
            lines += [f"  {student}: {'; '.join(reasons)}" for student, reasons in sorted(self.manual.items())]
        return "\n".join(lines)


FOLDER = "a folder"


# --- student ids ----------------------------------------------------------------------------------


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def student_id(name: str, lms_id: str | None = None) -> str:
    """A safe nbgrader student id that never merges two people; "" when there is nothing to go on.

    ``name`` is NFC-normalised (Unicode kept, not transliterated), runs of characters other than
    letters, digits, ``.``, ``_`` and ``-`` become ``_``, and the result is lower case. With an LMS
    user id the id is ``<name>_<user id>`` (the user id makes it unique). Without one, an id that
    lost anything of the exact name (case, spaces, punctuation, Unicode normalisation, length) ends
    in ``-`` and a hash of the name (NFC, spaces collapsed: the same person typed twice keeps one
    id). Names that still give one id are told apart by :func:`collect`, which marks such a student
    for manual grading with every path named.
    """
    text = " ".join(unicodedata.normalize("NFC", name or "").split())
    slug = re.sub(r"[^\w.-]+", "_", text).strip("._-").lower()
    if lms_id:
        uid = re.sub(r"[^\w.@-]+", "_", unicodedata.normalize("NFC", lms_id)).strip("._-").lower()
        if uid:
            if len(uid) > MAX_ID_CHARS - 9:
                uid = f"{uid[: MAX_ID_CHARS - 18]}-{_digest(lms_id)}"
            room = MAX_ID_CHARS - len(uid) - 1
            return f"{slug[:room].rstrip('._-')}_{uid}" if slug and room > 0 else uid
    if not text:
        return ""
    # compared with the exact name: a name that lost spaces (leading, trailing, repeated, non-breaking,
    # tabs) or its Unicode normalisation (an NFD accent) is lossy too
    lossless = slug == name and len(slug) <= MAX_ID_CHARS and not re.search(r"-[0-9a-f]{8}$", slug)
    if lossless:
        return slug
    return f"{slug[: MAX_ID_CHARS - 9].rstrip('._-') or 'student'}-{_digest(text)}"


@dataclass
class Identity:
    student: str
    time: datetime | None = None  # the LMS's submission time, when the path or metadata has one
    name: str = ""  # the exact name and user id the id was made from (look-alike names give one id)


def _visible(text: str) -> str:
    """``text`` in quotes, every character but letters, digits, punctuation and plain spaces escaped.

    Tabs, non-breaking and other spaces, combining marks (an NFD accent) and controls are shown as
    ``\\uXXXX``, so two names that look alike print differently.
    """
    shown = "".join(
        ch if ch == " " or (ch.isprintable() and unicodedata.category(ch)[0] not in "MZC") else f"\\u{ord(ch):04x}"
        for ch in text
    )
    return f"'{shown}'"


def exact_name(name: str | None, lms_id: str | None) -> str:
    """The exact name and user id of a submitter, as text that shows every invisible difference."""
    text = _visible(name or "")
    return f"{text} (user id {_visible(lms_id)})" if lms_id else text


def lms_time(text: str | None) -> datetime | None:
    """A submission time written ``YYYY-MM-DD-HH-MM-SS`` in a path (Blackboard's), None when absent or invalid."""
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%d-%H-%M-%S")
    except ValueError:
        return None


def compile_pattern(pattern: str, root: Path | None = None):
    """The collector (:class:`autograder.plugins.CourseCollector`) for ``--pattern``.

    ``pattern`` is a preset name (``moodle``, ``canvas``, ``blackboard``, ``gradescope``,
    ``folder``, ``file``), ``auto`` (every preset in turn), the dotted name of a
    :class:`~autograder.plugins.CourseCollector` subclass, or a regex with a named group ``student``
    and/or ``id`` (the LMS's user id), optionally ``time`` (``YYYY-MM-DD-HH-MM-SS``). A bad regex is
    a ValueError that says why. Any other nbgrader ``FileNameCollectorPlugin`` named so is used too,
    configured by ``root``'s ``nbgrader_config.py``.
    """
    # autograder.plugins builds on this module (reading, matching): imported when used, so that
    # importing either module first works.
    from autograder.plugins import collector_for

    return collector_for(pattern, root)


def find_student(path: str, collector, reserved: frozenset[str] | set[str] = frozenset()) -> Identity | None:
    """Who submitted the file at ``path`` (inside the download), by ``collector``'s rule; None: nobody."""
    return collector.identify(path, reserved)


def gradescope_identities(text: str) -> dict[str, Identity]:
    """submission folder -> submitter, from a Gradescope export's ``submission_metadata.yml``.

    The file maps ``submission_<id>`` to ``:submitters:`` (each with ``:name:``, ``:sid:``,
    ``:email:``) and ``:created_at:``. A group submission is attributed to its first submitter.
    """
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{GRADESCOPE_METADATA} is not valid YAML: {err}") from None
    found: dict[str, Identity] = {}
    for folder, record in (data or {}).items() if isinstance(data, dict) else []:
        if not isinstance(record, dict):
            continue
        submitters = record.get(":submitters") or record.get("submitters") or []
        first = submitters[0] if isinstance(submitters, list) and submitters and isinstance(submitters[0], dict) else {}
        name = str(first.get(":name") or first.get("name") or "")
        uid = first.get(":sid") or first.get("sid") or first.get(":email") or first.get("email")
        sid = student_id(name, str(uid) if uid else None)
        if not sid:
            continue
        created = record.get(":created_at") or record.get("created_at")
        when = None
        if isinstance(created, datetime):
            when = created.replace(tzinfo=None) if created.tzinfo is None else created.astimezone().replace(tzinfo=None)
        elif isinstance(created, str):
            try:
                parsed = datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", created.strip()).replace(" -", "-"))
                when = parsed.astimezone().replace(tzinfo=None) if parsed.tzinfo else parsed
            except ValueError:
                when = None
        found[str(folder)] = Identity(sid, when, exact_name(name, str(uid) if uid else None))
    return found


# --- reading the input, one member at a time -------------------------------------------------------


class _Budget:
    """Bytes still allowed to be read from one download (nested zips included)."""

    def __init__(self, limit: int):
        self.left = limit

    def take(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise _TooLarge(f"the download is over the {_mib(MAX_ARCHIVE_BYTES)} MiB read limit")


class _TooLarge(Exception):
    pass


def _mib(count: int) -> str:
    return f"{count / 2**20:,.0f}"


# What reading a damaged member raises: bad CRC (BadZipFile), broken deflate (zlib.error), truncated
# data (EOFError), unknown compression (NotImplementedError), encryption (RuntimeError).
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, OSError, ValueError)


def _read_bounded(handle, budget: _Budget, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = handle.read(min(2**20, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        budget.take(len(chunk))
        if size > limit:
            raise _TooLarge(f"larger than {limit / 2**20:g} MiB")
        chunks.append(chunk)


def skip_reason(rel: str) -> str:
    """Why a path is not even looked at ("" when it is)."""
    posix = rel.replace("\\", "/")
    parts = PurePosixPath(posix).parts
    if posix.startswith("/") or re.match(r"^[A-Za-z]:", posix) or ".." in parts:
        return "an unsafe path (absolute or with ..): not collected"
    if any(part.startswith(".") or part == "__MACOSX" for part in parts):
        return "a hidden file or folder (., __MACOSX): not collected"
    return ""


def iter_files(
    source: Path, keep: tuple[str, ...] = NOTEBOOKS
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    """(relative path, content or None, modification time, why it was skipped) of every entry.

    Content is read only for files whose lower-case name ends in one of ``keep`` (notebooks), one at a
    time, each bounded by ``MAX_FILE_BYTES`` and all of them by ``MAX_ARCHIVE_BYTES``; nested zips
    are opened up to ``MAX_ZIP_DEPTH`` deep. The modification time is the one stored in the zip, or
    the file's.
    """
    source = Path(source)
    budget = _Budget(MAX_ARCHIVE_BYTES)
    if source.is_file() and zipfile.is_zipfile(source):
        try:
            archive = zipfile.ZipFile(source)
        except (zipfile.BadZipFile, OSError) as err:
            raise ValueError(f"{source} is a damaged zip file: {err}") from None
        with archive:
            yield from _iter_zip(archive, "", 0, budget, keep)
    elif source.is_dir():
        yield from _iter_folder(source, budget, keep)
    elif source.is_file():
        raise ValueError(f"{source} is not a zip file or a folder of submissions")
    else:
        raise FileNotFoundError(f"{source} is neither a zip file nor a folder of submissions")


def read_file(path: str | Path) -> bytes:
    """The bytes of one file, at most ``MAX_FILE_BYTES`` (ValueError beyond); OSError when unreadable."""
    with open(path, "rb") as handle:
        try:
            return _read_bounded(handle, _Budget(MAX_FILE_BYTES + 1), MAX_FILE_BYTES)
        except _TooLarge as err:
            raise ValueError(f"too large to collect: {err}") from None


CHANGED = "changed while collecting"


def _iter_folder(
    source: Path, budget: _Budget, keep: tuple[str, ...]
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    """Every entry of a folder. A folder or file renamed or removed while this runs (an LMS sync, a
    teaching assistant tidying up) is never lost without a word: a path that vanished between listing
    and reading gets its own report line, and a second listing at the end takes in whatever appeared
    under a new name meanwhile, with a line saying so."""
    seen: set[str] = set()
    folders: set[str] = set()
    yield from _walk_folder(source, budget, keep, seen, folders, second_pass=False)
    late = list(_walk_folder(source, budget, keep, seen, set(), second_pass=True))
    appeared = set()
    for rel, *_ in late:  # the outermost new folder (a renamed student folder), else the file itself
        parts = rel.split("/")
        new = next(
            ("/".join(parts[: i + 1]) for i in range(len(parts) - 1) if "/".join(parts[: i + 1]) not in folders), rel
        )
        appeared.add(new)
    for rel in sorted(appeared):
        yield rel, None, None, f"{CHANGED}: appeared under this name during the run; taken after the first pass"
    yield from late


def _walk_folder(
    source: Path, budget: _Budget, keep: tuple[str, ...], seen: set[str], folders: set[str], second_pass: bool
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    vanished: list[str] = []

    def unreadable(error: OSError) -> None:  # os.walk could not list a folder it had found
        vanished.append(_rel(source, os.path.dirname(error.filename or ""), os.path.basename(error.filename or "")))

    for top, dirs, files in os.walk(source, followlinks=False, onerror=unreadable):
        dirs.sort()
        for name in sorted(dirs):
            rel = _rel(source, top, name)
            folders.add(rel)
            if rel in seen:
                continue
            if os.path.islink(os.path.join(top, name)):  # os.walk lists it but never enters it
                seen.add(rel)
                yield rel, None, None, "a symbolic link: not followed"
        for name in sorted(files):
            rel = _rel(source, top, name)
            if rel in seen:
                continue
            seen.add(rel)
            yield from _folder_entries(os.path.join(top, name), rel, budget, keep)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
    if not second_pass:
        for rel in vanished:
            seen.add(rel)
            yield rel, None, None, f"{CHANGED}: the folder was renamed or removed before it could be read"


def _folder_entries(
    path: str, rel: str, budget: _Budget, keep: tuple[str, ...]
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    """(rel, content or None, mtime, problem) of one file of a folder download (every entry of a zip)."""
    try:
        info = os.lstat(path)
    except OSError as err:
        yield rel, None, None, f"{CHANGED}: renamed or removed before it could be read ({err.strerror or err})"
        return
    mtime = datetime.fromtimestamp(info.st_mtime)
    problem = skip_reason(rel)
    if stat.S_ISLNK(info.st_mode):
        yield rel, None, mtime, "a symbolic link: not followed"
    elif not stat.S_ISREG(info.st_mode):
        yield rel, None, mtime, "not a regular file"
    elif problem:
        yield rel, None, mtime, problem
    elif rel.lower().endswith(".zip"):
        opener = lambda p=path: open(p, "rb")  # noqa: E731, SIM115 (closed by _iter_nested)
        yield from _iter_nested(rel, opener, mtime, 1, budget, keep)
    elif not rel.lower().endswith(keep):
        yield rel, None, mtime, "not a notebook (.ipynb)"
    else:
        try:
            with open(path, "rb") as handle:
                yield rel, _read_bounded(handle, budget, MAX_FILE_BYTES), mtime, ""
        except _TooLarge as err:
            yield rel, None, mtime, f"too large to collect: {err}"
        except FileNotFoundError as err:
            yield rel, None, mtime, f"{CHANGED}: renamed or removed before it could be read ({err.strerror})"
        except OSError as err:
            yield rel, None, mtime, f"could not be read: {err.strerror or err}"


def _rel(source: Path, top: str, name: str) -> str:
    return Path(os.path.relpath(os.path.join(top, name), source)).as_posix()


def _is_symlink(info: zipfile.ZipInfo) -> bool:
    return info.create_system == 3 and stat.S_ISLNK(info.external_attr >> 16)


def _iter_zip(
    archive: zipfile.ZipFile, prefix: str, depth: int, budget: _Budget, keep: tuple[str, ...]
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    for info in archive.infolist():
        rel = prefix + info.filename
        mtime = _zip_mtime(info)
        problem = skip_reason(info.filename)
        if info.is_dir():
            yield rel, None, mtime, problem or FOLDER
        elif problem:
            yield rel, None, mtime, problem
        elif _is_symlink(info):
            yield rel, None, mtime, "a symbolic link: not followed"
        elif budget.left <= 0:
            yield rel, None, mtime, f"not read: the download is over the {_mib(MAX_ARCHIVE_BYTES)} MiB read limit"
        elif info.filename.lower().endswith(".zip"):
            yield from _iter_nested(rel, lambda i=info: archive.open(i), mtime, depth + 1, budget, keep)
        elif not info.filename.lower().endswith(keep):
            yield rel, None, mtime, "not a notebook (.ipynb)"
        elif info.file_size > MAX_FILE_BYTES:
            yield rel, None, mtime, f"too large to collect: larger than {MAX_FILE_BYTES / 2**20:g} MiB"
        else:
            content, unread = _read_zip_member(archive, info, budget)
            yield rel, content, mtime, unread


def _zip_mtime(info: zipfile.ZipInfo) -> datetime | None:
    """When a zip entry was last changed, or None when the zip stores an impossible date."""
    try:
        return datetime(*info.date_time)
    except ValueError:
        return None


def _read_zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, budget: _Budget) -> tuple[bytes | None, str]:
    """(content, "") of one notebook in a zip, or (None, why it could not be read)."""
    try:
        with archive.open(info) as handle:
            return _read_bounded(handle, budget, MAX_FILE_BYTES), ""
    except _TooLarge as err:
        return None, f"too large to collect: {err}"
    except _READ_ERRORS as err:
        return None, f"damaged in the zip, could not be read ({type(err).__name__}: {err})"


def _iter_nested(
    rel: str, opener, mtime: datetime | None, depth: int, budget: _Budget, keep: tuple[str, ...]
) -> Iterator[tuple[str, bytes | None, datetime | None, str]]:
    """A zip inside the download (a student's own, or one per student): spooled to disk, then read."""
    if depth > MAX_ZIP_DEPTH:
        yield rel, None, mtime, f"a zip nested more than {MAX_ZIP_DEPTH} deep: not opened"
        return
    with tempfile.TemporaryFile(prefix="autograder-collect-") as spool:
        try:
            with opener() as handle:
                size = 0
                while chunk := handle.read(2**20):
                    size += len(chunk)
                    budget.take(len(chunk))
                    if size > MAX_FILE_BYTES:
                        raise _TooLarge(f"larger than {MAX_FILE_BYTES / 2**20:g} MiB")
                    spool.write(chunk)
        except _TooLarge as err:
            yield rel, None, mtime, f"a zip too large to open: {err}"
            return
        except _READ_ERRORS as err:
            yield rel, None, mtime, f"a zip damaged in the download, could not be read ({type(err).__name__}: {err})"
            return
        spool.seek(0)
        try:
            inner = zipfile.ZipFile(spool)
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            yield rel, None, mtime, f"a damaged zip file ({err})"
            return
        with inner:
            if not inner.infolist():
                yield rel, None, mtime, "an empty zip file"
                return
            yield from _iter_zip(inner, rel[:-4] + "/", depth, budget, keep)


def gradescope_metadata(source: Path) -> dict[str, Identity]:
    """The Gradescope submitters of a download (empty when it is not a Gradescope export)."""
    source = Path(source)
    text = None
    if source.is_dir():
        found = sorted(p for p in source.rglob(GRADESCOPE_METADATA) if p.is_file() and not p.is_symlink())
        if found and found[0].stat().st_size < MAX_FILE_BYTES:
            text = found[0].read_text(errors="replace")
    elif source.is_file() and zipfile.is_zipfile(source):
        try:
            with zipfile.ZipFile(source) as archive:
                names = sorted(n for n in archive.namelist() if PurePosixPath(n).name == GRADESCOPE_METADATA)
                if names:
                    with archive.open(names[0]) as handle:
                        text = _read_bounded(handle, _Budget(MAX_FILE_BYTES), MAX_FILE_BYTES).decode(errors="replace")
        except (*_READ_ERRORS, _TooLarge):
            text = None
    return gradescope_identities(text) if text else {}


# --- matching notebooks to assignments -------------------------------------------------------------


def release_index(root: Path, assignment_ids: list[str]) -> dict[tuple[str, str], set[str]]:
    """(assignment, notebook file name) -> grade_ids of its release notebook (modules/)."""
    from autograder.config import RELEASE_DIRECTORY

    index = {}
    for assignment in assignment_ids:
        index.update(notebook_index(Path(root) / RELEASE_DIRECTORY / assignment, assignment))
    return index


def notebook_index(folder: Path, assignment: str) -> dict[tuple[str, str], set[str]]:
    """(assignment, notebook file name) -> grade_ids, for the release notebooks in ``folder``."""
    from autograder.notebooks import read

    return {(assignment, path.name): repair.marked_ids(read(path)) for path in sorted(Path(folder).glob("*.ipynb"))}


def reserved_words(index: dict[tuple[str, str], set[str]]) -> frozenset[str]:
    """The words of the release notebooks' names ("prefill", "decode"): never taken for a student's name."""
    return frozenset(word for _, name in index for word in re.split(r"[_ .-]+", Path(name).stem.lower()) if word)


def _normalised_name(name: str) -> str:
    stem = PurePosixPath(name).name.lower()
    stem = re.sub(r"\.ipynb$", "", stem)
    stem = re.sub(r"^copy of ", "", stem)
    stem = re.sub(r"\s*\(\d+\)$|-\d+$", "", stem)
    return stem


def _by_name(name: str, index) -> list[tuple[str, str]]:
    stem = _normalised_name(name)
    return [key for key in index if Path(key[1]).stem.lower() in stem]


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
        by_name = _by_name(name, index)
        if len(by_name) == 1:
            return by_name[0], "matched by file name (no graded cells recognised)"
    return None, "does not look like any assignment's notebook (too few of its graded cells found)"


@dataclass
class Verdict:
    """What one notebook of a download is: whose, which release notebook, and how that was decided."""

    identity: Identity | None  # None: the collector's rule names nobody
    key: tuple[str, str] | None  # (assignment, notebook file name); None: not collected
    reason: str  # how it was matched, or why it was not
    unreadable: bool = False  # the student needs manual grading: their file could not be parsed


def examine(
    rel: str, content: bytes, collector, index: dict[tuple[str, str], set[str]], reserved: frozenset[str]
) -> Verdict:
    """Whose notebook ``content`` (found at ``rel`` in the download) is and which release notebook it is.

    One rule for ``autograder collect`` and the nbgrader collector plugins: the student from
    ``collector``'s rule on the path, the notebook from the markers of its graded cells
    (:func:`match_notebook`), whatever its file name.
    """
    identity = collector.identify(rel, reserved)
    if identity is None:
        return Verdict(None, None, NO_STUDENT)
    try:
        nb = repair.read_submission(content)
    except repair.UnreadableNotebook as err:
        return Verdict(identity, None, str(err), unreadable=True)
    key, how = match_notebook(nb, rel, index)
    return Verdict(identity, key, how)


# --- collect -------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    time: datetime
    entry: Entry
    content: bytes


def collect(
    source: Path,
    root: Path,
    assignment_ids: list[str],
    pattern: str = "auto",
    progress: bool = False,
) -> CollectReport:
    """Copy the notebooks in ``source`` (zip or folder) into ``root``'s submitted/ folder.

    ``pattern``: see :func:`compile_pattern`. Returns the report, also written to
    ``grading/collect-report.json``; students who need manual grading are in ``flags.json``.
    """
    course = Course(root)
    run = _Collection(Path(source), course, assignment_ids, compile_pattern(pattern, course.root))
    files = iter_files(source)
    if progress:
        from tqdm import tqdm

        files = tqdm(files, desc="collect", unit="entry")
    for rel, content, mtime, problem in files:
        run.take(rel, content, mtime, problem)
    run.write_submissions()
    run.write_records()
    return run.report


class _Collection:
    """One ``autograder collect`` run: every entry of the download in turn, then the files and records."""

    def __init__(self, source: Path, course: Course, assignment_ids: list[str], collector) -> None:
        self.course, self.assignment_ids, self.collector = course, assignment_ids, collector
        self.index = release_index(course.root, assignment_ids)
        if not self.index:
            raise RuntimeError(
                f"no release notebooks for {', '.join(assignment_ids)} in {course.release_dir}: "
                "run `autograder release` first"
            )
        collector.prepare(source)  # Gradescope's metadata
        self.reserved = reserved_words(self.index)
        self.report = CollectReport()
        self.manual: dict[str, dict[str, list[str]]] = {}  # assignment -> student -> reasons
        self.candidates: dict[tuple[str, str, str], list[_Candidate]] = {}  # (student, assignment, notebook)
        self.seen: dict[str, set[str]] = {a: set() for a in assignment_ids}  # students collected per assignment

    def flag(self, student: str, entry: Entry, why: str) -> None:
        """Mark ``student`` for manual grading in the assignment(s) ``entry`` may belong to."""
        keys = [(entry.assignment, entry.notebook)] if entry.assignment else _by_name(entry.source, self.index)
        for assignment in sorted({key[0] for key in keys} or set(self.assignment_ids)):
            self.manual.setdefault(assignment, {}).setdefault(student, []).append(f"{entry.source}: {why}")

    def take(self, rel: str, content: bytes | None, mtime: datetime | None, problem: str) -> None:
        """One entry of the download: listed as skipped, or kept as a candidate for its notebook."""
        entry = Entry(source=rel)
        own = self.collector.own_file(rel)
        if own:
            entry.reason = own
            self.report.unmatched.append(entry)
        elif content is None:
            self._skip_unread(entry, problem)
        else:
            self._take_notebook(entry, content, mtime)

    def _skip_unread(self, entry: Entry, problem: str) -> None:
        """An entry that was not read: its student (when the path names one) needs manual grading."""
        rel = entry.source
        looks_like_notebook = rel.lower().endswith(".ipynb") or (
            rel.lower().endswith(".zip") and problem and problem != FOLDER
        )
        identity = self.collector.identify(rel, self.reserved) if looks_like_notebook else None
        entry.student, entry.name = (identity.student, identity.name) if identity else (None, None)
        entry.reason = problem or "could not be read"
        self.report.unmatched.append(entry)
        if entry.student and not problem.startswith(("an unsafe path", "a hidden file")):
            self.flag(entry.student, entry, entry.reason)

    def _take_notebook(self, entry: Entry, content: bytes, mtime: datetime | None) -> None:
        verdict = examine(entry.source, content, self.collector, self.index, self.reserved)
        identity = verdict.identity
        entry.student, entry.name = (identity.student, identity.name) if identity else (None, None)
        if verdict.key is None:
            entry.reason = verdict.reason
            self.report.unmatched.append(entry)
            if verdict.unreadable:
                self.flag(entry.student, entry, entry.reason)
            return
        entry.assignment, entry.notebook = verdict.key
        entry.reason = verdict.reason
        when = identity.time or mtime or datetime.min
        entry.time = when.isoformat(sep=" ")
        pile = self.candidates.setdefault((entry.student, *verdict.key), [])
        pile.append(_Candidate(when, entry, content))
        self._supersede_older(pile, entry.student)

    def _supersede_older(self, pile: list[_Candidate], student: str) -> None:
        """Keep the content of the latest file(s) only: memory holds one notebook per slot (ties aside)."""
        latest = max(c.time for c in pile)
        for older in [c for c in pile if c.time < latest]:
            pile.remove(older)
            self.report.superseded.append(older.entry)
            older.entry.reason = f"older ({older.entry.time}) than another file of {student}"

    def write_submissions(self) -> None:
        """Resolve ties (the last path is graded, the student marked) and write each chosen file."""
        for (student, assignment, notebook), pile in sorted(self.candidates.items()):
            pile.sort(key=lambda c: c.entry.source)
            chosen = pile[-1]
            for other in pile[:-1]:
                other.entry.reason = f"same time ({other.entry.time}) as {chosen.entry.source}, which was graded"
                self.report.superseded.append(other.entry)
            if len(pile) > 1:
                names = ", ".join(c.entry.source for c in pile)
                self.manual.setdefault(assignment, {}).setdefault(student, []).append(
                    f"{len(pile)} files for {notebook} with the same time ({chosen.entry.time}): {names}; "
                    f"{chosen.entry.source} was graded (the last by path, not a judgement): check which one counts"
                )
            self._write(chosen, student, assignment, notebook)

    def _write(self, chosen: _Candidate, student: str, assignment: str, notebook: str) -> None:
        """submitted/<student>/<assignment>/<notebook> and timestamp.txt, and the copy as received."""
        self.seen.setdefault(assignment, set()).add(student)
        target = self.course.submitted / student / assignment / notebook
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.write_bytes(chosen.content)
        (target.parent / "timestamp.txt").write_text(chosen.time.strftime("%Y-%m-%d %H:%M:%S.%f"))
        received = self.course.work(assignment) / "received" / student / notebook
        received.parent.mkdir(parents=True, exist_ok=True)
        received.write_bytes(chosen.content)
        (received.parent / f"{notebook}.source").write_text(chosen.entry.source)
        chosen.entry.path = str(target.relative_to(self.course.root))
        self.report.collected.append(chosen.entry)

    def write_records(self) -> None:
        """flags.json per assignment (look-alike names included) and grading/collect-report.json."""
        _flag_look_alike_names(self.report, self.manual)
        for assignment in self.assignment_ids:
            flagged = self.manual.get(assignment, {})
            self.course.set_flags(assignment, "collect", flagged, self.seen.get(assignment, set()) | set(flagged))
            for student, reasons in flagged.items():
                self.report.manual.setdefault(student, []).extend(reasons)
        report = json.dumps(self.report.to_json(), indent=1, ensure_ascii=False)
        (self.course.grading / "collect-report.json").write_text(report)


def _flag_look_alike_names(report: CollectReport, manual: dict[str, dict[str, list[str]]]) -> None:
    """Mark for manual grading every student whose files came under different exact names.

    Names that differ only in Unicode normalisation (NFC and NFD, as macOS and Windows archives
    write them) or in spaces (leading, trailing, repeated, non-breaking, tabs) give one student id:
    they are taken as one person, but never silently: only one file per notebook is graded, so the
    student is marked for manual grading with every path and exact name named.
    """
    groups: dict[tuple[str, str], dict[str, list[str]]] = {}
    entries = [*report.collected, *report.superseded]
    for entry in entries:
        if entry.student and entry.assignment and entry.name is not None:
            groups.setdefault((entry.student, entry.assignment), {}).setdefault(entry.name, []).append(entry.source)
    for (student, assignment), names in sorted(groups.items()):
        if len(names) < 2:
            continue
        listed = "; ".join(f"{', '.join(sorted(paths))} (name {name})" for name, paths in sorted(names.items()))
        manual.setdefault(assignment, {}).setdefault(student, []).append(
            f"files under {len(names)} different names were taken as one student ({student}): {listed}; "
            "only the newest file of each notebook was graded: check that they are one person and which file counts"
        )


def received_name(course, assignment: str, student: str, notebook: str) -> str | None:
    """The file name a notebook had when it was collected (None when it was not collected by us)."""
    marker = course.work(assignment) / "received" / student / f"{notebook}.source"
    return marker.read_text() if marker.is_file() else None


def remove_submission(course: Course, assignment: str, student: str, notebook: str) -> None:
    """Take a notebook out of submitted/ (it stays in grading/<assignment>/received/)."""
    target = course.submitted / student / assignment / notebook
    if target.is_symlink() or target.exists():
        target.unlink() if target.is_symlink() or target.is_file() else shutil.rmtree(target)
