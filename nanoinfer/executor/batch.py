"""The scheduler's decision as plain data for the model runner (and, under tensor parallelism, for the
worker processes), and the runner's answer: no Sequence objects, no queues."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from nanoinfer.sampling_params import SamplingParams


@dataclass(slots=True)  # one is built per sequence per step
class ScheduledRow:
    token_ids: list[int]  # tokens to compute this step (a prompt chunk, or the one decode token)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]
    sample: bool  # whether a token is sampled from the last position's logits
    params: SamplingParams
    # The rest is set only for rows whose request uses the feature (the defaults cost nothing).
    seed: int | None = None  # this completion's own seed (None: the engine's generator draws its noise)
    num_output_tokens: int = 0  # tokens generated so far; picks the seeded noise of this step
    banned_token_ids: list[int] | None = None  # below min_tokens: EOS and stop_token_ids get -inf
    penalty_prompt_ids: np.ndarray | None = None  # distinct prompt token ids, for repetition_penalty
    penalty_output_ids: np.ndarray | None = None  # the tokens generated so far, for all penalties
    # Prompt logprobs: the prompt token that follows each of the first len(...) positions of this row.
    prompt_logprob_targets: list[int] | None = None


@dataclass
class ModelInput:
    is_prefill: bool
    rows: list[ScheduledRow]


class StepInputs(NamedTuple):
    """One step's model inputs as host arrays, built once from a ModelInput by rank 0's model runner.
    Under tensor parallelism it is also what the workers receive: a few numpy arrays pickle as plain
    memory copies, and the workers need no Python pass over the rows of their own."""

    is_prefill: bool
    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]; -1: write no K/V (warm-up rows)
    query_start_loc: np.ndarray  # int32 [rows + 1]
    seq_lens: np.ndarray  # int32 [rows], context length including this step's tokens
    block_tables: np.ndarray  # int32 [rows, widest table]
    max_query_len: int
    max_seq_len: int
    sample_token_index: np.ndarray  # int64: the last token of each row that samples
    # Tokens whose logits give prompt logprobs (computing logits is a collective: every rank joins).
    prompt_logprob_token_index: np.ndarray | None = None


@dataclass
class TokenLogprobs:
    """Logprobs at consecutive positions of one row: one position for a sampled token, several for a
    chunk of prompt. Logprobs are the log-softmax of the model's raw logits (before penalties,
    temperature and filters), as vLLM returns by default."""

    token_ids: list[int]  # the sampled (or actual prompt) token at each position
    logprobs: list[float]
    ranks: list[int]  # 1 + the number of other tokens at least as likely
    top_token_ids: list[list[int]]  # the row's top-N, most likely first (empty lists when N == 0)
    top_logprobs: list[list[float]]

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs

    def slice(self, start: int, end: int) -> TokenLogprobs:
        return TokenLogprobs(
            self.token_ids[start:end],
            self.logprobs[start:end],
            self.ranks[start:end],
            self.top_token_ids[start:end],
            self.top_logprobs[start:end],
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row with ``sample`` set, in row order
    # Logprobs of the sampled rows that asked for them: position j is sampled row logprob_rows[j].
    logprobs: TokenLogprobs | None = None
    logprob_rows: list[int] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row index -> its chunk
    # Sampled rows whose sampling raised (their token id is -1), with the error: those requests fail.
    failed_rows: dict[int, str] = field(default_factory=dict)
