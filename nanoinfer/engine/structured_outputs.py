"""The engine core's side of structured outputs: a grammar matcher per constrained request, and each
step's token bitmask of its constrained rows.

The bitmask of step n+1 depends on the token step n samples. The core therefore launches step n+1's
forward pass first, then (while the device runs it) waits for step n's tokens, advances the matchers
with them and fills step n+1's bitmask on the CPU, and only then launches step n+1's sampling with the
bitmask (``Executor.sample``). Without async scheduling the same order holds within one step.
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


class StructuredOutputManager:
    """Compiles constraints into matchers and fills bitmasks. The grammar compiler (llguidance's token
    trie, and for JSON xgrammar's tokenizer info: together about a second and a half for a 150k
    vocabulary) is built by the first constrained request, so that engines that never see one never
    pay for it."""

    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any]):
        self._config = config
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._bitmask: torch.Tensor | None = None
        # Time spent filling bitmasks, for the structured-outputs benchmark.
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
        from nanoinfer.structured.backend import allocate_token_bitmask

        started = time.perf_counter()
        compiler = self.compiler
        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            rows = max(len(grammars), self._config.max_num_seqs)
            self._bitmask = allocate_token_bitmask(rows, compiler.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        compiler.fill_bitmasks([(grammar, i) for i, (_, grammar) in enumerate(grammars)], bitmask)
        self.num_mask_steps += 1
        self.mask_seconds += time.perf_counter() - started
        return GrammarBitmask([row for row, _ in grammars], bitmask)
