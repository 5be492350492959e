"""``autograder feedback``: one HTML report per student that keeps hidden tests hidden.

nbgrader's ``generate_feedback`` shows hidden tests, and even with its ``ClearHiddenTests`` the
traceback of a failing hidden assert still prints the hidden line. Here nbgrader renders the
autograded notebook through :class:`autograder.nbgrader_ext.SafeFeedback`: hidden-test lines are
removed, a failing test cell shows one line (visible or hidden test, and the test's message) instead
of its outputs, any output that contains hidden test code (whatever printed or raised it) is
replaced by a note, scriptable outputs become text, and a summary at the top gives the score per
exercise and what the grader did (repairs, timeouts, restarted kernels). Students whose notebook
could not be graded get a short page saying so.

Every page is then made inert (:func:`inert_page`): its body, where everything the student wrote
ends up (markdown rendered to HTML, outputs, file names in notes), goes through the nh3 sanitizer
(Ammonia), which keeps formatting tags and drops scripts, event handlers, frames, forms, styles and
any link that is not http(s), mailto or an in-page anchor; images must be inline bitmaps.
"""

from __future__ import annotations

import html
import re
import warnings
from pathlib import Path

import nh3

from autograder.config import ensure_tools_on_path, nbgrader_app, nbgrader_config
from autograder.course_dir import Course


def feedback_config(course: Course):
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    from autograder.nbgrader_ext import SafeFeedback

    config = nbgrader_config(course.root, db_url=course.db_url)
    config.GenerateFeedback.preprocessors = [GetGrades, SafeFeedback, CSSHTMLHeaderPreprocessor]
    return config


def generate_feedback(
    course: Course, assignment: str, students: list[str] | None = None, progress: bool = False
) -> dict[str, Path]:
    """Write feedback/<student>/<assignment>/<notebook>.html; returns {student: folder}."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    ensure_tools_on_path()
    config = feedback_config(course)
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    students = students if students is not None else course.students(assignment)
    names = list(course.release_notebooks(assignment))
    written: dict[str, Path] = {}
    todo = students
    if progress:
        from tqdm import tqdm

        todo = tqdm(students, desc="feedback", unit="student")
    for student in todo:
        target = course.feedback / student / assignment
        graded = course.autograded / student / assignment
        if all((graded / name).is_file() for name in names):
            with nbgrader_app(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = api.generate_feedback(assignment, student, force=True)
            if not result["success"]:
                _failure_page(target, names, f"the feedback could not be rendered: {result.get('error', '')[-500:]}")
            for page in target.glob("*.html"):
                page.write_text(inert_page(page.read_text(encoding="utf-8")), encoding="utf-8")
        else:
            record = course.load_result(assignment, student) or {}
            _failure_page(target, names, record.get("message") or "your notebook has not been graded yet")
        written[student] = target
    return written


# Formatting the feedback body needs; everything else (script, iframe, object, form, style, svg, math,
# meta, base, link) is dropped with its content where it could carry any.
BODY_TAGS = set(nh3.ALLOWED_TAGS) - {"area", "map"}
BODY_ATTRIBUTES = {
    "*": {"class", "id", "title", "style", "lang", "dir"},
    "a": {"href", "name"},
    "img": {"src", "alt", "width", "height"},
    "td": {"colspan", "rowspan", "align"},
    "th": {"colspan", "rowspan", "align", "scope"},
    "ol": {"start"},
    "code": {"class"},
}
STYLE_PROPERTIES = {"color", "background-color", "font-weight", "font-style", "text-decoration", "text-align"}
_BITMAP = re.compile(r"^data:image/(?:png|jpeg|gif);base64,[A-Za-z0-9+/=\s]*$")
_SAFE_LINK = re.compile(r"^(?:#|https?://|mailto:)", re.IGNORECASE)


def _attribute_filter(tag: str, attribute: str, value: str) -> str | None:
    if attribute == "href":
        return value if _SAFE_LINK.match(value.strip()) else None
    if attribute == "src":
        return value if _BITMAP.match(value.strip()) else None
    return value


def inert_html(fragment: str) -> str:
    """``fragment`` without anything that could run: no script, handler, frame, form or active link."""
    return nh3.clean(
        fragment,
        tags=BODY_TAGS,
        clean_content_tags={"script", "style", "textarea", "noscript", "iframe", "object", "template", "svg", "math"},
        attributes=BODY_ATTRIBUTES,
        attribute_filter=_attribute_filter,
        url_schemes={"http", "https", "mailto", "data"},
        filter_style_properties=STYLE_PROPERTIES,
        link_rel="noopener noreferrer nofollow",
        strip_comments=True,
    )


# Characters a page must not carry raw: C0 controls but newline and tab, DEL, C1 controls (terminal
# escape sequences: ESC/CSI/OSC, BEL), and the bidirectional embeddings, overrides and isolates that
# can make text read in another order than it runs (U+202A-U+202E, U+2066-U+2069).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _shown(match: re.Match) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # the Control Pictures block: ESC shows as U+241B, BEL as U+2407
    if code == 0x7F:
        return "\u2421"
    return f"\u27e8U+{code:04X}\u27e9"  # C1 controls and bidi marks: <U+202E> in mathematical angle brackets


def visible_controls(text: str) -> str:
    """``text`` with every control character but newline and tab, and every bidi override, made visible."""
    return _CONTROLS.sub(_shown, text.replace("\r\n", "\n"))


def inert_page(page: str) -> str:
    """A rendered feedback page with its body sanitised (the head is the template's own: CSS, MathJax).

    The whole page then carries no control character but newline and tab and no bidirectional
    override: terminal escapes (ESC/CSI/OSC, BEL, C1) from markdown, outputs and messages, and
    U+202E and its kind, are shown as visible symbols (:func:`visible_controls`).
    """
    start = page.find("<body")
    opened = page.find(">", start) + 1 if start >= 0 else -1
    end = page.rfind("</body>")
    if start < 0 or opened <= 0 or end < opened:  # not the template's shape: sanitise all of it
        page = "<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>" + inert_html(page) + "</body></html>"
        return visible_controls(page)
    return visible_controls(page[:start] + "<body>" + inert_html(page[opened:end]) + page[end:])


def _failure_page(folder: Path, names: list[str], message: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        page = (
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Feedback</title></head><body>"
            f"<h1>{html.escape(Path(name).stem)}</h1>"
            "<p><strong>Your notebook could not be graded automatically:</strong> "
            f"{html.escape(message)}.</p><p>Your instructor will grade it by hand.</p></body></html>"
        )
        (folder / f"{Path(name).stem}.html").write_text(visible_controls(page))
