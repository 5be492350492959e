"""The grading kernel's seal: test verdicts that student code can neither forge nor hide its tampering from.

Student code and the tests share one Python process, so anything the tests run through (builtins,
``math.isclose``, ``course.grading``, the kernel's output channel, IPython's machinery) can be replaced
by a cell. What the grader can make sure of is that such a replacement is *seen*, by something the
student's code cannot reach, and reported through a channel it cannot forge:

* **The channel.** Before the kernel drops its privileges (:mod:`autograder.kernel`, as root) it
  connects to a Unix socket the grader listens on in a root-only folder; after the drop no process of
  the student's can connect there. The kernel makes a random key and sends it as its first message,
  before any student code runs. Every later message carries an HMAC with that key.
* **The watchdog.** A thread started with :func:`_thread.start_new_thread` (so ``threading`` does
  not list it) answers the grader's ``CHECK`` after every test cell: it compares what the tests run
  through with a record taken before any student code ran, and answers ``ok`` or the parts that
  changed. Everything it calls was captured at start (C functions; no module global is looked up at
  check time), it never calls a method of an object student code could have made, and it only
  *iterates* dictionaries (a lookup could run a planted ``__eq__`` in its thread).
* **The audit hook** (PEP 578; Python code cannot remove one). The key lives only in the closures of
  the hook and the watchdog, and a function's closure is reachable only through the garbage
  collector's or the interpreter's introspection (``gc.get_referrers``, ``sys._current_frames``, raw
  memory through ``ctypes``), each an audit event: the hook reports it and kills the kernel before the
  call returns. It also reports notebook code that changes the profile or trace function (the
  reference-call check of :func:`course.grading.forbid_reference` runs on the profile function),
  compiles code under a library's file name, rewrites a library function's code, or adds an audit hook.

The grader (:class:`autograder.execution.ResilientExecution`) treats a missing, late or badly signed
answer as tampering too, so the only way to keep a clean record is to leave the tests alone. What the
record covers, and what it does not, is in ``docs/instructors.md``.
"""

from __future__ import annotations

import ast
import builtins
import hmac
import os
import socket
import threading
from typing import Any

SEAL_ENV = "AUTOGRADER_SEAL_SOCKET"
DIGEST = "sha256"
OK = "ok"
# Events that reach the key (the hook's and the watchdog's closures) or another thread's frames: the
# hook reports them and kills the kernel before they return.
FATAL_EVENTS = frozenset(
    {
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        "sys._setprofileallthreads",
        "sys._settraceallthreads",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.cdata",
        "ctypes.cdata/buffer",
    }
)
# Events that change how the tests run when notebook code (not a library) raises them.
WATCHED_CALLS = frozenset({"sys.setprofile", "sys.settrace", "sys.addaudithook"})
# What the hook reports when a profile or trace function is replaced from the notebook's frame. CPython raises
# these events itself, with the notebook's frame on top, when it turns off a profile or trace function that raised
# (Python/sysmodule.c, profile_trampoline): the grader's KeyboardInterrupt landing inside course.grading's
# forbid_reference watcher does that. ResilientExecution sets them aside from a kernel it stops for not answering
# an interrupt (nothing that kernel runs afterwards reaches a verdict).
PROFILE_RESETS = frozenset({"the notebook called sys.setprofile", "the notebook called sys.settrace"})
# sys attributes that change by themselves between cells (the last exception, prompts).
VOLATILE_SYS = frozenset({"last_type", "last_value", "last_traceback", "last_exc", "ps1", "ps2", "ps3", "_"})
# Attributes of the kernel's objects that change with every request it serves (the parent message, the
# execution result, the buffers of the output streams, the saved input functions).
VOLATILE_ATTRIBUTES = frozenset(
    {
        "_parent_header",
        "_parent_header_global",
        "_parent_ident",
        "_parents",
        "_shell_context",
        "_buffers",
        "_allow_stdin",
        "trait _sys_raw_input",
        "trait _sys_eval_input",
        "trait last_execution_result",
        "last_execution_result",
        "last_execution_succeeded",
        "_",  # the displayhook's last three results
        "__",
        "___",
    }
)
# Module attributes that libraries themselves rebind while the notebook runs, none of them on the path of
# a test's verdict: found by grading every solution notebook under the seal.
LIBRARY_REBINDS = frozenset(
    {
        ("inspect", "getfile"),  # torch.package patches it when torch is imported
        ("course.grading", "_reporter"),  # made on first use (announce_passing_tests)
        ("matplotlib.pyplot", "_REPL_DISPLAYHOOK"),  # set when pyplot meets IPython
        ("matplotlib.pyplot", "_backend_mod"),  # the backend, loaded on first use
    }
)
# Names every module may gain or change by itself.
VOLATILE_MODULE_NAMES = frozenset({"__warningregistry__"})
# Builtins that IPython adds and removes around every cell it runs.
VOLATILE_BUILTINS = frozenset({"_", "__", "___", "get_ipython", "exit", "quit", "display", "__IPYTHON__"})
# Modules a test cell runs through that are imported before any student code, so the record holds them.
PRELOADED = ("math", "cmath", "operator", "numpy", "threading", "linecache", "traceback", "course.grading")


