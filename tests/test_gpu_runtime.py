"""benchmarks/gpu_runtime.py: its CPU dry run works end to end and writes the JSON a GPU run would."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_runtime  # noqa: E402
import pytest  # noqa: E402

from course import phases  # noqa: E402


def test_dry_run_reads_every_notebook_and_measures_module1_figures(tmp_path):
    out = tmp_path / "dry.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_runtime.py"), "--dry-run", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300, capture_output=True, text=True, cwd=ROOT)
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert set(report["notebooks"]) == {str(p.relative_to(ROOT)) for p in ROOT.glob("solutions/*/*.ipynb")}
    assert all(not nb["executed"] for nb in report["notebooks"].values())
    m1 = report["module1"]
    for key in ("decode_bandwidth_fraction", "prefill_flops_fraction", "measured_bandwidth_gbs", "model_params"):
        assert key in m1
    # Both decode figures side by side; on a CPU the graph one is absent and the note says why.
    assert m1["decode_headline"] == "eager" and m1["decode_bandwidth_fraction_graph"] is None
    assert m1["decode_bandwidth_fraction"] == m1["decode_bandwidth_fraction_eager"] and "CUDA" in m1["graph_note"]
    # The graph's static-cache step, run eagerly: timed at every batch, and checked against the dynamic cache.
    assert set(m1["decode_steps_static_eager"]) == set(m1["decode_steps"])
    # Each static-cache timing counts the steps every sweep times per batch, not the eager figures' rounds
    # (quick mode: 4 steps, 3 rounds): a timing's n of the eager sweep is the rounds' count.
    steps = phases.STEPS[True]
    assert m1["decode_steps_per_sweep"] == steps != m1["rounds"]
    assert all(t["n"] == m1["rounds"] for t in m1["decode_steps"].values())
    assert all(t["n"] == steps for t in m1["decode_steps_static_eager"].values())
    check = m1["static_cache_check"]
    assert check["compared"] == "eager static-cache steps" and check["max_abs_difference"] < 1e-4
    # The final lab: on a dry run, the recorded CPU run's figures through the code a GPU run uses.
    lab = report["vllm_lab"]
    assert lab["live"] is False and "dry run" in lab["why"]
    assert lab["startup_line"] == lab["predicted_line"], "the course's calculator predicts the recorded log line"
    counters = lab["counters"]
    assert counters["prefix_shared"]["prefix_hit_rate"] > 0 == counters["prefix_timestamp"]["prefix_hit_rate"]
    assert counters["preemption"]["preemptions"] > 0 and counters["admission"]["admission_rejections"] > 0
    assert set(lab["heldout_errors"]) == {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "output_throughput"}
    assert set(lab["server_comparison"]) == {"vLLM", "course serve"}


def test_without_vllm_the_lab_stage_says_why_and_starts_nothing(tmp_path, monkeypatch):
    from course import vllm_lab

    monkeypatch.setattr(vllm_lab, "vllm_missing", lambda: "vLLM is not installed in this Python (pip install vllm)")
    monkeypatch.setattr(vllm_lab, "record_run", lambda *a, **k: pytest.fail("no vLLM: nothing may start"))
    lab = gpu_runtime.vllm_lab_stage(False, tmp_path, "NVIDIA L4")
    assert lab == {"live": False, "why": "vLLM is not installed in this Python (pip install vllm)"}


def test_the_lab_on_a_gpu_keeps_the_cpu_runs_kv_capacity():
    """128 blocks of vLLM's GPU block size hold the 2,048 tokens of the recorded CPU run (16 x 128)."""
    from course import kv, vllm_lab

    args = gpu_runtime.LAB_GPU_ARGS
    blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
    assert blocks * kv.vllm.BLOCK_SIZE == vllm_lab.load_recorded_run().startup.kv_tokens
    assert args[args.index("--max-model-len") + 1] == "512"


def test_cuda_device_names_map_to_their_datasheets():
    assert gpu_runtime.datasheet_for("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert gpu_runtime.datasheet_for("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert gpu_runtime.datasheet_for("Tesla T4").name == "T4"
    assert gpu_runtime.datasheet_for("NVIDIA L4").name == "L4"
    assert gpu_runtime.datasheet_for("Some Future GPU") is None


def test_without_cuda_the_real_run_refuses_with_a_clear_message(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_runtime.py"), "--out", str(tmp_path / "x.json")]
    result = subprocess.run(command, timeout=120, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_the_documented_command_for_a_gpu_machine_uses_the_scripts_own_flags():
    import shlex

    readme = (ROOT / "docs" / "maintainers.md").read_text()
    line = next(x for x in readme.splitlines() if "python3 benchmarks/gpu_runtime.py" in x and "timeout" in x)
    words = shlex.split(line.split("python3 benchmarks/gpu_runtime.py", 1)[1].split("2>&1")[0])
    args = gpu_runtime.build_parser().parse_args(words)  # exits on a flag the script does not have
    assert args.quick and not args.dry_run and str(args.out).endswith("gpu_runtime.json")
    assert "bin/gpu-wheels" in readme and (ROOT / "bin" / "gpu-wheels").stat().st_mode & 0o111
