"""Feedback pages never show a hidden test and never run anything: a corpus of leak and script attempts.

A tiny assignment (one answer, one test cell with hidden tests) is graded through the pipeline
(repair, sandboxed grade, feedback). Each leak student tries to get the hidden tests into their own
feedback: printing the kernel's input history (``In``, ``_ih``, the history manager), dumping
``linecache``, raising with the calling frame's source or the whole stack, writing to stderr,
publishing it as display data, re-wrapping it on one line. Each script student plants markup in
markdown and raw cells and in the metadata of cells and notebook. The rendered pages are parsed:
no hidden line (even with its whitespace changed), no script, event handler, frame, form or
``javascript:`` URL in the body, and a head identical to a clean page's.
"""

from __future__ import annotations

import base64
import html
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_raw_cell

from autograder import notebooks
from autograder.course_dir import Course
from autograder.execution import HiddenText, hidden_region
from autograder.feedback import generate_feedback, inert_html
from autograder.pipeline import grade, repair_submissions

ASSIGNMENT = "tiny_fb"
NAME = "tiny_fb.ipynb"
HIDDEN = [
    "assert add(-1, 1) == 0, 'the hidden case failed'",
    "assert add(1000003, -7) == 999996, 'large numbers'",
    "secret_cases = [(2, 40, 42), (-5, 5, 0), (7, 8, 15)]",
    "assert all(add(a, b) == c for a, b, c in secret_cases), 'a table case failed'",
]
TEST = (
    '# TEST: ex1_1_add\n"""add adds two numbers."""\nassert add(1, 2) == 3, "1 + 2 should be 3"\n'
    "### BEGIN HIDDEN TESTS\n" + "\n".join(HIDDEN) + "\n### END HIDDEN TESTS"
)
ANSWER = "# EXERCISE: ex1_1\ndef add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION"
CORRECT = "# EXERCISE: ex1_1\ndef add(a, b):\n    return a + b"

# What each leak student adds after the test cell (or puts in add()).
LEAKS = {
    "print_in": (CORRECT, "print(In)"),
    "print_ih_joined": (CORRECT, "print(' '.join(_ih).replace(chr(10), ' '))"),
    "history_manager": (CORRECT, "print(get_ipython().history_manager.input_hist_raw)"),
    "linecache": (
        CORRECT,
        "import linecache\nfor name, entry in list(linecache.cache.items()):\n    print(name, ''.join(entry[2]))",
    ),
    "stderr": (CORRECT, "import sys\nsys.stderr.write('\\n'.join(In))"),
    "display_data": (CORRECT, "display({'text/plain': '\\n'.join(In), 'text/html': '<b>x</b>'}, raw=True)"),
    "raise_frame_source": (
        "# EXERCISE: ex1_1\nimport inspect\n\ndef add(a, b):\n"
        "    if a == 1000003:\n"
        "        raise AssertionError(inspect.getsource(inspect.currentframe().f_back))\n"
        "    return a + b",
        None,
    ),
    "raise_stack": (
        "# EXERCISE: ex1_1\nimport traceback\n\ndef add(a, b):\n"
        "    if a == -1:\n        raise ValueError(''.join(traceback.format_stack()))\n    return a + b",
        None,
    ),
    "exception_note": (
        "# EXERCISE: ex1_1\nimport inspect\n\ndef add(a, b):\n"
        "    if a == 2:\n"
        "        err = RuntimeError('see note')\n"
        "        err.add_note(''.join(inspect.stack()[1].code_context or []) + str(In))\n"
        "        raise err\n    return a + b",
        None,
    ),
}
# Encoded leaks: the learner's function copies the hidden test's source while the test runs (it can: it
# runs inside it), and a later cell prints it encoded, or the function raises with it encoded.
STASH_ANSWER = (
    "# EXERCISE: ex1_1\nimport inspect\nSTASH = []\n\ndef add(a, b):\n"
    "    STASH.append(inspect.getsource(inspect.currentframe().f_back))\n    return a + b"
)
ENCODED_LEAKS = {
    "zero_width_stash": (STASH_ANSWER, "print('\\u200b'.join('\\n'.join(STASH)))"),
    "base64_stash": (STASH_ANSWER, "import base64\nprint(base64.b64encode('\\n'.join(STASH).encode()).decode())"),
    # an encoding no detector knows: each byte xor 0x5A, in hex
    "xor_stash": (STASH_ANSWER, "print(bytes(c ^ 0x5A for c in '\\n'.join(STASH).encode()).hex())"),
    "raise_zero_width": (
        "# EXERCISE: ex1_1\nimport inspect\n\ndef add(a, b):\n"
        "    if a == 1000003:\n"
        "        raise ValueError('\\u200b'.join(inspect.getsource(inspect.currentframe().f_back)))\n"
        "    return a + b",
        None,
    ),
}
LEAKS.update(ENCODED_LEAKS)
SCRIPTS = [
    "<script>alert('md-script')</script>",
    "<img src=x onerror=alert('img-onerror')>",
    "<iframe src=\"javascript:alert('iframe')\"></iframe>",
    "[click me](javascript:alert('md-link'))",
    "<a href=\"JaVaScRiPt:alert('mixed-case')\">x</a>",
    "<a href=\"jav&#x09;ascript:alert('entity')\">y</a>",
    "<svg onload=alert('svg')><circle r=1></circle></svg>",
    "<math><mtext><table><mglyph><style><img src=x onerror=alert('mxss')>",
    "<form action=\"javascript:alert('form')\"><button>go</button></form>",
    '<meta http-equiv="refresh" content="0;url=javascript:alert(\'meta\')">',
    "<object data=\"javascript:alert('object')\"></object>",
    "<div style=\"background:url(javascript:alert('style'))\">styled</div>",
    "<base href=\"javascript:alert('base')//\">",
    "<details open ontoggle=alert('toggle')>d</details>",
    '<a href="data:text/html,<script>alert(1)</script>">data link</a>',
]


