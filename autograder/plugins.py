"""The course's collect and export rules as nbgrader plugins, for ``autograder`` and plain ``nbgrader`` alike.

``autograder collect`` and ``autograder export`` are built on these classes, and nbgrader's own
commands load them by name (``nbgrader_config.py`` or the command line)::

    c.ZipCollectApp.collector_plugin = "autograder.plugins.CanvasCollector"  # or AutoCollector, ...
    c.ZipCollectApp.extractor_plugin = "autograder.plugins.CourseExtractor"
    c.ExportApp.plugin_class = "autograder.plugins.CourseCsvExport"

    nbgrader zip_collect m1_prefill_decode --collector=autograder.plugins.AutoCollector \\
        --extractor=autograder.plugins.CourseExtractor
    nbgrader export --exporter=autograder.plugins.CourseCsvExport

One collector class per LMS preset (:data:`PRESETS`, ``--pattern`` of ``autograder collect``): the
rule that says who submitted a file lives in the class and nowhere else. Per file, a collector
does what ``autograder collect`` does (:func:`autograder.collect.examine`): the student id keeps
the LMS's user id (:func:`autograder.collect.student_id`), the notebook is recognised by the
markers of its graded cells against the release (any file name), and the LMS's own submission time
is kept. What nbgrader's one-file-at-a-time interface cannot carry stays in ``autograder collect``;
:class:`CourseCollector` says what plain ``nbgrader zip_collect`` does instead.

nbgrader's interfaces: ``nbgrader/plugins/zipcollect.py`` (``FileNameCollectorPlugin.collect``,
``ExtractorPlugin.extract``) and ``nbgrader/plugins/export.py`` (``ExportPlugin.export``), nbgrader 0.9.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import ClassVar

from nbgrader.plugins import ExportPlugin, ExtractorPlugin, FileNameCollectorPlugin
from traitlets import Unicode

from autograder import collect as _collect
from autograder.collect import Identity, exact_name, lms_time, student_id

# --- who submitted a file: one class per LMS preset --------------------------------------------------


@functools.lru_cache(maxsize=64)
def _compiled(rule: str, flags: int) -> re.Pattern:
    return re.compile(rule, flags)


@dataclass
class _ZipCollectRun:
    """What a collector needs to know of the ``nbgrader zip_collect`` run that loaded it."""

    extracted: Path  # downloaded/<assignment>/extracted: the files nbgrader hands to collect()
    archives: Path  # downloaded/<assignment>/archive: the downloads as the instructor put them there
    index: dict[tuple[str, str], set[str]]  # the assignment's release notebooks and their graded cells
    reserved: frozenset[str]
    trusted_times: bool  # CourseExtractor kept each file's time from the zip: a submission time

    def relative(self, path: str) -> str:
        """``path`` as inside the download: relative to ``extracted/``, without the folder nbgrader
        named after a zip of ``archive/`` (so ``amy/x.ipynb`` of ``class.zip`` is ``amy/x.ipynb``, as
        ``autograder collect class.zip`` sees it)."""
        rel = Path(os.path.relpath(path, self.extracted)).as_posix()
        first, _, rest = rel.partition("/")
        return rest if rest and (self.archives / f"{first}.zip").is_file() else rel


class CourseCollector(FileNameCollectorPlugin):
    """A course collector: who submitted a file (:meth:`identify`) and which notebook it is (its content).

    As ``c.ZipCollectApp.collector_plugin`` of plain ``nbgrader zip_collect``, :meth:`collect`
    returns the student id, the release notebook's file name as ``file_id`` (found by the graded
    cells' markers, so "Copy of x (1).ipynb" lands as ``x.ipynb``) and the LMS's submission time
    (Blackboard's file name, Gradescope's metadata; with :class:`CourseExtractor`, else the time
    stored in the zip). What plain ``zip_collect`` then does differently from ``autograder collect``:

    * duplicates: nbgrader keeps, per student, the file with the newest timestamp, compared with the
      newest of any of the student's files; a tie goes to the file whose path sorts last (the
      file ``autograder collect`` grades too) with a log warning only, where ``autograder collect``
      also marks the student for manual grading naming both files. A duplicate without timestamps
      stops ``zip_collect`` ("Duplicate submission file. No timestamps for comparison"): without
      :class:`CourseExtractor`, extracted files carry the extraction time, which says nothing about
      who submitted when, so only the LMS's own time is returned;
    * unreadable, damaged or unrecognised notebooks, files without a student id, symbolic links,
      hidden files: skipped with the reason in nbgrader's log; ``autograder collect`` also marks such
      a student for manual grading (``grading/<assignment>/flags.json``) and lists every entry in
      ``grading/collect-report.json`` (no report here), and keeps the file as received
      (``grading/<assignment>/received/``, whose original name feedback mentions);
    * look-alike names that give one student id (NFC and NFD, stray spaces) are merged without the
      mark ``autograder collect`` adds;
    * hostile downloads: nbgrader's default extractor unpacks everything, unbounded; use
      :class:`CourseExtractor` for ``autograder collect``'s bounded reading.
    """

    preset: ClassVar[str] = ""  # its --pattern name
    rule: ClassVar[str] = ""  # a regex searched in the path inside the download: groups student, id, time
    _run: _ZipCollectRun | None = None

    # --- the rule (also used by autograder collect) ---------------------------------------------

    def expression(self) -> re.Pattern:
        """The compiled rule (presets ignore case: LMS downloads write ``_LATE_`` and ``_late_``)."""
        return _compiled(self.rule, re.IGNORECASE)

    def prepare(self, source: Path) -> None:
        """Read what the rule needs from the whole download (a zip or folder) before any file; nothing here."""

    def own_file(self, rel: str) -> str:
        """Why the file at ``rel`` is the collector's own input, not a submission ("": a submission)."""
        return ""

    def takes_name(self, raw: str, reserved: frozenset[str]) -> bool:
        """Whether a name the rule found can be a student's (not a word of a notebook's name)."""
        return True

    def identify(self, rel: str, reserved: frozenset[str] = frozenset()) -> Identity | None:
        """Who submitted the file at ``rel`` (a ``/`` path inside the download); None when the rule names nobody.

        ``reserved``: words of the release notebooks' names, never taken for a student's name.
        """
        match = self.expression().search(rel)
        if match is None:
            return None
        groups = match.groupdict()
        raw, lms_id = groups.get("student") or "", groups.get("id")
        if not self.takes_name(raw, reserved):
            return None
        sid = student_id(raw, lms_id)
        return Identity(sid, lms_time(groups.get("time")), exact_name(raw, lms_id)) if sid else None

    # --- nbgrader zip_collect's interface --------------------------------------------------------

    def collect(self, submitted_file: str) -> dict | None:
        """nbgrader's call per extracted file: ``{student_id, file_id, timestamp}``, or None to skip it.

        ``submitted_file``: an absolute path under ``downloaded/<assignment>/extracted/``;
        ``timestamp``: a naive local datetime or None.
        """
        run = self._zip_collect_run()
        rel = run.relative(submitted_file)
        why_not = self._not_a_submission(submitted_file, rel)
        if why_not:
            (self.log.debug if why_not == _NOT_A_NOTEBOOK else self.log.warning)("Skipped %s: %s", rel, why_not)
            return None
        try:
            content = _collect.read_file(submitted_file)
        except (OSError, ValueError) as err:
            self.log.warning("Skipped %s: could not be read (%s)", rel, err)
            return None
        verdict = _collect.examine(rel, content, self, run.index, run.reserved)
        if verdict.key is None:
            manual = "; `autograder collect` marks the student for manual grading" if verdict.unreadable else ""
            self.log.warning("Skipped %s: %s%s", rel, verdict.reason, manual)
            return None
        when = verdict.identity.time
        if when is None and run.trusted_times:
            when = datetime.fromtimestamp(os.lstat(submitted_file).st_mtime)
        self.log.info("%s: %s, %s (%s)", rel, verdict.identity.student, verdict.key[1], verdict.reason)
        return {"student_id": verdict.identity.student, "file_id": verdict.key[1], "timestamp": when}

    def _not_a_submission(self, path: str, rel: str) -> str:
        if not rel.lower().endswith(_collect.NOTEBOOKS):
            return _NOT_A_NOTEBOOK
        if os.path.islink(path):
            return "a symbolic link: not followed"
        return self.own_file(rel) or _collect.skip_reason(rel)

    def _zip_collect_run(self) -> _ZipCollectRun:
        if self._run is None:
            self._run = self._run_of(self.parent)
            self.prepare(self._run.extracted)
        return self._run

    @staticmethod
    def _run_of(app) -> _ZipCollectRun:
        from nbgrader.apps.zipcollectapp import ZipCollectApp

        if not isinstance(app, ZipCollectApp):
            raise RuntimeError(
                "collect() is nbgrader zip_collect's call (c.ZipCollectApp.collector_plugin); "
                "elsewhere use identify() or `autograder collect`"
            )
        coursedir = app.coursedir
        assignment = coursedir.assignment_id
        # nbgrader's own layout of zip_collect (ZipCollectApp._format_collect_path), from its public settings
        layout = os.path.join(coursedir.root, app.collect_directory_structure)
        folder = functools.partial(layout.format, downloaded=app.downloaded_directory, assignment_id=assignment)
        release = Path(coursedir.format_path(coursedir.release_directory, ".", assignment))
        index = _collect.notebook_index(release, assignment)
        if not index:
            app.fail(f"no release notebooks in {release}: run `autograder release {assignment}` first")
        return _ZipCollectRun(
            extracted=Path(folder(collect_step=app.extracted_directory)),
            archives=Path(folder(collect_step=app.archive_directory)),
            index=index,
            reserved=_collect.reserved_words(index),
            trusted_times=issubclass(app.extractor_plugin, CourseExtractor),
        )


