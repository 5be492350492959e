"""``autograder``: the instructor's command line.

autograder release [ASSIGNMENT ...]   regenerate modules/ from solutions/ (outputs cleared)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _release(args: argparse.Namespace) -> int:
    from autograder.release import ReleaseError, release

    try:
        touched, released = release(args.root, args.assignments or None, args.db_url)
    except ReleaseError as err:
        print(f"autograder release: {err}", file=sys.stderr)
        return 1
    for path in touched:
        print(f"cleaned source notebook {path}")
    for path in released:
        print(f"released {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autograder", description="Instructor tools of the LLM serving course.")
    parser.add_argument("--root", type=Path, default=None, help="course repository root (default: this checkout)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    rel = commands.add_parser(
        "release",
        help="regenerate the student notebooks in modules/ from the nbgrader sources in solutions/",
        description="Rewrite each source notebook's setup cell from course/env.py, clear source outputs, "
        "then run nbgrader generate_assignment so modules/ holds the student notebooks (solutions and "
        "hidden tests removed, outputs cleared). Commit solutions/ and modules/ together.",
    )
    rel.add_argument("assignments", nargs="*", help="assignment ids (default: all folders of solutions/)")
    rel.add_argument("--db-url", default=None, help="gradebook URL (default: sqlite gradebook.db in the root)")
    rel.set_defaults(run=_release)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
