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

Before dropping its privileges it connects to the grader's seal socket (:mod:`autograder.seal`),
in a folder only root can enter. Then it becomes an ordinary ipykernel in the same process (same
pid, so nbgrader can still interrupt, kill and restart it), sealed by :func:`autograder.seal.install`
before any student code runs. The kernel user's home is made anew at every start, so nothing a
previous kernel of the same student left there (IPython startup files, a link) is run or followed.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import stat
import sys

from autograder import seal

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


def fresh_home(uid: int) -> str:
    """A new, empty home folder for the kernel's user (as root, before any student code of this start).

    The previous kernel of the same student could leave startup files there (IPython runs
    ``profile_default/startup/*.py`` before the seal is in place), or leave a symbolic link at its
    path so that root would chown or write somewhere else: whatever is there is removed without
    following links, and the folder is made anew (``mkdir`` fails rather than reuse one that
    reappeared)."""
    home = f"/tmp/kernel-home-{uid}"
    try:
        info = os.lstat(home)
    except FileNotFoundError:
        info = None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(home)  # does not follow the links inside it
        else:
            os.unlink(home)
    os.mkdir(home, 0o700)
    os.chown(home, uid, uid)
    return home


def drop_privileges(uid: int, connection_file: str) -> str:
    """Become ``uid`` (also as gid, no groups); return the connection file the kernel can read."""
    home = fresh_home(uid)
    readable = os.path.join(home, os.path.basename(connection_file))
    with open(connection_file, "rb") as source:
        content = source.read()
    handle = os.open(readable, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(handle, "wb") as target:
        target.write(content)
    os.chown(readable, uid, uid)
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
    # The grader's socket is in a root-only folder: connect before the privileges go.
    seal_fd = seal.connect(os.environ.pop(seal.SEAL_ENV, ""))
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
    if seal_fd is not None:
        seal.install(app.kernel, seal_fd, seal.trusted_dirs())  # before any student code (see autograder.seal)
    app.start()


if __name__ == "__main__":
    main()
