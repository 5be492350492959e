"""course.diagrams: each picture is drawn from the library's own objects, and says what they say.

Every check reads the drawn artists back (by their ``gid``) and compares them with what the library
computes: the TTFT span with ``metrics.ttft``, the token ticks with the simulated token times, the
block cells with ``BlockManager.block_table``, the hash cells with ``prompt_block_hashes``, the memory
bar with ``KVBudget``.
"""

from __future__ import annotations

import copy
from collections import deque

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from course import diagrams, hardware, kv, metrics
from course.sim import BlockManager, LinearCost, RooflineCost, SimConfig, SimRequest, prompt_block_hashes, simulate
from course.sim import steps as sim_steps
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload

GiB = 2**30


def artists(fig, prefix: str) -> dict:
    """The figure's artists whose gid starts with ``prefix``, by gid."""
    return {a.get_gid(): a for a in fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))}


def span_ms(fig, gid: str) -> float:
    """Length of the double-headed arrow ``gid`` (diagrams._span; its data units are ms)."""
    (arrow,) = [a for a in fig.findobj(lambda a: a.get_gid() == gid)]
    return abs(arrow.xy[0] - arrow.xyann[0])


def bar_width(fig, gid: str) -> float:
    (bar,) = [a for a in fig.findobj(lambda a: a.get_gid() == gid)]
    return bar.get_width()


def stall_workload() -> Workload:
    """Four short requests decoding, then a 4,000-token prompt arriving among them."""
    short = [RequestSpec(f"chat {i}", 0.0, 32, 60) for i in range(4)]
    return Workload([*short, RequestSpec("document", 0.05, 4000, 4)], name="a long prompt among decodes")


LLAMA_ON_H100 = RooflineCost(kv.get_model("Llama-3-8B"), hardware.gpu("H100-SXM"))


@pytest.fixture(scope="module")
def stall_runs():
    whole = simulate(stall_workload(), SimConfig(chunked_prefill=False, max_num_batched_tokens=8192), LLAMA_ON_H100)
    chunked = simulate(stall_workload(), SimConfig(max_num_batched_tokens=512), LLAMA_ON_H100)
    return {"no chunked prefill": whole, "chunks of 512": chunked}


# --- the request timeline --------------------------------------------------------------------------


def test_request_timeline_marks_the_metrics_of_a_client_trace():
    trace = RequestTrace("r", 10.0, [10.25, 10.3, 10.32, 10.5, 10.52], [1, 1, 1, 1, 1], 40, 5, "length")
    fig = diagrams.request_timeline(trace)
    assert span_ms(fig, "ttft") == pytest.approx(metrics.ttft(trace) * 1e3)
    assert span_ms(fig, "e2e") == pytest.approx(metrics.e2e(trace) * 1e3)
    assert span_ms(fig, "itl") == pytest.approx(max(metrics.itl(trace)) * 1e3)  # the longest gap, 10.32 -> 10.5
    assert span_ms(fig, "tpot") == pytest.approx((metrics.e2e(trace) - metrics.ttft(trace)) * 1e3)
    assert f"{metrics.tpot(trace) * 1e3:.3g} ms" in artists(fig, "tpot label")["tpot label"].get_text()
    (ticks,) = artists(fig, "chunks").values()
    drawn = sorted(seg[0][0] for seg in ticks.get_segments())
    assert drawn == pytest.approx([(t - 10.0) * 1e3 for t in trace.chunk_times]), "one tick per chunk, at its time"
    assert "wait" in artists(fig, "wait") and not artists(fig, "queue"), "a client cannot split queue from prefill"


def test_request_timeline_splits_queue_and_prefill_for_a_simulated_request():
    # Batch size 1: request 1 waits for request 0 to finish, then prefills.
    run = simulate(
        Workload([RequestSpec("0", 0.0, 100, 5), RequestSpec("1", 0.0, 100, 3)]),
        SimConfig(max_num_seqs=1),
        LinearCost(a=0.01, b=1e-4, c=0.0, d=0.0),
    )
    record = run.requests[1]
    fig = diagrams.request_timeline(record)
    queue, prefill = bar_width(fig, "queue"), bar_width(fig, "prefill")
    assert queue == pytest.approx((record.scheduled[0] - record.arrival_time) * 1e3) and queue > 0
    assert queue + prefill == pytest.approx(metrics.ttft(record.trace()) * 1e3)
    assert span_ms(fig, "ttft") == pytest.approx(metrics.ttft(run.traces[1]) * 1e3)


def test_request_timeline_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="failed"):
        diagrams.request_timeline(RequestTrace("x", 0.0, [], [], error="HTTP 500"))
    trace = RequestTrace("r", 1.0, [1.5, 1.6], [1, 1], output_tokens=2)
    with pytest.raises(ValueError, match="clock"):
        diagrams.request_timeline(trace, admitted=2.0)  # after the first chunk
    one = diagrams.request_timeline(RequestTrace("one", 0.0, [0.2], [1], output_tokens=1))
    assert not artists(one, "tpot") and not artists(one, "itl"), "one token: no ITL and no TPOT (vLLM's rule)"


