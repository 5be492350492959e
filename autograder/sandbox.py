"""Autograde one student in a throwaway sandbox: bubblewrap around nbgrader and its kernel.

Each job is one student's submission of one assignment. The host side (:func:`run_job`) stages the
job's inputs in a private folder and starts ``python -m autograder.sandbox run-job`` inside
bubblewrap; that entry point (:func:`run_job_inside`) builds a one-student nbgrader course in a
size-limited tmpfs, runs ``nbgrader autograde`` for that student, and writes the graded notebook
and the scores to an output folder. The host then merges them into the real gradebook.

What the sandbox gives student code (the kernel):

* no network: a new network namespace with only its own loopback (nbgrader talks to the kernel over
  it; the host's loopback and every other interface are out of reach);
* no solutions, no gradebook: the file system holds only the system, the Python environment and the
  course library, read-only; ``solutions/``, the real gradebook and other students' work are not
  mounted. nbgrader's own copy of this student's gradebook (which holds the hidden tests) is
  root-only, while the kernel runs as an unprivileged user of its own (see :mod:`autograder.kernel`);
* limits: address space, CPU seconds, processes, file size and open files per kernel; size-limited
  tmpfs for every writable place; a per-cell timeout; a wall-clock limit for the whole job, after
  which the whole process tree is killed;
* no view of other processes (a new PID namespace), no host environment variables;
* nothing it writes is ever run with more privileges than its own: every Python the grader starts
  runs isolated (``python -I``: no working directory on ``sys.path``), so a module planted in the
  notebook's folder is never imported by the root launcher that restarts a crashed kernel; and root
  inside the sandbox keeps only the capabilities it needs to start and stop the kernel's user
  (no mounting, no tracing), so even code that ran there as root could not remount anything.

Without bubblewrap (``sandbox="none"``: another OS, or not root) the same job runs unconfined,
with the same resilient execution and resource limits but none of the isolation.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder.config import CELL_TIMEOUT_S, configure
from autograder.seal import SEAL_ENV

KERNEL_NAME = "autograder-sandbox"
# Grading slot n runs its kernel as uid SANDBOX_UID_BASE + n: an id that no account uses, and a
# different one per parallel slot so that the process limit counts one student's processes only.
# Slots are leased machine-wide (:class:`UidLease`), so two runs at once never share a uid.
SANDBOX_UID_BASE = 2_100_000_000
UID_SLOTS = 4096
LOCK_DIR_ENV = "AUTOGRADER_LOCK_DIR"
MAX_NOTEBOOK_BYTES = 256 * 2**20
GiB = 2**30
MiB = 2**20
# Every Python the grader starts as root runs isolated: no current directory or script folder on
# sys.path, no PYTHON* variables, no user site-packages. The kernel starts in the notebook's folder,
# which the student's code can write to: without -I, `python -m autograder.kernel` would import a
# planted ./autograder/kernel.py as root. -B: nothing writes bytecode into the read-only mounts.
PYTHON_FLAGS = ("-I", "-B")
# The only capabilities root keeps inside the sandbox: what it needs to start the kernel as the slot's
# user and to stop that user's processes. Mounting (CAP_SYS_ADMIN), tracing, raw I/O and the rest are
# gone, so even code that ran as root there could not remount a read-only bind mount writable.
SANDBOX_CAPABILITIES = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
)


@dataclass
class Limits:
    """Resource limits of one grading job (every value is per student)."""

    cell_timeout_s: int = CELL_TIMEOUT_S  # per cell, then the kernel is interrupted
    job_timeout_s: int = 1800  # the whole nbgrader run, then everything is killed
    memory_bytes: int = 4 * GiB  # kernel address space (RLIMIT_AS)
    cpu_seconds: int = 1200  # kernel CPU time (RLIMIT_CPU), counted per kernel process
    processes: int = 256  # processes and threads of the kernel's user (RLIMIT_NPROC)
    file_size_bytes: int = 64 * MiB  # largest file the kernel may write (RLIMIT_FSIZE)
    open_files: int = 1024
    disk_bytes: int = 512 * MiB  # size of each writable tmpfs in the sandbox
    output_chars: int = 200_000  # output kept per cell
    max_kernel_restarts: int = 4  # after crashes or stuck cells, per notebook
    threads: int = 0  # OMP/MKL/torch threads of the kernel; 0: the CPU count divided by the workers


@dataclass
class Job:
    """One student's submission of one assignment, ready to grade."""

    assignment: str
    student: str
    notebooks: dict[str, str]  # notebook file name -> path of the submitted file on the host
    template_db: str  # sqlite gradebook holding just this assignment (made from solutions/)
    extra_files: str | None = None  # folder of the assignment's non-notebook files, if any
    timestamp: str | None = None
    limits: Limits = field(default_factory=Limits)
    # name -> "module" or "module:attribute" the released notebook's own cells import (autograder.seal)
    bindings: dict[str, str] = field(default_factory=dict)


