"""benchmarks/sim_fidelity.py --replay: a run kept with --keep is fitted and simulated again without a server."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from course.sim import StepSample
from course.trace import RequestTrace, save_traces

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import sim_fidelity  # noqa: E402  (benchmarks/ is not a package)

STEP = 0.004  # seconds per decode step of the made-up server
PREFILL_PER_TOKEN = 0.0001  # seconds per prompt token


def request(rid: str, send: float, prompt: int, output: int, batch: int = 1) -> RequestTrace:
    """A request on a server whose steps take STEP x (1 + batch / 8) and whose prefill is linear in the prompt."""
    first = send + 0.005 + PREFILL_PER_TOKEN * prompt
    gap = STEP * (1 + batch / 8)
    times = [first + i * gap for i in range(output)]
    return RequestTrace(rid, send, times, [1] * output, prompt_tokens=prompt, output_tokens=output)


def keep_a_round(folder: Path) -> None:
    folder.mkdir(parents=True)
    for prompt in sim_fidelity.PREFILL_LENGTHS:
        traces = [request(f"p{i}", i * 1.0, prompt, 2) for i in range(8)]
        save_traces(sim_fidelity.prefill_file(folder, prompt), traces)
    for context in sim_fidelity.DECODE_CONTEXTS:
        for batch in sim_fidelity.DECODE_BATCHES:
            traces = [request(f"d{i}", 0.0, context, sim_fidelity.DECODE_OUTPUT, batch) for i in range(batch)]
            save_traces(sim_fidelity.decode_file(folder, context, batch), traces)


def keep_a_run(folder: Path, run_steps: dict | None = None, passes: bool = False, server_ttft: float = 0.0,
               rounds: int = 3) -> None:  # fmt: skip
    """What ``--keep`` leaves: ``rounds`` calibration rounds (with the prefill passes the server counted in
    them when ``passes``, and with ``server_ttft`` > 0 the TTFTs it measured: the pass plus that many
    seconds), a run of 30 requests, its facts (with the server's step counters over it)."""
    for name in ("before", *(f"after{index}" for index in range(1, rounds))):
        keep_a_round(folder / name)
        if passes:
            counted = {str(p): [8, 8 * PREFILL_PER_TOKEN * p] for p in sim_fidelity.PREFILL_LENGTHS}
            if server_ttft:
                for p, entry in counted.items():
                    entry += [8 * (PREFILL_PER_TOKEN * int(p) + server_ttft), 8]
            (folder / name / sim_fidelity.PREFILL_PASSES).write_text(json.dumps(counted))
    save_traces(folder / "run.json", [request(str(i), 0.2 * i, 128, 64) for i in range(30)])
    facts = {"rate": 5.0, "capacity": 20.0, "during": "load average 1.0", "run_load": 0.5, "health": {}}
    if run_steps:
        facts["run_steps"] = run_steps
    (folder / "facts.json").write_text(json.dumps(facts))


def test_replay_fits_and_simulates_a_kept_run_without_a_server(tmp_path, capsys):
    keep_a_run(tmp_path)
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "replaying the run kept in" in out and "fitted linear:" in out
    for metric in ("TTFT p50", "TTFT p95", "ITL p50", "ITL p95"):
        assert metric in out, metric


def test_replay_of_a_folder_that_was_not_kept_says_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="not a folder kept by --keep with 1 rounds; missing .*before.*run.json"):
        sim_fidelity.main(["--replay", str(tmp_path)])
    (tmp_path / "before").mkdir()  # told how many rounds, it names the ones the folder lacks
    with pytest.raises(SystemExit, match="not a folder kept by --keep with 3 rounds; missing .*after1.*run.json"):
        sim_fidelity.main(["--replay", str(tmp_path), "--rounds", "3"])


def test_the_course_server_is_calibrated_in_six_rounds_and_a_replay_reads_what_its_folder_holds(tmp_path, capsys):
    # One round catches one stretch of a machine whose speed can move by 40 % for seconds at a time.
    assert sim_fidelity.parse_args([]).rounds == sim_fidelity.COURSE_ROUNDS == 6
    assert sim_fidelity.parse_args(["--engine", "vllm"]).rounds == 2
    assert sim_fidelity.parse_args(["--rounds", "4"]).rounds == 4
    keep_a_run(tmp_path, rounds=6)
    assert sim_fidelity.kept_rounds(tmp_path) == 6
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "calibration after5:" in out and "TTFT p50" in out
    assert sim_fidelity.main(["--replay", str(tmp_path), "--rounds", "3"]) == 0  # the first three, when told
    out = capsys.readouterr().out
    assert "calibration after2:" in out and "calibration after3:" not in out
    assert sim_fidelity.kept_rounds(tmp_path / "nothing here") == 1