# Terminal control bytes and bidi overrides a student can put into markdown, stdout and a failure message.
CONTROL_TEXT = (
    "esc\x1b[31mred\x1b[0m osc\x1b]0;title\x07 bel\x07 c1\x9b2J\x85 cr\rx bidi\u202eevil\u2066iso\u2069 del\x7f"
)
CONTROLS_ANSWER = (
    "# EXERCISE: ex1_1\nprint("
    + repr(CONTROL_TEXT)
    + ")\n\ndef add(a, b):\n    raise ValueError("
    + repr(CONTROL_TEXT)
    + ")"
)
FORBIDDEN_CHARACTERS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _meta(grade_id: str, test: bool, points: int = 0) -> dict:
    meta = {"grade": test, "grade_id": grade_id, "locked": test, "schema_version": 3, "solution": not test}
    meta["task"] = False
    if test:
        meta["points"] = points
    return {"nbgrader": meta}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    from autograder.release import generate

    root = tmp_path_factory.mktemp("feedback") / "course"
    source = new_notebook(
        cells=[
            new_markdown_cell("### Exercise 1.1 — Add two numbers (1 point)"),
            new_code_cell(ANSWER, metadata=_meta("ex1_1", False)),
            new_code_cell(TEST, metadata=_meta("ex1_1_add", True, 1)),
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    notebooks.write(source, root / "solutions" / ASSIGNMENT / NAME)
    generate(root, [ASSIGNMENT], f"sqlite:///{root / 'gradebook.db'}")
    course = Course(root)
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)

    def submit(student: str, answer: str, extra: list) -> None:
        nb = notebooks.with_answers(release, {"ex1_1": answer})
        nb.cells += extra
        target = course.submitted / student / ASSIGNMENT / NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))

    submit("clean", CORRECT, [])
    for student, (answer, cell) in LEAKS.items():
        submit(student, answer, [new_code_cell(cell)] if cell else [])
    scripts = [new_markdown_cell(text) for text in SCRIPTS]
    scripts.append(new_markdown_cell("tagged", metadata={"tags": ["\" onmouseover=\"alert('tag')"]}))
    scripts.append(new_raw_cell("<script>alert('raw')</script>", metadata={"raw_mimetype": "text/html"}))
    submit("scripts", CORRECT, scripts)
    planted = course.submitted / "scripts" / ASSIGNMENT / NAME
    nb = nbformat.read(str(planted), as_version=4)
    nb.metadata["title"] = "</title><script>alert('title')</script>"
    nb.metadata["autograder"] = {"repair": ["[x](javascript:alert('note'))", "<script>alert('note2')</script>"]}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": "</script><script>alert(1)"}}
    nbformat.write(nb, str(planted))

    submit("controls", CONTROLS_ANSWER, [new_markdown_cell("markdown " + CONTROL_TEXT)])
    planted = course.submitted / "controls" / ASSIGNMENT / NAME
    nb = nbformat.read(str(planted), as_version=4)
    nb.metadata["autograder"] = {"repair": ["a note " + CONTROL_TEXT]}
    nbformat.write(nb, str(planted))

    students = ["clean", "scripts", "controls", *LEAKS]
    repair_submissions(course, ASSIGNMENT, students)
    results = {r.student: r for r in grade(course, ASSIGNMENT, students, workers=2)}
    generate_feedback(course, ASSIGNMENT, students)
    pages = {s: (course.feedback / s / ASSIGNMENT / "tiny_fb.html").read_text() for s in students}
    return {"course": course, "results": results, "pages": pages, "source": source}


