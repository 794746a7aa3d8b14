"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability (log-softmax of the model's raw logits, before penalties,
    temperature and top-k/top-p/min-p: vLLM's default "raw logprobs")."""

    logprob: float
    rank: int | None = None  # 1 + the number of other tokens at least as likely (1: the most likely)
    decoded_token: str | None = None


# One position's logprobs: the sampled (or actual prompt) token, then the top-N, most likely first.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    # What stopped it with finish_reason "stop": the stop string, or the stop_token_ids entry; None for
    # EOS (and for the other finish reasons).
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None without logprobs
    logprobs: list[PositionLogprobs] | None = None  # one entry per generated token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (wall-clock seconds, time.time()), as vLLM reports them."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False  # all n completions are finished
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # With prompt_logprobs: None for the first prompt token, then one entry per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Why the request failed (its completions then have finish_reason "error"); None if it did not.
    # A failure is the request's own: the engine goes on with the others.
    error: str | None = None
    # The failure is the request's input's (its constraint hit a grammar limit, or its restrictions
    # excluded every token), not the engine's.
    invalid_input: bool = False
    metrics: RequestMetrics | None = None
