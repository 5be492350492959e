"""The grading contract, proven through nbgrader itself for every module.

For each assignment one autograde run grades: the blank student notebook (must score 0 on
every autograded cell), the solutions (full marks), and every answer fixture in
tests/fixtures/answers/<assignment>/ (plausible wrong answers score strictly between 0 and
full on the exercises they touch; answers that call the course's reference score 0; noisy
correct answers that write to stderr keep full marks). A fixture's ``# FAILS:`` line names the
test cells that must reject it, so a fixture for one mistake proves that the test written for that
mistake is the one that catches it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autograder import notebooks
from autograder.config import assignments
from autograder.execution import has_error
from autograder.throwaway import autograde

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "answers"
EXPECT = re.compile(r"^# EXPECT: (.+)$", re.MULTILINE)
FAILS = re.compile(r"^# FAILS: (.+)$", re.MULTILINE)
OUTCOMES = {"zero", "partial", "full"}


def must_fail(path: Path) -> set[str]:
    """The test cells (grade ids) that a fixture's ``# FAILS:`` lines say must not give it full marks."""
    return {grade_id for line in FAILS.findall(path.read_text()) for grade_id in line.split()}


def parse_answer_fixture(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(grade_id -> answer cell source, exercise -> expected outcome) from a fixture file."""
    text = path.read_text()
    expected = {}
    for line in EXPECT.findall(text):
        for pair in line.split():
            exercise, outcome = pair.split("=")
            assert outcome in OUTCOMES, f"{path.name}: unknown outcome {outcome!r}"
            expected[exercise] = outcome
    answers = {}
    for chunk in re.split(r"(?m)^(?=# EXERCISE: )", text)[1:]:
        grade_id = notebooks.MARKER.match(chunk.split("\n", 1)[0]).group(2)
        answers[grade_id] = chunk.strip("\n")
    assert set(expected) <= set(answers), f"{path.name}: EXPECT names exercises it does not answer"
    return answers, expected


def exercise_scores(cells) -> dict[str, tuple[float, float]]:
    totals: dict[str, tuple[float, float]] = {}
    for cell in cells.values():
        exercise = notebooks.exercise_of(cell.grade_id)
        score, maximum = totals.get(exercise, (0.0, 0.0))
        totals[exercise] = (score + cell.score, maximum + cell.max_score)
    return totals


@pytest.fixture(scope="module", params=assignments(ROOT))
def graded(request, tmp_path_factory):
    assignment = request.param
    source_path = next((ROOT / "solutions" / assignment).glob("*.ipynb"))
    release = notebooks.read(ROOT / "modules" / assignment / source_path.name)
    solutions = notebooks.answer_sources(notebooks.read(source_path))
    fixtures = {path.stem: parse_answer_fixture(path) for path in sorted((FIXTURES / assignment).glob("*.py"))}
    failing = {path.stem: must_fail(path) for path in sorted((FIXTURES / assignment).glob("*.py"))}
    submissions = {"blank": release, "solution": notebooks.with_answers(release, solutions)}
    for name, (answers, _) in fixtures.items():
        submissions[name] = notebooks.with_answers(release, {**solutions, **answers})
    run = autograde(
        assignment,
        {student: {source_path.name: nb} for student, nb in submissions.items()},
        workdir=tmp_path_factory.mktemp(assignment),
    )
    points = notebooks.test_points(notebooks.read(source_path))
    return assignment, run, points, fixtures, failing


def test_every_submission_was_graded(graded):
    assignment, run, points, *_ = graded
    for student, cells in run.scores.items():
        assert set(cells) == set(points), (
            f"{assignment}/{student}: nbgrader did not grade every cell\n{run.log[-3000:]}"
        )


def test_no_honest_submission_is_flagged(graded):
    """The blank notebook, the solution and every answer fixture leave the tests alone: the kernel's seal
    (autograder.seal) must find nothing replaced in any of them."""
    assignment, run, *_ = graded
    flagged = {student: result.flags for student, result in (run.results or {}).items() if result.flags}
    assert not flagged, f"{assignment}: honest submissions flagged for manual grading: {flagged}"


def test_blank_notebook_scores_zero_on_every_cell(graded):
    _, run, points, *_ = graded
    assert set(run.scores["blank"]) == set(points), "the blank notebook was not graded"
    scored = {grade_id: cell.score for grade_id, cell in run.scores["blank"].items() if cell.score != 0}
    assert not scored, f"the blank notebook scored points on {scored}"


def test_solution_scores_full_marks(graded):
    _, run, points, *_ = graded
    lost = {g: (c.score, c.max_score) for g, c in run.scores["solution"].items() if c.score != c.max_score}
    assert not lost, f"the solutions lost points on {lost}"
    assert run.total("solution") == (sum(points.values()), sum(points.values()))


def test_fixtures_score_as_expected(graded):
    assignment, run, _, fixtures, failing = graded
    for name, (_, expected) in fixtures.items():
        assert run.scores[name], f"{assignment}/{name} was not graded at all\n{run.log[-3000:]}"
        scores = exercise_scores(run.scores[name])
        for exercise, (score, maximum) in scores.items():
            outcome = expected.get(exercise, "full")  # exercises a fixture leaves alone keep the solution
            ok = {"zero": score == 0, "full": score == maximum, "partial": 0 < score < maximum}[outcome]
            assert ok, f"{assignment}/{name}: {exercise} scored {score}/{maximum}, expected {outcome}"
        cells = run.scores[name]
        unknown = failing[name] - set(cells)
        assert not unknown, f"{assignment}/{name}: FAILS names cells that do not exist: {sorted(unknown)}"
        passed = sorted(g for g in failing[name] if cells[g].score == cells[g].max_score)
        assert not passed, f"{assignment}/{name}: these tests were meant to reject it but gave full marks: {passed}"


def test_every_exercise_has_a_plausible_wrong_answer_in_between(graded):
    assignment, _, points, fixtures, _ = graded
    exercises = {notebooks.exercise_of(grade_id) for grade_id in points}
    covered = {ex for _, expected in fixtures.values() for ex, outcome in expected.items() if outcome == "partial"}
    assert exercises <= covered, f"{assignment}: no partial-credit fixture for {sorted(exercises - covered)}"


def test_solution_notebook_runs_top_to_bottom_without_an_error(graded):
    """What nbval would prove, from the same execution: the solutions are not executed a second time."""
    assignment, run, *_ = graded
    name = next((ROOT / "solutions" / assignment).glob("*.ipynb")).name
    executed = notebooks.read(run.workdir / "autograded" / "solution" / assignment / name)
    code = [(index, cell) for index, cell in enumerate(executed.cells) if cell.cell_type == "code"]
    not_run = [index for index, cell in code if cell.source.strip() and cell.get("execution_count") is None]
    failed = [index for index, cell in code if has_error(cell)]
    assert not not_run and not failed, f"{assignment}: cells not run {not_run}, cells with an error {failed}"


def test_blank_notebook_runs_every_cell_that_is_not_a_test(graded):
    """Issue 11: the blank notebook's demo cells say what they wait for instead of failing.

    This reads the notebook that the grading run above executed top to bottom (quick mode, as
    nbgrader runs it), so it costs no extra execution. Every code cell that is not a graded test
    cell must run without an error; a stub must fail with NotImplementedError where its first
    test calls it (the way the exercise is used), never with a TypeError from the wrong kind of
    function (an ``async def`` stub without ``yield`` is a coroutine, not an async generator).
    """
    assignment, run, *_ = graded
    executed = list((run.workdir / "autograded" / "blank" / assignment).glob("*.ipynb"))
    assert executed, f"the grading run kept no executed copy of the blank notebook\n{run.log[-3000:]}"
    failures, first_errors = [], {}
    for index, cell in enumerate(notebooks.read(executed[0]).cells):
        if cell.cell_type != "code":
            continue
        errors = [out for out in cell.get("outputs", []) if out.get("output_type") == "error"]
        if notebooks.is_test_cell(cell):
            exercise = notebooks.exercise_of(notebooks.grade_id(cell))
            first_errors.setdefault(exercise, (notebooks.grade_id(cell), errors[0].ename if errors else None))
        elif errors:
            first_line = cell.source.splitlines()[0][:60]
            failures.append(f"cell {index} ({first_line!r}): {errors[0].ename}: {errors[0].evalue}")
    assert not failures, f"{assignment}: cells that are not tests fail in the blank notebook:\n" + "\n".join(failures)
    wrong = {ex: got for ex, got in first_errors.items() if got[1] != "NotImplementedError"}
    assert not wrong, f"{assignment}: the first test of these exercises does not fail with NotImplementedError: {wrong}"
