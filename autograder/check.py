"""``autograder check NOTEBOOK``: a learner grades their own notebook, visible and hidden tests.

For self-study and Colab learners, who have no instructor and no gradebook. The notebook is
repaired the way the instructor's pipeline repairs it (marker comments, deleted test cells, Colab's
format), every test cell is replaced by its full version from the course's nbgrader *source*
notebook (``solutions/``, hidden tests included), and the notebook runs top to bottom in a fresh
kernel in quick mode, surviving crashes and hangs the same way. The score per exercise uses the
instructor's rule (a test cell earns its points when it raises nothing), and a failing hidden test
is reported by its message only.

Where the hidden tests come from, honestly: this course is open and ``solutions/`` is in its public
repository, so hidden tests are hidden from the notebook, not secret. ``check`` reads them from the
course checkout it is installed from (``bin/lab`` installs the repository in place), or, when the
course was pip-installed (Colab's setup cell), downloads the repository's ``solutions/`` once from
``course.env.REPO_URL`` at ``REPO_REF`` into ``~/.cache/llm-serving-course``. A learner who wants
to can read the solutions there; the tests keep their value as feedback. A class that needs secret
tests grades with a private copy of ``solutions/`` (its own hidden tests) and the instructor
pipeline; ``check`` then reports what the public tests say. nbgrader is not needed (and should
not be installed in Colab): only nbformat, nbclient and ipykernel.
"""

from __future__ import annotations

import copy
import io
import os
import re
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from nbclient import NotebookClient

from autograder import execution, notebooks, repair
from autograder.config import SOURCE_DIRECTORY, repo_root

SOLUTION_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*$", re.M | re.S)
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-serving-course"


class DownloadFailed(RuntimeError):
    """The course's tests could not be found or downloaded; the message says what to do."""


class CheckClient(execution.ResilientExecution, NotebookClient):
    """nbclient with the grader's resilience (dead or stuck kernels, capped output)."""


@dataclass
class TestResult:
    grade_id: str
    points: float
    score: float
    message: str = ""


@dataclass
class CheckReport:
    notebook: str
    assignment: str
    source: str
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exercises(self) -> dict[str, tuple[float, float]]:
        totals: dict[str, tuple[float, float]] = {}
        for test in self.tests:
            key = _exercise(test.grade_id)
            score, points = totals.get(key, (0.0, 0.0))
            totals[key] = (score + test.score, points + test.points)
        return totals

    @property
    def total(self) -> tuple[float, float]:
        return sum(t.score for t in self.tests), sum(t.points for t in self.tests)

    def table(self) -> str:
        lines = [f"{self.notebook}: assignment {self.assignment}, tests from {self.source}"]
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(f"{'exercise':10s} {'score':>9s}")
        for key, (score, points) in self.exercises.items():
            lines.append(f"{key:10s} {score:4g} / {points:<4g}")
            lines += [
                f"    {t.grade_id}: {t.message}" for t in self.tests if _exercise(t.grade_id) == key and t.message
            ]
        score, points = self.total
        lines.append(f"{'total':10s} {score:4g} / {points:<4g}")
        return "\n".join(lines)


def _exercise(grade_id: str) -> str:
    try:
        return notebooks.exercise_of(grade_id)
    except ValueError:
        return grade_id


def release_like(source_nb):
    """The student version of a source notebook, but keeping its hidden tests (nbgrader not needed)."""
    nb = copy.deepcopy(source_nb)
    for cell in nb.cells:
        if notebooks.is_answer_cell(cell) and cell.cell_type == "code":
            cell.source = SOLUTION_REGION.sub(lambda m: _indent(CODE_STUB, m.group(1)), cell.source)
    return nb


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.split("\n"))


def download_course(url: str | None = None, ref: str | None = None, cache: Path = CACHE) -> Path:
    """The course's solutions/ and modules/ from the public repository (cached); returns its root."""
    from course.env import REPO_REF, REPO_URL

    ref = ref or REPO_REF
    url = url or f"{REPO_URL}/archive/{ref}.tar.gz"
    root = Path(cache) / re.sub(r"[^A-Za-z0-9._-]", "_", ref)
    if (root / SOURCE_DIRECTORY).is_dir():
        return root
    print(f"Downloading the course's tests from {url} (once) ...")
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            data = response.read()
    except (OSError, ValueError) as err:  # URLError, HTTPError, timeouts and bad URLs
        reason = getattr(err, "reason", None) or err
        raise DownloadFailed(
            f"Could not download the course's tests from {url} ({reason}). Check this runtime's internet "
            "access (in Colab: Runtime > Disconnect and delete runtime, then reconnect) and run the check "
            "again, or point it at a copy of the course you have: check_colab(source='PATH/TO/solutions') "
            "or `autograder check NOTEBOOK --source PATH`."
        ) from None
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts[1:]  # drop the archive's top folder (REPO-REF/)
            if not parts or parts[0] not in (SOURCE_DIRECTORY, "modules") or not member.isfile():
                continue
            if any(part in ("..", "") for part in parts):
                continue
            target = root.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(member).read())
    return root


