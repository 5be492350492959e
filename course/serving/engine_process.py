"""The engine in its own process, apart from the API server (vLLM V1's ``EngineCoreProc`` and ``MPClient``).

:class:`EngineProcess` is the engine core's multiprocess client; :class:`~course.serving.engine.Engine` is
its in-process one. Both drive the same :class:`~course.serving.engine_core.EngineCore`.

:class:`~course.serving.engine.Engine` steps its core on a thread of the server's process. Python's GIL then
makes the event loop (parsing, detokenizing, writing SSE chunks) and the engine's forward pass take
turns: every token's serving work is added to the decode step. vLLM V1 (0.11) runs the engine
core in a separate process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in ``vllm/envs.py``;
``EngineCoreProc`` in ``vllm/v1/engine/core.py``) that talks to the API server over ZMQ sockets
(``AsyncMPClient`` in ``vllm/v1/engine/core_client.py``), so the two overlap on two cores.

:class:`EngineProcess` does the same with two :mod:`multiprocessing` pipes:

* the API server's side has the interface the server uses from ``Engine`` (``submit``,
  ``abort``, ``abort_all``, ``stop``, the counters and ``stats()``); its requests are the same
  :class:`~course.serving.request.EngineRequest` objects, consumed with ``for`` or ``async for``;
* the engine core (:func:`_engine_core`, in a ``spawn``-ed child) owns an
  :class:`~course.serving.engine_core.EngineCore` and steps it; each iteration's token events go back as one
  :class:`~course.serving.messages.StepOutputs`, with a snapshot of the engine's counters at most
  every ``STATS_INTERVAL_S`` and whenever the engine falls idle; commands and outputs are the typed
  records of :mod:`course.serving.messages`;
* on the server's side, the event loop reads the core's pipe itself (``loop.add_reader``, once
  the server calls :meth:`EngineProcess.read_outputs_on`, as vLLM's ``AsyncMPClient`` reads its
  ZMQ socket in an asyncio task) and puts each event straight into its stream's queue; used from
  plain code, a reader thread does it instead. Either way the pipe is read through :class:`FrameReader`,
  which never waits for the rest of a message: uvloop makes a pipe it watches non-blocking (libuv's
  ``uv_poll_init``), and there ``Connection.recv()`` fails half-way through any message larger than
  what has arrived (a step of 64 streams with 20 logprobs each is one), which once looked like the
  core's death.

The model is passed to the child by pickling: torch moves its tensors to shared memory, so
the weights are not copied. If the core process dies, every open request ends with a 500 error
event saying how it ended (its exit code, or the signal that killed it), new requests get a 503
saying the same, and :meth:`EngineProcess.health` reports it (the server's ``/health`` answers 503);
after :meth:`EngineProcess.stop`, requests end with a 503, as with :class:`Engine`. A core that is
alive but sends nothing for ``wedged_after`` seconds while requests are open is reported as wedged.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import torch.multiprocessing  # noqa: F401  registers torch's pickling of tensors into shared memory

from course.models import LanguageModel
from course.serving.config import EngineConfig
from course.serving.engine_client import checked_prompt
from course.serving.engine_core import EngineCore
from course.serving.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    Command,
    CoreFailed,
    CoreOutput,
    CoreReady,
    Shutdown,
    StepOutputs,
)
from course.serving.request import (
    EngineRequest,
    EngineStopped,
    FinishReason,
    TokenEvent,
    deliver,
    failed,
    unavailable,
    wait_for_tokens,
)
from course.serving.sampler import SamplingParams

STATS_INTERVAL_S = 0.05  # the engine's counters reach the API server at least this often while busy
START_TIMEOUT_S = 300.0  # loading torch, transformers and the course in a fresh process takes seconds

logger = logging.getLogger("course.serving.server")


class EngineStartError(RuntimeError):
    """The engine core process could not be started (the message says why and what to do)."""


class RunnerName(NamedTuple):
    """What the API server knows of the core's runner (``engine.runner.name``)."""

    name: str


