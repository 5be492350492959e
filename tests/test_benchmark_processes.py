"""benchmarks/_processes.py: the idle-core policy the serving benchmarks print beside the load average, and the CPU
time of a server's processes apart from its model's worker."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _processes import (  # noqa: E402  (benchmarks/ is not a package)
    CoreTime,
    core_time_by_process,
    cpu_seconds_outside,
    idle_policy,
    process_tree,
)


def fake_sysfs(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


CPUIDLE = "devices/system/cpu/cpuidle"
POLL_NS = "module/haltpoll/parameters/guest_halt_poll_ns"


def test_a_vm_whose_idle_vcpus_halt_at_once_says_so(tmp_path):
    sysfs = fake_sysfs(
        tmp_path, {f"{CPUIDLE}/current_driver": "haltpoll", f"{CPUIDLE}/current_governor": "haltpoll", POLL_NS: "0"}
    )
    words = idle_policy(sysfs)
    assert "driver haltpoll, governor haltpoll" in words
    assert "guest_halt_poll_ns 0" in words and "halts at once" in words


def test_a_vm_whose_idle_vcpus_poll_first_gives_how_long(tmp_path):
    sysfs = fake_sysfs(
        tmp_path,
        {f"{CPUIDLE}/current_driver": "haltpoll", f"{CPUIDLE}/current_governor_ro": "haltpoll", POLL_NS: "200000"},
    )
    words = idle_policy(sysfs)
    assert "governor haltpoll" in words  # read-only governor file (no cpuidle.governor= switch)
    assert "guest_halt_poll_ns 200000" in words and "polls that long" in words
    assert "halts at once" not in words


def test_bare_metal_gives_driver_and_governor_only(tmp_path):
    sysfs = fake_sysfs(tmp_path, {f"{CPUIDLE}/current_driver": "intel_idle", f"{CPUIDLE}/current_governor": "menu"})
    assert idle_policy(sysfs) == "idle cores: cpuidle driver intel_idle, governor menu"


@pytest.mark.parametrize("files", [{}, {f"{CPUIDLE}/current_governor": "menu"}])
def test_no_cpuidle_is_unknown_not_an_error(tmp_path, files):
    assert idle_policy(fake_sysfs(tmp_path, files)) == "idle cores: unknown (no cpuidle in /sys)"


def fake_proc(root: Path, processes: dict[int, tuple[str, list[int], dict[int, int]]]) -> Path:
    """``{pid: (command line, children, {thread id: nanoseconds on the CPU})}`` as /proc shows them."""
    for pid, (title, children, threads) in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(title.encode() + b"\0--flag\0")
        for index, (tid, nanoseconds) in enumerate(threads.items()):
            task = root / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            (task / "children").write_text(" ".join(map(str, children)) + " " if index == 0 else "")
            (task / "schedstat").write_text(f"{nanoseconds} 12345 67\n")
    return root


def test_a_servers_cpu_time_counts_its_tree_but_the_models_worker(tmp_path):
    # vllm serve (two threads) -> the engine core -> the worker (retitled VLLM::Worker), and a stranger beside it
    proc = fake_proc(tmp_path, {
        100: ("python", [200], {100: 3_000_000, 101: 1_000_000}),
        200: ("VLLM::EngineCore", [300], {200: 2_500_000}),
        300: ("VLLM::Worker", [], {300: 90_000_000, 301: 5_000_000}),
        400: ("python", [], {400: 7_000_000}),
    })  # fmt: skip
    assert sorted(process_tree(100, proc)) == [100, 200, 300]
    assert cpu_seconds_outside(100, "VLLM::Worker", proc) == pytest.approx(6.5e-3)
    assert cpu_seconds_outside(100, "nothing", proc) == pytest.approx(101.5e-3), "every process counted"
    assert cpu_seconds_outside(999, "VLLM::Worker", proc) is None, "a server that is gone says nothing"


def test_core_time_by_process_sums_threads_and_same_titles_and_takes_differences(tmp_path):
    proc = fake_proc(tmp_path, {
        100: ("/opt/venv/bin/python", [200, 250], {100: 3_000_000, 101: 1_000_000}),
        200: ("VLLM::EngineCore", [300], {200: 2_500_000}),
        250: ("VLLM::EngineCore", [], {250: 500_000}),
        300: ("VLLM::Worker", [], {300: 90_000_000, 301: 5_000_000}),
    })  # fmt: skip
    times = core_time_by_process(100, proc)
    assert set(times) == {"python", "VLLM::EngineCore", "VLLM::Worker"}, "titles without their folder"
    assert times["python"] == CoreTime(pytest.approx(4e-3), pytest.approx(2 * 12345e-9), 2 * 67), "two threads"
    assert times["VLLM::EngineCore"].ran == pytest.approx(3e-3) and times["VLLM::EngineCore"].slices == 2 * 67
    later = CoreTime(
        times["VLLM::Worker"].ran + 0.5, times["VLLM::Worker"].waited + 0.25, times["VLLM::Worker"].slices + 9
    )
    assert later.since(times["VLLM::Worker"]) == CoreTime(pytest.approx(0.5), pytest.approx(0.25), 9)
    assert core_time_by_process(999, proc) == {}, "a server that is gone: nothing"