def test_the_run_goes_in_parts_between_the_calibration_rounds():
    # Three rounds: round, part, round, part, round. The parts add up to the run and differ by one at most.
    assert sim_fidelity.run_parts(150, 3) == [75, 75]
    assert sim_fidelity.run_parts(151, 4) == [51, 50, 50]
    assert sim_fidelity.run_parts(150, 2) == [150]  # vLLM's two rounds: the whole run between them
    assert sim_fidelity.run_parts(150, 1) == [150]  # one round before the run: nothing to put between
    assert sim_fidelity.run_parts(2, 5) == [1, 1]  # never a part without a request


def test_the_rounds_are_merged_by_their_mean():
    # The run lies between the rounds and sees the drift's average: a round that caught a slow stretch
    # counts (the median of three would drop it). Deviations of every round are kept.
    rounds = [[StepSample(0, 2, 100, seconds, deviations=(d,))] for seconds, d in ((0.003, -1e-4), (0.003, 0.0),
                                                                                   (0.006, 2e-4))]  # fmt: skip
    (merged,) = sim_fidelity.merge_rounds(rounds)
    assert merged.seconds == pytest.approx(0.004)
    assert merged.deviations == (-1e-4, 0.0, 2e-4)
    assert (merged.decode_tokens, merged.kv_tokens_read) == (2, 100)


def test_the_runs_own_steps_become_samples_per_batch_and_prompt_size():
    run_steps = {"decode 1": [100, 0.4, 16000], "decode 2": [50, 0.25, 17000], "decode 9": [3, 0.03, 2000],
                 "prefill 128": [60, 0.9, 0], "prefill 384": [2, 0.05, 0]}  # fmt: skip
    samples = sim_fidelity.run_step_samples(run_steps, 128)  # decode 9 and prefill 384: too few to average
    assert [(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read) for s in samples] == [
        (0, 1, 160), (0, 2, 340), (128, 0, 0)
    ]  # fmt: skip
    assert [s.seconds for s in samples] == pytest.approx([0.004, 0.005, 0.015])
    # A pass of 256 tokens in a run of 128-token prompts prefilled two of them: two prompts' attention pairs,
    # not one 256-token prompt's, which the line's f would charge four times the pairs of one.
    both = sim_fidelity.run_step_samples({"prefill 128": [60, 0.9, 0], "prefill 256": [8, 0.2, 0]}, 128)
    assert [s.attention_pairs for s in both] == [128 * 129 / 2, 2 * 128 * 129 / 2]
    odd = sim_fidelity.run_step_samples({"prefill 200": [8, 0.2, 0]}, 128)
    assert odd[0].attention_pairs == 0  # no multiple of the prompt: read as one fresh prompt


def test_a_replay_with_the_servers_step_counters_tells_the_calibration_from_the_simulator(tmp_path, capsys):
    # The run's own decode steps, as the server counted them: 30 % slower than the calibration's server.
    slow = 1.3 * STEP
    keep_a_run(tmp_path, {"decode 1": [1000, 1000 * slow * (1 + 1 / 8), 1000 * 160],
                          "decode 2": [400, 400 * slow * (1 + 2 / 8), 400 * 330]})  # fmt: skip
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the run's own steps (the server's counters over its parts) against the fitted line" in out
    table = out.split("spends outside them):")[1]
    errors = [float(line.split()[-1].rstrip("%")) for line in table.splitlines()[2:4]]
    assert errors == pytest.approx([-23.1, -23.1], abs=1.0)  # 1 / 1.3 - 1
    assert "over the decode steps the line is -23" in out and "over the prefill steps" not in out
    assert "front end per request:" in out and "(the fitted e;" in out  # no counted passes kept
    assert "the simulator with a line fitted to the run's own steps" in out


