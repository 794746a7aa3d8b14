"""The scheduler's decision as plain data for the model runner (and, under tensor parallelism, for the
worker processes): no Sequence objects, no queues."""

from __future__ import annotations

from dataclasses import dataclass

from nanoinfer.sampling_params import SamplingParams


@dataclass
class ScheduledRow:
    token_ids: list[int]  # tokens to compute this step (a prompt chunk, or the one decode token)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]
    sample: bool  # whether a token is sampled from the last position's logits
    params: SamplingParams


@dataclass
class ModelInput:
    is_prefill: bool
    rows: list[ScheduledRow]
