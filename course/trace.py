"""The request trace: what one streamed request looked like from the client's side.

A trace is the record every module speaks: module 2's client writes it, module 1's metric
functions read it, and module 3's simulator replays and emits it, so measured and simulated
runs are compared with the same code. Times are seconds on one monotonic clock
(``time.perf_counter`` for real runs, the simulated clock for simulations).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

TRACE_FORMAT = "llm-serving-course/request-traces"
TRACE_VERSION = 1


@dataclass
class RequestTrace:
    """One request as a client saw it.

    Attributes:
        request_id: any id unique within a run.
        send_time: when the client sent the request (s).
        chunk_times: arrival time of every streamed chunk that carried a choice (s), in order.
            A chunk may carry no text (a special token, or text held back until it is valid
            UTF-8) and still counts, as in vLLM's benchmark. A trailing usage-only chunk is
            not a chunk.
        chunk_tokens: output tokens carried by each chunk (same length as ``chunk_times``;
            0 for an empty chunk, more than 1 when a server bundles tokens).
        prompt_tokens: tokens in the prompt (from the server's usage when it reports it).
        output_tokens: tokens generated (from usage when reported, else ``sum(chunk_tokens)``).
        finish_reason: "stop", "length", ... as the server reported it, or None.
        error: why the request failed, or None. Failed requests are left out of the metrics.
    """

    request_id: str
    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.chunk_times = [float(t) for t in self.chunk_times]
        self.chunk_tokens = [int(n) for n in self.chunk_tokens]
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError(
                f"trace {self.request_id!r}: chunk_times has {len(self.chunk_times)} entries but "
                f"chunk_tokens has {len(self.chunk_tokens)}; give one token count per chunk."
            )
        if any(later < earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])):
            raise ValueError(f"trace {self.request_id!r}: chunk_times must be in arrival order.")
        if self.chunk_times and self.chunk_times[0] < self.send_time:
            raise ValueError(
                f"trace {self.request_id!r}: the first chunk arrives before the request was sent "
                f"({self.chunk_times[0]} < {self.send_time}); are both on the same clock?"
            )
        if min(self.chunk_tokens, default=0) < 0 or self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"trace {self.request_id!r}: token counts cannot be negative.")

    @property
    def succeeded(self) -> bool:
        """A request counts when it did not fail and at least one chunk arrived (vLLM's rule)."""
        return self.error is None and len(self.chunk_times) > 0

    @classmethod
    def from_token_times(
        cls,
        request_id: str,
        send_time: float,
        token_times: Sequence[float],
        prompt_tokens: int = 0,
        *,
        error: str | None = None,
        finish_reason: str = "length",
    ) -> RequestTrace:
        """A trace of one chunk per output token, from the times the tokens became available (s).

        The one convention for the traces the library records itself (live measurements, the
        simulator, the static-batching reference): ``output_tokens`` counts the token times, and a
        request that failed (``error`` given, e.g. rejected or cut off) has no ``finish_reason``.
        Requests generate until their output length, so one that did not fail finished by "length".
        """
        times = list(token_times)
        return cls(
            request_id=request_id,
            send_time=send_time,
            chunk_times=times,
            chunk_tokens=[1] * len(times),
            prompt_tokens=prompt_tokens,
            output_tokens=len(times),
            finish_reason=None if error else finish_reason,
            error=error,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestTrace:
        known = set(cls.__dataclass_fields__)
        missing = {"request_id", "send_time"} - set(data)
        if missing:
            raise ValueError(f"a trace record lacks {sorted(missing)}; records need request_id and send_time.")
        return cls(**{key: value for key, value in data.items() if key in known})


def save_traces(path: str | Path, traces: Iterable[RequestTrace], **metadata: object) -> Path:
    """Write traces as JSON (with free-form metadata such as the server and workload)."""
    path = Path(path)
    document = {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "metadata": metadata,
        "traces": [trace.to_dict() for trace in traces],
    }
    path.write_text(json.dumps(document, indent=1))
    return path


def load_traces(path: str | Path) -> list[RequestTrace]:
    """Read traces written by :func:`save_traces` (or ``course bench``)."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); expected a trace file from course bench.") from None
    if not isinstance(document, dict) or document.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path} is not a request-trace file (expected format {TRACE_FORMAT!r}).")
    if document.get("version") != TRACE_VERSION:
        raise ValueError(
            f"{path} has trace format version {document.get('version')}; this course reads {TRACE_VERSION}."
        )
    return [RequestTrace.from_dict(record) for record in document["traces"]]