# --- grader side ----------------------------------------------------------------------------------

# CPython 3.11's ast module counts how deep it is in building a tree in one counter per interpreter
# (Python/Python-ast.c, ``state->recursion_depth``), not per call. Two grading threads that parse at once,
# with a hand-off of the GIL in between (a finalizer or a garbage-collector callback can release it), read
# each other's count, and ast.parse raises "SystemError: AST constructor recursion depth mismatch".
_PARSE_LOCK = threading.Lock()


def parse_python(source: str) -> ast.Module:
    """``ast.parse(source)``, one thread at a time (see ``_PARSE_LOCK``). Raises SyntaxError as ast.parse does."""
    with _PARSE_LOCK:
        return ast.parse(source)


def free_names(source: str) -> list[str]:
    """The names ``source`` (a test cell) reads without binding them itself: what it takes from the
    notebook's namespace or from builtins. A cell that does not parse gives none."""
    try:
        tree = parse_python(source)
    except SyntaxError:
        return []
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(name for name in loaded - bound if name.isidentifier())


def expected_bindings(cells: list) -> dict[str, str]:
    """What the course's own cells import, by the name they bind: ``{"np": "numpy", "assert_close":
    "course.grading:assert_close"}``; a name those cells define themselves maps to "" (the notebook's own
    code, on purpose). Taken from the code cells of the *released* notebook that are
    neither answers nor tests, so the tests' helpers are known as the course wrote them, whatever the
    submission's copy of those cells now says."""
    bindings: dict[str, str] = {}
    for cell in cells:
        if not _is_course_code(cell):
            continue
        try:
            tree = parse_python(cell.get("source", ""))
        except SyntaxError:
            continue
        for node in tree.body:
            _bind_statement(node, bindings)
    return bindings


def _is_course_code(cell) -> bool:
    """Whether a notebook cell is a code cell the course wrote: neither an answer nor a test."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return cell.get("cell_type") == "code" and not meta.get("solution") and not meta.get("grade")


def _bind_statement(node: ast.stmt, bindings: dict[str, str]) -> None:
    """Add to ``bindings`` what one top-level statement of a course cell binds (see expected_bindings)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        for name, origin in _imported(node):
            bindings[name] = origin
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        bindings[node.name] = ""  # defined by the course's own cell: the notebook's, by design
    elif isinstance(node, ast.Assign | ast.AnnAssign):
        for name in _assigned_names(node):
            bindings.setdefault(name, "")