class CorruptOutput(RuntimeError):
    """A message from the core that cannot be read (the pipe is out of step: nothing after it can be trusted)."""


class FrameReader:
    """The messages of a :class:`~multiprocessing.connection.Connection`'s pipe, read without ever
    waiting for the rest of one.

    Each :meth:`read` is one ``os.read`` of what the pipe holds (up to ``chunk`` bytes); the bytes are
    kept until a message is complete, and the complete ones are returned, unpickled. So the pipe may be
    non-blocking (uvloop makes every descriptor it watches so, and leaves it so) and a message may be of
    any size: a partial message is never an error, only the pipe's end (:attr:`ended`) is. The framing is
    ``Connection.send``'s (CPython's ``Lib/multiprocessing/connection.py``, ``_send_bytes``): a 4-byte
    big-endian signed length, or -1 and an 8-byte length for a message of 2 GiB or more, then the pickle,
    unpickled as ``Connection.recv`` does (``ForkingPickler.loads``).

    Windows' pipes are message pipes with no file descriptor: there each read is one whole
    ``Connection.recv()`` (no event loop watches them).
    """

    chunk = 1 << 16  # a pipe's default capacity on Linux: one read empties it

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.fd = connection.fileno()
        self.buffer = bytearray()
        self.ended = False  # the writer closed its end (exited) and every whole message was read
        self.last_data = time.monotonic()  # when a read last brought bytes

    def read(self) -> list[Any]:
        """The messages one read completes (often one, maybe none; blocks only on a blocking pipe that is
        empty). At the pipe's end: sets :attr:`ended` and returns the last messages. CorruptOutput if a
        message cannot be unpickled or the pipe ends inside one."""
        if sys.platform == "win32":
            try:
                message = self.connection.recv()
            except (EOFError, OSError):
                self.ended = True
                return []
            self.last_data = time.monotonic()
            return [message]
        try:
            data = os.read(self.fd, self.chunk)
        except (BlockingIOError, InterruptedError):  # nothing there yet (a wake-up another reader took)
            return []
        except OSError:  # the descriptor is closed: nothing more will come
            data = b""
        if not data:
            self.ended = True
            if self.buffer:
                raise CorruptOutput(f"the pipe ended inside a message ({len(self.buffer)} bytes of it arrived)")
            return []
        self.last_data = time.monotonic()
        self.buffer += data
        return self._whole_messages()

    def _whole_messages(self) -> list[Any]:
        buffer, start, messages = self.buffer, 0, []
        with memoryview(buffer) as view:  # released before the buffer is resized below
            while len(buffer) - start >= 4:
                (size,) = struct.unpack_from("!i", buffer, start)
                header = 4
                if size == -1:
                    if len(buffer) - start < 12:
                        break
                    (size,) = struct.unpack_from("!Q", buffer, start + 4)
                    header = 12
                elif size < 0:
                    raise CorruptOutput(f"a message announced a length of {size} bytes")
                end = start + header + size
                if len(buffer) < end:
                    break  # the rest is still on its way
                try:
                    messages.append(ForkingPickler.loads(view[start + header : end]))
                except Exception as err:
                    raise CorruptOutput(f"a message could not be unpickled: {type(err).__name__}: {err}") from None
                start = end
        if start:
            del buffer[:start]
        return messages


