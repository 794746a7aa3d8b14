"""The OpenAI-compatible API's request models, their validation, and the response bodies.

Requests are parsed strictly (no "1" for 1, no unknown fields) so that a typo never silently changes
what is generated. Sampling fields map onto SamplingParams through SAMPLING_FIELDS: passed through
where SamplingParams implements them, accepted only at their neutral value where it does not (yet).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nanoinfer.outputs import Logprob, PositionLogprobs
from nanoinfer.sampling_params import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        if error_type is None:
            error_type = "server_error" if status_code >= 500 else "invalid_request_error"
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# -- sampling fields: passed to the engine, or neutral-only until it supports them ------------------------


@dataclass(frozen=True)
class SamplingField:
    # Values that leave the feature off; any other value needs engine support.
    neutral: tuple
    # The SamplingParams field that implements it. As soon as SamplingParams has that field, the value
    # is passed through (after ``convert``) instead of being limited to ``neutral``. None: the server
    # must also learn to return something new (echo, tool calls...).
    sampling_param: str | None
    convert: Callable[[Any], Any] | None = None


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


# Request field -> how it maps onto the engine. Fields that exist only on one endpoint (echo, suffix,
# best_of for completions; tools for chat) are checked only where they exist. logprobs is not here: its
# meaning differs between the endpoints (see each request's engine_logprobs).
SAMPLING_FIELDS: dict[str, SamplingField] = {
    "n": SamplingField((None, 1), "n"),
    "top_p": SamplingField((None, 1.0), "top_p"),
    "top_k": SamplingField((None, -1, 0), "top_k"),
    "min_p": SamplingField((None, 0.0), "min_p"),
    "seed": SamplingField((None,), "seed"),
    "presence_penalty": SamplingField((None, 0.0), "presence_penalty"),
    "frequency_penalty": SamplingField((None, 0.0), "frequency_penalty"),
    "repetition_penalty": SamplingField((None, 1.0), "repetition_penalty"),
    "stop": SamplingField((None, []), "stop", _as_list),
    "stop_token_ids": SamplingField((None, []), "stop_token_ids"),
    "min_tokens": SamplingField((None, 0), "min_tokens"),
    "logit_bias": SamplingField((None, {}), "logit_bias"),
    "skip_special_tokens": SamplingField((None, True), "skip_special_tokens"),
    "spaces_between_special_tokens": SamplingField((None, True), "spaces_between_special_tokens"),
    "include_stop_str_in_output": SamplingField((None, False), "include_stop_str_in_output"),
    "echo": SamplingField((None, False), None),
    "suffix": SamplingField((None,), None),
    "best_of": SamplingField((None, 1), None),
    "response_format": SamplingField((None, {"type": "text"}), None),
    "tools": SamplingField((None, []), None),
    "tool_choice": SamplingField((None, "none"), None),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    # True == 1 in Python; a neutral bool only matches a bool and a neutral number only a number.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _engine_sampling_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}


# -- requests ----------------------------------------------------------------------------------------------

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
PositiveInt = Annotated[int, Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far as well.
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str | None = None  # None: the first served model name
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # an end-user id for the caller's own tracking; unused

    n: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.include_usage_in_stream and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top logprobs per token (None: no logprobs at all)."""
        raise NotImplementedError

    def check_supported(self) -> None:
        """Raises APIError naming the first field set to a value the engine cannot honour yet."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        engine_fields = _engine_sampling_fields()
        for name, spec in SAMPLING_FIELDS.items():
            if name not in type(self).model_fields:
                continue
            value = getattr(self, name)
            if spec.sampling_param in engine_fields or _is_neutral(value, spec.neutral):
                continue
            allowed = " or ".join(json.dumps(n) for n in spec.neutral)
            raise APIError(
                f"{name}={json.dumps(value)} is not supported yet; use {allowed} (or leave it out)",
                param=name,
                code="unsupported_parameter",
            )

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for this request; ``max_tokens`` is already resolved."""
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": self.engine_logprobs(),
        }
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        engine_fields = _engine_sampling_fields()
        for name, spec in SAMPLING_FIELDS.items():
            value = getattr(self, name, None)
            if value is None or spec.sampling_param not in engine_fields:
                continue
            kwargs[spec.sampling_param] = spec.convert(value) if spec.convert else value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            message = str(e)
            first_word = message.split(" ", 1)[0]
            raise APIError(message, param=first_word if first_word in kwargs else None) from e


class CompletionRequest(_GenerationRequest):
    # One prompt (text or token ids) or a batch of them; each gets its own choice.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None  # top logprobs per token; 0: only the sampled token's

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a list of texts or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        return list(prompt)


class TextContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def template_input(self) -> dict[str, str]:
        """The message as chat templates expect it: content is one string."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens; wins if both
    # Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # needs logprobs=true

    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if not self.logprobs:
            if top:
                raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
            return None
        return top or 0


def parse_request(model_cls: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
    """Parses a JSON body into ``model_cls``; any problem becomes a 400 APIError naming the field."""
    try:
        request = model_cls.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    request.check_supported()
    return request


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = [str(part) for part in err["loc"]]
    kind = err["type"]
    if kind == "json_invalid":
        return APIError(f"the request body is not valid JSON: {err['msg']}")
    if not loc:
        return APIError(f"the request body must be a JSON object: {err['msg']}")
    field_path = ".".join(loc)
    param = loc[0]
    if kind == "extra_forbidden":
        return APIError(f"unrecognized request field `{field_path}`", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(f"missing required field `{field_path}`", param=param)
    return APIError(f"invalid value for `{field_path}`: {err['msg']}", param=param)


# -- responses ---------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, str], finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# decode(token_id, logprob) -> the token's text, as shown in logprobs.
TokenDecoder = Callable[[int, Logprob], str]


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], decode: TokenDecoder, text_offset: int
) -> dict[str, list]:
    """The legacy /v1/completions logprobs object; ``text_offset`` is where the first token starts.

    top_logprobs maps each token's text to its logprob, for the top tokens plus the sampled one.
    """
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs, strict=True):
        token = decode(token_id, position[token_id])
        body["tokens"].append(token)
        body["token_logprobs"].append(position[token_id].logprob)
        body["top_logprobs"].append({decode(t, lp): lp.logprob for t, lp in position.items()})
        body["text_offset"].append(text_offset)
        text_offset += len(token)
    return body


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], decode: TokenDecoder, num_top: int
) -> dict[str, list]:
    """The chat logprobs object: per token its text, logprob, UTF-8 bytes and the ``num_top`` most likely."""

    def entry(token_id: int, logprob: Logprob) -> dict[str, Any]:
        token = decode(token_id, logprob)
        return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode())}

    content = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        ranked = sorted(
            ((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda item: item[1].rank,
        )
        content.append(
            {**entry(token_id, position[token_id]), "top_logprobs": [entry(t, lp) for t, lp in ranked]}
        )
    return {"content": content}


def response_body(
    object_type: str,
    response_id: str,
    created: int,
    model: str,
    choices: list[dict],
    usage_stats: dict | None,
) -> dict[str, Any]:
    """A whole response or one stream chunk: the envelope is the same, ``object`` tells them apart."""
    return {
        "id": response_id,
        "object": object_type,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_stats,
    }


def model_card(name: str, root: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "nanoinfer",
        "root": root,
        "max_model_len": max_model_len,
    }


def sse_event(data: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
