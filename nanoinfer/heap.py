"""The garbage collector's policy for the long-running processes (the API server, the engine core).

Both allocate many short-lived objects per engine step (outputs, events, coroutine frames) on top of a
large heap that lives as long as the process (modules, the tokenizer, the app, the model's Python
objects) and, while serving, the live requests (their token-id lists). CPython's full collections
traverse all of it; at the default thresholds they run often enough under load to cost the API process
about a quarter of its CPU (docs/benchmarks.md, "Serving"). So, once started, the process freezes its
startup heap (never traversed again, as vLLM does) and collects the oldest generation rarely: the
objects that stay alive long are requests, which are freed by reference counting when they end.
"""

from __future__ import annotations

import gc

# Young collections after every this many net allocations (CPython: 700, 10, 10).
GEN0_THRESHOLD = 10_000
GEN1_EVERY = 10
GEN2_EVERY = 100


def freeze_startup_heap() -> None:
    """Collects once, moves every object alive now to the permanent generation, and raises the
    thresholds. Call once, when the process is ready to serve."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_EVERY, GEN2_EVERY)