def test_the_front_end_is_the_calibrations_ttft_less_the_passes_the_server_counted(tmp_path, capsys):
    # The made-up server's TTFT is 5 ms + 0.1 ms per prompt token, its prefill pass the 0.1 ms per token.
    run_steps = {"decode 1": [1000, 1000 * STEP * (1 + 1 / 8), 1000 * 160],
                 "decode 2": [400, 400 * STEP * (1 + 2 / 8), 400 * 330],
                 "prefill 128": [30, 30 * PREFILL_PER_TOKEN * 128, 0]}  # fmt: skip
    keep_a_run(tmp_path, run_steps, passes=True)
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "front end per request: 5.00 ms (the calibration's median TTFTs minus the prefill passes" in out
    assert "prefill 128" in out and "over the prefill steps the line is" in out


def test_with_the_counted_passes_the_steps_and_the_front_end_are_fitted_apart(tmp_path, capsys):
    # The made-up server's TTFT is 5 ms + its pass, the pass 0.1 ms per prompt token: the front end is the 5 ms
    # the TTFTs spend outside the passes, and the line's prefill follows the passes, not the TTFTs.
    keep_a_run(tmp_path, passes=True, server_ttft=0.002)
    args = sim_fidelity.parse_args(["--replay", str(tmp_path)])
    rounds, _, facts = sim_fidelity.replayed(tmp_path, 3)
    samples = sim_fidelity.merge_rounds(rounds)
    cost = sim_fidelity.fitted_cost(args, "step", samples, facts)
    assert cost.step.e + cost.front_end.before_engine == pytest.approx(0.005)
    assert cost.front_end.before_engine == pytest.approx(0.003)  # 3 of the 5 ms before the engine (TTFT: pass + 2 ms)
    assert cost.step.prefill_spread == () or len(cost.step.prefill_spread) > 1
    # one fit of the TTFTs alone cannot tell the two apart: it takes the front end as the prefills' excess over
    # the decodes' intercept
    joint = sim_fidelity.fitted_cost(args, "step", samples, {})
    assert joint.step.e + joint.front_end.before_engine != pytest.approx(0.005, rel=0.05)
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    assert "the front end, 5.00 ms per request, is the prefill microbenchmarks' median TTFTs" in capsys.readouterr().out
    # a size without a counted pass: the joint fit
    del (
        facts["calibration_passes"][0]["128"],
        facts["calibration_passes"][1]["128"],
        facts["calibration_passes"][2]["128"],
    )
    assert sim_fidelity.fitted_cost(args, "step", samples, facts) == sim_fidelity.fitted_cost(
        args,
        "step",
        samples,
        {"before_engine_share": facts["before_engine_share"], "idle_wake": facts.get("idle_wake")},
    )


def test_the_share_of_the_front_end_before_the_engine_is_read_off_the_servers_ttft(tmp_path, capsys):
    # The made-up server's TTFT at the client is its pass + 5 ms; its own TTFT (from the engine's arrival
    # stamp) is the pass + 2 ms: 3 of the 5 ms come before the engine sees the request.
    run_steps = {"decode 1": [1000, 1000 * STEP * (1 + 1 / 8), 1000 * 160],
                 "prefill 128": [30, 30 * PREFILL_PER_TOKEN * 128, 0]}  # fmt: skip
    keep_a_run(tmp_path, run_steps, passes=True, server_ttft=0.002)
    folders = sim_fidelity.round_folders(tmp_path, 3)
    facts = sim_fidelity.counted_passes(folders)
    assert facts["before_engine_share"] == pytest.approx(0.6)
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "of a lone request's front-end time, 60% comes before the engine sees it (the prefill" in out
    # the front end the run's own steps are simulated with still reads the passes off the longer records
    assert "front end per request: 5.00 ms (the calibration's median TTFTs minus the prefill passes" in out
    # a folder kept before the server's TTFTs were recorded: no share, unless given
    keep_a_run(tmp_path / "older", passes=True)
    assert "before_engine_share" not in sim_fidelity.counted_passes(sim_fidelity.round_folders(tmp_path / "older", 3))
    assert sim_fidelity.main(["--replay", str(tmp_path / "older")]) == 0
    assert "comes before the engine sees it" not in capsys.readouterr().out
    assert sim_fidelity.main(["--replay", str(tmp_path / "older"), "--before-engine-share", "0.5"]) == 0
    assert "50% comes before the engine sees it (--before-engine-share)" in capsys.readouterr().out


