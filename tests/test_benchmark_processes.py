"""benchmarks/_processes.py: the idle-core policy the serving benchmarks print beside the load average."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _processes import idle_policy  # noqa: E402  (benchmarks/ is not a package)


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
