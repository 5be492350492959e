"""The course's nbgrader preprocessors: resilient execution, forgery-proof scores, feedback that keeps
hidden tests hidden. Configured by :func:`autograder.sandbox.nbgrader_settings` (grading) and
:mod:`autograder.feedback` (feedback)."""

from __future__ import annotations

import builtins
import html
import re

from nbformat import NotebookNode
from nbgrader import utils
from nbgrader.preprocessors import Execute, NbGraderPreprocessor, SaveAutoGrades

from autograder import execution

WITHHELD_NOTE = "[not shown in feedback: this cell ran after hidden tests]"
# The names of Python's own exceptions: the one thing feedback says about a cell whose output it withholds.
BUILTIN_EXCEPTIONS = frozenset(
    name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)
)
# Output types feedback keeps. HTML, JavaScript and SVG from student code could script the page that
# the learner or the instructor opens, so feedback shows text and bitmap images only.
SAFE_MIMETYPES = ("text/plain", "image/png", "image/jpeg")


class ResilientExecute(execution.ResilientExecution, Execute):
    """nbgrader's Execute that survives dead and stuck kernels and records what happened."""

    def preprocess(self, nb, resources=None, km=None):
        nb, resources = super().preprocess(nb, resources, km)
        events = []
        for event in self.grading_events:
            index = event["cell"]
            cell = nb.cells[index] if 0 <= index < len(nb.cells) else None
            grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") if cell is not None else None
            events.append({**event, "grade_id": grade_id})
        nb.metadata.setdefault("autograder", {})["events"] = events
        nb.metadata["autograder"]["integrity"] = list(self.integrity_problems)
        return nb, resources


class CourseSaveAutoGrades(SaveAutoGrades):
    """SaveAutoGrades with the course's rule: a test cell scores its points unless it raised.

    nbgrader would also read a numeric last expression as partial credit, which student code can
    forge by publishing an ``execute_result`` from inside a test; the course's tests never use it.
    """

    def _add_score(self, cell: NotebookNode, resources) -> None:
        grade = self.gradebook.find_grade(
            cell.metadata["nbgrader"]["grade_id"], self.notebook_id, self.assignment_id, self.student_id
        )
        if utils.is_solution(cell) or cell.cell_type != "code":
            grade.auto_score, _ = utils.determine_grade(cell, self.log)  # manually graded cells: nbgrader's rule
        else:
            grade.auto_score = execution.cell_score(cell, float(cell.metadata["nbgrader"]["points"]))
        grade.needs_manual_grade = grade.manual_score is not None or grade.auto_score is None
        self.gradebook.db.commit()