def test_the_run_sent_again_is_the_servers_own_error_beside_the_simulators(tmp_path, capsys):
    keep_a_run(tmp_path)
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "server again" in table and "the server against itself" not in table  # kept before it was sent again
    # the same requests again: TTFT p50 12 % slower, the rest as before
    real = sim_fidelity.percentiles_ms([request(str(i), 0.2 * i, 128, 64) for i in range(30)])
    again = {name: dict(values) for name, values in real.items()}
    again["ttft"]["p50"] *= 1.12
    facts = json.loads((tmp_path / "facts.json").read_text())
    (tmp_path / "facts.json").write_text(json.dumps({**facts, "repeat": again}))
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ttft, itl = (next(line for line in out.splitlines() if line.startswith(m)) for m in ("TTFT p50", "ITL p50"))
    assert ttft.split()[-1] == "+12.0%" and itl.split()[-1] == "+0.0%"
    assert "the server against itself: its second run missed ttft p50 against its first" in out


def test_the_verdict_on_the_run_sent_again_names_the_targets_finer_than_the_server():
    assert "met every target" in sim_fidelity.repeat_verdict(["itl p50"], [])
    said = sim_fidelity.repeat_verdict(["ttft p50", "itl p95"], ["ttft p50"])
    assert "its second run missed ttft p50 against its first" in said
    assert "the simulator missed ttft p50 too, where the target is finer than this server's own difference" in said
    assert "itl p95 too" not in said
    assert "the simulator missed" not in sim_fidelity.repeat_verdict([], ["ttft p95"])
    # a second run that lost part of the server's core to the hypervisor says so; a small share does not
    stolen = sim_fidelity.repeat_verdict([], ["ttft p95"], [0.01, None, 0.165])
    assert "the hypervisor took up to 16.5% of the server's core" in stolen
    assert "hypervisor" not in sim_fidelity.repeat_verdict([], ["ttft p95"], [0.01, 0.02])


def test_each_part_is_sent_again_with_its_own_seed():
    args = sim_fidelity.parse_args([])
    assert args.repeat and not sim_fidelity.parse_args(["--no-repeat"]).repeat
    first, second = (sim_fidelity.part_options(args, 5.0, 75, index) for index in (0, 1))
    assert first == sim_fidelity.part_options(args, 5.0, 75, 0) and first != second
    assert first[first.index("--seed") + 1] == "303" and second[second.index("--seed") + 1] == "304"


def test_a_folder_kept_before_prefills_were_counted_replays_its_decode_steps(tmp_path, capsys):
    # Its facts name the decode batches alone ("1", not "decode 1"); a replay stopped on them with a traceback.
    steps = {"decode 1": [1000, 1000 * STEP * (1 + 1 / 8), 1000 * 160], "decode 2": [400, 400 * 0.005, 400 * 340]}
    keep_a_run(tmp_path / "now", steps)
    keep_a_run(tmp_path / "older", {key.split()[1]: tally for key, tally in steps.items()})
    said = []
    for folder in ("now", "older"):
        assert sim_fidelity.main(["--replay", str(tmp_path / folder)]) == 0
        said.append(capsys.readouterr().out.split("the run's own steps")[1].replace(str(tmp_path / folder), ""))
    assert said[0] == said[1] and "over the decode steps the line is" in said[1]


def beside_traces(cost, config) -> tuple[list, list]:
    """The prefills-beside-a-stream microbenchmark and eight lone 128-token prefills sent back to back, as a
    server whose steps and front end are ``cost`` would answer them (the simulator stands in for it). The lone
    ones as the real server answers them: only the first, sent after a pause, waits its ``idle_wake`` for the
    machine to wake up."""
    import dataclasses

    from course.sim import simulate
    from course.workload import RequestSpec, Workload

    beside = simulate(Workload([RequestSpec(*row) for row in sim_fidelity.beside_rows()]), config, cost).traces
    awake = cost.replace(idle_wake=0.0)
    lone = simulate(Workload([RequestSpec(f"l{i}", 0.05 * i, 128, 2) for i in range(8)]), config, awake).traces
    first = lone[0]
    lone[0] = dataclasses.replace(first, chunk_times=[x + cost.front_end.idle_wake for x in first.chunk_times])
    return beside, lone


