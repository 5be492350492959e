"""Kernel launcher of the grading sandbox: ``python -m autograder.kernel -f CONNECTION_FILE [ipykernel args]``.

nbgrader starts it (through the kernelspec that :mod:`autograder.sandbox` writes) as root inside the
bubblewrap sandbox. Before any student code runs it

* sets resource limits (address space, CPU seconds, processes, file size, open files, no core dumps)
  taken from ``AUTOGRADER_KERNEL_LIMITS`` (JSON);
* when ``AUTOGRADER_KERNEL_UID`` is set and it runs as root: gives the kernel a private home and a
  readable copy of its connection file, opens its working directory to that user with the sticky bit
  (so the kernel can write files there but cannot replace the notebook nbgrader writes), then drops
  to that unprivileged user for good. Everything nbgrader keeps (the gradebook with the hidden tests,
  the restored notebook) stays root-only, so student code can neither read nor change it. Each
  parallel grading slot has its own uid, so the process limit is per student.

Then it becomes an ordinary ipykernel in the same process (same pid, so nbgrader can still
interrupt, kill and restart it), after :func:`autograder.guard.install` has recorded the machinery
the tests run through, so that the grader notices a notebook that replaced it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import sys

LIMIT_NAMES = {
    "address_space_bytes": resource.RLIMIT_AS,
    "cpu_seconds": resource.RLIMIT_CPU,
    "processes": resource.RLIMIT_NPROC,
    "file_size_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}
PR_SET_NO_NEW_PRIVS = 38


def apply_limits(limits: dict[str, int]) -> None:
    """Set hard and soft resource limits (never raising one above its current hard limit)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in limits.items():
        if name not in LIMIT_NAMES or not value:
            continue
        which = LIMIT_NAMES[name]
        _, hard = resource.getrlimit(which)
        value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (value, value))


def drop_privileges(uid: int, connection_file: str) -> str:
    """Become ``uid`` (also as gid, no groups); return the connection file the kernel can read."""
    home = f"/tmp/kernel-home-{uid}"
    os.makedirs(home, mode=0o700, exist_ok=True)
    os.chown(home, uid, uid)
    readable = os.path.join(home, os.path.basename(connection_file))
    shutil.copyfile(connection_file, readable)
    os.chown(readable, uid, uid)
    os.chmod(readable, 0o600)
    cwd = os.getcwd()
    os.chmod(cwd, 0o1777)  # writable for the kernel, but it cannot delete or replace root's files here
    for key, sub in {
        "HOME": "",
        "MPLCONFIGDIR": ".matplotlib",
        "IPYTHONDIR": ".ipython",
        "XDG_CACHE_HOME": ".cache",
    }.items():
        os.environ[key] = os.path.join(home, sub) if sub else home
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(home, "runtime")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.umask(0o022)
    return readable


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-f" not in argv:
        raise SystemExit("usage: python -m autograder.kernel -f CONNECTION_FILE [ipykernel options]")
    position = argv.index("-f") + 1
    if os.geteuid() == 0 and not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
        # Started as root with the working directory (the notebook's folder, writable by the student)
        # on sys.path, any module imported from here on could be the student's: refuse.
        raise SystemExit("autograder.kernel must be started as root with `python -I` (see autograder.sandbox)")
    limits = json.loads(os.environ.pop("AUTOGRADER_KERNEL_LIMITS", "{}") or "{}")
    uid = os.environ.pop("AUTOGRADER_KERNEL_UID", "")
    if uid and os.geteuid() == 0:
        argv[position] = drop_privileges(int(uid), argv[position])
    else:
        # Without a uid of its own RLIMIT_NPROC would count every process of the user running the
        # grader (and root ignores it anyway): leave processes unlimited.
        limits.pop("processes", None)
    apply_limits(limits)  # after the uid change: RLIMIT_NPROC counts the processes of the new user
    sys.argv = ["ipykernel_launcher", *argv]
    from ipykernel import kernelapp

    app = kernelapp.IPKernelApp.instance()
    app.initialize()
    from autograder import guard

    guard.install(app.kernel)  # before any student code: what the test machinery is (see autograder.guard)
    app.start()


if __name__ == "__main__":
    main()
