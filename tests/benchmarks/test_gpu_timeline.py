"""The device timeline's summary (``nanoinfer.benchmarks.gpu_timeline.summarize``) on hand-made
intervals: overlaps count once, gaps split into launch gaps and waits for the host."""

import contextlib
import importlib.util
import random
from pathlib import Path

import pytest

from nanoinfer.benchmarks.gpu_timeline import HOST_GAP_US, summarize


def test_busy_idle_and_host_gaps_per_step():
    intervals = [
        (0.0, 10.0, "a"),
        (5.0, 20.0, "b"),  # overlaps a: busy 0-20
        (30.0, 40.0, "a"),  # a 10 us gap: a launch gap, not the host's
        (100.0, 110.0, "c"),  # a 60 us gap: waiting for the host
    ]
    shuffled = intervals[:]
    random.Random(0).shuffle(shuffled)
    summary = summarize(shuffled, steps=2)
    assert summary == {
        "steps": 2,
        "operations": 4,
        "span_us_per_step": 55.0,
        "busy_us_per_step": 20.0,
        "idle_us_per_step": 35.0,
        "host_gaps_per_step": 0.5,
        "host_gap_us_per_step": 30.0,
        "top": [("a", 10.0, 1.0), ("b", 7.5, 0.5), ("c", 5.0, 0.5)],
    }
    assert 10.0 < HOST_GAP_US < 60.0


def test_an_operation_inside_a_longer_one_adds_no_busy_time():
    summary = summarize([(0.0, 100.0, "long"), (10.0, 20.0, "short"), (150.0, 160.0, "after")], steps=1)
    assert summary["busy_us_per_step"] == 110.0
    assert summary["span_us_per_step"] == 160.0
    assert summary["host_gap_us_per_step"] == 50.0


def test_no_operations_and_bad_step_counts():
    assert summarize([], steps=3) == {"steps": 3, "operations": 0}
    with pytest.raises(ValueError, match="steps must be at least 1"):
        summarize([(0.0, 1.0, "a")], steps=0)


def _structured_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"
    spec = importlib.util.spec_from_file_location("structured_outputs_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("host_phases", [False, True])
def test_the_structured_benchmark_summarizes_its_runs_device_operations_per_step(
    tiny_qwen3, monkeypatch, host_phases
):
    """``--gpu-timeline`` on the CPU, with the profiler's record replaced by one 100 us operation: the
    run's summary divides it by the run's engine steps (counted with or without ``--profile``)."""
    from nanoinfer import LLM, SamplingParams

    benchmark = _structured_benchmark()

    @contextlib.contextmanager
    def one_operation():
        operations = []
        yield operations
        operations.append((0.0, 100.0, "kernel"))

    monkeypatch.setattr(benchmark, "recorded_device_operations", one_operation)
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4)
    try:
        params = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in range(2)]
        run, lengths = benchmark._run(llm, params, profile=host_phases, gpu_timeline=True)
    finally:
        llm.close()
    assert lengths == [6, 6]
    timeline = run["gpu_timeline"]
    assert timeline["steps"] >= 6  # a prefill step and a decode step per later token
    if host_phases:
        assert timeline["steps"] == run["host_phase_us_per_step"]["steps"]
    steps = timeline["steps"]
    assert timeline["busy_us_per_step"] == round(100.0 / steps, 1)
    assert timeline["top"] == [("kernel", round(100.0 / steps, 1), round(1 / steps, 2))]