class SafeFeedback(NbGraderPreprocessor):
    """Prepare an autograded notebook for the learner's eyes.

    * test cells lose their hidden-test lines; when such a cell failed, its outputs are replaced by
      one line that says whether a visible or a hidden test failed and with which message, never
      the hidden code or a traceback through it;
    * every output and message of every cell is checked for hidden test code, as it is and in common
      encodings (:class:`autograder.hidden.HiddenText`), and replaced by a note where it holds some;
    * from the first cell with hidden tests on, nothing student code printed is shown (its cells'
      outputs become one note) and a failing test shows a message only when the test itself raised it
      (not a learner's function), cut to 200 characters: student code that read a hidden test while it
      ran cannot hand it to feedback in an encoding no detector knows;
    * outputs that could run script in the page (HTML, JavaScript, SVG, widgets) become text; cell
      and notebook metadata the student controls (tags, widget state, titles) is dropped;
    * a summary cell at the top lists the score per exercise and what the grader did (repairs,
      timeouts, restarted kernels, truncated output), its notes escaped so they stay plain text.

    The rendered page is then sanitised as a whole (:func:`autograder.feedback.inert_page`).
    """

    def preprocess(self, nb, resources):
        from autograder.seal import trusted_dirs

        self._scores: dict[str, list[float]] = {}
        self._hidden = execution.HiddenText(
            [cell.source for cell in nb.cells if cell.cell_type == "code" and _is_test(cell)]
        )
        self._library_dirs = tuple(trusted_dirs())
        # From the first cell with hidden tests on, student code could have read them (a learner's function
        # runs inside the test): nothing it printed or raised from there on is shown, in any encoding.
        self._first_hidden = next(
            (
                index
                for index, cell in enumerate(nb.cells)
                if cell.cell_type == "code" and _is_test(cell) and execution.hidden_region(cell.source)
            ),
            len(nb.cells),
        )
        self._withheld = 0
        notes = grading_notes(nb)
        nb, resources = super().preprocess(nb, resources)
        nb.metadata = NotebookNode(
            kernelspec=NotebookNode(name="python3", display_name="Python 3", language="python"),
            language_info=NotebookNode(name="python", pygments_lexer="ipython3"),
        )
        if self._withheld:
            notes.append(
                f"Outputs of {self._withheld} cell(s) that ran after the first hidden test are not shown here "
                "(your own notebook has them): code that runs after hidden tests could have read them."
            )
        summary = NotebookNode(cell_type="markdown", metadata=NotebookNode(), source=self._summary(notes, resources))
        nb.cells.insert(0, summary)
        return nb, resources

    def preprocess_cell(self, cell, resources, cell_index):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        cell.metadata = NotebookNode(nbgrader=meta) if meta else NotebookNode()
        cell.pop("attachments", None)
        if cell.cell_type == "code":
            after_hidden = cell_index >= self._first_hidden
            if _is_test(cell):
                cell = self._test_cell(cell, after_hidden)
                score = meta.get("score")
                entry = self._scores.setdefault(_exercise(meta.get("grade_id", "")), [0.0, 0.0])
                entry[0] += float(score or 0)
                entry[1] += float(meta.get("points") or 0)
            elif after_hidden and cell.get("outputs"):
                note = WITHHELD_NOTE
                raised = [o.get("ename") for o in cell.outputs if o.get("output_type") == "error"]
                if raised and raised[-1] in BUILTIN_EXCEPTIONS:  # a builtin's name carries no hidden text
                    note += f" It raised {raised[-1]}."
                cell.outputs = [NotebookNode(output_type="stream", name="stdout", text=note + "\n")]
                self._withheld += 1
            cell.outputs = [self._hidden.scrub_output(_safe_output(output)) for output in cell.outputs]
        return cell, resources

    def _test_cell(self, cell, after_hidden: bool):
        source = cell.source
        hidden = execution.hidden_region(source)
        if not hidden and not after_hidden:
            return cell
        errors = [output for output in cell.outputs if output.get("output_type") == "error"]
        cell.source = execution.without_hidden_tests(source)
        if errors:
            count = cell.get("execution_count")
            own = execution.raised_by_test(errors[-1], source, count, self._library_dirs)
            summary = execution.hidden_test_summary(
                errors[-1], source, count, limit=200 if after_hidden else 300, show_message=own or not after_hidden
            )
            summary = self._hidden.scrub_text(summary)
            cell.outputs = [NotebookNode(output_type="stream", name="stdout", text=summary + "\n")]
        else:
            cell.outputs = []
        return cell

    def _summary(self, notes: list[str], resources) -> str:
        info = resources.get("nbgrader", {})
        score, maximum = info.get("score"), info.get("max_score")
        lines = ["## Grading summary", ""]
        if score is not None and maximum is not None:
            lines += [f"**Score: {_number(score)} / {_number(maximum)}**", ""]
        if self._scores:
            lines += ["| exercise | score |", "|---|---|"]
            lines += [f"| {_plain(ex)} | {_number(s)} / {_number(m)} |" for ex, (s, m) in self._scores.items()]
            lines.append("")
        if notes:
            lines += ["**What the grader did with your notebook:**", ""]
            lines += [f"* {_plain(self._hidden.scrub_text(note))}" for note in notes]
            lines.append("")
        lines.append(
            "Test cells show their visible tests only. When a hidden test fails, the cell says so and shows the "
            "test's message, never its code."
        )
        return "\n".join(lines)


def _plain(text: str) -> str:
    """``text`` as literal markdown: no HTML, and no markdown syntax (links, emphasis, code) of its own."""
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|<>~])", r"\\\1", html.escape(" ".join(str(text).split()), quote=False))


def _is_test(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def grading_notes(nb) -> list[str]:
    """What collect, repair and the grader did to a notebook, as sentences for the learner."""
    record = nb.metadata.get("autograder", {})
    if not isinstance(record, dict):
        return []
    notes = [str(note) for key in ("collect", "repair", "grade") for note in _as_list(record.get(key))]
    for event in _as_list(record.get("events")):
        if isinstance(event, dict):
            where = event.get("grade_id") or f"#{event.get('cell')}"
            notes.append(f"Cell {where}: {event.get('detail')}.")
    return notes


def _as_list(value) -> list:
    return value if isinstance(value, list) else []


def _exercise(grade_id: str) -> str:
    from autograder.notebooks import exercise_of

    try:
        return exercise_of(grade_id)
    except ValueError:
        return grade_id


def _number(value) -> str:
    return f"{float(value):g}"


def _safe_output(output):
    """Keep text and bitmaps; turn anything that could carry script into its text form."""
    if output.get("output_type") not in ("display_data", "execute_result"):
        return output
    data = output.get("data", {})
    kept = {key: value for key, value in data.items() if key in SAFE_MIMETYPES}
    if not kept:
        kept = {"text/plain": f"[{', '.join(sorted(data)) or 'empty'} output not shown in feedback]"}
    output["data"] = kept
    output["metadata"] = {}
    return output
