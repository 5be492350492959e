"""Give the C allocator's free memory back to the system when an engine falls idle.

torch allocates a CPU tensor's storage with the C library's ``malloc``. glibc keeps what is freed in its heap
for reuse and returns it to the system only from the heap's top (``M_TRIM_THRESHOLD``) or for blocks above its
mmap threshold, which rises with every large block freed, up to 32 MiB (``M_MMAP_THRESHOLD``'s dynamic
adjustment, glibc's ``malloc(3)`` and ``mallopt(3)``). A serving engine frees tensors of a new size at almost
every step (a batch's KV cache grown by a token, a prompt's attention), so its heap holds more and more free
memory that no later request fits: measured with ``benchmarks/memory_soak.py --no-trim``, the engine core process
grew from 1.5 to 3.5 GiB over 10,000 varied requests and was still growing, while an engine stepped in one
process for 1,600 varied requests kept the same 1,089 live tensors throughout and ``malloc_trim(0)`` brought it
back to where it had started each time.

:class:`HeapTrimmer` calls ``malloc_trim(0)`` (which also releases free pages inside the heap, not only at its
top) when the engine falls idle and the process's resident memory has grown by more than ``slack_bytes`` since
the last trim (checked at most every ``interval`` s, by reading ``/proc/self/statm``): what a load left behind
goes back to the system as soon as nobody waits for a step. It does not trim while the engine is busy: a trim
takes 10-90 ms on a quiet machine and up to 1.2 s on a busy one, which every running stream would wait for, and
a busy engine faults back in what it gave back within seconds. Measured (``benchmarks/memory_soak.py``, 10,000
varied requests): trimmed whenever 256 MiB had grown, a busy engine trimmed about once a second and served 26 %
fewer requests/s; trimmed every 30 s, its samples under load still reached 3.4 GiB, as without trimming (3.5 GiB),
while an idle engine fell back to 0.9 GiB. Under a steady varied load the engine's resident memory is the
allocator's working heap, which grew ever more slowly over the run (+0.27 GiB per 1,000 requests over the first
half, +0.14 over the second). Where there is no glibc (macOS, Windows, musl) the trimmer does nothing:
those allocators return memory in their own ways. ``COURSE_HEAP_TRIM=0`` in the environment turns it off (to
measure what it buys: ``benchmarks/memory_soak.py --no-trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

SLACK_BYTES = 32 * 2**20  # an idle engine gives back its heap once it has grown this much since the last trim
INTERVAL_S = 1.0  # at most one check this often
_clock = time.monotonic  # (tests replace it)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (``/proc/self/statm``), or None where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Call :meth:`maybe_trim` after each engine iteration, saying whether the engine is now idle.

    Attributes:
        trims: how many times it trimmed; ``released_bytes``: resident bytes the trims gave back;
        ``seconds``: the time the trims took.
    """

    def __init__(self, slack_bytes: int = SLACK_BYTES, interval: float = INTERVAL_S) -> None:
        self.slack, self.interval = slack_bytes, interval
        wanted = os.environ.get("COURSE_HEAP_TRIM", "1") != "0"
        self._trim = _malloc_trim() if wanted and resident_bytes() is not None else None
        self._after_trim = resident_bytes() or 0  # resident bytes after the last trim (or at the start)
        self._next_check = 0.0  # no check before this (monotonic s)
        self.trims = 0
        self.released_bytes = 0
        self.seconds = 0.0

    @property
    def active(self) -> bool:
        """Whether this platform can trim (glibc and /proc)."""
        return self._trim is not None

    def maybe_trim(self, idle: bool) -> bool:
        """When ``idle`` (the engine has nothing to do), trim if resident memory grew by more than the slack
        since the last trim (checked at most every ``interval`` s). True if it trimmed."""
        if self._trim is None or not idle:
            return False
        now = _clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.interval
        before = resident_bytes() or 0
        if before - self._after_trim <= self.slack:
            return False
        self._trim(0)
        self._after_trim = resident_bytes() or 0
        self.seconds += _clock() - now
        self.trims += 1
        self.released_bytes += max(0, before - self._after_trim)
        return True
