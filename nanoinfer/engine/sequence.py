"""A sequence: one completion being generated, with its tokens, progress and KV block table."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from nanoinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or mid chunked prefill, or preempted
    RUNNING = auto()  # prompt fully computed; decoding
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, request_id: str = ""):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
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
