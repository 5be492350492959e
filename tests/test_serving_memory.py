"""An idle engine gives the C allocator's free memory back (course.serving.memory.HeapTrimmer).

glibc keeps freed tensor storage in its heap, and an engine that frees tensors of a new size at almost every
step keeps what a load left behind (``benchmarks/memory_soak.py``: the engine core at 3.5 GiB after 10,000 varied
requests without trimming, 0.9 GiB once idle with it, the live tensors unchanged). The trimmer's policy is
checked here with a fake clock, a fake resident size and a fake ``malloc_trim``; the benchmark measures what it
does to a real server.
"""

from __future__ import annotations

import sys

import pytest

from course.serving import memory
from course.serving.memory import HeapTrimmer

MIB = 2**20


class FakeProcess:
    """A resident size the test sets, a clock it moves, and a malloc_trim that drops to ``floor``."""

    def __init__(self, monkeypatch) -> None:
        self.rss, self.floor, self.now, self.trims = 500 * MIB, 400 * MIB, 1000.0, 0
        monkeypatch.setattr(memory, "resident_bytes", lambda: self.rss)
        monkeypatch.setattr(memory, "_malloc_trim", lambda: self.trim)
        monkeypatch.setattr(memory, "_clock", lambda: self.now)

    def trim(self, pad: int) -> int:
        self.trims += 1
        self.rss = self.floor
        return 1


def test_an_idle_engine_gives_back_what_grew_over_the_slack(monkeypatch):
    fake = FakeProcess(monkeypatch)
    trimmer = HeapTrimmer(slack_bytes=32 * MIB, interval=1.0)
    assert trimmer.active
    fake.rss += 20 * MIB
    assert not trimmer.maybe_trim(idle=True), "under the slack"
    fake.now += 2
    fake.rss += 20 * MIB  # 40 MiB over the start
    assert trimmer.maybe_trim(idle=True) and fake.trims == 1
    assert trimmer.released_bytes == 140 * MIB and trimmer.trims == 1
    fake.rss += 40 * MIB
    assert not trimmer.maybe_trim(idle=True), "checked at most once per interval"
    fake.now += 2
    assert trimmer.maybe_trim(idle=True) and fake.trims == 2


def test_a_busy_engine_is_never_trimmed(monkeypatch):
    """A trim stalls the step every running stream waits for, and a busy engine faults its heap back in."""
    fake = FakeProcess(monkeypatch)
    trimmer = HeapTrimmer(slack_bytes=32 * MIB, interval=1.0)
    for _ in range(5):
        fake.rss += 1000 * MIB
        fake.now += 60
        assert not trimmer.maybe_trim(idle=False)
    assert fake.trims == 0
    assert trimmer.maybe_trim(idle=True) and fake.trims == 1


def test_the_trimmer_can_be_turned_off_and_engines_report_it(monkeypatch):
    monkeypatch.setenv("COURSE_HEAP_TRIM", "0")
    assert not HeapTrimmer().active and not HeapTrimmer().maybe_trim(idle=True)
    monkeypatch.delenv("COURSE_HEAP_TRIM")
    if sys.platform == "linux" and memory._malloc_trim() is not None:
        assert HeapTrimmer().active
    from course.serving.engine import Engine
    from course.serving.testing import chatty_tiny_model

    stats = Engine(chatty_tiny_model(seed=1), background=False).stats()
    assert {"heap_trims", "heap_released_bytes", "heap_trim_seconds"} <= set(stats)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/statm")
def test_resident_bytes_reads_this_process():
    import resource

    rss = memory.resident_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert 10 * MIB < rss <= peak * 1.01