_NOT_A_NOTEBOOK = "not a notebook (.ipynb)"


class MoodleCollector(CourseCollector):
    """Moodle's "Download all submissions": ``Full Name_<participant id>_assignsubmission_file_/<file>``
    (a folder, or a file name prefix); the id is ``<name>_<participant id>``."""

    preset = "moodle"
    rule = (
        r"^(?:[^/]*/)*?(?P<student>[^/]+?)_(?P<id>\d+)_assign(?:submission|feedback)_"
        r"(?:file|onlinetext)(?:_?/|_)"
    )


class CanvasCollector(CourseCollector):
    """Canvas's "Download submissions": ``lastfirst[_LATE]_<user id>_<attachment id>_<file name>``;
    the id is ``<lastfirst>_<user id>``."""

    preset = "canvas"
    rule = r"(?:^|/)(?P<student>[^/_]+)_(?:late_)?(?P<id>\d+)_\d+_[^/]+$"


class BlackboardCollector(CourseCollector):
    """Blackboard's "Download assignment": ``<assignment>_<username>_attempt_<YYYY-MM-DD-HH-MM-SS>_<file>``;
    the id is the username, the attempt's time the submission time."""

    preset = "blackboard"
    rule = r"(?:^|/)[^/]*?_(?P<id>[^/_]+)_attempt_(?P<time>\d{4}-\d\d-\d\d-\d\d-\d\d-\d\d)(?:_[^/]*)?$"


