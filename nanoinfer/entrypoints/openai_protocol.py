"""The OpenAI-compatible API's request models, their validation, and the response bodies.

Requests are parsed strictly (no "1" for 1, no unknown fields) so that a typo never silently changes
what is generated. Sampling fields map onto SamplingParams through SAMPLING_FIELDS: passed through
where SamplingParams implements them, accepted only at their neutral value where it does not (yet).
Fields that change nothing here (``user``, ``store``, ``metadata``, ``parallel_tool_calls``...) are
accepted with any value of their type.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
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


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
    converted = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(
                f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                param="logit_bias",
            )
        converted[int(key)] = value
    return converted


# Request field -> how it maps onto the engine. Fields that exist only on one endpoint (suffix, best_of
# for completions; tools for chat) are checked only where they exist. logprobs is not here: its meaning
# differs between the endpoints (see each request's engine_logprobs); nor is echo, which the server
# implements itself. Rows with no sampling_param are OpenAI (or vLLM) features that would change the
# result and that nanoinfer does not have: only their neutral values are accepted.
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
    "logit_bias": SamplingField((None, {}), "logit_bias", _token_id_keys),
    "allowed_token_ids": SamplingField((None,), "allowed_token_ids"),
    "bad_words": SamplingField((None, []), "bad_words"),
    "skip_special_tokens": SamplingField((None, True), "skip_special_tokens"),
    "spaces_between_special_tokens": SamplingField((None, True), "spaces_between_special_tokens"),
    "include_stop_str_in_output": SamplingField((None, False), "include_stop_str_in_output"),
    "suffix": SamplingField((None,), None),
    "best_of": SamplingField((None, 1), None),
    "functions": SamplingField((None, []), None),
    "function_call": SamplingField((None, "none"), None),
    "service_tier": SamplingField((None, "auto", "default"), None),
    "modalities": SamplingField((None, ["text"]), None),
    "audio": SamplingField((None,), None),
    "reasoning_effort": SamplingField((None,), None),
    "web_search_options": SamplingField((None,), None),
    "priority": SamplingField((None, 0), None),
    "truncate_prompt_tokens": SamplingField((None,), None),
    "use_beam_search": SamplingField((None, False), None),
    "length_penalty": SamplingField((None, 1.0), None),
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
    # Accepted with any value: they change nothing that is generated here. An end-user id and a safety
    # id for the caller's own tracking; OpenAI's storing of completions and its metadata for them
    # (nothing is stored); a prompt-caching hint (the prefix cache needs none).
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    # OpenAI's and vLLM's features nanoinfer does not have: neutral values only (see SAMPLING_FIELDS).
    service_tier: str | None = None
    priority: int | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None

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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Output constraints (entrypoints/structured_requests.py: at most one per request): OpenAI's
    # response_format, vLLM's structured_outputs object, and vLLM's older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams for this request; ``max_tokens`` is already resolved. Fields the
        request leaves out take ``defaults`` (the model's generation config: SamplingParams keywords)."""
        kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k != "max_tokens"}
        kwargs.update(max_tokens=max_tokens, ignore_eos=self.ignore_eos, logprobs=self.engine_logprobs())
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
    echo: bool | None = None  # the prompt before the completion, in text and logprobs (vLLM's meaning)
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