def _imported(node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """(name, what it is) for each name an import binds: ``import a.b`` binds "a" to "a", ``import a.b as c``
    "c" to "a.b", ``from m import f as g`` "g" to "m:f"; a relative or star import binds nothing known."""
    if isinstance(node, ast.Import):
        return [_import_binding(alias) for alias in node.names]
    if not node.module or node.level:
        return []
    return [(alias.asname or alias.name, f"{node.module}:{alias.name}") for alias in node.names if alias.name != "*"]


def _import_binding(alias: ast.alias) -> tuple[str, str]:
    """(name, module) one ``import`` clause binds: the alias to the full module, or else the top package."""
    if alias.asname:
        return alias.asname, alias.name
    top = alias.name.split(".")[0]
    return top, top


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> list[str]:
    """Every plain name an assignment's targets bind, in order (``a, (b, c) = ...`` gives a, b, c)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]


def listen(path: str) -> socket.socket:
    """The grader's listening socket at ``path`` (its folder is made root-only, 0700)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.setblocking(False)
    return server


def sign(key: bytes, payload: str) -> str:
    return hmac.new(key, payload.encode(), DIGEST).hexdigest()


def alert_reason(payload: str | None) -> str | None:
    """What an ``ALERT <seq> <reason>`` payload reports, or None for any other payload."""
    if payload is None or not payload.startswith("ALERT ") or payload.count(" ") < 2:
        return None
    return payload.split(" ", 2)[2]


def parse(key: bytes, line: bytes) -> str | None:
    """The payload of a signed line, or None when its signature is not the kernel's."""
    try:
        text = line.decode()
    except UnicodeDecodeError:
        return None
    payload, _, mac = text.rpartition("|")
    if not payload or not hmac.compare_digest(sign(key, payload), mac.strip()):
        return None
    return payload


def trusted_dirs() -> list[str]:
    """The folders library code runs from (the Python installation and the course's checkout), each
    ending in "/": code anywhere else, a notebook cell above all, is the student's."""
    import sys

    import autograder
    import course

    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    folders |= {os.path.dirname(os.path.dirname(module.__file__)) for module in (autograder, course)}
    found = set()
    for folder in folders:
        found |= {os.path.abspath(folder), os.path.realpath(folder)}
    return sorted(path.rstrip("/") + "/" for path in found)


# --- kernel side ------------------------------------------------------------------------------------


def connect(path: str) -> int | None:
    """Connect to the grader's socket (as root, before the kernel drops its privileges); the fd, or None."""
    if not path:
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(path)
    except OSError:
        client.close()
        return None
    fd = client.detach()
    os.set_inheritable(fd, False)
    return fd


def install(kernel: Any, fd: int, trusted_dirs: list[str]) -> None:
    """Seal ``kernel`` (an ipykernel ``IPythonKernel``, built, before any student code): send the key on
    ``fd``, record the test machinery, start the watchdog and add the audit hook. ``trusted_dirs`` are
    the read-only folders library code lives in; code from anywhere else is the notebook's."""
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # numpy is a dependency of the course, but a bare kernel may lack it
            continue
    _build_seal(kernel, fd, tuple(trusted_dirs))


def _build_seal(kernel: Any, fd: int, trusted_dirs: tuple[str, ...]) -> None:  # noqa: C901 (one closure world)
    # Everything the hook and the watchdog use is bound here, once: C functions and plain data. After
    # this function returns, the key exists only in their closures.
    import _hashlib
    import _thread
    import posix
    import sys
    import types

    key = posix.urandom(32)
    b_type, b_len, b_id, b_str, b_zip = builtins.type, builtins.len, builtins.id, builtins.str, builtins.zip
    t_str, t_dict, t_list, t_module, t_type = str, dict, list, types.ModuleType, type
    m_builtins = builtins
    t_function, t_builtin = types.FunctionType, types.BuiltinFunctionType
    dict_items = dict.items
    list_copy = list.copy
    str_join, str_startswith, str_encode, str_split = str.join, str.startswith, str.encode, str.split
    str_partition = str.partition
    bytes_hex, bytes_decode, bytes_split = bytes.hex, bytes.decode, bytes.split
    class_dict = type.__dict__["__dict__"].__get__
    class_name = type.__dict__["__name__"].__get__
    class_mro = type.__dict__["__mro__"].__get__
    module_dict = t_module.__dict__["__dict__"].__get__
    function_module = t_function.__dict__["__module__"].__get__
    function_name = t_function.__dict__["__name__"].__get__
    function_code = t_function.__dict__["__code__"].__get__
    builtin_module = t_builtin.__dict__["__module__"].__get__
    builtin_name = t_builtin.__dict__["__name__"].__get__
    instance_dict = object.__getattribute__
    hmac_digest = _hashlib.hmac_digest
    write, read, getpid, kill = posix.write, posix.read, posix.getpid, posix.kill
    get_ident, allocate_lock = _thread.get_ident, _thread.allocate_lock
    getframe = sys._getframe
    m_sys = sys
    sys_dict = module_dict(sys)
    plain_types = (int, float, complex, str, bytes, bool, type(None))
    proxy_items = types.MappingProxyType.items
    send_lock = allocate_lock()
    state: dict[str, Any] = {"alerts": [], "busy": {}, "watchdog": None, "seq": 0}
    fatal, watched_calls = FATAL_EVENTS, WATCHED_CALLS
    volatile_sys, volatile_builtins, volatile_attributes = VOLATILE_SYS, VOLATILE_BUILTINS, VOLATILE_ATTRIBUTES
    library_rebinds, volatile_module_names = LIBRARY_REBINDS, VOLATILE_MODULE_NAMES
    user_module_names = ("__main__", "__mp_main__")
    t_method = types.MethodType
    method_function = t_method.__dict__["__func__"].__get__
    method_self = t_method.__dict__["__self__"].__get__
    rewritable = ("__code__", "__defaults__", "__kwdefaults__")
    ok_text = OK
    hidden_marker = "BEGIN HIDDEN TESTS"
    # Exception classes too: an `except OSError` looks the name up in builtins when it runs.
    e_base, e_exception, e_os, e_value, e_attribute = BaseException, Exception, OSError, ValueError, AttributeError

    def send(payload: str) -> None:
        data = str_encode(payload + "|" + bytes_hex(hmac_digest(key, str_encode(payload), "sha256")) + "\n")
        with send_lock:
            while data:
                data = data[write(fd, data) :]

    # --- the record ---------------------------------------------------------------------------------
    def plain_items(mapping) -> list:
        """(key, value) pairs of a real dict whose keys are all exact strings; None otherwise."""
        if b_type(mapping) is not t_dict:
            return None
        pairs = []
        for name, value in dict_items(mapping):
            if b_type(name) is not t_str:
                return None
            pairs.append((name, value))
        return pairs

    def is_plain(kind) -> bool:
        """Whether ``kind`` is one of the plain data types (by identity: ``in`` could run a metaclass's
        ``__eq__``)."""
        for candidate in plain_types:  # noqa: SIM110 (any() is a builtin, looked up at call time)
            if kind is candidate:
                return True
        return False

    def class_pairs(klass) -> list:
        """(name, value) pairs of a class's own dictionary, iterated without hashing a key; None when a
        key is not an exact string."""
        pairs = []
        for name, value in proxy_items(class_dict(klass)):
            if b_type(name) is not t_str:
                return None
            pairs.append((name, value))
        return pairs

    def snapshot(mapping) -> dict:
        pairs = plain_items(mapping)
        return t_dict(pairs) if pairs is not None else None

    modules_dict = sys_dict["modules"]
    recorded_modules: dict[str, Any] = {}
    recorded_dicts: dict[int, dict] = {}

    def record_module(name: str, module) -> None:
        recorded_modules[name] = module
        if b_type(module) is t_module:
            recorded_dicts[b_id(module)] = snapshot(module_dict(module))

    for name, module in plain_items(modules_dict) or []:
        record_module(name, module)
    builtins_snapshot = snapshot(module_dict(builtins))

    def attributes_of(obj) -> dict:
        """An object's own attributes, traitlets' stored values included, read without running its code;
        None when a key is not an exact string."""
        try:
            own = instance_dict(obj, "__dict__")
        except e_attribute:
            return {}
        pairs = plain_items(own)
        if pairs is None:
            return None
        found = t_dict(pairs)
        traits = found.get("_trait_values")
        if traits is not None:
            trait_pairs = plain_items(traits)
            if trait_pairs is None:
                return None
            for name, value in trait_pairs:
                found["trait " + name] = value
        return found

    shell = kernel.shell
    user_module = getattr(shell, "user_module", None)
    channel_objects = {"kernel": kernel, "shell": shell}
    for label, owner, name in (
        ("session", kernel, "session"),
        ("iopub socket", kernel, "iopub_socket"),
        ("iopub thread", kernel, "iopub_thread"),
        ("displayhook", shell, "displayhook"),
        ("display publisher", shell, "display_pub"),
        ("events", shell, "events"),
        ("compiler", shell, "compile"),
        ("input transformer manager", shell, "input_transformer_manager"),
        ("traceback formatter", shell, "InteractiveTB"),
    ):
        value = getattr(owner, name, None)
        if value is not None:
            channel_objects[label] = value
    for label in ("stdout", "stderr"):
        if sys_dict.get(label) is not None:
            channel_objects[label] = sys_dict[label]
    recorded_objects: dict[str, tuple] = {}
    recorded_classes: dict[int, tuple] = {}
    for label, obj in channel_objects.items():
        cls = b_type(obj)
        recorded_objects[label] = (obj, cls, attributes_of(obj) or {})
        for klass in class_mro(cls):
            if b_id(klass) not in recorded_classes:
                recorded_classes[b_id(klass)] = (klass, t_dict(class_pairs(klass) or []))
    callable_lists = {
        "input transformers (cleanup)": shell.input_transformers_cleanup,
        "input transformers (post)": shell.input_transformers_post,
        "AST transformers": shell.ast_transformers,
    }
    manager = shell.input_transformer_manager
    for name in ("cleanup_transforms", "line_transforms", "token_transformers"):
        callable_lists[f"input transformers ({name})"] = getattr(manager, name)
    recorded_lists = {label: (value, list_copy(value)) for label, value in callable_lists.items()}
    recorded_handlers = snapshot(kernel.shell_handlers) or {}
    recorded_metaclasses = set()
    for before in recorded_dicts.values():
        for value in (before or {}).values():
            kind = b_type(value)
            if kind is not type and issubclass(kind, type):
                recorded_metaclasses.add(b_id(kind))

    # --- the comparison -----------------------------------------------------------------------------
    def dict_changes(before: dict, now: dict, skip=frozenset(), plain_ok=True) -> list:
        """Names whose value in ``now`` is not the recorded object (plain data may change by itself)."""
        if now is None:
            return ["(an attribute whose name is not a string)"]
        changed = []
        for name, value in dict_items(before):
            if name in skip:
                continue
            current = now.get(name, now)  # `now` itself marks a missing name
            if current is value:
                continue
            if plain_ok and is_plain(b_type(value)) and is_plain(b_type(current)):
                continue
            if (  # the same method bound again (`self.write = self._write`)
                b_type(value) is t_method
                and b_type(current) is t_method
                and method_function(value) is method_function(current)
                and method_self(value) is method_self(current)
            ):
                continue
            changed.append(name)
        return changed

    def as_dict(pairs) -> dict:
        return t_dict(pairs) if pairs is not None else None

    def class_from_notebook(klass) -> bool:
        """Whether a class was written in the notebook (its module says so, or one of its functions is)."""
        pairs = class_pairs(klass)
        if pairs is None:
            return True
        for name, value in pairs:
            if name == "__module__" and b_type(value) is t_str and value == "__main__":
                return True
            if b_type(value) is t_function and not library_code(value):
                return True
        return False

    def from_notebook_object(value) -> bool:
        """Whether ``value`` is code the notebook wrote, or an object of a class it wrote."""
        kind = b_type(value)
        if kind is t_function or kind is t_method:
            return not library_code(value)
        if kind is t_type or b_id(kind) in recorded_metaclasses:
            return class_from_notebook(value)
        return class_from_notebook(kind)

    def is_data(value) -> bool:
        kind = b_type(value)
        return is_plain(kind) or kind is t_dict or kind is t_list or kind is t_tuple or kind is t_set

    def lazy_change(before, now, modules: dict, owner: str, attribute: str) -> bool:
        """A change a library makes by itself, none of them a way to change a verdict: a value set on first
        use (None before), one data structure for another, a submodule imported lazily; never one whose new
        value is the notebook's code or holds it (``owner``: the module's name in sys.modules)."""
        if now is modules:  # the name is gone
            return False
        if b_type(now) is t_module:
            return genuine_submodule(before, now, modules, owner, attribute)
        if not (before is None or (is_data(before) and is_data(now))):
            return False
        if from_notebook_object(now):
            return False
        for value in held_values(now):  # noqa: SIM110 (all() is a builtin, looked up at call time)
            if not is_plain(b_type(value)) and from_notebook_object(value):
                return False
        return True

    def genuine_submodule(before, now, modules: dict, owner: str, attribute: str) -> bool:
        """Whether the module ``now``, found in place of ``before`` as ``owner.attribute``, is what an import
        puts there: the module sys.modules holds under its own name, and that name is the one ``before`` had
        (a module imported again) or ``owner.attribute`` (a package's submodule). A module the notebook made
        and registered under another name (``np.testing = fake``, ``course.grading.math = fake``) is not."""
        name = module_name(now)
        if name is None or modules.get(name, modules) is not now:
            return False
        if b_type(before) is t_module:
            return module_name(before) == name
        return name == owner + "." + attribute

    def module_name(module):
        """A module's ``__name__`` when it is an exact string, read from its dictionary without hashing a key
        (a key could be a string subclass with code of its own); None otherwise."""
        for key, value in dict_items(module_dict(module)):
            if b_type(key) is t_str and key == "__name__":
                return value if b_type(value) is t_str else None
        return None

    def held_values(data):
        """What a dict (its keys and values), list or tuple holds, each to be looked at; nothing for other data."""
        if b_type(data) is t_dict:
            held = []
            for key, value in dict_items(data):  # iterating a real dict runs no code of its keys
                held.append(key)
                held.append(value)
            return held
        if b_type(data) is t_list or b_type(data) is t_tuple:
            return data
        return ()

    def compare_modules(problems: list) -> dict:
        current_pairs = plain_items(modules_dict)
        if current_pairs is None or sys_dict.get("modules") is not modules_dict:
            problems.append("sys.modules")
            return {}
        current = t_dict(current_pairs)
        for name, module in dict_items(recorded_modules):
            if current.get(name, current) is not module:
                problems.append(f"sys.modules[{name!r}]")
        for name, module in current_pairs:
            if name not in recorded_modules:
                record_module(name, module)  # first seen now: its record starts here
        for name, module in dict_items(recorded_modules):
            if b_type(module) is not t_module or name in user_module_names or module is user_module:
                continue  # the notebook's own namespace: compare_names looks at what the tests take from it
            compare_module_attributes(name, module, current, problems)
        return current

    def compare_module_attributes(name: str, module, modules: dict, problems: list) -> None:
        """The attributes of the recorded module ``name`` that changed, but for the changes libraries make by
        themselves (``modules``: sys.modules now)."""
        before = recorded_dicts.get(b_id(module))
        if before is None:
            return
        skip = volatile_sys if module is m_sys else volatile_builtins if module is m_builtins else ()
        now = as_dict(plain_items(module_dict(module)))
        for attribute in dict_changes(before, now, skip):
            if attribute in volatile_module_names or (name, attribute) in library_rebinds:
                continue
            if now is not None and lazy_change(before[attribute], now.get(attribute, now), modules, name, attribute):
                continue
            problems.append(f"{name}.{attribute}")

    def compare_channel(problems: list) -> dict:
        """The kernel's objects, their classes and the shell's hooks; returns the shell's attributes."""
        current_shell = compare_objects(problems)
        compare_classes(problems)
        compare_transformers(problems)
        compare_callbacks(problems)
        compare_handlers(problems)
        return current_shell or {}

    def compare_objects(problems: list):
        """Each recorded kernel object: its class, its attributes, and no attribute of its own hiding a method
        of its class; returns the shell's attributes now (None when they cannot be read)."""
        current_shell = None
        for label, (obj, cls, attributes) in dict_items(recorded_objects):
            if b_type(obj) is not cls:
                problems.append(f"the {label}'s class")
                continue
            now = attributes_of(obj)
            if label == "shell":
                current_shell = now
            for attribute in dict_changes(attributes, now, volatile_attributes):
                problems.append(f"the {label}'s {attribute}")
            for name, value in dict_items(now or {}):  # an instance attribute hiding a method of the class
                if name in attributes or is_plain(b_type(value)):
                    continue
                if hides_method(obj, cls, name, value):
                    problems.append(f"the {label}'s {name}")
        return current_shell

    def hides_method(obj, cls, name: str, value) -> bool:
        """Whether ``value``, set on ``obj`` itself as ``name``, hides what the first class in ``cls``'s method
        order that recorded ``name`` (as anything but plain data) holds there."""
        for klass in class_mro(cls):
            entry = recorded_classes.get(b_id(klass))
            if entry is None or name not in entry[1] or is_plain(b_type(entry[1][name])):
                continue
            return not (  # the class's own method bound to this object (`stream.write = stream.write`)
                b_type(value) is t_method and method_self(value) is obj and method_function(value) is entry[1][name]
            )
        return False

    def compare_classes(problems: list) -> None:
        """The recorded classes of the kernel's objects: an attribute changed, or a new one (which can hide a
        base class's method)."""
        for klass, before in recorded_classes.values():
            now = as_dict(class_pairs(klass))
            for attribute in dict_changes(before, now, plain_ok=False):
                problems.append(f"{class_name(klass)}.{attribute}")
            for attribute in now or ():  # a new class attribute can hide a base class's method
                if attribute not in before:
                    problems.append(f"{class_name(klass)}.{attribute}")

    def compare_transformers(problems: list) -> None:
        """The shell's input and AST transformer lists: each the same list, holding the same objects."""
        for label, (value, items) in dict_items(recorded_lists):
            if b_type(value) is not t_list or b_len(value) != b_len(items):
                problems.append(label)
                continue
            for before, now in b_zip(items, value):
                if before is not now:
                    problems.append(label)
                    break

    def compare_handlers(problems: list) -> None:
        """The kernel's message handlers (``execute_request`` runs every cell)."""
        kernel_now = attributes_of(kernel) or {}
        handlers = kernel_now.get("shell_handlers")
        for name in dict_changes(recorded_handlers, as_dict(plain_items(handlers))):
            problems.append(f"the kernel's {name} handler")

    def library_code(function) -> bool:
        """Whether a callable runs library code (a function or method from the trusted folders, or C)."""
        kind = b_type(function)
        if kind is t_method:
            function, kind = method_function(function), b_type(method_function(function))
        if kind is t_builtin:
            return True
        if kind is not t_function:
            return False
        filename = function_code(function).co_filename
        return b_type(filename) is t_str and str_startswith(filename, trusted_dirs)

    def compare_callbacks(problems: list) -> None:
        """IPython's event callbacks: a library's (matplotlib's, the course's) are fine; one the notebook
        defined sees every cell's source as it runs, hidden tests included, and can rewrite its result."""
        events = channel_objects.get("events")
        callbacks = (attributes_of(events) or {}).get("callbacks") if events is not None else None
        pairs = plain_items(callbacks) if callbacks is not None else []
        if pairs is None:
            problems.append("IPython's event callbacks")
            return
        for event, registered in pairs:
            if b_type(registered) is not t_list:
                problems.append(f"IPython's {event} callbacks")
                continue
            for function in registered:
                if not library_code(function):
                    problems.append(f"an IPython {event} callback defined by the notebook")
                    break

    def home_of(value):
        """(module name, attribute name) a library object says it lives at, or None for other objects."""
        kind = b_type(value)
        if kind is t_function:
            return function_module(value), function_name(value)
        if kind is t_builtin:
            return builtin_module(value), builtin_name(value)
        if kind is t_type or b_id(kind) in recorded_metaclasses:
            return t_dict(class_pairs(value) or []).get("__module__"), class_name(value)
        return None

    def compare_names(names: list, modules: dict, shell_now: dict, problems: list) -> None:
        """What a test cell takes from the notebook besides the learner's answers (the grader leaves
        those out of ``names``): builtins not shadowed, modules and library helpers the real ones."""
        namespace = as_dict(plain_items(shell_now.get("_user_ns", shell_now.get("user_ns"))))
        if namespace is None:
            problems.append("the notebook's namespace")
            return
        module_ids = {b_id(module) for module in recorded_modules.values()}
        for token in names:
            name, _, expected = str_partition(token, "=")
            if name not in namespace:
                continue
            value = namespace[name]
            if expected:
                compare_import(name, value, expected, modules, problems)
            elif name in builtins_snapshot and name not in volatile_builtins:
                if value is not builtins_snapshot[name]:
                    problems.append(f"the builtin {name} (the notebook defines its own)")
            elif b_type(value) is t_module:
                if b_id(value) not in module_ids:
                    problems.append(f"the module the tests call {name}")
            else:
                compare_home(name, value, modules, problems)

    def compare_import(name: str, value, expected: str, modules: dict, problems: list) -> None:
        """A name the course's own cells import (``expected``: "module" or "module:attribute"): still that object."""
        module_name, _, attribute_name = str_partition(expected, ":")
        module = modules.get(module_name)
        if b_type(module) is not t_module:
            problems.append(f"{name} (the course's cells import it from {module_name}, not loaded)")
        elif attribute_name:
            if not module_holds(module, attribute_name, value):
                problems.append(f"{name} (not {module_name}.{attribute_name})")
        elif value is not module:
            problems.append(f"{name} (not the module {module_name})")

    def compare_home(name: str, value, modules: dict, problems: list) -> None:
        """A function or class the tests take from the notebook: the very object the module it names as its
        home holds under its name (data the notebook prepared is not a replacement for a library function)."""
        home = home_of(value)
        if home is None:
            return  # data the notebook prepared: not a replacement for a library function
        module_name, attribute_name = home
        if b_type(module_name) is not t_str or b_type(attribute_name) is not t_str:
            problems.append(f"{name} (its module is not a name)")
            return
        if module_name == "__main__":
            problems.append(f"{name} (a library helper the tests use, defined by the notebook instead)")
            return
        module = modules.get(module_name)
        if b_type(module) is not t_module:
            problems.append(f"{name} (from {module_name}, which is not loaded)")
            return
        if not module_holds(module, attribute_name, value):
            problems.append(f"{name} (not {module_name}.{attribute_name})")

    def module_holds(module, attribute_name: str, value) -> bool:
        """Whether ``module``'s own dictionary holds ``value`` itself under ``attribute_name``."""
        members = as_dict(plain_items(module_dict(module))) or {}
        return members.get(attribute_name, members) is value

    def check(names: list) -> str:
        problems: list = []
        try:
            modules = compare_modules(problems)
            shell_now = compare_channel(problems)
            if builtins_snapshot is None:
                problems.append("builtins")
            compare_names(names, modules, shell_now, problems)
        except e_exception:  # whatever broke the comparison is itself a finding
            problems.append("the record could not be compared")
        problems = state["alerts"] + problems
        if not problems:
            return ok_text
        seen: list = []
        for problem in problems:
            if problem not in seen:
                seen.append(problem)
        return "changed: " + str_join(", ", seen[:40])

    linecache_dict = getattr(sys_dict["modules"].get("linecache"), "cache", None)
    dict_pop = dict.pop
    t_set = set
    set_attribute = object.__setattr__
    from IPython.core.interactiveshell import ExecutionResult as execution_result_class

    str_find = str.find
    t_tuple = tuple

    def forget_hidden() -> None:
        """Drop what still holds a hidden test's source or frames: its line-cache entry (IPython puts
        every cell there for tracebacks) and the last exception, whose traceback reaches its frame."""
        pairs = plain_items(linecache_dict)
        for name, entry in pairs or ():
            if b_type(entry) is not t_tuple or b_len(entry) < 3 or b_type(entry[2]) is not t_list:
                continue
            for line in entry[2]:
                if b_type(line) is t_str and str_find(line, hidden_marker) >= 0:
                    dict_pop(linecache_dict, name, None)
                    break
        if plain_items(sys_dict) is not None:  # only exact-string keys: a lookup runs no planted __eq__
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                if name in sys_dict:
                    sys_dict[name] = None
        shell_now = attributes_of(shell) or {}
        result = shell_now.get("trait last_execution_result", shell_now.get("last_execution_result"))
        if result is not None and b_type(result) is execution_result_class:
            for name in ("error_in_exec", "error_before_exec"):
                set_attribute(result, name, None)

    def serve() -> None:
        state["watchdog"] = get_ident()
        pending = b""
        while True:
            try:
                chunk = read(fd, 65536)
            except e_os:
                return
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = bytes_split(pending, b"\n", 1)
                parts = str_split(bytes_decode(line, "ascii", "replace"), " ")
                if b_len(parts) >= 3 and parts[0] == "CHECK":
                    names = str_split(parts[3], ",") if b_len(parts) > 3 and parts[3] else []
                    answer = check(names)
                    if parts[2] == "H":
                        forget_hidden()
                    send("ANSWER " + parts[1] + " " + answer)

    # --- the audit hook -------------------------------------------------------------------------------
    def from_notebook(depth: int) -> bool:
        """Whether the code ``depth`` frames up is the student's. From inside the hook the caller of the
        audited operation is 4 up: from_notebook, the inspect_* function of its event, inspect_event, hook."""
        try:
            frame = getframe(depth)
        except e_value:
            return False
        filename = frame.f_code.co_filename
        if b_type(filename) is not t_str:
            return True
        if str_startswith(filename, "<frozen "):
            return False
        return not str_startswith(filename, trusted_dirs)

    def alert(reason: str) -> None:
        state["seq"] += 1
        state["alerts"].append(reason)
        try:  # noqa: SIM105 (contextlib is a module student code can change)
            send("ALERT " + b_str(state["seq"]) + " " + reason)
        except e_os:
            pass

    def hook(event: str, args: tuple) -> None:
        # Never raise: a traceback through the hook would hand its frame (and the key) to the caller.
        try:
            inspect_event(event, args)
        except e_base:
            state["alerts"].append("the grader's audit hook failed")

    def inspect_event(event: str, args: tuple) -> None:
        ident = get_ident()
        if ident == state["watchdog"] or ident in state["busy"]:
            return
        # Each inspect_* function marks its thread busy while it looks, so that the events its own
        # work raises are not inspected in turn.
        if event in fatal:
            inspect_fatal(ident, event)
        elif event in watched_calls:
            inspect_watched_call(ident, event)
        elif event == "compile" or event == "code.__new__":
            inspect_compile(ident, args)
        elif event == "object.__setattr__":
            inspect_setattr(ident, args)
        elif event == "open":
            inspect_open(ident, args)

    def inspect_fatal(ident: int, event: str) -> None:
        state["busy"][ident] = True
        alert(f"the notebook called {event}, which reaches the grader's record; the kernel was stopped")
        kill(getpid(), 9)

    def inspect_watched_call(ident: int, event: str) -> None:
        state["busy"][ident] = True
        try:
            if from_notebook(4):
                alert(f"the notebook called {event}")
        finally:
            state["busy"].pop(ident, None)

    def inspect_compile(ident: int, args: tuple) -> None:
        filename = args[1] if b_len(args) > 1 else None
        if b_type(filename) is t_str and str_startswith(filename, trusted_dirs):
            state["busy"][ident] = True
            try:
                if from_notebook(4):
                    alert(f"the notebook made code under a library's file name ({filename})")
            finally:
                state["busy"].pop(ident, None)

    def inspect_setattr(ident: int, args: tuple) -> None:
        if not (b_len(args) > 1 and b_type(args[1]) is t_str and args[1] in rewritable):
            return
        target = args[0]
        if b_type(target) is t_function:
            state["busy"][ident] = True
            try:
                code = function_code(target)
                name = function_name(target)
                name = name if b_type(name) is t_str else "?"
                if str_startswith(code.co_filename, trusted_dirs) and from_notebook(4):
                    alert(f"the notebook rewrote the library function {name}")
            finally:
                state["busy"].pop(ident, None)

    def inspect_open(ident: int, args: tuple) -> None:
        if b_len(args) > 0 and b_type(args[0]) is t_str:
            path = args[0]
            if str_startswith(path, "/proc/") and path[-4:] == "/mem":
                state["busy"][ident] = True
                alert("the notebook opened the kernel's memory; the kernel was stopped")
                kill(getpid(), 9)

    _thread.start_new_thread(serve, ())
    send("KEY " + bytes_hex(key))
    sys.addaudithook(hook)