class FolderCollector(CourseCollector):
    """A folder per student: the first folder of the path is the student's name."""

    preset = "folder"
    rule = r"^(?P<student>[^/]+)/"


class FilePrefixCollector(CourseCollector):
    """The student's name as a file name prefix, up to the first ``_``, ``-`` or space (``s1234567-week1.ipynb``).

    A prefix that is a word of a notebook's name ("Copy of ...", "prefill_decode.ipynb") is no name.
    """

    preset = "file"
    rule = r"(?:^|/)(?P<student>[^/_ -]+)[_ -][^/]+$"
    NOT_NAMES: ClassVar[frozenset[str]] = frozenset({"copy", "untitled", "submission", "notebook"})

    def takes_name(self, raw: str, reserved: frozenset[str]) -> bool:
        return raw.lower() not in self.NOT_NAMES and raw.lower() not in reserved


class GradescopeCollector(CourseCollector):
    """Gradescope's "Export submissions": ``submission_<id>/`` folders named in ``submission_metadata.yml``.

    The id is ``<name>_<student id>`` (else the e-mail) of the first submitter; the time is
    ``:created_at:``. Under plain ``nbgrader zip_collect`` the metadata file is read from the
    extracted folder (nbgrader's default extractor keeps it; :class:`CourseExtractor` too).
    """

    preset = "gradescope"
    submitters: dict[str, Identity] | None = None  # submission folder -> submitter

    def prepare(self, source: Path) -> None:
        self.submitters = _collect.gradescope_metadata(source)

    def own_file(self, rel: str) -> str:
        if self.submitters and PurePosixPath(rel).name == _collect.GRADESCOPE_METADATA:
            return "Gradescope's list of submitters (read for the student ids)"
        return ""

    def identify(self, rel: str, reserved: frozenset[str] = frozenset()) -> Identity | None:
        for part in PurePosixPath(rel).parts[:-1]:
            if self.submitters and part in self.submitters:
                return self.submitters[part]
        return None


