"""The two vLLM releases the course names: 0.34's GPU rules beside 0.32's, the extensible KV cache's budget,
the release in every printout, and the release bump's parts (course.vllm_bump) on small stand-in sources.

The rules themselves are checked against each release's own code by the oracle (tests/oracle/test_drift.py
for 0.32, tests/oracle/sources for 0.34); these tests pin the arithmetic and the interfaces.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from course import hardware, kv, vllm_bump
from course.cli import main as course_main
from course.kv import vllm
from course.vllm_release import GPU_VLLM_VERSION, NEWEST, RUNNABLE, VLLM_VERSION, get_release

GIB = 2**30
H100 = hardware.gpu("H100-SXM")
LOG = vllm.REFERENCE_LOG


# --- the releases ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["0.34", "0.34.0", "vLLM 0.34.0", None, NEWEST])
def test_the_newest_release_by_any_name(name):
    assert get_release(name) is NEWEST and NEWEST.version == GPU_VLLM_VERSION


def test_an_unknown_release_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"vLLM release '0.33'.*0.32 \(.*0.34 \("):
        get_release("0.33")


def test_the_runnable_release_is_the_oracles():
    assert get_release("0.32") is RUNNABLE and RUNNABLE.version == VLLM_VERSION == vllm.VLLM_VERSION


def test_each_differing_rule_is_cited_at_its_release():
    for release in (RUNNABLE, NEWEST):
        rules = vllm.rules(release)
        for fact in ("block_size", "cpu_block_size", "utilization", "budget", "startup_check", "batches_in_flight"):
            assert "vllm/" in rules.sources[fact] and "(" in rules.sources[fact], (release.version, fact)


# --- block sizes and batches in flight ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("card", "is_mla", "old", "new"),
    [("H100-SXM", False, 16, 64), ("H100-SXM", True, 16, 64), ("A100-80GB", True, 16, 64), ("T4", False, 16, 64),
     ("CPU", False, 128, 128)],
)  # fmt: skip
def test_default_block_sizes(card, is_mla, old, new):
    device = hardware.gpu(card)
    assert vllm.default_block_size(device, is_mla, release="0.32") == old
    assert vllm.default_block_size(device, is_mla, release="0.34") == new


def test_blackwell_mla_is_32_in_032_and_64_in_034():
    b200 = hardware.HardwareSpec("B200", 192e9, 8e12, 2.25e15, "stand-in", compute_capability=(10, 0))
    assert (vllm.mla_block_size(b200, release="0.32"), vllm.mla_block_size(b200, release="0.34")) == (32, 64)


def test_library_defaults_stay_the_runnable_releases():
    """Notebooks call these without a release: they keep 0.32's answers."""
    assert kv.paged_blocks(100).block_size == vllm.BLOCK_SIZE == 16
    assert vllm.GPU_MEMORY_UTILIZATION == 0.92
    b = kv.budget("Llama-3-8B", "H100-SXM", max_model_len=8192)
    assert (b.release, b.block_size, b.utilization, b.extensible) == ("0.32.0", 16, 0.92, False)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_batches_in_flight_by_release(pp):
    assert vllm.max_concurrent_batches(True, pp, release="0.34") == pp + 1
    assert vllm.max_concurrent_batches(True, pp, release="0.32") == pp + 1  # 0.32's GPU default: the V2 runner
    assert vllm.max_concurrent_batches(True, pp, release="0.32", v2_model_runner=False) == max(pp, 2 if pp == 1 else pp)
    assert vllm.max_concurrent_batches(False, pp, release="0.34") == pp


def test_sliding_layers_reserve_for_every_batch_in_flight_under_pp():
    one, two = (kv.budget("Gemma-3-27B", "H200-SXM", max_model_len=32768, release="0.34", pipeline_parallel=pp,
                          kv_cache_memory_bytes=20 * GIB) for pp in (1, 2))  # fmt: skip
    assert (one.in_flight_tokens, two.in_flight_tokens) == (2 * one.max_num_batched_tokens, 3 * 8192)
    assert two.blocks_per_request > one.blocks_per_request


def test_gb10_leaves_the_large_batch_tier_in_034():
    gb10 = hardware.HardwareSpec("GB10", 128e9, 273e9, 1e15, "stand-in", 119.7 * GIB, compute_capability=(12, 1))
    assert vllm.batch_defaults(gb10, release="0.32").max_num_batched_tokens == 8192
    assert vllm.batch_defaults(gb10, release="0.34").max_num_batched_tokens == 2048