# --- the batched timeline --------------------------------------------------------------------------


def test_batched_timeline_draws_every_token_at_its_simulated_time(stall_runs):
    fig = diagrams.batched_timeline(stall_runs)
    for label, run in stall_runs.items():
        ax = next(a for a in fig.axes if a.get_title() == label)
        ticks = {a.get_gid(): a for a in ax.findobj(lambda a: (a.get_gid() or "").startswith("tokens "))}
        for record in run.requests:
            drawn = [seg[0][0] for seg in ticks[f"tokens {record.request_id}"].get_segments()]
            assert drawn == pytest.approx(list(record.token_times * 1e3)), f"{label}: {record.request_id}'s ticks"
        bands = {a.get_gid() for a in ax.findobj(lambda a: (a.get_gid() or "").startswith("step "))}
        assert bands == {f"step {i}" for i in np.flatnonzero(run.steps.prefill_tokens)}, "a band per prefill step"


def test_batched_timeline_shows_the_long_prefill_as_the_decodes_stall(stall_runs):
    fig = diagrams.batched_timeline(stall_runs)
    stalls = {}
    for label, run in stall_runs.items():
        ax = next(a for a in fig.axes if a.get_title() == label)
        (arrow,) = [a for a in ax.findobj(lambda a: a.get_gid() == "longest itl")]
        stalls[label] = abs(arrow.xy[0] - arrow.xyann[0])
        pooled = [gap for t in run.traces for gap in metrics.itl(t)]
        assert stalls[label] == pytest.approx(max(pooled) * 1e3), f"{label}: the marked stall is the longest ITL"
    whole = stall_runs["no chunked prefill"]
    longest_step = whole.steps.duration[np.argmax(whole.steps.prefill_tokens)]
    assert stalls["no chunked prefill"] == pytest.approx(longest_step * 1e3), "the stall is the prompt's one step"
    assert stalls["chunks of 512"] < stalls["no chunked prefill"] / 2, "chunked prefill shortens the stall"


def test_batched_timeline_windows_and_bad_input(stall_runs):
    run = stall_runs["no chunked prefill"]
    fig = diagrams.batched_timeline(run, start=0.04, end=0.2, max_requests=3)
    (ax,) = fig.axes
    assert ax.get_xlim() == pytest.approx((40.0, 200.0))
    assert len(ax.get_yticks()) == 3
    with pytest.raises(ValueError, match="end > start"):
        diagrams.batched_timeline(run, start=1.0, end=0.5)
    with pytest.raises(ValueError, match="at least one"):
        diagrams.batched_timeline({})


# --- block tables and a preemption ------------------------------------------------------------------


def decoding(blocks: BlockManager, request_id: str, prompt: int, generated: int) -> SimRequest:
    request = SimRequest(request_id, 0.0, prompt, 100, computed=prompt + generated - 1, generated=generated)
    assert blocks.allocate(request_id, request.computed)
    return request


def test_block_tables_show_a_preempted_requests_blocks_gone():
    blocks = BlockManager(6, 4)
    running = [decoding(blocks, "a", 8, 1), decoding(blocks, "b", 5, 3), decoding(blocks, "c", 6, 2)]
    before = copy.deepcopy(blocks)
    waiting: deque = deque()
    # a has 8 tokens in 2 full blocks and needs a third; none is free, so c (the latest) is preempted
    sim_steps.continuous_step(running, waiting, blocks, token_budget=64, max_num_seqs=8)
    assert [r.request_id for r in waiting] == ["c"]
    fig = diagrams.block_tables({"before the step": before, "after the step": blocks}, ["a", "b", "c"])
    panels = {ax.get_title().split(":")[0]: ax for ax in fig.axes}
    for label, manager in (("before the step", before), ("after the step", blocks)):
        cells = {a.get_gid() for a in panels[label].findobj(lambda a: (a.get_gid() or "").startswith("block "))}
        owners = diagrams.block_owners(manager, ["a", "b", "c"])
        expected = {f"block {k}: {owners[k][0] if k in owners else 'free'}" for k in range(manager.num_blocks)}
        assert cells == expected, f"{label}: one cell per physical block, named by its owner"
        for rid in ("a", "b", "c"):
            owned = {k for k, (owner, _) in owners.items() if owner == rid}
            assert owned == (set(manager.block_table(rid)) if rid in manager else set())
    cells = {label: {a.get_gid() for a in ax.findobj(lambda a: (a.get_gid() or "").startswith("block "))}
             for label, ax in panels.items()}  # fmt: skip
    assert any(gid.endswith(": c") for gid in cells["before the step"]), "c held blocks before"
    assert not any(gid.endswith(": c") for gid in cells["after the step"]), "the preempted request holds no block"
    tables = artists(fig, "table c")
    assert {t.get_text() for t in tables.values()} >= {"c: no blocks"}
    assert len(blocks.block_table("a")) == 3, "a got the block c gave back"