class PatternCollector(CourseCollector):
    """An instructor's own rule: ``c.PatternCollector.pattern``, ``autograder collect --pattern REGEX``.

    A regex searched in the path inside the download, with a named group ``student`` (a name)
    and/or ``id`` (the LMS's user id), optionally ``time`` (``YYYY-MM-DD-HH-MM-SS``); case matters.
    """

    preset = "custom"
    pattern = Unicode("", help="regex with (?P<student>...) and/or (?P<id>...), optionally (?P<time>...)").tag(
        config=True
    )

    def expression(self) -> re.Pattern:
        return check_pattern(self.pattern)


def check_pattern(pattern: str) -> re.Pattern:
    """``pattern`` compiled; a ValueError that says what is wrong with it otherwise."""
    try:
        compiled = _compiled(pattern, 0)
    except re.error as err:
        raise ValueError(f"--pattern {pattern!r} is not a valid regular expression: {err}") from None
    if not {"student", "id"} & set(compiled.groupindex):
        raise ValueError(
            f"--pattern {pattern!r} needs a named group for the student id, e.g. '^(?P<student>[^/]+)/' "
            "(and optionally (?P<id>...) for the LMS's user id)"
        )
    return compiled


PRESETS: dict[str, type[CourseCollector]] = {
    cls.preset: cls
    for cls in (
        GradescopeCollector,
        MoodleCollector,
        CanvasCollector,
        BlackboardCollector,
        FolderCollector,
        FilePrefixCollector,
    )
}


class AutoCollector(CourseCollector):
    """Every preset in turn (Gradescope, Moodle, Canvas, Blackboard, folder, file prefix): the first that
    names a student wins. ``autograder collect``'s default."""

    preset = "auto"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.members = [cls(parent=self.parent) for cls in PRESETS.values()]

    def prepare(self, source: Path) -> None:
        for member in self.members:
            member.prepare(source)

    def own_file(self, rel: str) -> str:
        return next((why for member in self.members if (why := member.own_file(rel))), "")

    def identify(self, rel: str, reserved: frozenset[str] = frozenset()) -> Identity | None:
        return next((found for member in self.members if (found := member.identify(rel, reserved))), None)


class ForeignCollector(CourseCollector):
    """An nbgrader ``FileNameCollectorPlugin`` an instructor already has, inside ``autograder collect``.

    nbgrader calls such a plugin with a file's absolute path under ``extracted/``; here it gets the
    path inside the download (``Jane Doe_1_assignsubmission_file_/x.ipynb``), which a
    ``named_regexp`` that starts with ``.*`` matches alike. Its ``student_id`` is kept when it is a
    safe folder name (letters, digits, ``.``, ``_``, ``-``), else made one by
    :func:`~autograder.collect.student_id`; its ``timestamp`` is read as nbgrader reads it (UTC);
    its ``file_id`` is not needed: the notebook is recognised by its content, as with every collector.
    """

    preset = "plugin"

    def __init__(self, plugin: FileNameCollectorPlugin, **kwargs) -> None:
        super().__init__(**kwargs)
        self.plugin = plugin

    def identify(self, rel: str, reserved: frozenset[str] = frozenset()) -> Identity | None:
        from nbgrader.utils import parse_utc

        info = self.plugin.collect(rel)
        raw = info.get("student_id") if isinstance(info, dict) else None
        if not isinstance(raw, str) or not raw:
            return None
        sid = raw if re.fullmatch(r"\w[\w.-]{0,63}", raw) else student_id(raw)
        try:
            when = parse_utc(info.get("timestamp") or None)
        except (ValueError, OverflowError):  # dateutil's errors for a timestamp it cannot read
            when = None
        return Identity(sid, when, exact_name(raw, None)) if sid else None


def collector_for(pattern: str, root: Path | None = None) -> CourseCollector:
    """The collector ``autograder collect --pattern`` names: ``auto``, a preset, a class, or a regex.

    A class is given by its dotted name (``mycourse.plugins.MyCollector``): a :class:`CourseCollector`
    subclass, or any nbgrader ``FileNameCollectorPlugin`` (wrapped in :class:`ForeignCollector`;
    its settings, such as ``named_regexp``, come from ``nbgrader_config.py`` in the course ``root``).
    Anything else is taken for a regex (:class:`PatternCollector`).
    """
    if pattern == "auto":
        return AutoCollector()
    if pattern in PRESETS:
        return PRESETS[pattern]()
    found = _named_class(pattern)
    if found is not None and issubclass(found, CourseCollector):
        return found()
    if found is not None and issubclass(found, FileNameCollectorPlugin):
        return ForeignCollector(found(config=_course_config(root)))
    if found is not None:
        raise ValueError(f"--pattern {pattern}: {found.__name__} is not an nbgrader FileNameCollectorPlugin")
    collector = PatternCollector(pattern=pattern)
    collector.expression()  # a bad regex is an error now, not at the first file
    return collector


