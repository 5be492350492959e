"""Hidden tests: where they are in a test cell, and keeping them out of what a learner is shown.

Standard library only, so that any Python the course supports can run it (the tests check the leak
detector on 3.11 and 3.13, whose tokenizers differ).

* :func:`hidden_region` and :func:`without_hidden_tests` find and remove the ``BEGIN HIDDEN TESTS`` /
  ``END HIDDEN TESTS`` regions of a test cell.
* :class:`HiddenText` finds hidden test code in text student code produced: the kernel's input history
  printed, a traceback's source lines, an exception carrying its caller's frame, and the same text
  re-spaced, interleaved with invisible characters, in full-width letters, reversed, rot13'd, or as
  base64, base32, hex or percent-escapes. Its message parts (string literals, f-string text, comments)
  do not count: a failing hidden test shows its own message on purpose.
* :func:`hidden_test_summary` names a failing test without its code or traceback, and tells whether
  the message came from the test itself or from the learner's code (:func:`raised_by_test`).

No detector can recognise every encoding; :class:`autograder.nbgrader_ext.SafeFeedback` therefore also
withholds whatever student code printed after hidden tests could be read (the rule is there).
"""

from __future__ import annotations

import base64
import binascii
import codecs
import io
import re
import tokenize
import unicodedata
import urllib.parse

HIDDEN_BEGIN = "BEGIN HIDDEN TESTS"
HIDDEN_END = "END HIDDEN TESTS"
LEAK_NOTE = "[hidden by the grader: this output contained hidden test code]"
# Error names the grader itself writes into outputs (autograder.execution): messages of the grader.
GRADER_ENAMES = frozenset({"CellTimeoutError", "KernelDied", "KernelUnresponsive", "NotRun"})
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SPACE = re.compile(r"\s+")
_CELL_FRAME = re.compile(r"(?:Cell In\s*\[(\d+)\]|<ipython-input-(\d+)-[0-9a-f]+>),?\s*(?:line\s*)?(\d+)")
# One frame of an IPython traceback: a cell ("Cell In[3], line 2") or a file ("File /x/y.py:12, in f").
_FRAME_HEAD = re.compile(r"^(?:Cell In\s*\[(\d+)\]|File\s+(\S+?):\d+|<ipython-input-(\d+)-)", re.MULTILINE)
# Runs that may be an encoding of text: base64/base32 (and their URL-safe forms), hex, percent-escapes.
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_\-]{16,}={0,2}")
_HEX_RUN = re.compile(r"(?:[0-9a-fA-F]{2}){8,}")
_PERCENT_RUN = re.compile(r"(?:%[0-9a-fA-F]{2}|[A-Za-z0-9._~\-]){12,}")
_ESCAPE_RUN = re.compile(r"(?:\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})|[^\\\s]){12,}")
# Token kinds that are text, not code: string literals, the literal parts of f-strings (3.12+), comments.
_TEXT_TOKENS = {tokenize.STRING, tokenize.COMMENT} | {
    getattr(tokenize, name) for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, name)
}


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def hidden_region(source: str) -> set[int]:
    """1-based line numbers of ``source`` inside hidden-test regions, delimiter lines included."""
    lines, inside, hidden = source.split("\n"), False, set()
    for number, line in enumerate(lines, start=1):
        if HIDDEN_BEGIN in line:
            inside = True
        if inside:
            hidden.add(number)
        if HIDDEN_END in line:
            inside = False
    return hidden


def without_hidden_tests(source: str) -> str:
    """``source`` with its hidden-test regions removed (what the learner's copy of the cell shows)."""
    hidden = hidden_region(source)
    return "\n".join(line for number, line in enumerate(source.split("\n"), 1) if number not in hidden)


def normalize(text: str) -> str:
    """``text`` as the leak check compares it: no ANSI colours, no invisible (format) characters,
    compatibility forms folded (full-width letters), no whitespace."""
    text = unicodedata.normalize("NFKC", strip_ansi(text))
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Cf")
    return _SPACE.sub("", text)


