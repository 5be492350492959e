"""Repair a submitted notebook so nbgrader can grade it: lost metadata, deleted cells, Colab's format.

Students' notebooks reach the grader damaged in predictable ways: Colab saves nbformat 4.0 without
cell ids and with its own metadata, "Save a copy" or copy and paste drops nbgrader's cell metadata,
students delete or edit test cells, duplicate answer cells, or turn a cell into markdown. nbgrader
then silently loses points (a cell without metadata is not graded) or refuses the notebook
("Inconsistent checksums"). Every graded cell of the course starts with a marker comment
(``# EXERCISE: <grade_id>`` or ``# TEST: <grade_id>``), so the cells can be recognised by content
and their metadata restored from the *release* notebook (the student version in ``modules/``),
which holds no solutions or hidden tests. nbgrader then restores every test cell's full source
(hidden tests included) from the gradebook when it autogrades.

:func:`repair` returns the repaired notebook and learner-facing notes of what was done; the notes
travel in the notebook's metadata (``metadata.autograder.repair``) into the feedback.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field

import nbformat
from nbformat import NotebookNode

from autograder import notebooks

# Keys Colab adds; they mean nothing to Jupyter or nbgrader.
COLAB_CELL_KEYS = ("id", "colab", "outputId", "executionInfo", "colab_type")
COLAB_NOTEBOOK_KEYS = ("colab", "accelerator", "gpuClass", "widgets")
# The metadata that decides how nbgrader grades a cell (checksums are restored too, but silently).
GRADING_KEYS = ("grade", "grade_id", "locked", "points", "solution", "task")
_DEF = re.compile(r"^(?:async\s+)?(?:def|class)\s+([A-Za-z_]\w*)", re.MULTILINE)


class UnreadableNotebook(ValueError):
    """The file is not a notebook that can be read (the message says why)."""


@dataclass
class RepairResult:
    notebook: NotebookNode
    notes: list[str] = field(default_factory=list)  # what was repaired, in words for the learner

    @property
    def changed(self) -> bool:
        return bool(self.notes)


def read_submission(raw: bytes | str) -> NotebookNode:
    """Parse a submitted file; nbformat 3 and 4.x notebooks are upgraded to 4.

    Malformed parts that a notebook editor or a student can leave behind are mended (and listed in
    ``metadata.autograder.read``): metadata that is not an object, a cell source that is a number,
    cells that are not objects, outputs in a shape nbformat rejects (outputs are cleared before
    grading anyway). Grader notes a student planted in ``metadata.autograder`` are dropped. A file
    that is not a notebook at all raises :class:`UnreadableNotebook` with the reason.
    """
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8-sig", errors="replace")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise UnreadableNotebook(f"the file is not valid notebook JSON ({err.msg} at line {err.lineno})") from None
    except (ValueError, RecursionError) as err:
        raise UnreadableNotebook(f"the file is not valid notebook JSON ({type(err).__name__})") from None
    if not isinstance(data, dict) or "cells" not in data and "worksheets" not in data:
        raise UnreadableNotebook("the file is JSON but not a Jupyter notebook (no cells)")
    notes: list[str] = []
    if "cells" in data:
        _mend(data, notes)
    try:
        nb = nbformat.reads(json.dumps(data), as_version=4)
    except Exception as err:  # nbformat raises several types for malformed notebooks
        raise UnreadableNotebook(f"the notebook cannot be read by nbformat: {err}") from None
    mended = json.loads(nbformat.writes(nb, version=nbformat.NO_CONVERT)) if "cells" not in data else None
    if mended is not None:  # an nbformat 3 notebook, converted: mend what the conversion carried over
        _mend(mended, notes)
        nb = nbformat.from_dict(mended)
    nb.metadata["autograder"] = {"read": notes}
    return nb


def _mend(data: dict, notes: list[str]) -> None:
    """Make an nbformat-4-shaped notebook's structure well-formed in place (see read_submission)."""
    if not isinstance(data.get("cells"), list):
        raise UnreadableNotebook(f"the notebook's cells are a {type(data.get('cells')).__name__}, not a list")
    if not isinstance(data.get("metadata"), dict):
        data["metadata"] = {}
        notes.append("The notebook's metadata was not an object and was reset.")
    data["metadata"].pop("autograder", None)  # only the grader writes its notes
    if not isinstance(data.get("nbformat"), int) or not isinstance(data.get("nbformat_minor"), int):
        data["nbformat"], data["nbformat_minor"] = 4, 0
    cells, dropped, mended = [], 0, 0
    for cell in data["cells"]:
        if not isinstance(cell, dict) or cell.get("cell_type") not in ("code", "markdown", "raw"):
            dropped += 1
            continue
        mended += _mend_cell(cell)
        cells.append(cell)
    data["cells"] = cells
    if dropped:
        notes.append(f"Dropped {dropped} malformed cell(s) that were not notebook cells.")
    if mended:
        notes.append(f"Mended the malformed source or metadata of {mended} cell(s).")