@dataclass
class JobResult:
    """What grading one student produced; ``status`` is "graded", "failed" or "timeout"."""

    student: str
    status: str
    message: str = ""
    grades: dict[str, dict] = field(default_factory=dict)  # notebook -> grade_id -> {score, max_score, ...}
    comments: dict[str, dict] = field(default_factory=dict)  # notebook -> grade_id -> auto comment
    autograded: dict[str, str] = field(default_factory=dict)  # notebook -> graded notebook path on the host
    log: str = ""
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # where the time went inside the sandbox
    uid: int | None = None  # the kernel's uid (bwrap), for the record
    flags: list[str] = field(default_factory=list)  # why the student needs manual grading (collect, repair)


# --- uid slots shared by every run on this machine ------------------------------------------------


def lock_dir() -> Path:
    """Where the machine-wide slot locks live (``$AUTOGRADER_LOCK_DIR``, else /run/lock or /tmp)."""
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        folder = Path(configured)
    else:
        base = Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path(tempfile.gettempdir())
        folder = base / "autograder-slots"
    folder.mkdir(parents=True, exist_ok=True, mode=0o755)
    return folder


class UidLease:
    """Grading slots (kernel uids ``SANDBOX_UID_BASE + slot``) held by this run until :meth:`release`.

    Each slot is an exclusive ``flock`` on ``<lock dir>/slot-<n>.lock``: a second run (another
    process, or another lease in this one) takes the next free slots, and a run that dies releases
    its slots with its file descriptors, so nothing is left to clean up.
    """

    def __init__(self, count: int, folder: Path | None = None):
        import fcntl

        self._files = []
        self.slots: list[int] = []
        folder = Path(folder) if folder else lock_dir()
        for slot in range(UID_SLOTS):
            if len(self.slots) == count:
                break
            handle = open(folder / f"slot-{slot}.lock", "a+")  # noqa: SIM115 (held until release)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                continue
            self._files.append(handle)
            self.slots.append(slot)
        if len(self.slots) < count:
            self.release()
            raise RuntimeError(
                f"no free grading slots: {UID_SLOTS} are held by other autograder runs on this machine "
                f"(locks in {folder}); wait for them to finish"
            )

    def release(self) -> None:
        for handle in self._files:
            handle.close()
        self._files, self.slots = [], []

    def __enter__(self) -> UidLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --- host side ----------------------------------------------------------------------------------


