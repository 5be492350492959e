"""benchmarks/speed_drift.py: the table of how the machine's speed drifts, from interleaved lone prefills."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import speed_drift  # noqa: E402  (benchmarks/ is not a package)


def interleaved(levels: list[float], sizes=(16, 128), base=(0.005, 0.010), gap: float = 0.1) -> list[tuple]:
    """Rows ``(send s, size, TTFT s)`` for one cycle per entry of ``levels``: every size at that speed."""
    rows, now = [], 100.0
    for level in levels:
        for size, seconds in zip(sizes, base):
            rows.append((now, size, seconds * level))
            now += gap
    return rows


def test_a_drift_moves_every_size_together_block_by_block():
    rows = interleaved([1.0] * 4 + [1.2] * 4 + [0.9] * 4)
    table = speed_drift.drift_table(rows, [16, 128], block=4)
    starts = [round(seconds, 6) for seconds, _ in table]
    assert starts == [0.0, 0.8, 1.6]  # each block from its first cycle's send time
    # the run's median is the level 1.0 (four cycles at 0.9, four at 1.0, four at 1.2): the ratios are the levels
    for (_, ratios), level in zip(table, (1.0, 1.2, 0.9)):
        assert ratios == pytest.approx([level, level])


def test_a_disturbed_request_moves_one_cell_not_the_block():
    rows = interleaved([1.0] * 8)
    rows[2] = (rows[2][0], 16, 0.050)  # one 16-token prefill ten times slower
    (_, first), (_, second) = speed_drift.drift_table(rows, [16, 128], block=4)
    assert first == pytest.approx([1.0, 1.0]) and second == pytest.approx([1.0, 1.0])  # a median of four shrugs it off


def test_a_partial_last_block_is_left_out():
    table = speed_drift.drift_table(interleaved([1.0] * 10), [16, 128], block=4)
    assert len(table) == 2


@pytest.mark.parametrize(
    "argv, message",
    [(["--sizes", "0"], "--sizes must be"), (["--requests", "10"], "--requests must fill two blocks")],
)
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        speed_drift.parse_args(argv)
    assert message in capsys.readouterr().err
