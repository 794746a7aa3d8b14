"""What the engine core knows of one sequence: its token ids, how many are computed, its KV blocks.

The core works in token ids only. One user request with ``n`` completions is ``n`` core requests (the
frontend fans it out and gathers the outputs), each with its own seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import numpy as np

from nanoinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine.grammar_process import RemoteGrammar
    from nanoinfer.structured.backend import Grammar


def engine_eos_token_ids(config: EngineConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a sequence: the tokenizer's EOS (None: no tokenizer at hand), and the
    ``eos_token_id`` (one id or a list) of the model config and of the generation config."""
    ids: set[int] = set(config.generation_eos_token_ids)  # generation_config.json's
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config.hf_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


@dataclass
class EngineRequest:
    """A validated, tokenized request, as the frontend hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The noise seed of this completion (every request has one: the frontend draws it when the user gave
    # none), so that its samples do not depend on what else is batched.
    seed: int
    # Ending tokens: EOS (unless ignore_eos) and the request's stop_token_ids.
    eos_token_ids: tuple[int, ...] = ()
    # Another request of the same user request whose prompt this one waits for, so that it finds the
    # prompt's blocks in the prefix cache instead of computing them again (n > 1).
    leader_id: str | None = None
    arrival_time: float = 0.0


class RequestStatus(Enum):
    WAITING = auto()  # queued, preempted, or waiting for its leader
    WAITING_FOR_GRAMMAR = auto()  # queued while its structured-outputs constraint compiles
    RUNNING = auto()  # scheduled at least once since it was (re)admitted: prefill chunks or decode
    FINISHED = auto()


class Request:
    """The core's state of one sequence. ``num_computed_tokens`` counts tokens whose K/V is in the cache
    or being written by a step already launched; ``num_pending`` counts tokens sampled by launched steps
    whose ids the host does not know yet (async scheduling): the sequence is ``num_tokens + num_pending``
    long."""

    __slots__ = (
        "request_id",
        "params",
        "seed",
        "eos_token_ids",
        "stop_token_ids",
        "leader_id",
        "arrival_time",
        "arrival_index",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_pending",
        "block_ids",
        "num_cached_blocks",
        "num_cached_prompt_tokens",
        "status",
        "finish_reason",
        "stop_reason",
        "skip_prefix_cache",
        "output_token_array",
        "distinct_prompt_ids",
        "min_tokens_banned_ids",
        "allowed_token_set",
        "grammar",
    )

    def __init__(
        self,
        engine_request: EngineRequest,
        arrival_index: int,
        grammar: Grammar | RemoteGrammar | None = None,
        waits_for_grammar: bool = False,
    ):
        params = engine_request.params
        self.request_id = engine_request.request_id
        self.params = params
        self.seed = engine_request.seed
        self.eos_token_ids = frozenset(engine_request.eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.leader_id = engine_request.leader_id
        self.arrival_time = engine_request.arrival_time
        self.arrival_index = arrival_index
        self.token_ids = list(engine_request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_cached_prompt_tokens = -1  # prompt tokens served by the prefix cache; -1: not admitted yet
        self.status = RequestStatus.WAITING_FOR_GRAMMAR if waits_for_grammar else RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Prompt logprobs need the logits of every prompt position: no prefix-cache hits for the prompt.
        self.skip_prefix_cache = params.prompt_logprobs is not None
        # Penalties and bad_words read the generated tokens every step: a numpy copy kept up to date.
        self.output_token_array = _TokenArray() if params.needs_output_token_ids else None
        self.distinct_prompt_ids = np.unique(self.token_ids) if params.repetition_penalty != 1.0 else None
        banned = self.eos_token_ids | self.stop_token_ids
        self.min_tokens_banned_ids = sorted(banned) if params.min_tokens else []
        allowed = params.allowed_token_ids
        self.allowed_token_set = frozenset(allowed) if allowed is not None else None
        # The matcher of a structured-outputs request (set once compiled), advanced by every token it
        # accepts.
        self.grammar = grammar

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids the host knows (prompt + generated)."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, including those sampled but not yet known on the host."""
        return len(self.token_ids) - self.num_prompt_tokens + self.num_pending

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_token_array is not None:
            self.output_token_array.append(token_id)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size : (index + 1) * block_size]


class _TokenArray:
    """An append-only int64 array (amortized O(1) append) whose filled part is a numpy view."""

    __slots__ = ("_data", "_size")

    def __init__(self, capacity: int = 64):
        self._data = np.empty(capacity, dtype=np.int64)
        self._size = 0

    def append(self, token_id: int) -> None:
        if self._size == len(self._data):
            self._data = np.concatenate([self._data, np.empty_like(self._data)])
        self._data[self._size] = token_id
        self._size += 1

    def view(self) -> np.ndarray:
        return self._data[: self._size]