def exit_words(exitcode: int | None) -> str:
    """How a process ended, in words: ``exit code N``, and the signal's name when a signal killed it."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit code {exitcode}: killed by {name}"
    return f"exit code {exitcode}"


class EngineProcess:
    """A continuous-batching engine core running in a child process; the same arguments and use as
    :class:`~course.serving.engine.Engine`.

    Args:
        lm: the model and tokenizer (the tokenizer stays here for the server; the weights are
            shared with the child, not copied).
        config: the engine's settings (:class:`~course.serving.config.EngineConfig`), or give them as
            keyword arguments, as for :class:`~course.serving.engine.Engine`; the child builds its core from the
            same record.
            Its ``wedged_after``: seconds of silence from a core with requests open after which
            :meth:`health` reports it wedged.
        start_timeout: seconds to wait for the child to build its engine.

    Raises:
        EngineStartError: the engine core could not start (its error is in the message).
    """

    def __init__(
        self,
        lm: LanguageModel,
        config: EngineConfig | None = None,
        *,
        start_timeout: float = START_TIMEOUT_S,
        **settings,
    ) -> None:
        import torch

        if config is not None and settings:
            raise TypeError(f"give the engine's settings as config or as keyword arguments, not both: {settings}")
        self.config = config = config or EngineConfig(**settings)
        self.lm = lm
        context = multiprocessing.get_context("spawn")  # fork is unsafe after torch threads or CUDA
        core_commands, self._commands = context.Pipe(duplex=False)
        self._outputs, core_outputs = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_engine_core,
            args=(lm, config, torch.get_num_threads(), core_commands, core_outputs),
            name="course-engine-core",
            daemon=True,  # never outlives the server
        )
        try:
            self.process.start()  # pickles the model: its tensors move to shared memory here
        except (OSError, RuntimeError) as err:
            raise EngineStartError(
                f"the engine core process could not start: {err}. The model's weights reach it through "
                "shared memory (/dev/shm): in a container give it more (docker run --shm-size 2g), or "
                "keep the engine in this process (course serve --engine-core thread)"
            ) from None
        # Our copies of the child's ends: closed, so that the child's exit shows here as EOF.
        core_commands.close()
        core_outputs.close()
        ready = None
        if multiprocessing.connection.wait([self._outputs, self.process.sentinel], start_timeout):
            ready = self._receive_or_none() if self._outputs.poll() else None
        if not isinstance(ready, CoreReady):
            self.process.kill()
            self.process.join(5)
            if isinstance(ready, CoreFailed):
                reason = ready.error
            elif self.process.exitcode not in (None, -signal.SIGKILL):
                # spawn runs the main script again in the child: unguarded, it starts a server there too
                reason = (
                    f"it exited with code {self.process.exitcode} before it was ready (in a script, start "
                    "servers under `if __name__ == '__main__':`, as multiprocessing's spawn needs)"
                )
            else:
                reason = f"no answer within {start_timeout:.0f} s"
            raise EngineStartError(f"the engine core process did not start: {reason}")
        self.max_batch_size: int = ready.max_batch_size
        self.max_model_len: int = ready.max_model_len
        self.runner = RunnerName(ready.runner)
        self.last_error: str | None = None
        self._stats: dict[str, Any] = ready.stats
        self._open: dict[str, EngineRequest] = {}  # submitted and not finished, by request id
        self._lock = threading.Lock()  # guards _open, _stats and the command pipe
        self._ids = itertools.count()
        self._stopping = False
        self._reader: threading.Thread | None = None  # reads the core's pipe when no event loop does
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that reads it instead
        self._gone = False  # the core's pipe reached its end and what was open is failed
        self._frames = FrameReader(self._outputs)  # the handshake above read whole messages: nothing is left over
        self.wedged_after = config.wedged_after
        self._busy_since = time.monotonic()  # when the first of the requests open now was sent

    # --- the interface of Engine that the server uses -------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Queue a request in the core; iterate over the returned request to receive its tokens.

        The prompt is checked here (:func:`~course.serving.engine_client.checked_prompt`: ValueError), once:
        the core queues what it receives as it is.
        """
        prompt_ids = checked_prompt(prompt_ids, params, self.max_model_len, self.lm.vocab_size)
        request = EngineRequest(request_id or f"req-{next(self._ids)}", prompt_ids, params, cache_salt)
        with self._lock:
            if self._stopping or not self.process.is_alive():
                raise EngineStopped(self._why_stopped())
            if self._loop is None and self._reader is None:
                name = f"course-engine-output-{self.process.pid}"
                self._reader = threading.Thread(target=self._read_outputs, name=name, daemon=True)
                self._reader.start()
            if not self._open:
                self._busy_since = time.monotonic()
            self._open[request.request_id] = request
            self._send(AddRequest(request.request_id, prompt_ids, params, cache_salt))
        return request

    def read_outputs_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the core's events on ``loop`` (call it from that loop, before the first request).

        Each message is then read, and its events put into their streams' queues, in one callback
        of the loop: no reader thread, no thread switch and no second wake-up per token. Requests
        may still be submitted and consumed from other threads.
        """
        with self._lock:
            if self._reader is not None or self._loop is not None:
                raise RuntimeError("read_outputs_on() must come before the first request, and only once")
            self._loop = loop
        loop.add_reader(self._frames.fd, self._read_one_on_loop)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request; takes effect before the core's next decode step. Unknown ids are ignored."""
        reason = FinishReason(reason)  # a reason that is none: ValueError here, not in the core
        with self._lock:
            if request_id in self._open:
                self._send(AbortRequest(request_id, reason))

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Fail every waiting and running request with an error event of status 503."""
        with self._lock:
            self._send(AbortAll(reason))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Generate synchronously (from plain code, not inside an event loop); returns the token ids."""
        return wait_for_tokens(self.submit(prompt_ids, params))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything (503 error events), refuse new requests, and end the core process.

        ``timeout=0`` only tells the core to stop (for a signal handler); otherwise wait up to
        ``timeout`` s for it, then kill it.
        """
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._send(Shutdown())
        if not timeout:
            return
        # When the loop that reads the pipe is this thread (a server's shutdown), it cannot run its
        # callback meanwhile: read the core's last events here while the core exits.
        read_here = self._loop is not None and self._reads_here()
        if read_here:
            self._read_until_end(time.monotonic() + timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)
        elif read_here:  # after a kill: the end of the pipe
            self._read_until_end(time.monotonic() + 5)

    @property
    def num_running(self) -> int:
        with self._lock:
            return sum(1 for request in self._open.values() if request.output_ids)

    @property
    def num_waiting(self) -> int:
        """Requests sent to the core that have no token yet (known here at once, not from a snapshot)."""
        with self._lock:
            return sum(1 for request in self._open.values() if not request.output_ids)

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._open)

    def cache_tokens(self) -> int:
        """Token slots held by the core's batch cache, as of its last snapshot."""
        return self._stats.get("cache_tokens", 0)

    def stats(self) -> dict[str, Any]:
        """The core's counters (as of its last snapshot, at most ``STATS_INTERVAL_S`` old while it
        is busy and fresh when it is idle), with this side's running/waiting counts."""
        running, waiting, unfinished = self.num_running, self.num_waiting, self.num_unfinished
        return {
            **self._stats,
            "running": running,
            "waiting": waiting,
            "unfinished": unfinished,
            "engine_process": self.process.pid,
        }

    def health(self) -> str | None:
        """None while the core lives and answers; otherwise why not, in words (the server's ``/health``
        answers 503 with it): it exited (how), it is shutting down, or it has requests open and has sent
        nothing for more than ``wedged_after`` seconds."""
        if self._gone or not self.process.is_alive() or self._stopping:
            return self._why_stopped()
        silent = time.monotonic() - max(self._frames.last_data, self._busy_since)
        open_now = self.num_unfinished
        if open_now and silent > self.wedged_after:
            return (
                f"the engine core process (pid {self.process.pid}) has {open_now} requests open and has sent "
                f"nothing for {silent:.0f} s (more than {self.wedged_after:g} s): it is wedged"
            )
        return None

    def _why_stopped(self) -> str:
        """Why this engine takes no requests: the core's death (how it ended), or a shutdown."""
        if self.last_error is not None:
            return self.last_error
        if not self._stopping and not self.process.is_alive():
            return f"the engine core process exited ({exit_words(self.process.exitcode)}); restart the server"
        return "the engine is shut down"

    # --- reading the core's events: on the event loop, or on a reader thread ----------------------

    def _send(self, message: Command) -> None:
        """Send a command to the core (caller holds the lock); a core that is gone is left to the reader."""
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            self._commands.send(message)

    def _receive_or_none(self) -> CoreOutput | None:
        """One whole message, waiting for it (only for the handshake, before anything else reads the pipe)."""
        try:
            return self._outputs.recv()
        except (EOFError, OSError):
            return None

    def _pump(self) -> bool:
        """Read what the pipe holds and hand over every message it completes; False once the pipe ended
        (the core exited, or sent something unreadable: then it is stopped) and what was open is failed."""
        try:
            messages = self._frames.read()
        except CorruptOutput as err:
            messages, broken = [], f"the engine core's output could not be read ({err})"
        else:
            broken = None
        for message in messages:
            self._handle(message)
        if broken is None and not self._frames.ended:
            return True
        if self._loop is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # the loop may be closed already
                self._loop.remove_reader(self._frames.fd)
        self._core_gone(broken)
        return False

    def _read_outputs(self) -> None:
        """The reader thread: hand each message's events to their requests until the core exits."""
        while self._pump():
            pass

    def _read_one_on_loop(self) -> None:
        """The event loop's callback when the pipe is readable: what it holds now (the loop calls
        again while more is waiting; a message that has not wholly arrived waits in the reader)."""
        if not self._gone:
            self._pump()

    def _reads_here(self) -> bool:
        """Whether this thread may read the pipe in the event loop's place: it is the loop's own
        thread, or the loop no longer runs."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        return running is self._loop or not self._loop.is_running()

    def _read_until_end(self, deadline: float) -> None:
        """Read and hand over messages until the core's pipe ends (the core exited) or ``deadline``."""
        while not self._gone and (left := deadline - time.monotonic()) > 0:
            if multiprocessing.connection.wait([self._outputs], left):
                self._pump()

    def _handle(self, message: StepOutputs) -> None:
        """One message from the core: its events to their requests, and its counter snapshot."""
        pending = []
        now = time.perf_counter()
        with self._lock:
            for request_id, event in message.events:
                request = self._open.get(request_id)
                if request is None:
                    continue
                if event.token is not None:
                    request.output_ids.append(event.token)
                    if request.first_token_time is None:
                        request.first_token_time = now
                if event.finish_reason is not None:
                    request.finish_reason, request.error = event.finish_reason, event.error
                    del self._open[request_id]
                pending.append((request, event))
            if message.stats is not None:
                self._stats = message.stats
        deliver(pending)

    def _core_gone(self, broken: str | None = None) -> None:
        """The core's pipe ended (or ``broken`` says why it cannot be read): fail every open request,
        with 503 after stop(), else 500 saying how the core ended; a core that still runs is killed."""
        if self._gone:
            return
        self._gone = True
        self.process.join(1 if broken is None else 0)  # its pipe ended: it is exiting
        if self.process.is_alive():  # an unreadable pipe, or a core that closed it and lives on: of no use
            self.process.kill()
            self.process.join(5)
        if self._stopping and broken is None:
            event = unavailable("the engine is shut down")
        else:
            how = broken or f"the engine core process exited ({exit_words(self.process.exitcode)})"
            self.last_error = f"{how}; restart the server"
            event = failed(self.last_error)
        with self._lock:
            self._stopping = True
            left, self._open = list(self._open.values()), {}
        if event.status == 500:
            logger.error("%s: %d open requests failed, new ones get 503", self.last_error, len(left))
        for request in left:
            request.finish_reason, request.error = event.finish_reason, event.error
        deliver([(request, event) for request in left])

    def __repr__(self) -> str:
        state = "running" if self.process.is_alive() else f"exited ({self.process.exitcode})"
        return f"EngineProcess(pid {self.process.pid}, {state}, {self.num_unfinished} requests open)"