def test_a_hybrids_attention_block_aligns_to_the_block_size():
    old, new = (kv.budget("Qwen3-Next-80B-A3B", "H200-SXM", tp=4, max_model_len=8192, release=r,
                          kv_cache_memory_bytes=20 * GIB) for r in ("0.32", "0.34"))  # fmt: skip
    assert old.block_size % 16 == 0 and new.block_size % 64 == 0 and new.block_size >= old.block_size


# --- the extensible KV cache -------------------------------------------------------------------------------


def _overheads(**extra):
    return dict(max_model_len=8192, activation_bytes=LOG.activation_bytes, non_torch_bytes=LOG.non_torch_bytes, **extra)


def test_measured_budget_by_hand():
    """Unset utilization (1.0), no other process: free - weights - non-torch - graphs - peak - margin."""
    b = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", cuda_graph_bytes=0.5 * GIB, **_overheads())
    assert b.extensible and b.utilization == 1.0 and not b.utilization_given
    peak = LOG.activation_bytes + 0.5 * GIB
    margin = max(GIB, int(0.75 * peak))
    expected = H100.total_memory - b.weights - LOG.non_torch_bytes - 0.5 * GIB - peak - margin
    assert b.measured_peak == peak and b.margin == margin
    assert b.kv_memory == pytest.approx(expected, abs=1)
    assert b.num_blocks == int(expected // (64 * 131072))  # 131,072 B per token over all 32 layers
    assert b.num_blocks <= b.capacity_blocks  # the reserved range, the estimate at 1.0, is never exceeded


def test_the_range_is_the_given_overheads_to_the_ceiling():
    given = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", **_overheads())
    low, high = given.kv_memory_range
    assert low < high == pytest.approx(H100.total_memory - given.weights - GIB, abs=1)
    bare = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", max_model_len=8192)
    assert bare.kv_memory_range == (high, high)
    estimated = kv.budget("Llama-3-8B", "H100-SXM", release="0.32", **_overheads())
    assert estimated.kv_memory_range == (estimated.kv_memory, estimated.kv_memory)


def test_a_larger_transient_peak_costs_up_to_one_and_three_quarters():
    base = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", transient_peak_bytes=2 * GIB, **_overheads())
    more = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", transient_peak_bytes=3 * GIB, **_overheads())
    assert base.kv_memory - more.kv_memory == pytest.approx(1.75 * GIB, abs=2)
    small, smaller = (kv.budget("Llama-3-8B", "H100-SXM", release="0.34", transient_peak_bytes=peak * GIB,
                                max_model_len=8192) for peak in (0.5, 1.0))  # fmt: skip
    assert small.kv_memory - smaller.kv_memory == pytest.approx(0.5 * GIB, abs=2)  # the margin at its floor
    profiled = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", transient_peak_bytes=0.5 * GIB, **_overheads())
    assert profiled.measured_peak == LOG.activation_bytes  # never below the profiled activation peak


def test_the_estimate_path_of_034():
    """Off (--kv-cache-memory-bytes, num_gpu_blocks_override, --no-enable-extensible-kv-cache, the CPU): the estimate
    at 0.92, as in 0.32 but with 64-token blocks."""
    off = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", extensible_kv_cache=False, **_overheads())
    old = kv.budget("Llama-3-8B", "H100-SXM", release="0.32", **_overheads())
    assert (off.utilization, off.extensible, off.block_size) == (0.92, False, 64)
    assert off.kv_memory == old.kv_memory and off.num_blocks == old.num_blocks // 4
    fixed = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", kv_cache_memory_bytes=10 * GIB, max_model_len=8192)
    assert not fixed.extensible and fixed.kv_memory == 10 * GIB
    blocks = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", num_gpu_blocks_override=500, max_model_len=8192)
    assert not blocks.extensible and blocks.num_blocks == 500
    cpu = kv.budget("Llama-3-8B", "CPU", release="0.34", kv_cache_memory_bytes=4 * GIB, max_model_len=4096)
    assert not cpu.extensible and cpu.block_size == 128 and any("triton-cpu" in note for note in cpu.notes)
    with pytest.raises(ValueError, match="0.32.0 has none"):
        kv.budget("Llama-3-8B", "H100-SXM", release="0.32", extensible_kv_cache=True)
    with pytest.raises(ValueError, match="cannot be on here"):
        kv.budget("Llama-3-8B", "H100-SXM", release="0.34", extensible_kv_cache=True, kv_cache_memory_bytes=GIB)


def test_another_process_no_longer_stops_the_start_it_shrinks_the_cache():
    alone = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", **_overheads())
    shared = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", other_process_bytes=10 * GIB, **_overheads())
    assert shared.startup_error is None and alone.kv_memory - shared.kv_memory == pytest.approx(10 * GIB, abs=1)
    refused = kv.budget("Llama-3-8B", "H100-SXM", release="0.32", utilization=0.92, other_process_bytes=10 * GIB)
    assert refused.startup_error and refused.num_blocks == 0


@pytest.mark.parametrize(("utilization", "warns"), [(None, False), (0.9, True), (0.7, False), (0.98, False)])
def test_the_warning_for_a_utilization_that_withholds_free_memory(utilization, warns):
    """0.98 withholds under 1 GiB; 0.7 is outside (0.7, 1.0); unset is 1.0."""
    b = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", utilization=utilization, **_overheads())
    assert (b.warning is not None) is warns
    if warns:
        assert b.warning.startswith("gpu_memory_utilization=0.9 caps this instance at 71.23 GiB, keeping ")
        assert b.binding_bound.startswith("the requested share")


def test_the_memory_after_warmup_line():
    b = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", **_overheads())
    line = b.memory_after_warmup
    free = vllm.format_gib(H100.total_memory - b.weights - LOG.non_torch_bytes)
    assert line.startswith(f"Memory after warmup: {free} GiB free, 0.0 GiB committed to the KV cache, 1.19 GiB kept")
    assert f"; {b.num_blocks} KV cache blocks (" in line and line.endswith("fit within the requested 79.14 GiB.")
    assert kv.budget("Llama-3-8B", "H100-SXM", release="0.32", **_overheads()).memory_after_warmup is None


def test_measure_kv_cache_bytes_keeps_the_peak_and_a_margin():
    common = dict(init_free_memory=70 * GIB, free_memory=50 * GIB, committed_bytes=0)
    assert vllm.measure_kv_cache_bytes(requested_memory=80 * GIB, **common) == 49 * GIB  # the 1 GiB floor
    assert vllm.measure_kv_cache_bytes(requested_memory=80 * GIB, transient_peak_bytes=4 * GIB, **common) == 43 * GIB
    assert vllm.measure_kv_cache_bytes(requested_memory=40 * GIB, transient_peak_bytes=4 * GIB, **common) == 16 * GIB
    assert vllm.measure_kv_cache_bytes(requested_memory=GIB, **common) == 0


# --- the printouts name the release ------------------------------------------------------------------------


def test_course_kv_defaults_to_the_newest_release_and_names_it(capsys):
    assert course_main(["kv", "Llama-3-8B", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "as vLLM 0.34.0 sizes it: measured after warm-up" in out and "64 tokens x 32 layers" in out
    assert "x utilization 1 " in out and "(unset: 1.0 with the extensible KV cache)" in out
    assert course_main(["kv", "Llama-3-8B", "--max-model-len", "8192", "--vllm", "0.32"]) == 0
    out = capsys.readouterr().out
    assert "as vLLM 0.32.0 sizes it: estimated at startup" in out and "16 tokens x 32 layers" in out
    assert course_main(["kv", "Llama-3-8B", "--max-model-len", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vllm_version"] == "vLLM 0.34.0" and data["block_size"] == 64 and data["extensible"]


def test_course_kv_without_the_extensible_kv_cache(capsys):
    assert course_main(["kv", "Llama-3-8B", "--max-model-len", "8192", "--no-extensible-kv-cache"]) == 0
    out = capsys.readouterr().out
    assert "as vLLM 0.34.0 sizes it: estimated at startup" in out and "x utilization 0.92" in out


def test_course_kv_refuses_an_unknown_release(capsys):
    with pytest.raises(SystemExit):
        course_main(["kv", "Llama-3-8B", "--vllm", "0.33"])
    assert "invalid choice: '0.33'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "release", "block"), [([], "vLLM 0.34.0", 64), (["--vllm", "0.32"], "vLLM 0.32.0", 16)]
)
def test_course_simulate_names_its_release(capsys, flag, release, block):
    args = ["simulate", "--requests", "5", "--rate", "0", "--max-model-len", "8192", *flag]
    assert course_main(args) == 0
    out = capsys.readouterr().out
    assert f"{release} rules: continuous" in out and f"KV blocks of {block};" in out
    assert course_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vllm"] == release and data["config"]["block_size"] == block


def test_course_simulate_blocks_are_the_releases_budget(capsys):
    assert course_main(["simulate", "--requests", "5", "--rate", "0", "--max-model-len", "8192", "--json"]) == 0
    blocks = json.loads(capsys.readouterr().out)["config"]["num_blocks"]
    b = kv.budget("Llama-3-8B", "H100-SXM", release="0.34", **_overheads())
    assert blocks == b.num_blocks


# --- the release bump's parts, on stand-in sources --------------------------------------------------------------


def _release(tmp_path, name: str, files: dict[str, str]):
    root = tmp_path / name
    rows = []
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
        rows.append(f"{path},{vllm_bump.record_hash((root / path).read_bytes())},1")
    (root / "RECORD").write_text("\n".join(rows) + "\n")
    return root


def test_compare_tells_unchanged_changed_moved_and_gone(tmp_path):
    old = _release(tmp_path, "old", {
        "vllm/a.py": '''
            class Config:
                DEFAULT = 16
                def size(self):
                    """Old words."""
                    return self.DEFAULT
            def helper():
                return 1
            def leaving():
                return 2
        ''',
        "vllm/b.py": "X = 1\n",
    })  # fmt: skip
    new = _release(tmp_path, "new", {
        "vllm/a.py": '''
            class Config:
                DEFAULT = 64
                def size(self):
                    """New words: only the docstring changed."""
                    return self.DEFAULT  # and a comment
            def helper():
                return 1
        ''',
        "vllm/c.py": "def leaving():\n    return 2\n",
    })  # fmt: skip
    cited = {
        "vllm/a.py": vllm_bump.Citation("vllm/a.py", {"Config.DEFAULT", "Config.size", "helper", "leaving"}, {"x"}),
        "vllm/b.py": vllm_bump.Citation("vllm/b.py", {"X"}, {"y"}),
    }
    got = {(c.path, c.name): (c.status, c.detail) for c in vllm_bump.compare(old, new, cited)}
    assert got[("vllm/a.py", None)][0] == "changed"
    assert got[("vllm/a.py", "Config.DEFAULT")][0] == "changed"
    assert got[("vllm/a.py", "Config.size")][0] == "unchanged"  # docstrings and comments are no code
    assert got[("vllm/a.py", "helper")][0] == "unchanged"
    assert got[("vllm/a.py", "leaving")] == ("moved", "now in vllm/c.py (same code)")
    assert got[("vllm/b.py", None)] == ("gone", "not in the new release")


@pytest.mark.parametrize(
    ("body", "refuses"), [("raise RuntimeError('needs Triton')", True), ("logger.warning('x')", False)]
)
def test_whether_a_cpu_build_starts_without_triton(tmp_path, body, refuses):
    root = _release(tmp_path, "cpu", {"vllm/platforms/cpu.py": f'''
        class CpuPlatform:
            @classmethod
            def check_and_update_config(cls, vllm_config):
                from vllm.triton_utils import HAS_TRITON
                if cls.get_cpu_architecture() == "x86" and not HAS_TRITON:
                    {body}
    '''})  # fmt: skip
    assert vllm_bump.refuses_without_triton(root) is refuses


def test_the_course_cites_vllm_paths_with_names():
    cited = vllm_bump.citations(())
    assert "vllm/v1/worker/extensible_kv_cache.py" in cited and "vllm/config/cache.py" in cited
    assert "course/kv/vllm.py" in cited["vllm/v1/worker/extensible_kv_cache.py"].places
    assert not set(cited) & (vllm_bump.HISTORICAL | vllm_bump.CPU_PACKAGING)


def test_the_bump_says_why_when_pypi_cannot_be_reached(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(vllm_bump, "CACHE", tmp_path)
    monkeypatch.setattr(vllm_bump, "WHEEL_PLATFORM", ("--index-url", "http://127.0.0.1:9/simple", "--retries", "0",
                                                      "--timeout", "1"))  # fmt: skip
    assert vllm_bump.main(["0.99.0", "--no-tests"]) == 2
    assert "cannot download vllm==" in capsys.readouterr().err


def test_math_of_the_ceiling_is_the_weights_and_the_floor():
    b = kv.budget("Llama-3-8B", "A100-80GB", release="0.34", max_model_len=8192)
    assert math.isclose(b.kv_memory_ceiling, b.total_memory - b.weights - GIB, abs_tol=1)
