"""Helpers shared by several test modules (imported as ``helpers``; pytest puts tests/ on the path).

Test modules import from here instead of from each other, so a test file can be renamed, split or
run alone without breaking another.
"""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from autograder import notebooks
from autograder.course_dir import Course
from course.sim import BlockManager, SimConfig, harness, steps
from course.trace import RequestTrace
from course.workload import Workload

# --- the simulator's readable reference ----------------------------------------------------------


class CheckedBlocks:
    """A block manager that checks its invariants after every change (slow; for property tests)."""

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks

    def __getattr__(self, name):
        attribute = getattr(self._blocks, name)
        if name in {"allocate", "append", "reserve", "free", "cache_full_blocks"}:

            def checked(*args, **kwargs):
                result = attribute(*args, **kwargs)
                self._blocks.check()
                return result

            return checked
        return attribute


def reference(
    work: Workload, config: SimConfig, cost, *, check_blocks: bool = False
) -> tuple[list[RequestTrace], harness.HarnessRun | None]:
    """``config``'s simulation through the readable reference: (traces, the harness run or None).

    Iteration-level schedulers run through the readable ledger under the simulator's clock
    (:func:`course.sim.harness.run_config`: the step functions of :mod:`course.sim.steps` with every setting of
    ``config``); static batching through :func:`course.sim.steps.run_static` (no harness run). So the fast
    ledger can be compared with this on any configuration; ``check_blocks`` checks the block manager's
    invariants after every change.
    """
    if config.scheduler == "static":
        traces = steps.run_static(
            work,
            config.max_num_seqs,
            cost,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
        )
        return traces, None
    blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
    run = harness.run_config(work, config, cost, CheckedBlocks(blocks) if check_blocks else None)
    return run.traces, run


# --- the grading pipeline's test courses and damaged files ---------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]
# Module 1, the assignment the hostile corpus and `autograder check` tests grade.
M1_ASSIGNMENT = "m1_prefill_decode"
M1_NOTEBOOK = "prefill_decode.ipynb"
ZIP_DAMAGE = {"bad-crc", "symlink"}  # damage to the zip entry (applied by the hostile corpus's build_zip)
# A two-point assignment whose kernel needs no torch (the sandbox and PostgreSQL tests).
TINY_ASSIGNMENT = "tiny"
TINY_NOTEBOOK = "tiny.ipynb"

ANSWER = "# EXERCISE: ex1_1\ndef add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION"
TEST = (
    '# TEST: ex1_1_add\n"""add adds two numbers."""\nassert add(1, 2) == 3, "1 + 2 should be 3"\n'
    "### BEGIN HIDDEN TESTS\nassert add(-1, 1) == 0, 'the hidden case failed'\n### END HIDDEN TESTS"
)
TEST2 = '# TEST: ex1_1_types\n"""add works on floats."""\nassert add(0.5, 0.25) == 0.75'
CORRECT = "# EXERCISE: ex1_1\ndef add(a, b):\n    return a + b"


def _meta(grade_id: str, test: bool, points: int = 0) -> dict:
    meta = {
        "grade": test,
        "grade_id": grade_id,
        "locked": test,
        "schema_version": 3,
        "solution": not test,
        "task": False,
    }
    if test:
        meta["points"] = points
    return {"nbgrader": meta}


def tiny_source():
    """A two-point nbgrader source notebook: one answer cell, two test cells (one with hidden tests)."""
    return new_notebook(
        cells=[
            new_markdown_cell("### Exercise 1.1 — Add two numbers (2 points)"),
            new_code_cell(ANSWER, metadata=_meta("ex1_1", False)),
            new_code_cell(TEST, metadata=_meta("ex1_1_add", True, 1)),
            new_code_cell(TEST2, metadata=_meta("ex1_1_types", True, 1)),
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )


def tiny_course(root: Path, db_url: str | None = None) -> Course:
    """A course with the tiny assignment released (modules/ and the gradebook made by nbgrader)."""
    from autograder.release import generate

    notebooks.write(tiny_source(), root / "solutions" / TINY_ASSIGNMENT / TINY_NOTEBOOK)
    generate(root, [TINY_ASSIGNMENT], db_url or f"sqlite:///{root / 'gradebook.db'}")
    return Course(root, db_url=db_url)


def submit(course: Course, student: str, body: str) -> None:
    release = notebooks.read(course.release_dir / TINY_ASSIGNMENT / TINY_NOTEBOOK)
    nb = notebooks.with_answers(release, {"ex1_1": body})
    target = course.submitted / student / TINY_ASSIGNMENT / TINY_NOTEBOOK
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(target))


def lite_source() -> dict:
    """Module 1's source notebook without the measurement cells (exercises, tests and prose kept)."""
    src = notebooks.read(REPO_ROOT / "solutions" / M1_ASSIGNMENT / M1_NOTEBOOK)
    code = [i for i, cell in enumerate(src.cells) if cell.cell_type == "code"]
    keep = set(code[:2]) | {i for i, cell in enumerate(src.cells) if notebooks.grade_id(cell)}
    src.cells = [cell for i, cell in enumerate(src.cells) if i in keep or cell.cell_type == "markdown"]
    return src