class ContentPart(BaseModel):
    """One part of a message's content. Only text parts are supported; the others (image_url,
    input_audio, file...) parse, so that check_supported can name their type in a clear error."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None


class FunctionCallMessage(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text of an object


class ToolCallMessage(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallMessage

    def template_input(self) -> dict[str, Any]:
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError(
                f"tool_calls[].function.arguments must be the JSON text of an object, got "
                f"{self.function.arguments!r:.80}",
                param="messages",
            )
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls (OpenAI's shape: id, type, function {name, arguments}), and the id of
    # the call a tool message answers.
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    # A reasoning parser's split of an earlier assistant turn, as clients send it back: not shown to the
    # template (Qwen3's drops earlier turns' reasoning too).
    reasoning_content: str | None = None

    def check_text_only(self, index: int) -> None:
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            if part.type != "text":
                raise APIError(
                    f"this model takes text only: content parts of type {part.type} are not supported "
                    f"(messages[{index}].content[{i}])",
                    param="messages",
                    code="unsupported_content_type",
                )
            if part.text is None or set(part.model_extra or ()):
                raise APIError(
                    f"messages[{index}].content[{i}]: a text part has exactly the fields type and text",
                    param="messages",
                )

    def template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: content is one string; a call's arguments are an
        object (what the templates render with tojson), not OpenAI's JSON text."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _check_messages(request: ChatCompletionRequest | TokenizeChatRequest) -> None:
    """What a chat request and a chat /tokenize request check alike: text-only messages, and a prompt
    that either opens the assistant's turn or continues the final message."""
    for i, message in enumerate(request.messages):
        message.check_text_only(i)
    if request.add_generation_prompt and request.continue_final_message:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name for max_tokens; wins if both
    # Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # needs logprobs=true
    # vLLM's: the prompt ends with the assistant's turn opened, or continues the final message.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Whether several tool calls may come at once: accepted, and not enforced (tool_choice "required"
    # allows one or more calls, "auto" parses all the model writes).
    parallel_tool_calls: bool | None = None
    # Predicted outputs only speed up generating text close to the prediction; the text is the same.
    prediction: dict[str, Any] | None = None

    # Passed to the chat template; tool_choice "required" or a named function constrains the output to
    # calls, "auto" parses calls out of it (see entrypoints/structured_requests.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def check_supported(self) -> None:
        _check_messages(self)
        super().check_supported()

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


class TokenizeCompletionRequest(BaseModel):
    """vLLM's POST /tokenize with a prompt."""

    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's POST /tokenize with messages: the prompt the chat template renders from them."""

    model_config = _STRICT
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        _check_messages(self)


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def parse_body(model_cls: type[BaseModel], body: bytes) -> BaseModel:
    """Parses a JSON body into ``model_cls`` (then runs its check_supported, if it has one); any
    problem becomes a 400 APIError naming the field."""
    try:
        request = model_cls.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    check = getattr(request, "check_supported", None)
    if check is not None:
        check()
    return request


def parse_request(model_cls: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
    """:func:`parse_body` for the generation endpoints."""
    return parse_body(model_cls, body)


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
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict | None = None,
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``message``: the assistant message when a parser split the text (reasoning, tool calls)."""
    return {
        "index": index,
        "message": message if message is not None else {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# A logprob of -inf (a token masked out by a constraint, say) has no JSON number: vLLM sends this instead.
MIN_JSON_LOGPROB = -9999.0


def _json_logprob(logprob: float) -> float:
    return logprob if logprob > MIN_JSON_LOGPROB else MIN_JSON_LOGPROB


# decode(token_id, logprob) -> the token's text, as shown in logprobs (logprob None: decode the id).
TokenDecoder = Callable[[int, Logprob | None], str]


def completion_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs | None], decode: TokenDecoder, text_offset: int
) -> dict[str, list]:
    """The legacy /v1/completions logprobs object; ``text_offset`` is where the first token starts.

    top_logprobs maps each token's text to its logprob, for the top tokens plus the sampled one. A None
    position (the first prompt token, echoed) has None for both.
    """
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, logprobs, strict=True):
        if position is None:  # the first prompt token (echo): nothing comes before it
            token = decode(token_id, None)
            body["tokens"].append(token)
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            body["text_offset"].append(text_offset)
            text_offset += len(token)
            continue
        token = decode(token_id, position[token_id])
        body["tokens"].append(token)
        body["token_logprobs"].append(_json_logprob(position[token_id].logprob))
        body["top_logprobs"].append({decode(t, lp): _json_logprob(lp.logprob) for t, lp in position.items()})
        body["text_offset"].append(text_offset)
        text_offset += len(token)
    return body


def chat_logprobs(
    token_ids: list[int], logprobs: list[PositionLogprobs], decode: TokenDecoder, num_top: int
) -> dict[str, list]:
    """The chat logprobs object: per token its text, logprob, UTF-8 bytes and the ``num_top`` most likely."""

    def entry(token_id: int, logprob: Logprob) -> dict[str, Any]:
        token = decode(token_id, logprob)
        return {"token": token, "logprob": _json_logprob(logprob.logprob), "bytes": list(token.encode())}

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


def tokenize_response(
    token_ids: list[int], max_model_len: int, token_strs: list[str] | None = None
) -> dict[str, Any]:
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
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


def sse_event(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object (compact, UTF-8). msgspec encodes it straight to
    bytes, several times faster than json.dumps and a str encode: one event per request per step."""
    return b"data: " + _json_encoder.encode(data) + b"\n\n"


_json_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