@functools.cache
def bwrap_problem() -> str | None:
    """Why the bubblewrap sandbox cannot be used here (None when it can)."""
    if sys.platform != "linux":
        return "the grading sandbox needs Linux (bubblewrap)"
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    if os.geteuid() != 0:
        return (
            "the grading sandbox runs each kernel as an unprivileged user of its own, which needs root: "
            "run the grader as root (in a container or VM), or pass --sandbox none for trusted notebooks"
        )
    probe = subprocess.run(
        ["bwrap", "--unshare-net", "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/", "--", "true"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"bubblewrap does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def resolve_sandbox(mode: str) -> str:
    """ "bwrap" or "none" for a requested mode "auto", "bwrap" or "none"."""
    if mode not in {"auto", "bwrap", "none"}:
        raise ValueError(f"sandbox must be auto, bwrap or none, not {mode!r}")
    if mode == "none":
        return "none"
    problem = bwrap_problem()
    if problem and mode == "bwrap":
        raise RuntimeError(f"cannot sandbox the grading: {problem}")
    return "none" if problem else "bwrap"


def _package_dirs() -> list[str]:
    import autograder
    import course

    return sorted({str(Path(module.__file__).resolve().parent) for module in (autograder, course)})


def _bwrap_command(job_dir: Path, limits: Limits) -> list[str]:
    command = ["bwrap", "--die-with-parent", "--new-session", "--unshare-net", "--unshare-pid", "--unshare-ipc"]
    command += ["--cap-drop", "ALL"]
    for capability in SANDBOX_CAPABILITIES:
        command += ["--cap-add", capability]
    command += ["--unshare-uts", "--unshare-cgroup-try", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    command += _system_dir_mounts()
    # The writable places come first: mounts are applied in order, and a tmpfs on /tmp would hide a
    # Python environment or a checkout that lives under /tmp (a CI clone, a pytest tmp_path).
    size = str(limits.disk_bytes)
    command += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    command += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    command += ["--perms", "0755", "--size", size, "--tmpfs", "/grading"]
    command += _read_only_binds(_python_binds())
    command += ["--ro-bind", str(job_dir / "in"), "/input", "--bind", str(job_dir / "out"), "/output"]
    command += ["--chdir", "/grading", "--"]
    return command


def _system_dir_mounts() -> list[str]:
    """bwrap arguments for the top-level system folders outside /usr: a symbolic link (``/bin -> usr/bin``)
    is made again as that link, a real folder is bound read-only, a missing one is left out."""
    arguments = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            arguments += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            arguments += ["--ro-bind", top, top]
    return arguments


def _within(path: str, folders: list[str]) -> bool:
    """Whether ``path`` is one of ``folders`` or inside one of them."""
    return any(path == folder or path.startswith(folder + "/") for folder in folders)


def _python_binds() -> list[tuple[str, str]]:
    """(host path, path in the sandbox) of the Python installation and the course's packages that /usr
    does not already hold, each bound once (a folder inside another bound one is not bound again)."""
    mounted = ["/usr"]
    for path in sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), *_package_dirs()}):
        if not _within(path, mounted):
            mounted.append(path)
    binds = [(path, path) for path in mounted[1:]]
    # A virtual environment reached through a symbolic link (a venv shared by two course copies, a
    # link to it): the interpreter is started by the link's path, so the link's path must exist too.
    for path in {os.path.abspath(sys.prefix), os.path.abspath(os.path.dirname(sys.executable))}:
        real = os.path.realpath(path)
        if real != path and not _within(path, mounted):
            binds.append((real, path))
            mounted.append(path)
    return binds


def _read_only_binds(binds: list[tuple[str, str]]) -> list[str]:
    """bwrap arguments binding each (host path, sandbox path) read-only, its parents made first."""
    arguments = []
    created = set()
    for source, path in binds:
        # bwrap would create the parents of a mount point as 0700 root: the kernel's user could not
        # walk through them to the Python installation.
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in created and str(parent) not in {"/usr", "/etc", "/tmp"}:
                arguments += ["--perms", "0755", "--dir", str(parent)]
                created.add(str(parent))
        arguments += ["--ro-bind", source, path]
    return arguments


def _clean_env(limits: Limits) -> dict[str, str]:
    """The environment inside the sandbox: nothing of the host's except the course's quiet settings."""
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": "/tmp/home",
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        "COURSE_QUICK": "1",
    }
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(max(1, limits.threads))
    return env