def _engine_core(
    lm: LanguageModel, config: EngineConfig, threads: int, commands: Connection, outputs: Connection
) -> None:
    """The child: build an :class:`~course.serving.engine_core.EngineCore` and step it, taking commands in between.

    What runs between two forward passes is on every token's path, and there it runs several
    times slower than in a tight loop (each forward pass streams the weights through the caches).
    So the loop enters inference mode once, checks for commands with one ``poll`` system call, and
    sends each step's events as one :class:`~course.serving.messages.StepOutputs` (which pickles
    its events as plain tuples; ``benchmarks/serving.py`` measures the whole path).
    """
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    torch.set_num_threads(threads)
    outbox: list[tuple[str, TokenEvent]] = []

    def collect(pending: list[tuple[EngineRequest, TokenEvent]]) -> None:
        outbox.extend((request.request_id, event) for request, event in pending)

    try:
        core = EngineCore(lm, config, on_events=collect)
    except Exception as err:  # a bad argument or a model the runner cannot run: say so to the server
        outputs.send(CoreFailed(f"{type(err).__name__}: {err}"))
        return
    ready = CoreReady(core.max_batch_size, core.max_model_len, core.runner.name, core.stats())
    outputs.send(ready)
    command_waiting = _readable_now(commands)
    stats_sent = time.monotonic()
    stopping = stopped = False
    with torch.inference_mode():  # entered once here, around every step
        while not stopped:
            try:
                # Idle: block until a command comes. Busy (or stopping): take the commands that came, then step.
                while not stopping and (command_waiting() if core.num_unfinished else commands.poll(None)):
                    stopping = _apply(core, commands.recv(), collect)
            except (EOFError, OSError):  # the server is gone
                _shut_down(core)
                stopping = True
            stopped = core.step()
            idle = core.num_unfinished == 0
            now = time.monotonic()
            stats = None
            if idle or stopped or now - stats_sent >= STATS_INTERVAL_S:
                stats, stats_sent = core.stats(), now
            if outbox or stats is not None:
                try:
                    outputs.send(StepOutputs(outbox, stats))
                except (BrokenPipeError, OSError):
                    return
                outbox = []


