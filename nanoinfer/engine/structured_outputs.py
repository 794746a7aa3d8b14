"""The engine core's side of structured outputs: a grammar matcher per constrained request, and each
step's token bitmask of its constrained rows.

The bitmask of step n+1 depends on the token step n samples. The core therefore launches step n+1's
forward pass with its sampling deferred and waits for step n's tokens, which advance the matchers. With
async scheduling it then returns step n's outputs, and in its next step schedules and prepares step n+2
before it fills step n+1's bitmask, launches step n+1's sampling with it (``Executor.sample``) and, right
behind it, step n+2's forward pass: the device runs step n+1's forward pass meanwhile. The fill runs on
the engine's thread (on the grammar libraries' threads while it waits): on a thread of its own it would
wait for the GIL, which a busy engine thread hands over only every few milliseconds
(benchmarks/structured_backends.py --fill-threads). Without async scheduling the same order holds within
one step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.request import engine_eos_token_ids
from nanoinfer.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    # The grammar libraries are imported by the first constrained request only.
    from nanoinfer.structured.backend import Grammar, GrammarCompiler


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows."""

    rows: list[int]  # indices into SchedulerOutput.scheduled, of rows that sample
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)] on the CPU (see structured/backend.py)
    # Recorded after the copy to the GPU, which reads the (pinned) buffer until then.
    uploaded: torch.cuda.Event | None = None

    def upload(self, device: torch.device) -> torch.Tensor:
        """The bitmask on ``device``, without waiting for the device: the buffer is pinned on CUDA, and
        is refilled only after ``uploaded`` (see :meth:`StructuredOutputManager._take_buffer`)."""
        if device.type != "cuda":
            return self.bitmask
        masks = self.bitmask.to(device, non_blocking=True)
        self.uploaded = torch.cuda.Event()
        self.uploaded.record()
        return masks


class StructuredOutputManager:
    """Compiles constraints into matchers and fills bitmasks. The grammar compiler (llguidance's token
    trie, and for JSON xgrammar's tokenizer info: together about a second and a half for a 150k
    vocabulary) is built by the first constrained request, so that engines that never see one never
    pay for it."""

    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any]):
        self._config = config
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._buffer: torch.Tensor | None = None
        self._last: GrammarBitmask | None = None  # the latest bitmask made in the buffer
        # For the structured-outputs benchmark: time spent filling bitmasks.
        self.num_mask_steps = 0
        self.mask_seconds = 0.0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from nanoinfer.structured.backend import GrammarCompiler

            tokenizer = self._tokenizer()
            config = self._config
            self._compiler = GrammarCompiler(
                tokenizer, config.hf_config.vocab_size, engine_eos_token_ids(config, tokenizer)
            )
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher; ValueError naming the field when the constraint is invalid."""
        return self.compiler.compile(params)

    def bitmask(self, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        """The bitmask of (scheduled row, matcher) pairs, filled on the grammar libraries' threads."""
        started = time.perf_counter()
        result = self._take_buffer(grammars)
        self.compiler.fill_bitmasks([(grammar, i) for i, (_, grammar) in enumerate(grammars)], result.bitmask)
        self.num_mask_steps += 1
        self.mask_seconds += time.perf_counter() - started
        return result

    def _take_buffer(self, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        """The next bitmask, in the one buffer. Its previous bitmask's copy to the GPU came before the
        sampling whose tokens advanced these matchers, so the wait is for a finished copy."""
        from nanoinfer.structured.backend import allocate_token_bitmask

        previous = self._last
        if previous is not None and previous.uploaded is not None:
            previous.uploaded.synchronize()
        num_rows = len(grammars)
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = allocate_token_bitmask(
                max(num_rows, self._config.max_num_seqs),
                self.compiler.vocab_size,
                pin_memory=self._config.device == "cuda",
            )
        self._last = GrammarBitmask([row for row, _ in grammars], self._buffer[:num_rows])
        return self._last