def run_job(job: Job, job_dir: Path, slot: int = 0, sandbox: str = "bwrap") -> JobResult:
    """Grade one student in ``job_dir`` (a fresh folder), sandboxed or not; never raises for student faults."""
    started = time.perf_counter()
    job_dir = Path(job_dir)
    inbox, outbox = job_dir / "in", job_dir / "out"
    for folder in (job_dir, inbox, outbox):
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    shutil.copyfile(job.template_db, inbox / "gradebook.db")
    (inbox / "submitted").mkdir(exist_ok=True)
    for name, path in job.notebooks.items():
        shutil.copyfile(path, inbox / "submitted" / name)
    if job.extra_files and Path(job.extra_files).is_dir():
        shutil.copytree(job.extra_files, inbox / "extra", dirs_exist_ok=True)
    spec = {
        "assignment": job.assignment,
        "student": job.student,
        "notebooks": sorted(job.notebooks),
        "timestamp": job.timestamp,
        "limits": asdict(job.limits),
        "uid": SANDBOX_UID_BASE + slot if sandbox == "bwrap" else None,
        "bindings": job.bindings,
        "python": sys.executable,
    }
    (inbox / "job.json").write_text(json.dumps(spec))
    entry = [sys.executable, *PYTHON_FLAGS, "-m", "autograder.sandbox", "run-job"]
    if sandbox == "bwrap":
        command = _bwrap_command(job_dir, job.limits) + entry + ["/input", "/grading", "/output"]
    else:
        (job_dir / "work").mkdir(exist_ok=True)
        command = entry + [str(inbox), str(job_dir / "work"), str(outbox)]
    env = _clean_env(job.limits)
    if sandbox == "none":
        env["HOME"] = str(job_dir / "home")
        env["TMPDIR"] = str(job_dir / "tmp")
        for folder in (env["HOME"], env["TMPDIR"]):
            os.makedirs(folder, exist_ok=True)
    log_path = job_dir / "entry.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=job.limits.job_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    result_path = outbox / "result.json"
    if result_path.is_file():
        data = json.loads(result_path.read_text())
        result = JobResult(student=job.student, **data)
        result.autograded = {
            name: str(outbox / "autograded" / name)
            for name in result.autograded
            if (outbox / "autograded" / name).is_file()
        }
    else:
        result = JobResult(
            student=job.student,
            status="timeout" if timed_out else "failed",
            message=f"grading did not finish within {job.limits.job_timeout_s} s"
            if timed_out
            else f"the grading process stopped unexpectedly (exit code {process.returncode})",
        )
    result.log = _tail(log_path) + ("\n" + _tail(outbox / "nbgrader.log") if (outbox / "nbgrader.log").exists() else "")
    result.seconds = time.perf_counter() - started
    result.uid = spec["uid"]
    return result


def _tail(path: Path, limit: int = 20_000) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


# --- inside the sandbox -------------------------------------------------------------------------

CONFIG_TEMPLATE = """\
import json, os
from autograder.sandbox import nbgrader_settings
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.json")) as spec:
    nbgrader_settings(get_config(), json.load(spec), os.path.dirname(os.path.abspath(__file__)))
"""


def nbgrader_settings(c, spec: dict, root: str) -> None:
    """nbgrader configuration of a grading job: the course's settings plus resilient execution."""
    from nbconvert.preprocessors import ClearMetadataPreprocessor
    from nbgrader.preprocessors import AssignLatePenalties, CheckCellMetadata, IgnorePattern, LimitOutput

    from autograder.nbgrader_ext import CourseSaveAutoGrades, ResilientExecute

    limits = Limits(**spec["limits"])
    configure(c, root=root, db_url=f"sqlite:///{os.path.join(root, 'gradebook.db')}")
    c.Execute.timeout = limits.cell_timeout_s
    c.Execute.kernel_name = KERNEL_NAME
    c.Execute.shutdown_kernel = "immediate"
    c.Execute.error_on_timeout = {
        "ename": "CellTimeoutError",
        "evalue": f"the cell ran longer than {limits.cell_timeout_s} s and was interrupted",
        "traceback": [f"CellTimeoutError: the cell ran longer than {limits.cell_timeout_s} s and was interrupted"],
    }
    c.ResilientExecute.max_kernel_restarts = limits.max_kernel_restarts
    c.ResilientExecute.max_output_chars = limits.output_chars
    c.ResilientExecute.kernel_uid = int(spec.get("uid") or 0)
    c.ResilientExecute.check_integrity = True
    c.ResilientExecute.seal_socket = seal_socket_path(root)
    c.ResilientExecute.expected_bindings = dict(spec.get("bindings") or {})
    c.Autograde.autograde_preprocessors = [
        ResilientExecute,
        IgnorePattern,
        ClearMetadataPreprocessor,
        LimitOutput,
        CourseSaveAutoGrades,
        AssignLatePenalties,
        CheckCellMetadata,
    ]