def damage(nb, spec: str):
    """Apply a case's notebook-level damage (see fixtures/hostile/README.md)."""
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, target = item.partition("=")
        index = next((i for i, cell in enumerate(nb.cells) if notebooks.grade_id(cell) == target), None)
        if kind == "strip-metadata":
            for cell in nb.cells:
                for key in ("nbgrader", "deletable", "editable"):
                    cell.metadata.pop(key, None)
        elif kind == "delete-test":
            del nb.cells[index]
        elif kind in ("edit-test", "edit-test-metadata"):
            nb.cells[index].source = f"# TEST: {target}\npass"
            if kind == "edit-test-metadata":
                nb.cells[index].metadata.nbgrader.update(grade=False, locked=False)
                nb.cells[index].metadata.nbgrader.pop("checksum", None)
        elif kind == "markdown":
            cell = nb.cells[index]
            nb.cells[index] = {"cell_type": "markdown", "id": cell.id, "metadata": {}, "source": cell.source}
        elif kind == "colab":
            nb.nbformat_minor = 0
            nb.metadata["colab"] = {"provenance": [], "name": M1_NOTEBOOK}
            nb.metadata["accelerator"] = "GPU"
            for number, cell in enumerate(nb.cells):
                cell.pop("id", None)
                cell.metadata["id"] = f"c{number:04d}"
                if cell.cell_type == "code":
                    cell.metadata["colab"] = {"base_uri": "https://localhost:8080/"}
                    cell.metadata["outputId"] = f"o{number:04d}"
        elif kind == "nbgrader-string":
            nb.cells[index].metadata["nbgrader"] = target
        elif kind == "source-number":
            next(cell for cell in nb.cells if cell.cell_type == "markdown")["source"] = 42
        elif kind == "cells-object":
            nb["cells"] = {str(number): cell for number, cell in enumerate(nb.cells)}
        elif kind == "autograder-string":
            nb.metadata["autograder"] = "<a href='javascript:alert(1)'>grade: 1000/30</a>"
        elif kind not in ZIP_DAMAGE and kind != "blank":
            raise ValueError(f"unknown damage {item!r}")
    return nb


def m1_release():
    """Module 1's released student notebook (``modules/``), as a learner downloads it."""
    return notebooks.read(REPO_ROOT / "modules" / M1_ASSIGNMENT / M1_NOTEBOOK)


def m1_course(tmp_path: Path, nbgrader_config: bool = False) -> Path:
    """A course folder in ``tmp_path`` with module 1's release in ``modules/``; with ``nbgrader_config``, also
    the ``nbgrader_config.py`` that nbgrader's own commands (and the plugins they load) read."""
    root = tmp_path / "course"
    shutil.copytree(REPO_ROOT / "modules" / M1_ASSIGNMENT, root / "modules" / M1_ASSIGNMENT)
    if nbgrader_config:
        (root / "nbgrader_config.py").write_text(
            "from autograder.config import configure\n\nconfigure(get_config(), root=__file__.rsplit('/', 1)[0])\n"
        )
    return root


def notebook_bytes(nb) -> bytes:
    """A notebook as the bytes of its ``.ipynb`` file."""
    return nbformat.writes(nb).encode()


def zip_with_times(files: list[tuple[str, bytes, tuple]], compression=zipfile.ZIP_DEFLATED) -> bytes:
    """A zip whose members carry the given (year, month, day, hour, minute, second) times, in order."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, content, when in files:
            archive.writestr(zipfile.ZipInfo(name, date_time=when), content, compress_type=compression)
    return buffer.getvalue()


def corrupt_member(data: bytes, name: str) -> bytes:
    """The zip with one byte in the middle of ``name``'s stored data flipped (its CRC no longer matches)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo(name)
    raw = bytearray(data)
    header = info.header_offset
    name_len = int.from_bytes(raw[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(raw[header + 28 : header + 30], "little")
    start = header + 30 + name_len + extra_len
    raw[start + info.compress_size // 2] ^= 0xFF
    return bytes(raw)


# --- the serving tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Engine, server and clients share the test process: spinning OpenMP workers would starve them.

    Autouse in every module that imports it.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def wait_until_healthy(process, base_url: str, log_path: Path, timeout: float = 120.0) -> None:
    """Wait for a server process's ``/health`` to answer 200; fail with its log if it dies or never answers."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log_path.read_text()[-2000:]
        assert time.monotonic() < deadline, f"the server did not start within {timeout:.0f} s"
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)


def generate_staggered(engine, prompts: list, outputs: list[int], gap: float) -> list:
    """Each prompt from its own thread, started ``gap`` seconds after the previous one (requests join and
    leave a running batch); greedy, exactly ``outputs[i]`` tokens each. Returns the engine's results in order."""
    import threading
    import time

    from course.serving import SamplingParams

    results = [None] * len(prompts)

    def client(i: int) -> None:
        time.sleep(gap * i)
        results[i] = engine.generate(prompts[i], SamplingParams(max_tokens=outputs[i], ignore_eos=True))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results
