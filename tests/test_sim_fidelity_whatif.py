"""benchmarks/sim_fidelity_whatif.py: one change to the fitted model of vLLM, tried on kept runs."""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from course import metrics
from course.sim import FrontEnd, LinearCost, ServerCost
from course.sim.frontend import FrontDoor
from course.trace import load_traces, save_traces

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).parent))
import sim_fidelity  # noqa: E402
import sim_fidelity_whatif as whatif  # noqa: E402
from test_sim_fidelity_replay import keep_a_run  # noqa: E402


def keep_a_run_in_parts(folder: Path) -> None:
    """A kept run of three parts of ten requests, sent again 10 % slower, as ``--keep`` leaves it."""
    keep_a_run(folder)
    run = load_traces(folder / "run.json")
    slower = [dataclasses.replace(t, chunk_times=[t.send_time + (x - t.send_time) * 1.1 for x in t.chunk_times])
              for t in run]  # fmt: skip
    for part in range(3):
        save_traces(folder / f"run_part{part + 1}.json", run[10 * part : 10 * part + 10])
        save_traces(folder / f"repeat_part{part + 1}.json", slower[10 * part : 10 * part + 10])
    facts = json.loads((folder / "facts.json").read_text())
    facts["repeat"] = sim_fidelity.percentiles_ms(slower)
    (folder / "facts.json").write_text(json.dumps(facts))


def test_unchanged_the_what_if_gives_the_replays_own_errors(tmp_path, capsys):
    keep_a_run_in_parts(tmp_path)
    mine = whatif.judged(tmp_path, whatif.Change(), None)
    args = sim_fidelity.parse_args(["--replay", str(tmp_path), *whatif.FIT])
    theirs = sim_fidelity.report(args, sim_fidelity.sim_config(args), "queue",
                                 *sim_fidelity.replayed(tmp_path, 3))  # fmt: skip
    for metric in sim_fidelity.TARGETED:
        assert mine.errors[metric] == pytest.approx(theirs.errors[metric], abs=1e-9), metric
        assert mine.again[metric] == pytest.approx(theirs.again[metric], abs=1e-6), metric


def test_a_change_scales_the_decode_line_and_the_spread_and_leaves_the_prefill_alone():
    cost = ServerCost(LinearCost(0.002, 3e-5, 1e-4, 5e-7, spread=(-0.5, 0.0, 0.5), prefill_spread=(-0.1, 0.1)),
                      FrontEnd(before_engine=0.005, serial=True))  # fmt: skip
    changed = whatif.Change(decode_spread_scale=0.5, step_scale=1.2).apply(cost)
    assert (changed.step.a, changed.step.c, changed.step.d) == pytest.approx((0.0024, 1.2e-4, 6e-7))
    assert changed.step.b == cost.step.b and changed.step.prefill_spread == cost.step.prefill_spread
    assert changed.step.spread == pytest.approx((-0.25, 0.0, 0.25)) and changed.front_end == cost.front_end
    assert whatif.Change(decode_spread_scale=3).apply(cost).step.spread[0] == -1.0, "no step shorter than nothing"


def test_an_arrival_takes_only_its_share_of_the_core_and_the_door_is_put_back():
    door = FrontDoor(FrontEnd(before_engine=0.005))
    original = FrontDoor.stretch
    with whatif.arrival_core(0.001):
        assert door.stretch(0.0, 0.010, [0.002]) == pytest.approx(0.011), "1 ms of the 5 ms of work"
        assert door.taken() == 0.0
        assert door.stretch(0.0, 0.010, [0.0095]) == pytest.approx(0.0105), "half a ms left in this step"
        assert door.taken() == pytest.approx(0.0005), "the rest from the next step"
    assert FrontDoor.stretch is original
    assert door.stretch(0.0, 0.010, [0.002]) == pytest.approx(0.015), "unchanged outside: all 5 ms"


def test_a_step_scale_read_from_the_first_part_is_judged_on_the_others(tmp_path, capsys):
    keep_a_run_in_parts(tmp_path)
    judged = whatif.judged(tmp_path, whatif.Change(), "first-part")
    plain = whatif.judged(tmp_path, whatif.Change(), None, later_parts=True)
    assert set(plain.errors) == set(judged.errors) and plain.again == pytest.approx(judged.again), "the same parts"
    out = capsys.readouterr().out
    assert "decode steps x" in out and "from the first part" in out
    assert judged.again is not None and set(judged.errors) == set(sim_fidelity.TARGETED)
    whole = whatif.judged(tmp_path, whatif.Change(), "run")
    assert "from the run" in capsys.readouterr().out
    assert abs(whole.errors["itl p50"]) < 0.05, "the scale read from the run puts its ITL where the run's is"


