"""A sequence: one completion being generated, with its tokens, progress and KV block table."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

import numpy as np

from nanoinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or mid chunked prefill, or preempted
    RUNNING = auto()  # prompt fully computed; decoding
    FINISHED = auto()


class TokenArray:
    """An append-only int64 array (amortized O(1) append) whose filled part is a numpy view."""

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


class Sequence:
    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        request_id: str = "",
        index: int = 0,
        seed: int | None = None,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.seed = seed  # this completion's own seed (each of n siblings differs), or None
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # Tokens whose K/V are in the cache (from the prefix cache or computed in earlier steps).
        self.num_computed_tokens = 0
        # Tokens to compute in the current step (a chunk of the prompt, or the one decode token).
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        # Prompt tokens served by the prefix cache at first allocation; -1 until allocated.
        self.num_cached_prompt_tokens = -1
        self.finish_reason: str | None = None
        # While set, the block manager must not serve this sequence's prompt from the prefix cache: its
        # prompt logprobs need the logits of every prompt position.
        self.skip_prefix_cache = False
        # Penalties read the generated tokens every step; a numpy copy kept up to date avoids rebuilding one
        # from the token list each time. Repetition penalty also needs the prompt's distinct tokens.
        self.output_token_array = TokenArray() if params.uses_penalties else None
        self.distinct_prompt_ids = np.unique(token_ids) if params.repetition_penalty != 1.0 else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled: the rest of the
        prompt (or of everything, after a preemption) in prefill, exactly 1 in decode."""
        return self.num_tokens - self.num_computed_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_blocks(self) -> int:
        return self.num_blocks_for(self.num_tokens)

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.output_token_array is not None:
            self.output_token_array.append(token_id)
