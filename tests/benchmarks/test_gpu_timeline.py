"""The device timeline's summary (``nanoinfer.benchmarks.gpu_timeline.summarize``) on hand-made
intervals: overlaps count once, gaps split into launch gaps and waits for the host."""

import random

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