def decodings(text: str) -> list[str]:
    """Readings of ``text`` that an encoding would hide code in: reversed, rot13, and every run that
    decodes as base64, base32, hex, percent-escapes or backslash escapes to mostly printable text."""
    found = [text[::-1], codecs.encode(text, "rot13")]
    for run in _BASE64_RUN.findall(text):
        for decode in (base64.b64decode, base64.urlsafe_b64decode, base64.b32decode):
            padded = run + "=" * (-len(run) % (8 if decode is base64.b32decode else 4))
            try:
                found.append(_printable(decode(padded)))
            except (binascii.Error, ValueError):
                continue
    for run in _HEX_RUN.findall(text):
        try:
            found.append(_printable(bytes.fromhex(run)))
        except ValueError:
            continue
    found += [urllib.parse.unquote(run) for run in _PERCENT_RUN.findall(text) if "%" in run]
    for run in _ESCAPE_RUN.findall(text):
        if "\\" in run:
            try:
                found.append(codecs.decode(run, "unicode_escape"))
            except (UnicodeDecodeError, ValueError):
                continue
    return [candidate for candidate in found if candidate]


def _printable(data: bytes) -> str:
    text = data.decode("utf-8", "replace")
    shown = sum(ch.isprintable() or ch.isspace() for ch in text)
    return text if text and shown >= 0.9 * len(text) else ""


def _text_mask(source: str) -> list[list[bool]]:
    """Per line of ``source``, per character: True inside text (a string, an f-string's literal part, a
    comment) by Python's tokenizer; a source that does not tokenize counts as all code."""
    lines = source.split("\n")
    mask = [[False] * len(line) for line in lines]
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in _TEXT_TOKENS:
                continue
            (row, col), (end_row, end_col) = token.start, token.end
            for number in range(row, end_row + 1):
                line = mask[number - 1]
                first = col if number == row else 0
                last = end_col if number == end_row else len(line)
                for index in range(first, min(last, len(line))):
                    line[index] = True
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # not Python: every character counts as code
    return mask


class HiddenText:
    """The hidden test code of a notebook, and a check for it in text that student code produced.

    A leak is any run of ``window`` non-blank characters of a hidden-test line (after
    :func:`normalize`, so re-spaced, re-wrapped or invisibly interleaved code still counts), or a
    whole shorter line of at least ``min_chars``, in the text or in one of its :func:`decodings`; a
    run counts only if it holds ``min_code`` characters of code (not of a string, an f-string's text
    or a comment: a test's message is shown on purpose) and is not shown to the learner anyway (it
    occurs in a visible part of a test cell).
    """

    def __init__(self, test_sources: list[str], window: int = 24, min_chars: int = 10, min_code: int = 6):
        self.window = window
        visible = "\n".join(normalize(without_hidden_tests(source)) for source in test_sources)
        self.windows: set[str] = set()
        self.short: dict[int, set[str]] = {}
        for source in test_sources:
            hidden = hidden_region(source)
            if not hidden:
                continue
            lines = source.split("\n")
            mask = _text_mask(source)
            for number in sorted(hidden):
                line = lines[number - 1]
                if HIDDEN_BEGIN in line or HIDDEN_END in line:
                    continue
                chars = [(ch, mask[number - 1][i]) for i, ch in enumerate(line) if not ch.isspace()]
                text = normalize("".join(ch for ch, _ in chars))
                code = [not in_text for _, in_text in chars]
                if len(code) != len(text):  # normalizing changed the length: count every character as code
                    code = [True] * len(text)
                if len(text) >= window:
                    for start in range(len(text) - window + 1):
                        piece = text[start : start + window]
                        if sum(code[start : start + window]) >= min_code and piece not in visible:
                            self.windows.add(piece)
                elif len(text) >= min_chars and sum(code) >= min_code and text not in visible:
                    self.short.setdefault(len(text), set()).add(text)

    def __bool__(self) -> bool:
        return bool(self.windows or self.short)

    def _contains(self, squashed: str) -> bool:
        if self.windows and any(
            squashed[i : i + self.window] in self.windows for i in range(len(squashed) - self.window + 1)
        ):
            return True
        return any(
            squashed[i : i + size] in pieces
            for size, pieces in self.short.items()
            for i in range(len(squashed) - size + 1)
        )

    def leaks(self, text: str) -> bool:
        """Whether ``text`` contains hidden test code, as it is or in a common encoding."""
        if not self or not text:
            return False
        if self._contains(normalize(text)):
            return True
        return any(self._contains(normalize(candidate)) for candidate in decodings(strip_ansi(text)))

    def scrub_text(self, text: str) -> str:
        return LEAK_NOTE if self.leaks(text) else text

    def scrub_output(self, output):
        """``output`` (an nbformat output) itself, or one of the same type saying it was hidden when it
        contains hidden test code."""
        make = type(output)
        kind = output.get("output_type")
        if kind == "error":
            parts = [str(output.get("ename", "")), str(output.get("evalue", "")), *output.get("traceback", [])]
            if self.leaks("\n".join(parts)):
                ename = str(output.get("ename", "Error"))
                ename = ename if not self.leaks(ename) else "Error"
                return make(output_type="error", ename=ename, evalue=LEAK_NOTE, traceback=[f"{ename}: {LEAK_NOTE}"])
            return output
        if kind == "stream":
            text = output.get("text", "")
            text = "".join(text) if isinstance(text, list) else str(text)
        else:
            text = "\n".join(
                "".join(value) if isinstance(value, list) else str(value) for value in output.get("data", {}).values()
            )
        if self.leaks(text):
            return make(output_type="stream", name="stdout", text=LEAK_NOTE + "\n")
        return output