def test_every_student_was_graded(graded):
    for student, result in graded["results"].items():
        assert result.status == "graded", f"{student}: {result.message}\n{result.log[-2000:]}"
    assert graded["results"]["clean"].grades[NAME]["ex1_1_add"]["auto_score"] == 1.0
    assert graded["results"]["raise_frame_source"].grades[NAME]["ex1_1_add"]["auto_score"] == 0.0


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("student", ["clean", "scripts", *LEAKS])
def test_feedback_never_contains_hidden_test_code(graded, student):
    text = html.unescape(re.sub(r"<[^>]+>", "", graded["pages"][student]))
    for line in HIDDEN:
        assert line not in text, f"{student}: feedback shows hidden line {line!r}"
        code = line.split(", '")[0]  # the code before the message, which feedback may show
        assert _squash(code) not in _squash(text), f"{student}: feedback shows hidden code {code!r} (re-spaced)"


HISTORY_LEAKS = {"print_in", "print_ih_joined", "history_manager", "linecache", "stderr", "display_data"}


def _graded_outputs(graded, student: str) -> str:
    nb = notebooks.read(graded["course"].autograded / student / ASSIGNMENT / NAME)
    return str([cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"])


def test_the_leaks_were_real(graded):
    """Code that runs inside a hidden test can read it: those students' graded notebooks hold hidden code (plain
    or encoded), so what keeps it out of feedback is the feedback's rule, not luck."""
    for student in set(LEAKS) - HISTORY_LEAKS - {"xor_stash", "base64_stash"}:
        outputs = _graded_outputs(graded, student).replace("\\u200b", "").replace("\u200b", "")
        assert "secret_cases" in outputs or "1000003" in outputs or "add(-1, 1)" in outputs, student
    nb = notebooks.read(graded["course"].autograded / "base64_stash" / ASSIGNMENT / NAME)
    printed = [out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    decoded = [base64.b64decode(text.strip()).decode(errors="replace") for text in printed if text.strip()]
    assert any("secret_cases" in text for text in decoded), "the base64-encoded hidden test was printed"
    xor = bytes(c ^ 0x5A for c in b"secret_cases").hex()
    assert xor in _graded_outputs(graded, "xor_stash"), "the xor-encoded hidden test was printed"
    assert xor not in graded["pages"]["xor_stash"], "an encoding no detector knows never reaches feedback"


def test_later_cells_cannot_read_hidden_tests_back(graded):
    """A cell with hidden tests is not stored in the kernel's history and its source leaves the line cache
    after it ran: the history students find nothing hidden, even in the graded notebook."""
    for student in HISTORY_LEAKS - {"stderr"}:  # stderr never reaches the graded copy at all
        outputs = _graded_outputs(graded, student)
        assert "secret_cases" not in outputs and "1000003" not in outputs, student


def test_messages_of_hidden_tests_are_still_shown(graded):
    text = html.unescape(graded["pages"]["raise_stack"])
    assert "A hidden test failed: ValueError" in text or "hidden by the grader" in text
    wrong = html.unescape(graded["pages"]["clean"])
    assert "Score: 1 / 1" in wrong


class _Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.in_body = False
        self.body_tags: list[str] = []
        self.attributes: list[tuple[str, str, str]] = []
        self.head: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "body":
            self.in_body = True
            return
        if self.in_body:
            self.body_tags.append(tag)
        else:
            self.head.append(f"{tag} {sorted(attrs)}")
        self.attributes += [(tag, name, value or "") for name, value in attrs]


FORBIDDEN_TAGS = {"script", "iframe", "object", "embed", "form", "base", "meta", "style", "svg", "math", "link"}


@pytest.mark.parametrize("student", ["scripts", "print_in"])
def test_feedback_pages_are_inert(graded, student):
    page = _Page()
    page.feed(graded["pages"][student])
    clean = _Page()
    clean.feed(graded["pages"]["clean"])
    assert not FORBIDDEN_TAGS & set(page.body_tags), FORBIDDEN_TAGS & set(page.body_tags)
    assert [a for a in page.attributes if a[1].startswith("on")] == []
    for tag, name, value in page.attributes:
        squashed = re.sub(r"[\s\x00-\x1f]+", "", value).lower()
        assert "javascript:" not in squashed and "vbscript:" not in squashed, (tag, name, value)
        if name in ("href", "src", "action", "formaction", "data"):
            assert not squashed.startswith("data:text"), (tag, name, value)
    assert [h for h in page.head if not h.startswith("title")] == [h for h in clean.head if not h.startswith("title")]
    assert "alert(" not in "".join(re.findall(r"<script.*?</script>", graded["pages"][student], re.S))


def test_the_script_students_markup_still_reads(graded):
    text = graded["pages"]["scripts"]
    assert "click me" in text and "styled" in text and "Grading summary" in text


def test_sanitiser_corpus():
    """The page sanitiser on the attempts directly (fast, no grading)."""
    for attempt in SCRIPTS:
        page = _Page()
        page.in_body = True
        page.feed(inert_html(attempt))
        assert not FORBIDDEN_TAGS & set(page.body_tags), attempt
        for tag, name, value in page.attributes:
            assert not name.startswith("on") and "javascript" not in value.lower(), (attempt, tag, name, value)
            assert name != "href" or value.startswith(("#", "http://", "https://", "mailto:")), attempt


def test_hidden_text_sees_through_common_encodings():
    hidden = HiddenText([TEST])
    code = "\n".join(HIDDEN)
    encodings = {
        "zero-width joined": "\u200b".join(code),
        "base64": base64.b64encode(code.encode()).decode(),
        "url-safe base64 in a sentence": "data: " + base64.urlsafe_b64encode(code.encode()).decode() + " end",
        "base32": base64.b32encode(code.encode()).decode(),
        "hex": code.encode().hex(),
        "reversed": code[::-1],
        "rot13": __import__("codecs").encode(code, "rot13"),
        "full-width": "".join(chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" else ch for ch in code),
        "percent-escaped": __import__("urllib.parse").parse.quote(code),
        "unicode escapes": "".join(f"\\u{ord(ch):04x}" for ch in code),
    }
    missed = [name for name, text in encodings.items() if not hidden.leaks(text)]
    assert not missed, f"not recognised as hidden test code: {missed}"
    assert not hidden.leaks(base64.b64encode(b"an ordinary output of the learner's").decode())


def test_hidden_text_finds_code_but_not_messages():
    source = TEST
    hidden = HiddenText([source])
    assert hidden.leaks("x = " + HIDDEN[1].replace(" ", "   "))
    assert hidden.leaks(HIDDEN[2][:30])
    assert not hidden.leaks("AssertionError: the hidden case failed")
    assert not hidden.leaks("assert add(1, 2) == 3"), "visible test code is not a leak"
    assert len(hidden_region(source)) == len(HIDDEN) + 2


def test_leak_fixture_names_match(graded):
    assert set(graded["pages"]) == {"clean", "scripts", "controls", *LEAKS}
    assert Path(graded["course"].feedback).is_dir()


def test_feedback_pages_carry_no_control_characters_or_bidi_overrides(graded):
    """Only newline and tab; terminal escapes and U+202E from markdown, stdout and messages are shown visibly."""
    for student, page in graded["pages"].items():
        found = sorted({f"U+{ord(ch):04X}" for ch in FORBIDDEN_CHARACTERS.findall(page)})
        assert not found, f"{student}: the feedback page carries {found}"
    text = graded["pages"]["controls"]
    assert text.count("\u241b") >= 3 and "\u27e8U+202E\u27e9" in text, "the escapes are shown, not dropped"
    assert "ValueError" in text and "markdown esc" in text


def test_visible_controls_on_every_kind():
    from autograder.feedback import inert_page, visible_controls

    assert visible_controls("a\tb\nc") == "a\tb\nc"
    every = "".join(
        chr(c) for c in [*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    )
    shown = inert_page(f"<html><head></head><body><p>{every}</p></body></html>")
    assert not FORBIDDEN_CHARACTERS.search(shown.replace("\t", "").replace("\n", ""))
    assert "\u241b" in shown and "\u27e8U+009B\u27e9" in shown and "\u27e8U+2069\u27e9" in shown


# A hidden test whose failure messages are f-strings and whose comment says what the message says: on
# Python 3.12 and newer an f-string tokenizes into parts, which the leak check once counted as code.
MESSAGE_TEST = (
    "# TEST: ex1_1_add\n"
    "### BEGIN HIDDEN TESTS\n"
    "# the even-length case: the median is the mean of the two middle values\n"
    "value = add(1000003, -7)\n"
    'assert value == 999996, f"the even-length case: the median is the mean of the two middle values, got {value!r}"\n'
    "### END HIDDEN TESTS"
)
MESSAGE_CHECK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from autograder.hidden import HiddenText
hidden = HiddenText([sys.argv[2]])
message = "AssertionError: the even-length case: the median is the mean of the two middle values, got 5"
print(json.dumps({
    "message": hidden.leaks(message),
    "comment": hidden.leaks("the even-length case: the median is the mean of the two middle values"),
    "code": hidden.leaks("value = add(1000003, -7)"),
}))
"""


def _interpreters() -> dict[str, str]:
    """Python versions on this machine that run (pyenv's installations, then PATH), by "3.x"."""
    import shutil
    import subprocess
    import sys

    found = {f"{sys.version_info.major}.{sys.version_info.minor}": sys.executable}
    for version in ("3.11", "3.13"):
        candidates = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
        candidates += [Path(p) for p in [shutil.which(f"python{version}")] if p]
        for candidate in candidates:
            works = subprocess.run([str(candidate), "-c", "pass"], capture_output=True).returncode == 0
            if works:
                found.setdefault(version, str(candidate))
                break
    return found


@pytest.mark.parametrize("version", ["3.11", "3.13"])
def test_a_hidden_tests_own_message_gets_through_on_every_python(version):
    """The message a failing hidden test writes is shown, whether Python tokenizes its f-string whole (3.11)
    or in parts (3.12+), and whatever its comment says; its code is still hidden."""
    import json
    import subprocess

    python = _interpreters().get(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [python, "-I", "-c", MESSAGE_CHECK, str(root), MESSAGE_TEST], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert not seen["message"], f"Python {version}: the test's own f-string message was taken for hidden code"
    assert not seen["comment"], f"Python {version}: a message repeating the test's comment was taken for code"
    assert seen["code"], f"Python {version}: the hidden code itself must still be recognised"