def test_block_tables_refuse_an_empty_mapping():
    with pytest.raises(ValueError, match="at least one"):
        diagrams.block_tables({}, ["a"])


# --- prefix hashes -------------------------------------------------------------------------------------


def prompt(request_id: str, *segments: tuple[str, int]) -> RequestSpec:
    return RequestSpec(request_id, 0.0, sum(n for _, n in segments), 1, prompt_segments=tuple(segments))


def hash_cells(fig, request_id: str) -> dict[int, tuple[str, object]]:
    """Block index -> (drawn hash text, face colour) of one prompt's row."""
    out = {}
    for a in fig.findobj(lambda a: (a.get_gid() or "").startswith(f"{request_id} block ")):
        index, value = a.get_gid().removeprefix(f"{request_id} block ").split(": ")
        out[int(index)] = (value, a.get_facecolor())
    return out


def colour(rgba) -> str:
    for name, value in (("hit", diagrams.HIT), ("miss", diagrams.MISS), ("partial", diagrams.PARTIAL)):
        if np.allclose(rgba, to_rgba(value)):
            return name
    return str(rgba)


def test_prefix_hashes_a_timestamp_changes_every_later_block_hash():
    first = prompt("t1", ("system prompt", 48), ("timestamp 12:00:01", 8), ("question one", 24))
    second = prompt("t2", ("system prompt", 48), ("timestamp 12:00:02", 8), ("question one", 24))
    front = prompt("t3", ("timestamp 12:00:03", 8), ("system prompt", 48), ("question one", 24))
    fig = diagrams.prefix_hashes([first, second, front], block_size=16)
    for spec in (first, second, front):
        library = prompt_block_hashes(spec.request_id, spec.prompt_tokens, 16, spec.prompt_segments)
        cells = hash_cells(fig, spec.request_id)
        assert [cells[k][0] for k in range(len(library))] == [str(h) for h in library], "the library's hashes"
        assert len(cells) == len(library), "80 tokens: five full blocks, no partial one"
    second_cells, front_cells = hash_cells(fig, "t2"), hash_cells(fig, "t3")
    # blocks 0-2 hold only the system prompt: cached by t1; block 3 holds the timestamp, and every block after differs
    assert [colour(second_cells[k][1]) for k in range(5)] == ["hit"] * 3 + ["miss"] * 2
    first_hashes = prompt_block_hashes("t1", 80, 16, first.prompt_segments)
    second_hashes = prompt_block_hashes("t2", 80, 16, second.prompt_segments)
    assert first_hashes[:3] == second_hashes[:3] and all(a != b for a, b in zip(first_hashes[3:], second_hashes[3:]))
    assert [colour(front_cells[k][1]) for k in range(5)] == ["miss"] * 5, "a timestamp in front: nothing is cached"
    assert [colour(hash_cells(fig, "t1")[k][1]) for k in range(5)] == ["miss"] * 5, "the first prompt finds nothing"


def test_prefix_hashes_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        diagrams.prefix_hashes([])
    with pytest.raises(ValueError, match="block_size"):
        diagrams.prefix_hashes([prompt("p", ("x", 4))], block_size=0)


# --- the memory budget ----------------------------------------------------------------------------------


def test_memory_budget_segments_add_up_to_utilization_times_total():
    log = kv.vllm.REFERENCE_LOG
    budget = kv.budget(
        "Llama-3-8B", "H100-SXM", max_model_len=8192, activation_bytes=log.activation_bytes,
        non_torch_bytes=log.non_torch_bytes, cuda_graph_bytes=0.5 * GiB,
    )  # fmt: skip
    fig = diagrams.memory_budget({"H100": budget})
    inside = ["weights", "activation peak", "non-torch memory", "CUDA graphs", "KV cache"]
    widths = {name: bar_width(fig, f"H100: {name}") for name in inside + ["not given to vLLM"]}
    assert sum(widths[name] for name in inside) == pytest.approx(budget.utilization * budget.total_memory / GiB)
    assert widths["not given to vLLM"] == pytest.approx((1 - budget.utilization) * budget.total_memory / GiB)
    assert widths["KV cache"] == pytest.approx(budget.kv_memory / GiB)
    assert widths["weights"] == pytest.approx(budget.weights / GiB)
    (line,) = artists(fig, "H100: requested").values()
    assert line.get_segments()[0][0][0] == pytest.approx(budget.requested / GiB)
    assert not artists(fig, "H100: does not fit")