def _named_class(pattern: str) -> type | None:
    """The class a dotted name (``package.module.Class``) names; None when ``pattern`` names none."""
    if "(" in pattern or not re.fullmatch(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", pattern):
        return None  # a regex with a named group has a "("
    module, _, name = pattern.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def _course_config(root: Path | None):
    """The settings of the course's ``nbgrader_config.py`` (as nbgrader reads it), empty without one."""
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    folder = Path(root) if root is not None else Path.cwd()
    if not (folder / "nbgrader_config.py").is_file():
        return Config()
    return PyFileConfigLoader("nbgrader_config.py", path=str(folder)).load_config()


# --- extracting the downloads --------------------------------------------------------------------


class CourseExtractor(ExtractorPlugin):
    """nbgrader zip_collect's extraction with ``autograder collect``'s bounded reading.

    Reads every download in ``archive/`` (zips, nested zips up to two deep, plain files) as
    ``autograder collect`` does (:func:`autograder.collect.iter_files`): one member at a time, each
    at most 100 MiB and 4 GiB in all, symbolic links, unsafe (``..``, absolute) and hidden paths
    never written. Only notebooks and Gradescope's ``submission_metadata.yml`` are extracted, each
    with the time stored in the zip (or the file's), which the course's collectors then take as the
    submission time. A zip ``archive/class.zip`` is extracted into ``extracted/class/``, as
    nbgrader's default extractor does. ``zip_ext``: only ``.zip`` is opened.
    """

    def extract(self, archive_path: str, extracted_path: str) -> None:
        """Write the notebooks of every download in ``archive_path`` under ``extracted_path``."""
        written = 0
        keep = (*_collect.NOTEBOOKS, _collect.GRADESCOPE_METADATA)
        for rel, content, mtime, problem in _collect.iter_files(Path(archive_path), keep=keep):
            if content is None:
                if problem != _collect.FOLDER:  # a folder entry of a zip says nothing
                    log = self.log.debug if problem == _NOT_A_NOTEBOOK else self.log.warning
                    log("Not extracted: %s: %s", rel, problem)
                continue
            target = Path(extracted_path, rel)
            if target.exists():  # two downloads give one path (archive/class.zip and archive/class/)
                self.log.warning("Not extracted: %s: another download already gave %s", rel, target)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            if mtime is not None:
                os.utime(target, (mtime.timestamp(), mtime.timestamp()))
            written += 1
        self.log.info("Extracted %d file(s) from %s", written, archive_path)


# --- exporting the grades ------------------------------------------------------------------------


class CourseCsvExport(ExportPlugin):
    """The course's ``grades.csv`` and ``summary.csv`` per assignment, as ``autograder export`` writes them.

    ``nbgrader export --exporter=autograder.plugins.CourseCsvExport`` writes them for every assignment
    of the gradebook (``--assignment`` and ``--student`` narrow it) into ``grading/<assignment>/``,
    or ``<to>/<assignment>/`` with ``--to FOLDER``. The columns and rounding are
    :func:`autograder.export.grades_of`'s: one row per student with each exercise's score, the
    total, the maximum and the status (including the reasons of ``autograder``'s manual-grading
    marks, read from ``grading/<assignment>/``).
    """

    def export(self, gradebook) -> None:
        """nbgrader's call: ``gradebook`` is the open nbgrader ``Gradebook`` of the course."""
        course = self._course()
        names = [str(name) for name in self.assignment] or [found.name for found in gradebook.assignments]
        for name in names:
            folder = Path(self.to) / name if self.to else None
            result, grades, summary = self.write(gradebook, course, name, folder)
            self.log.info("%s: %d student(s): wrote %s and %s", name, len(result.rows), grades, summary)

    def write(self, gradebook, course, assignment: str, folder: Path | None = None):
        """(Export, grades.csv, summary.csv) of one assignment, in ``folder`` (default grading/<assignment>/)."""
        from autograder.export import grades_of, write_csv

        students = {str(student) for student in self.student} or None
        result = grades_of(gradebook, course, assignment, students)
        return (result, *write_csv(result, Path(folder) if folder else course.work(assignment)))

    def _course(self):
        from autograder.course_dir import Course

        coursedir = getattr(self.parent, "coursedir", None)
        if coursedir is None:
            raise RuntimeError("export() is nbgrader export's call (c.ExportApp.plugin_class); elsewhere use write()")
        return Course(coursedir.root, db_url=coursedir.db_url)