def seal_socket_path(root: str | Path) -> str:
    """Where the grader listens for the sealed kernel (:mod:`autograder.seal`): a root-only folder of the
    job. A Unix socket's path is limited to about 100 bytes, so a long job folder (an unconfined run
    under a deep temporary folder) uses a short one named after it."""
    path = os.path.join(str(root), "seal", "kernel.sock")
    if len(path.encode()) < 100:
        return path
    import hashlib

    digest = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"autograder-seal-{digest}", "kernel.sock")


def _kernelspec(spec: dict, root: Path) -> Path:
    limits = Limits(**spec["limits"])
    kernel_limits = {
        "address_space_bytes": limits.memory_bytes,
        "cpu_seconds": limits.cpu_seconds,
        "processes": limits.processes,
        "file_size_bytes": limits.file_size_bytes,
        "open_files": limits.open_files,
    }
    env = {"AUTOGRADER_KERNEL_LIMITS": json.dumps(kernel_limits), SEAL_ENV: seal_socket_path(root)}
    if spec.get("uid"):
        env["AUTOGRADER_KERNEL_UID"] = str(spec["uid"])
    folder = root / "jupyter" / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    kernel = {
        "argv": [spec["python"], *PYTHON_FLAGS, "-m", "autograder.kernel", "-f", "{connection_file}"],
        "display_name": "Python 3 (grading sandbox)",
        "language": "python",
        "interrupt_mode": "signal",
        "env": env,
    }
    (folder / "kernel.json").write_text(json.dumps(kernel))
    return root / "jupyter"


def run_job_inside(inbox: Path, work: Path, outbox: Path) -> int:
    """Build a one-student course in ``work``, autograde it, write result.json to ``outbox``."""
    os.umask(0o077)  # everything nbgrader writes (gradebook, restored notebook) is root-only
    clock = {"start": time.perf_counter()}
    spec = json.loads((inbox / "job.json").read_text())
    _limit_own_memory(spec)
    assignment, student = spec["assignment"], spec["student"]
    _build_course(inbox, work, spec)
    _point_jupyter_at(work, spec)
    # nbgrader runs in this process (importing it twice would cost seconds per student); the host
    # enforces the wall-clock limit by killing the whole sandbox.
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config

    clock["imported"] = time.perf_counter()
    config = Config()
    nbgrader_settings(config, spec, str(work))
    os.chdir(work)
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    outcome = api.autograde(assignment, student, force=True, create=True)
    clock["autograded"] = time.perf_counter()
    (outbox / "nbgrader.log").write_text((outcome.get("log") or "") + "\n" + (outcome.get("error") or ""))
    autograded, flags = _copy_out_graded(work, outbox, spec)
    status, message = "graded", ""
    if len(autograded) < len(spec["notebooks"]):
        status = "failed"
        message = "nbgrader could not grade the notebook; see the grading log"
    grades, comments = _read_scores(work, assignment, student, spec["notebooks"]) if autograded else ({}, {})
    clock["done"] = time.perf_counter()
    timings = {
        "setup_and_import_s": clock["imported"] - clock["start"],
        "autograde_s": clock["autograded"] - clock["imported"],
        "collect_scores_s": clock["done"] - clock["autograded"],
    }
    result = {
        "status": status,
        "message": message,
        "grades": grades,
        "comments": comments,
        "autograded": autograded,
        "timings": timings,
        "flags": flags,
    }
    (outbox / "result.json").write_text(json.dumps(result))
    return 0