def test_the_script_tallies_the_kept_runs_and_refuses_a_negative_scale(tmp_path, capsys):
    for name in ("a", "b"):
        keep_a_run_in_parts(tmp_path / name)
    assert whatif.main(["--arrival-core-ms", "1", "--replay", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "arrival_core=0.001" in out and "within the bar on all four:" in out and "of 2 runs" in out
    with pytest.raises(SystemExit):
        whatif.main(["--step-scale", "-1", "--replay", str(tmp_path / "a")])


def test_a_step_scale_read_from_each_part_puts_every_part_on_its_own_speed(tmp_path, capsys):
    keep_a_run_in_parts(tmp_path)
    run = load_traces(tmp_path / "run.json")
    # the second part's server 30 % slower: one scale for the run cannot fit both, one per part can
    slow = [dataclasses.replace(t, chunk_times=[t.send_time + (x - t.send_time) * 1.3 for x in t.chunk_times])
            for t in run[10:20]]  # fmt: skip
    save_traces(tmp_path / "run_part2.json", slow)
    save_traces(tmp_path / "run.json", run[:10] + slow + run[20:])
    change = whatif.Change()
    measured, simulated, scales = whatif.each_part(tmp_path, change, 0.0, np.random.default_rng(0))
    assert [t.request_id for t in measured] == [t.request_id for t in run], "every part once, in order"
    assert len(scales) == 3 and scales[1] > 1.15 * max(scales[0], scales[2]), "the slow part gets its own scale"
    assert f"decode steps x {scales[0]:.3f}, {scales[1]:.3f}" in capsys.readouterr().out, "and says so"
    for part in range(3):
        real, model = (
            metrics.summarize(traces[10 * part : 10 * part + 10]).itl["mean"] for traces in (measured, simulated)
        )
        assert model == pytest.approx(real, rel=0.05), f"part {part + 1} on its own speed"
    noisy = whatif.each_part(tmp_path, change, 0.2, np.random.default_rng(7))[2]
    draws = np.random.default_rng(7).normal(0.0, 0.2, size=3)
    assert noisy == pytest.approx(np.multiply(scales, np.exp(draws))), "each part's scale times its draw"


def test_scale_noise_goes_only_with_each_part_and_each_part_judges_the_whole_run(tmp_path):
    base = ["--replay", str(tmp_path)]
    assert whatif.parse_args([*base, "--step-scale-from", "each-part", "--scale-noise", "0.1"]).scale_noise == 0.1
    assert whatif.parse_args([*base, "--rounds-beside-each-part"]).step_scale_from == "rounds-beside"
    for wrong in (["--scale-noise", "0.1"], ["--step-scale-from", "run", "--scale-noise", "0.1"],
                  ["--step-scale-from", "each-part", "--scale-noise", "-0.1"],
                  ["--step-scale-from", "each-part", "--later-parts"], ["--rounds-beside-each-part", "--later-parts"],
                  ["--rounds-beside-each-part", "--step-scale-from", "run"]):  # fmt: skip
        with pytest.raises(SystemExit):
            whatif.parse_args([*base, *wrong])


def test_each_part_fitted_to_the_rounds_beside_it_sees_only_those_rounds(tmp_path, monkeypatch):
    keep_a_run_in_parts(tmp_path)
    shutil.copytree(tmp_path / "after1", tmp_path / "after3")  # three parts need a fourth round after the last
    merged = []
    real_merge = sim_fidelity.merge_rounds
    monkeypatch.setattr(sim_fidelity, "merge_rounds", lambda rounds: merged.append(len(rounds)) or real_merge(rounds))
    measured, simulated, scales = whatif.each_part(tmp_path, whatif.Change(), 0.0, np.random.default_rng(0), True)
    assert merged == [2, 2, 2], "each part from the round before it and the round after it"
    assert len(measured) == len(simulated) == 30 and scales == [], "unscaled"
    shutil.rmtree(tmp_path / "after3")
    with pytest.raises(SystemExit, match="a round before and after every part"):
        whatif.each_part(tmp_path, whatif.Change(), 0.0, np.random.default_rng(0), beside=True)
