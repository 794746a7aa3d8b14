"""Text, messages or token ids in; validated, tokenized EngineRequests out (one per completion)."""

from __future__ import annotations

import dataclasses
import inspect
import random
import time
from dataclasses import dataclass
from typing import Any

from nanoinfer.config import EngineConfig
from nanoinfer.engine.request import EngineRequest, engine_eos_token_ids
from nanoinfer.engine.structured_outputs import StructuredOutputManager
from nanoinfer.sampling_params import SamplingParams, derive_seed

PromptType = str | list[int] | dict

# How content given as a list of parts reaches the chat template (vLLM's chat_template_content_format):
# "string" joins the text parts with newlines (what the built-in architectures' templates expect; "auto"
# does the same), "openai" passes the list of text parts as it is.
CHAT_CONTENT_FORMATS = ("auto", "string", "openai")


def completion_seed(seed: int, index: int) -> int:
    """Completion 0 uses the request's seed as is (so n=1 and n>1 agree on it); the others derive theirs.
    Negative indices: distinct from the seeds derived from it elsewhere (index >= 0). The result is the
    seed's 64 bits as a signed int64 (any Python int is a valid seed)."""
    value = (seed if index == 0 else derive_seed(seed, -index)) & ((1 << 64) - 1)
    return value - (1 << 64) if value >= 1 << 63 else value


def text_only_content(content: Any, where: str, content_format: str = "string") -> str | list[dict]:
    """A message's content as the chat template gets it: a string, None as "", or a list of parts of
    which only text parts are allowed (the models take text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise ValueError(f"{where} must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if kind is None:
                raise ValueError(f"{where}[{i}] must be a content part with a 'type', got {part!r}")
            raise ValueError(f"this model takes text only: content parts of type {kind} are not supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{i}] is a text part without a 'text' string")
        texts.append(text)
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(texts)


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
    content_format: str = "auto",
) -> tuple[str, list[int]]:
    """A conversation through the chat template (the tokenizer's, or ``chat_template``): the prompt text
    and its token ids. The template writes every special token the model expects, so the text is
    tokenized without adding any."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if content_format not in CHAT_CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {CHAT_CONTENT_FORMATS}, got {content_format!r}"
        )
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation must be a non-empty list of messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' string, got {message!r}")
        content = text_only_content(message.get("content"), f"messages[{i}].content", content_format)
        conversation.append({**message, "content": content})
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if reserved:
        raise ValueError(f"chat_template_kwargs may only hold template variables; {reserved} are not allowed")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; pass chat_template")
    text = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **kwargs,
    )
    return text, list(tokenizer.encode(text, add_special_tokens=False))


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The core's id of completion ``index`` of a request of ``n`` completions."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a validated snapshot
    children: list[EngineRequest]  # one per completion, in completion order
    arrival_time: float


def check_prompt_token_ids(ids: Any, vocab_size: int) -> list[int]:
    """``ids`` as a list, or ValueError unless they are integers in [0, vocab_size)."""
    # The common case (plain ints) is checked by C loops: this runs for every token of every prompt.
    if not isinstance(ids, list | tuple) or (
        set(map(type, ids)) - {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ValueError("prompt_token_ids must be a list of integers")
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    return list(ids)


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        num_kv_blocks: int,
        structured_outputs: StructuredOutputManager | None = None,
    ):
        """``structured_outputs``: the engine core's, when it runs in this process (one grammar compiler
        serves both); otherwise the frontend builds its own to check constraints as they arrive."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = engine_eos_token_ids(config, tokenizer)
        # Seeds of requests that name none: every request samples from noise of its own seed.
        self._seeds = random.Random(config.seed)
        self.structured_outputs = structured_outputs or StructuredOutputManager(config, lambda: tokenizer)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        return check_prompt_token_ids(ids, self.vocab_size)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Validates and tokenizes a request; raises ValueError naming what is wrong. Without
        ``params`` the request gets the engine's default sampling parameters (generation_config)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = params if params is not None else self.config.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        # A validated snapshot: the caller may reuse or change its object while this request runs.
        params = dataclasses.replace(params)
        self._check_logit_controls(params)
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, more than max_model_len={max_len} "
                "(the maximum context length)"
            )
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}); got {bad_stops[:5]}")
        self._check_kv_fit(len(token_ids), params)
        if params.structured_outputs is not None:
            # Compiled here too, so that an invalid constraint is the caller's ValueError (a 400 on the
            # server) rather than a failed request later; the core compiles its own matcher.
            self.structured_outputs.validate(params.structured_outputs)
        arrival_time = time.time() if arrival_time is None else arrival_time
        n = params.n
        if params.seed is not None:
            seeds = [completion_seed(params.seed, i) for i in range(n)]
        else:
            seeds = [self._seeds.getrandbits(63) for _ in range(n)]
        eos = () if params.ignore_eos else self.eos_token_ids
        block_size = self.config.kvcache_block_size
        # Siblings wait for the first completion's prompt blocks only if there are full blocks to share.
        shareable = self.config.enable_prefix_caching and (len(token_ids) - 1) // block_size > 0
        leader = child_request_id(request_id, 0, n) if shareable else None
        children = [
            EngineRequest(
                request_id=child_request_id(request_id, i, n),
                prompt_token_ids=token_ids,
                params=params,
                seed=seeds[i],
                eos_token_ids=eos,
                leader_id=leader if i > 0 else None,
                arrival_time=arrival_time,
            )
            for i in range(n)
        ]
        # The first completion computes the prompt logprobs; the others need none.
        for child in children[1:]:
            if params.prompt_logprobs is not None:
                child.params = dataclasses.replace(params, prompt_logprobs=None)
        return ProcessedRequest(request_id, text, token_ids, params, children, arrival_time)

    def _check_logit_controls(self, params: SamplingParams) -> None:
        """Token ids of logit_bias and allowed_token_ids must be the model's; bad_words are tokenized."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
        params.update_from_tokenizer(self.tokenizer)
        if params.bad_words_token_ids:
            bad = [t for word in params.bad_words_token_ids for t in word if t >= vocab]
            if bad:
                raise ValueError(f"bad_words give token ids outside the model's [0, {vocab}): {bad[:5]}")

    def _check_kv_fit(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Every token that ever needs K/V (all but the last sampled one) must fit in the whole pool."""
        max_len = self.config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len
        kv_tokens = min(num_prompt_tokens + max_tokens - 1, max_len)
        block_size = self.config.kvcache_block_size
        needed = -(-kv_tokens // block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({kv_tokens} tokens) but the KV cache holds only "
                f"{self.num_kv_blocks} blocks of {block_size} tokens; shorten the prompt or max_tokens"
            )
