"""The device's timeline over a benchmark run: how much of each engine step the GPU was busy, how long it
waited for the host, and which kernels and copies took the busy time (``torch.profiler`` with CUDA
activity only, so that the host's side is not traced: the profiler still slows it a little, which
shows as idle time).

Used by ``benchmarks/structured_outputs.py --gpu-timeline`` (docs/benchmarks.md, run 89): a constrained
step's own device cost is its busy time over the length-matched run's, and its idle time beyond that
run's is the host's share.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

# A gap between two device operations longer than this is counted as waiting for the host (shorter ones
# are the launch gaps inside a CUDA graph).
HOST_GAP_US = 20.0


def summarize(intervals: list[tuple[float, float, str]], steps: int, top: int = 12) -> dict:
    """Per engine step: the span from the first operation's start to the last one's end, the time the
    device was busy (the union of the intervals), the rest (idle), the gaps over ``HOST_GAP_US``, and the
    ``top`` operation names by busy time (name, us per step, calls per step). ``intervals``: each device
    operation's (start us, end us, name)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not intervals:
        return {"steps": steps, "operations": 0}
    ordered = sorted(intervals)
    busy, gaps = 0.0, []
    run_start, run_end = ordered[0][0], ordered[0][1]
    for start, end, _ in ordered[1:]:
        if start > run_end:
            busy += run_end - run_start
            gaps.append(start - run_end)
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    span = max(end for _, end, _ in ordered) - ordered[0][0]
    time_by_name: Counter[str] = Counter()
    calls_by_name: Counter[str] = Counter()
    for start, end, name in ordered:
        time_by_name[name] += end - start
        calls_by_name[name] += 1
    host_gaps = [gap for gap in gaps if gap > HOST_GAP_US]
    return {
        "steps": steps,
        "operations": len(ordered),
        "span_us_per_step": round(span / steps, 1),
        "busy_us_per_step": round(busy / steps, 1),
        "idle_us_per_step": round((span - busy) / steps, 1),
        "host_gaps_per_step": round(len(host_gaps) / steps, 2),
        "host_gap_us_per_step": round(sum(host_gaps) / steps, 1),
        "top": [
            (name, round(us / steps, 1), round(calls_by_name[name] / steps, 2))
            for name, us in time_by_name.most_common(top)
        ],
    }


@contextlib.contextmanager
def recorded_device_operations() -> Iterator[list[tuple[float, float, str]]]:
    """Yields a list that holds, on exit, the (start us, end us, name) of every kernel and copy the CUDA
    devices ran meanwhile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    intervals: list[tuple[float, float, str]] = []
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        yield intervals
        torch.cuda.synchronize()
    intervals.extend(
        (event.time_range.start, event.time_range.end, event.name)
        for event in profiler.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