@pytest.mark.parametrize("slowdown", [1.5, 3.5])
def test_the_front_ends_slowdown_beside_a_step_is_fitted_to_prefills_sent_while_a_request_decodes(slowdown):
    # A made-up server whose front end takes `slowdown` times longer beside a step: the fit, starting from the even
    # share, finds it again from the prefills' TTFTs over the lone ones.
    from course.capacity import server_sim_config
    from course.sim import FrontEnd, LinearCost, ServerCost

    config = server_sim_config(16, 512)
    line = LinearCost(a=0.002, b=1e-5, c=1e-4, d=0, e=0.0005)
    even = ServerCost(line, FrontEnd(before_engine=0.003, idle_wake=0.0015))
    true = even.replace(slowdown=slowdown)
    pairs = [beside_traces(true, config)] * 2
    fits = sim_fidelity.front_end_slowdowns(pairs, even, config)
    # within half a unit: a request joins at a step's boundary, so neighbouring slowdowns can give the same TTFTs
    assert len(fits) == 2 and all(abs(fit - slowdown) <= 0.5 for fit in fits)
    # the lone prefills the wake-up was measured against carry none of it: charging it to every one of them (as
    # to every request that finds the server idle) would take 1.5 ms off the prefills' excess and inflate the fit
    beside, lone = pairs[0]
    assert sim_fidelity.beside_extra(beside, lone, true, None) == pytest.approx(
        sim_fidelity.beside_extra(beside, lone, true, config), abs=1e-6
    )
    # without front-end work before the engine there is nothing to slow down
    assert sim_fidelity.front_end_slowdowns(pairs, ServerCost(line), config) == []