def _mend_cell(cell: dict) -> bool:
    """Make one cell (a dict with a known cell_type) well-formed in place and clear its outputs; whether its
    source or metadata was malformed."""
    fixed = _mend_source(cell)
    if not isinstance(cell.get("metadata"), dict):
        cell["metadata"], fixed = {}, True
    if "nbgrader" in cell["metadata"] and not isinstance(cell["metadata"]["nbgrader"], dict):
        del cell["metadata"]["nbgrader"]  # repair restores it from the marker comment
        fixed = True
    if "id" in cell and not isinstance(cell["id"], str):
        del cell["id"]
        fixed = True
    if not isinstance(cell.get("attachments", {}), dict):
        del cell["attachments"]
        fixed = True
    if cell["cell_type"] == "code":
        cell["outputs"], cell["execution_count"] = [], None
    else:
        cell.pop("outputs", None)
        cell.pop("execution_count", None)
    return fixed


def _mend_source(cell: dict) -> bool:
    """Make a cell's source one string in place (a list of lines is joined; None becomes "", any other
    value its JSON); whether it was malformed (a list of lines is not)."""
    fixed = False
    source = cell.get("source", "")
    if isinstance(source, list) and all(isinstance(part, str) for part in source):
        source = "".join(source)
    if not isinstance(source, str):
        source, fixed = ("" if source is None else json.dumps(source)), True
    cell["source"] = source
    return fixed


def first_marker(cell) -> tuple[str, str] | None:
    """("EXERCISE" | "TEST", grade_id) from the cell's first non-blank line (any cell type)."""
    source = cell.get("source", "")
    if isinstance(source, list):
        source = "".join(source)
    for line in source.split("\n"):
        if line.strip():
            match = notebooks.MARKER.match(line.strip())
            return (match.group(1), match.group(2)) if match else None
    return None


def marked_ids(nb) -> set[str]:
    """grade_ids a notebook carries, by marker or by metadata."""
    found = {m[1] for m in map(first_marker, nb.cells) if m}
    return found | {gid for gid in map(notebooks.grade_id, nb.cells) if gid}


def _normalise_format(nb, release, notes: list[str]) -> None:
    colab = "colab" in nb.metadata or any(
        key in cell.get("metadata", {}) for cell in nb.cells for key in ("colab", "id", "outputId", "executionInfo")
    )
    old_minor = nb.get("nbformat_minor", 0)
    for key in COLAB_NOTEBOOK_KEYS:
        nb.metadata.pop(key, None)
    for key in ("kernelspec", "language_info"):
        if key in release.metadata:
            nb.metadata[key] = copy.deepcopy(release.metadata[key])
    seen: set[str] = set()
    missing_ids = 0
    for cell in nb.cells:
        for key in COLAB_CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
        cell_id = cell.get("id")
        if not isinstance(cell_id, str) or not re.fullmatch(r"[a-zA-Z0-9-_]{1,64}", cell_id) or cell_id in seen:
            cell["id"] = uuid.uuid4().hex[:12]
            missing_ids += 1
        seen.add(cell["id"])
        if cell.cell_type == "code":
            # nbgrader clears outputs before grading anyway; dropping them here also drops any output
            # Colab wrote in a shape nbformat would reject.
            cell["outputs"], cell["execution_count"] = [], None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    nb.nbformat, nb.nbformat_minor = 4, max(5, old_minor)
    if colab or old_minor < 5 or missing_ids:
        what = "Colab's notebook format" if colab else f"notebook format 4.{old_minor}"
        notes.append(f"Converted {what} to nbformat 4.{nb.nbformat_minor} (cell ids added where missing).")