def _limit_own_memory(spec: dict) -> None:
    """Bound this process's address space (no core dumps): nbgrader holds the kernel's outputs in memory
    (the kernel lowers its own limit to the job's)."""
    import resource

    ceiling = max(Limits(**spec["limits"]).memory_bytes, 4 * GiB) + GiB
    resource.setrlimit(resource.RLIMIT_AS, (ceiling, ceiling))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _build_course(inbox: Path, work: Path, spec: dict) -> None:
    """The one-student nbgrader course in ``work``: the gradebook, the job, the config, the assignment's
    extra files and the student's notebooks (with their submission time) from ``inbox``."""
    assignment, student = spec["assignment"], spec["student"]
    work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(inbox / "gradebook.db", work / "gradebook.db")
    (work / "job.json").write_text(json.dumps(spec))
    (work / "nbgrader_config.py").write_text(CONFIG_TEMPLATE)
    source = work / "solutions" / assignment
    source.mkdir(parents=True, exist_ok=True)
    if (inbox / "extra").is_dir():
        shutil.copytree(inbox / "extra", source, dirs_exist_ok=True)
    submitted = work / "submitted" / student / assignment
    submitted.mkdir(parents=True, exist_ok=True)
    for name in spec["notebooks"]:
        shutil.copyfile(inbox / "submitted" / name, submitted / name)
    if spec.get("timestamp"):
        (submitted / "timestamp.txt").write_text(spec["timestamp"])


def _point_jupyter_at(work: Path, spec: dict) -> None:
    """Jupyter's paths into ``work``: the grading kernel (:func:`_kernelspec`), its runtime and config."""
    os.environ["JUPYTER_PATH"] = str(_kernelspec(spec, work))
    os.environ["JUPYTER_RUNTIME_DIR"] = str(work / "runtime")
    os.environ["JUPYTER_CONFIG_DIR"] = str(work / "jupyter-config")
    os.makedirs(os.environ.get("HOME", "/tmp/home"), exist_ok=True)


def _copy_out_graded(work: Path, outbox: Path, spec: dict) -> tuple[dict[str, str], list[str]]:
    """Copy the notebooks nbgrader autograded to ``outbox/autograded``: ({name: name} of those copied, the
    integrity flags of their scores). A notebook missing or not trusted is left out."""
    graded_dir = work / "autograded" / spec["student"] / spec["assignment"]
    autograded = {}
    flags: list[str] = []
    (outbox / "autograded").mkdir(exist_ok=True)
    for name in spec["notebooks"]:
        path = graded_dir / name
        try:
            info = os.lstat(path)
        except OSError:
            continue
        # Only a regular file that nbgrader (root) wrote, of sane size: never a link planted by the kernel.
        if (
            path.is_file()
            and not path.is_symlink()
            and info.st_uid == os.geteuid()
            and info.st_size < MAX_NOTEBOOK_BYTES
        ):
            shutil.copyfile(path, outbox / "autograded" / name)
            autograded[name] = name
            flags += _integrity_flags(path, name)
    return autograded, flags


def _integrity_flags(path: Path, name: str) -> list[str]:
    """Why the grader does not trust the scores of an autograded notebook (written by nbgrader, not the kernel)."""
    try:
        record = json.loads(path.read_text()).get("metadata", {}).get("autograder", {})
        problems = record.get("integrity", []) if isinstance(record, dict) else []
    except (OSError, ValueError, AttributeError):
        return []
    return [f"{name}: score not trusted: {problem}" for problem in problems if isinstance(problem, str)]


def _read_scores(work: Path, assignment: str, student: str, names: list[str]) -> tuple[dict, dict]:
    from nbgrader.api import Gradebook, MissingEntry

    grades: dict[str, dict] = {}
    comments: dict[str, dict] = {}
    with Gradebook(f"sqlite:///{work / 'gradebook.db'}") as gradebook:
        for name in names:
            notebook_id = Path(name).stem
            try:
                notebook = gradebook.find_submission_notebook(notebook_id, assignment, student)
            except MissingEntry:
                continue
            grades[name] = {
                grade.name: {
                    "auto_score": grade.auto_score,
                    "max_score": grade.max_score,
                    "needs_manual_grade": grade.needs_manual_grade,
                }
                for grade in notebook.grades
            }
            comments[name] = {comment.name: comment.auto_comment for comment in notebook.comments}
    return grades, comments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder.sandbox", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    job = commands.add_parser("run-job", help="(inside the sandbox) grade the job staged in INPUT")
    job.add_argument("input", type=Path)
    job.add_argument("work", type=Path)
    job.add_argument("output", type=Path)
    args = parser.parse_args(argv)
    return run_job_inside(args.input, args.work, args.output)


if __name__ == "__main__":
    sys.exit(main())