def test_a_replay_takes_the_rounds_slowdown_from_the_microbenchmark_its_folder_kept(tmp_path, capsys):
    from course.capacity import server_sim_config
    from course.sim import ServerCost

    keep_a_run(tmp_path, passes=True, server_ttft=0.002)
    folders = sim_fidelity.round_folders(tmp_path, 3)
    assert sim_fidelity.beside_facts(folders) == {}  # kept before the microbenchmark: the even share, as before
    args = sim_fidelity.parse_args(["--replay", str(tmp_path)])
    rounds, _, facts = sim_fidelity.replayed(tmp_path, 3)
    before = sim_fidelity.fitted_cost(args, "step", sim_fidelity.merge_rounds(rounds), facts)
    assert before.front_end.slowdown == 2.0
    config = server_sim_config(args.max_batch_size, args.max_prefill_tokens)
    for folder, slowdown in zip(folders, (3.0, 4.0, 6.0)):  # each round's own server: the fit takes the median
        true = ServerCost(dataclasses.replace(before.step, spread=(), prefill_spread=()), before.front_end).replace(
            slowdown=slowdown
        )
        beside, _ = beside_traces(true, config)
        save_traces(folder / sim_fidelity.BESIDE_FILE, beside)
    rounds, _, facts = sim_fidelity.replayed(tmp_path, 3)
    assert len(facts["beside_stream"]) == 3
    fitted = sim_fidelity.fitted_cost(args, "step", sim_fidelity.merge_rounds(rounds), facts)
    assert fitted.front_end.slowdown > 2.0
    assert fitted.replace(slowdown=2.0) == before  # nothing else moved
    assert sim_fidelity.main(["--replay", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"beside a step that work takes {fitted.front_end.slowdown:.3g}x as long: the median of the rounds'" in out
    assert isinstance(fitted, ServerCost)


def test_a_replay_fits_a_queued_front_end_and_the_line_where_the_run_lives(tmp_path, capsys):
    # vLLM's API server pinned beside its engine core: one request at a time before the engine, on the engine's core;
    # and the step line fitted again with the microbenchmarks weighted by the simulated run's time in steps like them
    keep_a_run(tmp_path)
    args = ["--replay", str(tmp_path), "--engine", "vllm", "--front-end", "queue", "--where-the-run-lives"]
    assert sim_fidelity.main(args) == 0
    out = capsys.readouterr().out
    assert "fitted where the run lives" in out and "one request at a time (requests queue for it)" in out
    assert "ms of front-end work before the engine sees a request" in out
    parsed = sim_fidelity.parse_args(["--engine", "vllm", "--front-end", "queue", "--before-engine-share", "0.5"])
    assert parsed.before_engine_share == 0.5
    rounds, _, facts = sim_fidelity.replayed(tmp_path, 1)
    queued = sim_fidelity.fitted_cost(parsed, "queue", sim_fidelity.merge_rounds(rounds), facts)
    assert queued.front_end.serial and queued.front_end.before_engine > 0 and queued.front_end.latency == 0


def host_round(per_request: float, per_token: float) -> dict:
    """A round's host_work.json on a server whose front end and engine core use ``per_request`` + ``per_token`` x
    output tokens of CPU per request (s), the per-request part growing by 1 % per 128 prompt tokens."""
    round_ = {f"prefill {p}": [8, 8 * (per_request * (1 + 0.01 * p / 128) + 2 * per_token), 2]
              for p in sim_fidelity.PREFILL_LENGTHS}  # fmt: skip
    output = sim_fidelity.DECODE_OUTPUT
    round_["decode 256"] = [6, 6 * (per_request * 1.02 + output * per_token), output]
    return round_


def test_the_hosts_work_per_request_and_per_token_are_told_apart_and_what_lies_beyond_the_front_door_is_after():
    rounds = [host_round(0.005, 0.0003), host_round(0.007, 0.0001)]
    request, token = sim_fidelity.host_work(rounds, 128)
    assert token == pytest.approx(0.0002) and request == pytest.approx(0.006 * 1.01)
    facts = {"host_work": rounds}
    assert sim_fidelity.after_engine_work(facts, 128, 0.004) == pytest.approx(0.006 * 1.01 - 0.004)
    assert sim_fidelity.after_engine_work(facts, 128, 0.010) == 0.0, "never below nothing"
    assert sim_fidelity.after_engine_work({}, 128, 0.004) == 0.0, "not measured (the course's server): none"
    without_decodes = [{key: value for key, value in r.items() if key != "decode 256"} for r in rounds]
    assert sim_fidelity.host_work(without_decodes, 128) is None


def test_a_vllm_replay_takes_the_hosts_work_after_the_engine_from_the_rounds(tmp_path, capsys):
    keep_a_run(tmp_path)
    for name in ("before", "after1", "after2"):
        (tmp_path / name / sim_fidelity.HOST_WORK).write_text(json.dumps(host_round(0.020, 0.0002)))
    queue = ["--replay", str(tmp_path), "--engine", "vllm", "--front-end", "queue"]
    assert sim_fidelity.main([*queue, "--after-engine"]) == 0
    out = capsys.readouterr().out
    assert "used 20.20 ms of CPU per lone request and 0.200 ms per output token" in out
    assert "of host work per request after the engine" in out and "taken from the steps when it finishes" in out
    assert sim_fidelity.main(queue) == 0  # measured and said, but not in the model unless asked
    out = capsys.readouterr().out
    assert "used 20.20 ms of CPU per lone request" in out and "not in the model (--after-engine puts it there)" in out
    assert "of host work per request after the engine" not in out
    (tmp_path / "after1" / sim_fidelity.HOST_WORK).unlink()  # a round without it: none, as in folders kept before
    assert sim_fidelity.main([*queue, "--after-engine"]) == 0
    out = capsys.readouterr().out
    assert "of host work per request after the engine" not in out and "ms of CPU per lone request" not in out


def test_a_metric_is_within_the_bar_when_it_is_within_its_target_or_the_servers_own_difference():
    errors = {"ttft p50": -0.15, "ttft p95": 0.19, "itl p50": 0.12, "itl p95": -0.35}
    again = {"ttft p50": 0.20, "ttft p95": -0.05, "itl p50": 0.05, "itl p95": 0.30}
    verdict = sim_fidelity.Verdict("r1", errors, again)
    assert verdict.within("ttft p50"), "15 % off, but the server moved 20 % against itself"
    assert verdict.within("ttft p95"), "within its 20 % target; the server's 5 % does not narrow it"
    assert not verdict.within("itl p50"), "past 10 % and past the server's 5 %"
    assert not verdict.within("itl p95"), "past the server's 30 %: the sign of the difference does not matter"
    assert verdict.held == 2
    assert sim_fidelity.Verdict("r2", errors).held == 1, "a run not sent again is held to the targets alone"


def test_several_kept_runs_are_replayed_and_tallied_against_the_bar(tmp_path, capsys):
    for name in ("a", "b"):
        keep_a_run(tmp_path / name)
    args = ["--replay", str(tmp_path / "a"), str(tmp_path / "b"), "--engine", "vllm", "--front-end", "queue"]
    assert sim_fidelity.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("replaying the run kept in") == 2
    assert "ITL by requests streaming" in out
    tally = out[out.index("2 runs, each metric within") :]
    rows = [line for line in tally.splitlines() if line.split()[0].endswith(("/a", "/b"))]
    assert len(rows) == 2 and all(line.endswith("of 4") for line in rows)
    assert "within the bar on all four:" in tally and "of 2 runs" in tally
    assert sim_fidelity.main(["--replay", str(tmp_path / "a")]) == 0
    assert "runs, each metric within" not in capsys.readouterr().out, "one run: no tally"