def _as_code(cell) -> NotebookNode:
    """A code cell with ``cell``'s source, id and metadata (a graded cell turned into markdown comes back)."""
    return NotebookNode(
        cell_type="code",
        id=cell.get("id", uuid.uuid4().hex[:12]),
        metadata=cell.get("metadata", {}),
        source=cell.get("source", ""),
        outputs=[],
        execution_count=None,
    )


def _is_stub(cell, release_cell) -> bool:
    return cell.get("source", "").strip() == release_cell.source.strip()


def _visible_source(source: str) -> str:
    from autograder.execution import without_hidden_tests

    return "\n".join(line.rstrip() for line in without_hidden_tests(source).strip().split("\n"))


@dataclass
class _Repairs:
    """What :func:`repair` changed, by grade_id, for its notes."""

    restored: list[str] = field(default_factory=list)  # grading metadata put back from a marker comment
    edited: list[str] = field(default_factory=list)  # test cells whose visible source had been changed
    duplicates: list[str] = field(default_factory=list)  # ids claimed by several cells
    adopted: list[str] = field(default_factory=list)  # answer cells found by the functions they define
    added: list[str] = field(default_factory=list)  # graded cells put back from the release
    retyped: list[str] = field(default_factory=list)  # cells turned back into their release type
    stripped: int = 0  # cells that lost grading metadata they do not hold


def repair(submission: NotebookNode, release: NotebookNode) -> RepairResult:
    """Restore the graded cells of ``submission`` from the ``release`` notebook.

    Args:
        submission: the learner's notebook (it is not modified; the result is a copy).
        release: the student version of the assignment's notebook (modules/), with nbgrader metadata.
    """
    nb = copy.deepcopy(submission)
    record = nb.metadata.get("autograder")
    notes: list[str] = list(record.get("read", [])) if isinstance(record, dict) else []
    _normalise_format(nb, release, notes)
    graded = [(notebooks.grade_id(cell), cell) for cell in release.cells if notebooks.grade_id(cell)]
    release_ids = {gid for gid, _ in graded}
    repairs = _Repairs()
    placed: dict[str, NotebookNode] = {}  # grade_id -> the submission cell now holding it
    for gid, release_cell in graded:
        index = _find_cell(nb, gid, release_cell, release_ids, repairs)
        if index is not None:
            placed[gid] = _restore_cell(nb, index, gid, release_cell, repairs)
    repairs.stripped = _strip_stray_metadata(nb, placed)
    _add_missing_cells(nb, graded, placed, repairs)
    notes += _notes(repairs, dict(graded))
    nb.metadata["autograder"] = {"repair": notes}
    nbformat.validate(nb)
    return RepairResult(nb, notes)


def _find_cell(nb, gid: str, release_cell, release_ids: set[str], repairs: _Repairs) -> int | None:
    """The index of the submission cell that holds ``gid``: by marker comment, else by metadata, else
    (answer cells) by the functions it defines; of several, the last one with an answer."""
    by_marker = [i for i, cell in enumerate(nb.cells) if (first_marker(cell) or ("", ""))[1] == gid]
    by_meta = [i for i, cell in enumerate(nb.cells) if notebooks.grade_id(cell) == gid and first_marker(cell) is None]
    candidates = by_marker or by_meta
    if len(candidates) > 1:
        answered = [i for i in candidates if not _is_stub(nb.cells[i], release_cell)]
        repairs.duplicates.append(gid)
        candidates = answered or candidates
    if candidates:
        return candidates[-1]
    if notebooks.is_answer_cell(release_cell):
        index = _adopt_by_names(nb, release_cell, release_ids)
        if index is not None:
            repairs.adopted.append(gid)
        return index
    return None


def _restore_cell(nb, index: int, gid: str, release_cell, repairs: _Repairs) -> NotebookNode:
    """Give the cell at ``index`` the release cell's type, grading metadata and lock flags; returns it."""
    cell = nb.cells[index]
    if cell.cell_type != release_cell.cell_type:
        if release_cell.cell_type == "code":
            cell = nb.cells[index] = _as_code(cell)
        else:
            cell.cell_type = release_cell.cell_type
        repairs.retyped.append(gid)
    wanted = copy.deepcopy(release_cell.metadata.get("nbgrader", {}))
    have = cell.get("metadata", {}).get("nbgrader") or {}
    if any(have.get(key) != wanted.get(key) for key in GRADING_KEYS) and gid not in repairs.adopted:
        repairs.restored.append(gid)
    cell.setdefault("metadata", NotebookNode())["nbgrader"] = wanted
    for flag in ("deletable", "editable"):
        if flag in release_cell.metadata:
            cell.metadata[flag] = release_cell.metadata[flag]
    if notebooks.is_test_cell(release_cell) and _visible_source(cell.source) != _visible_source(release_cell.source):
        repairs.edited.append(gid)
    return cell


