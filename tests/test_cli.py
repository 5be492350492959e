"""The `course` and `autograder` command lines."""

import json
import subprocess
import sys

import pytest

from course.cli import main as course_main
from course.metrics import summarize
from course.trace import RequestTrace, save_traces


def test_course_info(capsys):
    assert course_main(["info"]) == 0
    assert "torch" in capsys.readouterr().out


def test_course_tiny_model_writes_a_loadable_folder(tmp_path, capsys):
    assert course_main(["tiny-model", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    assert (tmp_path / "tiny" / "config.json").exists() and (tmp_path / "tiny" / "tokenizer.json").exists()
    assert "seed 3" in capsys.readouterr().out


def test_course_summarize_prints_table_and_json(tmp_path, capsys):
    traces = [
        RequestTrace(str(i), 0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.02], [1, 1], output_tokens=2) for i in range(4)
    ]
    path = save_traces(tmp_path / "run.json", traces)
    assert course_main(["summarize", str(path)]) == 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "completed 4" in table
    assert course_main(["summarize", str(path), "--json", "--percentiles", "50", "90"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["completed"] == 4 and data["itl"]["n"] == 4 and "p90_s" in data["ttft"]
    # the same record as `course bench --json` and `course simulate --json` print
    assert data == summarize(traces, percentiles=[50, 90]).to_dict()
    assert data["output_tokens"] == 8 and data["request_throughput_req_s"] == pytest.approx(4 / 0.42)


def test_course_summarize_bad_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "x.json").write_text("[]")
    assert course_main(["summarize", str(tmp_path / "x.json")]) == 2
    assert "not a request-trace file" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["course", "--help"], ["autograder", "release", "--help"]])
def test_console_scripts_are_installed(command):
    bin_dir = __import__("pathlib").Path(sys.executable).parent
    result = subprocess.run([str(bin_dir / command[0]), *command[1:]], capture_output=True, text=True)
    assert result.returncode == 0 and "usage:" in result.stdout


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_course_serve_bad_argument_is_a_clear_error(engine_core, capsys):
    # a setting that cannot work is a usage error (2) on either engine: refused before any engine core starts
    argv = ["serve", "--model", "tiny", "--max-batch-size", "0", "--engine-core", engine_core, "--threads", "1"]
    assert course_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("course serve: error: ") and "max_batch_size must be >= 1" in err, err
    assert "Traceback" not in err
