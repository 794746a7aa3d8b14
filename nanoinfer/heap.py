"""The garbage collector's policy: the startup heap frozen, and for the long-running processes (the API
server, the engine core) rare full collections.

Both allocate many short-lived objects per engine step (outputs, events, coroutine frames) on top of a
large heap that lives as long as the process (modules, the tokenizer, the app, the model's Python
objects) and, while serving, the live requests (their token-id lists). CPython's full collections
traverse all of it; at the default thresholds they run often enough under load to cost the API process
about a quarter of its CPU (docs/benchmarks.md, "Serving"). So, once started, the process freezes its
startup heap (never traversed again, as vLLM does) and collects the oldest generation rarely: the
objects that stay alive long are requests, which are freed by reference counting when they end.
The offline ``LLM`` lives in its user's process: it freezes the heap (one full collection over torch's,
Triton's and the model's objects costs 0.1-0.4 s, a stall in the middle of a batch) and leaves the
thresholds alone.
"""

from __future__ import annotations

import gc

# Young collections after every this many net allocations (CPython: 700, 10, 10).
GEN0_THRESHOLD = 10_000
GEN1_EVERY = 10
GEN2_EVERY = 100


def freeze_heap() -> None:
    """Collects once and moves every object alive now to the permanent generation, which collections
    never traverse (nor free: ``gc.unfreeze`` gives its objects back once they may be garbage)."""
    gc.collect()
    gc.freeze()


def freeze_startup_heap() -> None:
    """Freezes the heap and raises the thresholds. Call once, when the process is ready to serve."""
    freeze_heap()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_EVERY, GEN2_EVERY)