def failing_line(output, source: str, execution_count: int | None = None) -> int | None:
    """The line of ``source`` where an error output's traceback left the cell, when it can be told.

    The outermost frame of an IPython traceback is the cell that ran, whatever count labels it (the
    grader runs a cell with hidden tests without storing it in the kernel's history, so that later
    cells cannot read it back, and IPython then labels it with the next count)."""
    text = strip_ansi("\n".join(output.get("traceback", [])))
    frames = list(_FRAME_HEAD.finditer(text))
    if not frames or frames[0].group(1) is None and frames[0].group(3) is None:
        return None
    match = _CELL_FRAME.match(text, frames[0].start())
    return int(match.group(3)) if match else None


def raised_by_test(output, source: str, execution_count: int | None = None, library_dirs: tuple[str, ...] = ()) -> bool:
    """Whether the error left only the test cell's own code and library code on its way up (an assertion of
    the test, a helper such as ``assert_close``): no frame of the learner's cells, no code from elsewhere.
    Its message is then the test's; otherwise student code chose it."""
    text = strip_ansi("\n".join(output.get("traceback", [])))
    frames = list(_FRAME_HEAD.finditer(text))
    if not frames or (frames[0].group(1) or frames[0].group(3)) is None:
        return False
    for frame in frames[1:]:
        if frame.group(1) or frame.group(3):
            return False  # another cell: the learner's code
        if not (library_dirs and frame.group(2).startswith(library_dirs)):
            return False
    return True


def hidden_test_summary(
    output, source: str, execution_count: int | None, limit: int = 300, show_message: bool = True
) -> str:
    """One line about a test cell's error that reveals neither hidden test code nor a traceback.
    ``show_message=False`` gives the error's kind without its message (a message student code chose)."""
    ename = str(output.get("ename", "Error"))
    evalue = strip_ansi(str(output.get("evalue", ""))).strip()
    if len(evalue) > limit:
        evalue = evalue[:limit] + "..."
    if ename in GRADER_ENAMES:
        return f"{ename}: {evalue}" if evalue else ename
    if show_message:
        message = f"{ename}: {evalue}" if evalue else ename
    else:
        message = f"{ename} raised in your code (its message is not shown: it was written after hidden tests ran)"
    line = failing_line(output, source, execution_count)
    if line is not None and line in hidden_region(source):
        return f"A hidden test failed: {message}"
    if line is not None:
        shown = source.split("\n")[line - 1].strip() if 0 < line <= len(source.split("\n")) else ""
        return f"A visible test failed at `{shown}`: {message}" if shown else f"A visible test failed: {message}"
    return f"A test failed: {message}"