def _readable_now(connection: Connection) -> Callable[[], bool]:
    """A check, without waiting, whether ``connection`` has something to read (or reached its end).

    One ``poll`` system call on POSIX; ``Connection.poll(0)`` goes through ``multiprocessing``'s
    ``wait()``, which builds a selector every call.
    """
    if not hasattr(select, "poll"):  # Windows: its pipes are not selectable
        return lambda: connection.poll(0)
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLIN)
    return lambda: bool(poller.poll(0))


def _shut_down(core: EngineCore) -> None:
    """End every request (503) and refuse new ones: the core's next step finishes it."""
    core.abort_all("the server is shutting down")  # as Engine.stop() says it
    core.stop()


def _apply(core: EngineCore, command: Command, collect) -> bool:
    """Carry out one command from the server; True if it was :class:`Shutdown`."""
    match command:
        case AddRequest(request_id, prompt_ids, params, cache_salt):
            try:  # checked by EngineProcess.submit already: queued as it is
                core.add_request(EngineRequest(request_id, prompt_ids, params, cache_salt))
            except (ValueError, EngineStopped) as err:  # a request id already running, a stopping engine
                last = unavailable(str(err)) if isinstance(err, EngineStopped) else failed(str(err))
                collect([(EngineRequest(request_id, [], params), last)])
        case AbortRequest(request_id, reason):
            core.abort(request_id, reason)
        case AbortAll(reason):
            core.abort_all(reason)
        case Shutdown():
            _shut_down(core)
            return True
    return False