def course_root(source: str | Path | None = None) -> Path:
    """Where solutions/ is: the given folder, this checkout, or a downloaded copy."""
    if source is not None:
        path = Path(source)
        return path.parent if path.name == SOURCE_DIRECTORY else path
    here = repo_root()
    if (here / SOURCE_DIRECTORY).is_dir():
        return here
    return download_course()


def find_source(nb, file_name: str, source: str | Path | None = None) -> tuple[str, Path]:
    """(assignment, source notebook path) that a learner's notebook belongs to."""
    from autograder.collect import match_notebook

    if source is not None and Path(source).is_file():
        return Path(source).parent.name, Path(source)
    root = course_root(source)
    index = {
        (path.parent.name, path.name): repair.marked_ids(notebooks.read(path))
        for path in sorted((root / SOURCE_DIRECTORY).glob("*/*.ipynb"))
    }
    key, why = match_notebook(nb, file_name, index)
    if key is None:
        raise LookupError(f"{file_name}: {why} (looked in {root / SOURCE_DIRECTORY})")
    return key[0], root / SOURCE_DIRECTORY / key[0] / key[1]


def check_notebook(
    path: str | Path, source: str | Path | None = None, timeout: int = 300, kernel_name: str = ""
) -> CheckReport:
    """Run one notebook with all of its tests and score it per exercise.

    Args:
        path: the learner's notebook.
        source: the course root, its solutions/ folder or the source notebook (default: found or downloaded).
        timeout: seconds per cell.
        kernel_name: Jupyter kernel to run it in (default: the notebook's, else python3).
    """
    path = Path(path)
    submission = repair.read_submission(path.read_bytes())
    assignment, source_path = find_source(submission, path.name, source)
    reference = release_like(notebooks.read(source_path))
    repaired = repair.repair(submission, reference)
    nb = repaired.notebook
    full_tests = {notebooks.grade_id(c): c.source for c in reference.cells if notebooks.is_test_cell(c)}
    for cell in nb.cells:
        if notebooks.is_test_cell(cell):
            cell.source = full_tests[notebooks.grade_id(cell)]
    report = CheckReport(path.name, assignment, str(source_path), notes=list(repaired.notes))
    with tempfile.TemporaryDirectory(prefix="autograder-check-") as workdir:
        for extra in source_path.parent.iterdir():  # data files the notebook reads
            if extra.is_file() and extra.suffix != ".ipynb":
                (Path(workdir) / extra.name).write_bytes(extra.read_bytes())
        client = CheckClient(
            nb,
            timeout=timeout,
            kernel_name=kernel_name,
            allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout={
                "ename": execution.TIMEOUT_ENAME,
                "evalue": f"the cell ran longer than {timeout} s and was interrupted",
                "traceback": [f"{execution.TIMEOUT_ENAME}: the cell ran longer than {timeout} s"],
            },
            resources={"metadata": {"path": workdir}},
        )
        saved = {key: os.environ.get(key) for key in ("NBGRADER_EXECUTION", "COURSE_QUICK")}
        os.environ.update(NBGRADER_EXECUTION="autograde", COURSE_QUICK="1")  # as under the grader: quick mode
        try:
            client.execute(stderr=subprocess.DEVNULL)  # the kernel's own log lines are not the learner's business
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    for event in client.grading_events:
        cell = nb.cells[event["cell"]] if 0 <= event["cell"] < len(nb.cells) else None
        where = notebooks.grade_id(cell) if cell is not None else None
        report.notes.append(f"cell {where or event['cell']}: {event['detail']}")
    hidden = execution.HiddenText(list(full_tests.values()))
    for cell in nb.cells:
        if not notebooks.is_test_cell(cell):
            continue
        points = float(cell.metadata.nbgrader.get("points", 0))
        score = execution.cell_score(cell, points)
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        message = execution.hidden_test_summary(errors[-1], cell.source, cell.get("execution_count")) if errors else ""
        message = hidden.scrub_text(message)
        report.tests.append(TestResult(notebooks.grade_id(cell), points, score, message))
    return report


def check_colab(source: str | Path | None = None, timeout: int = 300) -> CheckReport:
    """Check the notebook open in this Colab session (uses Colab's private ``get_ipynb`` request).

    Colab keeps notebooks in Drive, where the kernel cannot read them; this asks the Colab frontend
    for the live notebook. If Colab ever removes that private API, download the notebook
    (File > Download > .ipynb), upload it to the session and run ``!autograder check NAME.ipynb``.
    """
    import json

    from google.colab import _message  # type: ignore[import-not-found]

    reply = _message.blocking_request("get_ipynb", timeout_sec=120)
    if not reply or "ipynb" not in reply:
        raise RuntimeError("Colab did not return the notebook; save it and run `!autograder check FILE.ipynb`")
    with tempfile.NamedTemporaryFile("w", suffix=".ipynb", delete=False) as handle:
        json.dump(reply["ipynb"], handle)
    report = check_notebook(handle.name, source=source, timeout=timeout)
    print(report.table())
    return report
