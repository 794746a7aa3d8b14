"""Per-request sampling options, with vLLM's names, meanings and defaults."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from nanoinfer.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (vLLM's threshold): dividing logits by them only
# amplifies rounding noise.
GREEDY_TEMPERATURE_EPS = 1e-5
# Largest number of top logprobs a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
PENALTY_RANGE = 2.0
# Bounds that keep the sampler's float32 arithmetic finite and meaningful. A nonzero probability-like
# value (top_p, min_p) must survive rounding to float32 (the smallest normal float32); a temperature or
# repetition penalty outside these bounds turns logits of ordinary size into infinities or zeros.
MIN_FLOAT32_PROBABILITY = 1.2e-38
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
MAX_TOP_K = (1 << 31) - 1
# Completions per request offline (the server's own default limit is lower, see entrypoints/server.py).
MAX_N = 1024
# logit_bias values allowed (OpenAI's range): +-100 already makes a token certain or impossible.
LOGIT_BIAS_RANGE = 100.0
_MASK64 = (1 << 64) - 1


class RequestOutputKind(Enum):
    """What the engine reports of a request and when (vLLM's names): CUMULATIVE, after every step that
    advanced it, everything so far; DELTA, after every such step, only what is new (text, token ids,
    logprobs), which streaming needs; FINAL_ONLY, once, when it finishes (offline generation), which
    lets the engine skip per-step text work."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit seed derived from ``(seed, index)`` (splitmix64), so that nearby seeds or indices give
    unrelated random streams: the seed of completion ``index`` of a request, or of its ``index``-th
    sampling step."""
    z = ((seed & _MASK64) ^ ((index + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(name: str, value: object, low: float, high: float) -> float:
    allowed = f"in [{low:g}, {high:g}]"
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if value < low or value > high:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return float(value)


def _check_probability(name: str, value: object, allow_zero: bool) -> float:
    """A probability-like field: in [0, 1] (or (0, 1]), nonzero values at least MIN_FLOAT32_PROBABILITY."""
    allowed = f"{'0 or ' if allow_zero else ''}in [{MIN_FLOAT32_PROBABILITY:g}, 1]"
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if value == 0 and allow_zero:
        return 0.0
    if not MIN_FLOAT32_PROBABILITY <= value <= 1:
        raise ValueError(
            f"{name} must be {allowed} (smaller nonzero values round to 0 in float32), got {value}"
        )
    return float(value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_optional_count(name: str, value: object, high: int) -> None:
    if value is not None and (not _is_int(value) or not 0 <= value <= high):
        raise ValueError(f"{name} must be None or an integer in [0, {high}], got {value!r}")


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction; the engine takes a snapshot at
    ``add_request``, so changing a params object afterwards does not affect running requests."""

    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 (or below 1e-5) means greedy (argmax), deterministic
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th included); 0 or -1: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the generated tokens
    # Logits of tokens seen in the prompt or the output: positive ones divided by it, negative ones
    # multiplied (so > 1 discourages repetition).
    repetition_penalty: float = 1.0
    # Makes the request's random draws reproducible whatever else runs in the same batch.
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings; normalized to a list
    stop_token_ids: list[int] | None = None  # normalized to a list
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: until the context (max_model_len) is full
    min_tokens: int = 0  # EOS, stop tokens and stop strings are ignored until this many tokens exist
    ignore_eos: bool = False
    # Top logprobs returned per generated token, plus the sampled token's own (None: no logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    # The output must follow a JSON schema, regex, choice list or grammar (see StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token id -> a bias added to its logit before any penalty or filter (vLLM's and OpenAI's
    # logit_bias). Ids are checked against the vocabulary when the request is added.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (None: all).
    allowed_token_ids: list[int] | None = None
    # Words the completion may not contain: each is banned as a token sequence (with and without a
    # leading space), by masking its last token whenever the generated tokens end with the rest of it.
    bad_words: list[str] | None = None
    # bad_words as token-id sequences, set by update_from_tokenizer (the engine calls it on add). A
    # field, not private state, so that it crosses to an engine process with the rest.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        self.temperature = _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        self.top_p = _check_probability("top_p", self.top_p, allow_zero=False)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(
                f"top_k must be -1, 0 (both disable it) or a positive integer up to {MAX_TOP_K}, "
                f"got {self.top_k!r}"
            )
        self.min_p = _check_probability("min_p", self.min_p, allow_zero=True)
        if self.temperature == 0.0:
            # The filters never change the argmax; resetting them (as vLLM does) keeps greedy rows on
            # the short path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.presence_penalty = _check_number(
            "presence_penalty", self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE
        )
        self.frequency_penalty = _check_number(
            "frequency_penalty", self.frequency_penalty, -PENALTY_RANGE, PENALTY_RANGE
        )
        self.repetition_penalty = _check_number(
            "repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE
        )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        self._check_stops()
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_optional_count("logprobs", self.logprobs, MAX_LOGPROBS)
        _check_optional_count("prompt_logprobs", self.prompt_logprobs, MAX_LOGPROBS)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be None or a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
            )
        self._check_logit_controls()
        # Read by the sampler for every row of every step: requests that only set a temperature
        # take the short path.
        self._temperature_only = not (
            self.uses_top_k
            or self.top_p < 1.0
            or self.min_p > 0.0
            or self.uses_penalties
            or self.seed is not None
            or self.logprobs is not None
            or self.min_tokens > 0
            or self.uses_logit_controls
        )

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"stop must be None, a non-empty string or a list of non-empty strings, got {stop!r}"
            )
        self.stop = list(stop)
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be None or a list of integers >= 0, got {ids!r}")
        self.stop_token_ids = list(ids)

    def _check_logit_controls(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be None or a dict of token id -> bias, got {bias!r}")
            for token_id, value in bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
                if not _is_number(value) or not math.isfinite(value) or abs(value) > LOGIT_BIAS_RANGE:
                    bound = f"{LOGIT_BIAS_RANGE:g}"
                    raise ValueError(
                        f"logit_bias values must be numbers in [-{bound}, {bound}], got {value!r} for token "
                        f"{token_id}"
                    )
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, list | tuple)
                or not allowed
                or not all(_is_int(t) and t >= 0 for t in allowed)
            ):
                raise ValueError(
                    f"allowed_token_ids must be None or a non-empty list of token ids (integers >= 0), "
                    f"got {allowed!r}"
                )
            self.allowed_token_ids = list(allowed)
        words = self.bad_words
        if words is not None:
            if isinstance(words, str):
                words = [words]
            if not isinstance(words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise ValueError(
                    f"bad_words must be None or a list of strings that are not blank, got {words!r}"
                )
            self.bad_words = list(words) or None
        ids = self.bad_words_token_ids
        if ids is not None and (
            not isinstance(ids, list)
            or not all(isinstance(w, list) and w and all(_is_int(t) and t >= 0 for t in w) for w in ids)
        ):
            raise ValueError(f"bad_words_token_ids must be None or a list of token-id lists, got {ids!r}")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenizes bad_words (vLLM's method of the same name): each word as it is (leading spaces
        stripped) and, when that gives other tokens, with one leading space, as the word reads after
        another one. Raises ValueError when a word gives no tokens."""
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            bare = word.lstrip()
            for text in (bare, " " + bare):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise ValueError(f"bad_words entry {word!r} gives no tokens")
                if ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences or None

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's clone): changing the copy's lists or dicts leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def uses_logit_controls(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words is set."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def needs_output_token_ids(self) -> bool:
        """Sampling reads the tokens generated so far (penalties count them, bad_words match their tail):
        the engine core keeps them for such requests."""
        return self.uses_penalties or bool(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def temperature_only(self) -> bool:
        """No filter, penalty, seed, logprobs, min_tokens or logit control: sampling needs nothing but the
        temperature."""
        return self._temperature_only