def _strip_stray_metadata(nb, placed: dict[str, NotebookNode]) -> int:
    """Remove grading metadata from cells that claim an id they do not hold (duplicates, ids from other
    notebooks): nbgrader would grade the wrong cell (it keeps the last cell of a duplicated id).
    Returns how many cells lost it."""
    holders = {id(cell) for cell in placed.values()}
    stripped = 0
    for cell in nb.cells:
        if "nbgrader" in cell.get("metadata", {}) and id(cell) not in holders:
            del cell.metadata["nbgrader"]
            stripped += 1
    return stripped


def _add_missing_cells(nb, graded: list, placed: dict[str, NotebookNode], repairs: _Repairs) -> None:
    """Graded cells that are gone come back from the release, after the graded cell that precedes them
    (before the next one when none precedes them)."""
    for position, (gid, release_cell) in enumerate(graded):
        if gid in placed:
            continue
        fresh = copy.deepcopy(release_cell)
        fresh["id"] = uuid.uuid4().hex[:12]
        if fresh.cell_type == "code":
            fresh.outputs, fresh.execution_count = [], None
        anchor = next((placed[g] for g, _ in reversed(graded[:position]) if g in placed), None)
        if anchor is not None:
            at = next(i for i, cell in enumerate(nb.cells) if cell is anchor) + 1
        else:
            following = next((placed[g] for g, _ in graded[position + 1 :] if g in placed), None)
            at = next((i for i, cell in enumerate(nb.cells) if cell is following), len(nb.cells))
        nb.cells.insert(at, fresh)
        placed[gid] = fresh
        repairs.added.append(gid)


def _notes(repairs: _Repairs, release_cells: dict) -> list[str]:
    """One sentence per kind of repair, for the instructor and the learner's feedback."""
    notes = []
    if repairs.restored:
        notes.append(
            f"Restored the grading metadata of {len(repairs.restored)} cell(s) from their marker comments: "
            f"{', '.join(repairs.restored)}."
        )
    if repairs.retyped:
        notes.append(f"Turned cell(s) {', '.join(repairs.retyped)} back into code cells.")
    if repairs.adopted:
        notes.append(
            f"Found answer cell(s) {', '.join(repairs.adopted)} by the functions they define (marker comment missing)."
        )
    if repairs.duplicates:
        notes.append(f"Several cells claimed {', '.join(repairs.duplicates)}; the last one with an answer was graded.")
    if repairs.edited:
        notes.append(f"Test cell(s) {', '.join(repairs.edited)} had been edited; the original tests were used.")
    missing_tests = [g for g in repairs.added if notebooks.is_test_cell(release_cells[g])]
    missing_answers = [g for g in repairs.added if notebooks.is_answer_cell(release_cells[g])]
    if missing_tests:
        notes.append(f"Test cell(s) {', '.join(missing_tests)} were missing and were added back.")
    if missing_answers:
        notes.append(
            f"Answer cell(s) {', '.join(missing_answers)} were missing (no marker comment and no cell defining "
            "its functions); the empty starter cell was added back, so those exercises score 0."
        )
    if repairs.stripped:
        notes.append(f"Removed stray grading metadata from {repairs.stripped} cell(s) that are not graded.")
    return notes


def _adopt_by_names(nb, release_cell, release_ids: set[str]) -> int | None:
    """Index of the last unmarked code cell that defines every function/class of the answer stub."""
    names = set(_DEF.findall(release_cell.source))
    if not names:
        return None
    for index in range(len(nb.cells) - 1, -1, -1):
        cell = nb.cells[index]
        if cell.cell_type != "code" or first_marker(cell) or notebooks.grade_id(cell) in release_ids:
            continue
        if names <= set(_DEF.findall(cell.source)):
            return index
    return None