def test_memory_budget_shows_a_budget_that_does_not_fit():
    budget = kv.budget("Llama-3.1-70B", "L4", max_model_len=4096)  # 141 GB of weights on a 24 GB card
    fig = diagrams.memory_budget({"L4": budget})
    assert not artists(fig, "L4: KV cache"), "no memory is left for the KV cache"
    fixed = budget.weights + budget.activation_peak + budget.non_torch + budget.cuda_graphs
    assert bar_width(fig, "L4: does not fit") == pytest.approx((fixed - budget.requested) / GiB)
    assert diagrams.budget_shortfall(budget) == pytest.approx(fixed - budget.requested)


def test_memory_budget_with_a_fixed_kv_cache_size():
    budget = kv.budget("Llama-3-8B", "H100-SXM", max_model_len=8192, kv_cache_memory_bytes=20 * GiB)
    parts = diagrams.budget_parts(budget)
    assert parts["KV cache"] == 20 * GiB
    assert sum(parts.values()) == pytest.approx(budget.total_memory)
    fig = diagrams.memory_budget(budget)
    assert not artists(fig, f"{budget.model} on {budget.gpu}: requested"), "utilization is ignored"


# --- rendering -------------------------------------------------------------------------------------------


def test_figures_render_as_png_and_stay_out_of_pyplot():
    import matplotlib.pyplot as plt
    from IPython.core.formatters import DisplayFormatter

    before = plt.get_fignums()
    trace = RequestTrace("r", 0.0, [0.1, 0.15], [1, 1], output_tokens=2)
    fig = diagrams.request_timeline(trace)
    # IPython's own formatter, without the inline backend (a notebook whose first picture is a diagram)
    data, _ = DisplayFormatter().format(fig)
    assert data["image/png"][:8] == b"\x89PNG\r\n\x1a\n" and len(data["image/png"]) > 5000
    assert plt.get_fignums() == before, (
        "a pyplot figure would be shown twice in a notebook (by pyplot and as the value)"
    )


# --- the glossary and the modules' "You need from earlier modules" boxes ----------------------------


def test_glossary_and_prerequisite_links_point_to_files_that_exist():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    link = re.compile(r"\]\(([^)#\s]+)\)|^\[M\d\]: (\S+)$", re.MULTILINE)
    sources = {root / "docs" / "glossary.md": (root / "docs" / "glossary.md").read_text()}
    for folder in ("solutions", "modules"):
        for module in ("m2_streaming_server", "m3_batching_simulator", "m4_kv_calculator", "m5_capacity_planning",
                       "m6_beyond_one_gpu", "m7_vllm_lab"):  # fmt: skip
            (notebook,) = (root / folder / module).glob("*.ipynb")
            cells = json.loads(notebook.read_text())["cells"]
            (box,) = [
                "".join(c["source"]) for c in cells if "**You need from earlier modules**" in "".join(c["source"])
            ]
            sources[notebook] = box
    for path, text in sources.items():
        targets = [a or b for a, b in link.findall(text) if not (a or b).startswith("http")]
        assert targets, f"{path.name}: no local links found"
        for target in targets:
            assert (path.parent / target).resolve().exists(), f"{path.name} links to {target}, which does not exist"


def test_phases_overview_draws_a_row_per_prompt_token_and_per_sequence():
    fig = diagrams.phases_overview(prompt_tokens=6, batch=2)
    assert len(artists(fig, "prefill-x")) == 6 and len(artists(fig, "decode-x")) == 2
    assert len(artists(fig, "kv-prefill")) == 6 and len(artists(fig, "kv-decode")) == 1  # the prompt, then +1
    (w_prefill,), (w_decode,) = artists(fig, "weights-prefill").values(), artists(fig, "weights-decode").values()
    assert w_prefill.get_width() == w_decode.get_width()  # the same weights, read by both phases
    with pytest.raises(ValueError, match="fewer decode rows"):
        diagrams.phases_overview(prompt_tokens=2, batch=2)


def test_module_1_opens_with_the_committed_overview_at_the_release_tag():
    """The picture is a committed PNG, linked by an absolute URL at the release tag (Colab resolves no
    relative paths and ignores cell attachments), so it shows before any cell runs."""
    import json
    from pathlib import Path

    from course.env import REPO_REF, REPO_URL

    root = Path(__file__).resolve().parents[1]
    url = f"{REPO_URL.replace('https://github.com/', 'https://raw.githubusercontent.com/')}/{REPO_REF}/docs/figures/prefill_decode.png"
    assert (root / "docs/figures/prefill_decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for folder in ("solutions", "modules"):
        cells = json.loads((root / folder / "m1_prefill_decode/prefill_decode.ipynb").read_text())["cells"]
        first = "".join(cells[0]["source"])
        assert cells[0]["cell_type"] == "markdown" and f"]({url})" in first, folder
