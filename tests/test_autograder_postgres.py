"""The grading pipeline with a PostgreSQL gradebook (``--db-url postgresql+psycopg2://...``).

The fixture starts a throwaway PostgreSQL server from Debian's packages (``bin/test`` installs them
when it runs as root): a fresh cluster in a temporary folder, listening only on a Unix socket there,
stopped at the end.
"""

from __future__ import annotations

import csv
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import CORRECT, TINY_ASSIGNMENT, submit, tiny_course

from autograder import cli

ASSIGNMENT = TINY_ASSIGNMENT


def _server_binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="module")
def postgres():
    binaries = _server_binaries()
    if binaries is None:
        pytest.skip("PostgreSQL server binaries not found (bin/test installs them with apt-get when run as root)")
    pytest.importorskip("psycopg2")
    import psycopg2

    user = None
    if os.geteuid() == 0:  # initdb refuses to run as root
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a 'postgres' system user to run the server")
        user = "postgres"
    base = Path(tempfile.mkdtemp(prefix="autograder-pg-"))
    os.chmod(base, 0o755)
    if user:
        shutil.chown(base, user, user)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data, log = base / "data", base / "server.log"
    run = {"check": True, "capture_output": True, "user": user} if user else {"check": True, "capture_output": True}
    initdb = [binaries / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
    subprocess.run(initdb, **run)
    options = f"-k {base} -c listen_addresses='' -p {port} -c fsync=off"
    subprocess.run([binaries / "pg_ctl", "-D", data, "-l", log, "-o", options, "-w", "start"], **run)
    try:
        connection = psycopg2.connect(host=str(base), port=port, user="postgres", dbname="postgres")
        connection.autocommit = True
        connection.cursor().execute("CREATE DATABASE course")
        connection.close()
        yield f"postgresql+psycopg2://postgres@/course?host={base}&port={port}"
    finally:
        subprocess.run([binaries / "pg_ctl", "-D", data, "-m", "immediate", "stop"], **{**run, "check": False})
        shutil.rmtree(base, ignore_errors=True)


def test_grade_and_export_into_postgres(postgres, tmp_path, capsys):
    from nbgrader.api import Gradebook

    course = tiny_course(tmp_path / "course", db_url=postgres)
    submit(course, "good", CORRECT)
    submit(course, "wrong", "# EXERCISE: ex1_1\ndef add(a, b):\n    return abs(a) + b")
    root = str(course.root)
    assert cli.main(["--root", root, "grade", ASSIGNMENT, "--db-url", postgres, "--workers", "2"]) == 0
    assert cli.main(["--root", root, "export", ASSIGNMENT, "--db-url", postgres]) == 0
    assert cli.main(["--root", root, "feedback", ASSIGNMENT, "--db-url", postgres]) == 0
    capsys.readouterr()
    rows = {row["student"]: row for row in csv.DictReader((course.work(ASSIGNMENT) / "grades.csv").open())}
    assert (rows["good"]["total"], rows["wrong"]["total"]) == ("2.0", "1.0")
    with Gradebook(postgres) as gradebook:
        assert sorted(s.id for s in gradebook.students) == ["good", "wrong"]
        assert gradebook.find_submission(ASSIGNMENT, "good").score == 2.0
    assert not (course.root / "gradebook.db").exists(), "the sqlite default must not be used"
    assert (course.feedback / "wrong" / ASSIGNMENT / "tiny.html").is_file()
