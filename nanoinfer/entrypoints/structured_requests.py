"""The server's structured outputs, tools and reasoning: what a request's fields ask of the engine (one
constraint), and how an output's text becomes an OpenAI message (reasoning_content, content,
tool_calls), whole or as streaming deltas.

Request fields, at most one of which constrains the output:

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs`` object (StructuredOutputsParams' fields) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- ``tool_choice`` ``"required"`` or a named function (chat only): the Hermes-format calls of
  ``structured/tools.py``, which always parse.

``tool_choice`` ``"auto"`` (the default when ``tools`` are given) constrains nothing: the output is
parsed for calls, which needs the server's ``--enable-auto-tool-choice --tool-call-parser hermes``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from nanoinfer.entrypoints.openai_protocol import APIError
from nanoinfer.entrypoints.reasoning_parsers import (
    THINK_END,
    THINK_START,
    Qwen3ReasoningParser,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
)
from nanoinfer.entrypoints.tool_parsers import HermesToolParser
from nanoinfer.structured.params import ReasoningSpan, StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
REASONING_PARSERS = ("qwen3",)
# vLLM's pre-structured_outputs names, and the StructuredOutputsParams field each one sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


@dataclass(frozen=True)
class ToolOptions:
    """The server's settings: vLLM's --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser hermes)")


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(str(e), param=field) from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError('response_format must be an object with a "type"', param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    if kind != "json_schema":
        raise APIError(
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
            param="response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(
            'response_format.json_schema must be an object with a "schema" object',
            param="response_format",
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError("response_format.json_schema.name must be a string", param="response_format")
    return _params("response_format", json=spec["schema"])


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise APIError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise APIError(
            f"structured_outputs has unsupported field(s) {unknown}; the fields are "
            f"{list(_STRUCTURED_OUTPUTS_KEYS)}",
            param="structured_outputs",
        )
    return _params("structured_outputs", **value)


def request_constraint(request: Any, special_tokens: Collection[str]) -> StructuredOutputsParams | None:
    """The one constraint a completion or chat request asks for, or None. APIError (400) names the
    field when a constraint is invalid or two are given."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        params = _response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    structured = getattr(request, "structured_outputs", None)
    if structured is not None:
        found.append(("structured_outputs", _structured_outputs(structured)))
    for field, name in GUIDED_FIELDS.items():
        value = getattr(request, field, None)
        if value is not None:
            found.append((field, _params(field, **{name: value})))
    tools = getattr(request, "tools", None)
    tool_choice = getattr(request, "tool_choice", None)
    if tools or tool_choice is not None:
        if not tools and tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        from nanoinfer.structured.tools import tool_call_constraint  # llguidance, on first use

        try:
            params = tool_call_constraint(tools, tool_choice, special_tokens)
        except ValueError as e:
            raise APIError(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
        if params is not None:
            found.append(("tool_choice", params))
    if len(found) > 1:
        fields = " and ".join(field for field, _ in found)
        raise APIError(f"only one output constraint may be given, got {fields}", param=found[1][0])
    return found[0][1] if found else None


def reasoning_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` where the tokenizer has each as one token (Qwen3's has),
    else None."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    if all(len(tag_ids) == 1 for tag_ids in ids):
        return ids[0][0], ids[1][0]
    return None


def constrain_after_reasoning(
    constraint: StructuredOutputsParams | None, think_token_ids: tuple[int, int] | None, prompt: str
) -> StructuredOutputsParams | None:
    """With a reasoning parser, a chat request's constraint applies to the answer after the reasoning
    (vLLM's behaviour): the reasoning stays free. Unchanged where the tokenizer has no single
    ``<think>`` / ``</think>`` tokens (``think_token_ids`` None: the gate works on token ids), or where
    the prompt closed the reasoning (the answer comes first)."""
    if constraint is None or think_token_ids is None or prompt_closes_reasoning(prompt):
        return constraint
    span = ReasoningSpan(*think_token_ids, opened=prompt_opens_reasoning(prompt))
    return dataclasses.replace(constraint, reasoning=span)


def effective_tool_choice(request: Any) -> str | dict | None:
    """OpenAI's default: "auto" when tools are given, else "none"."""
    tool_choice = getattr(request, "tool_choice", None)
    if tool_choice is None:
        return "auto" if getattr(request, "tools", None) else "none"
    return tool_choice


class ChatOutputParser:
    """How the outputs of one chat request become messages: the reasoning split off (with a reasoning
    parser), then tool calls parsed out of the content (with tool_choice "auto" and the server's tool
    parser, or "required" / a named function, whose constraint makes the output calls)."""

    def __init__(self, request: Any, options: ToolOptions, prompt: str):
        self.reasoning = (
            Qwen3ReasoningParser(prompt_opens_reasoning(prompt)) if options.reasoning_parser else None
        )
        tool_choice = effective_tool_choice(request)
        if tool_choice == "auto" and getattr(request, "tools", None):
            if not options.enable_auto_tool_choice:
                raise APIError(
                    '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                    "--tool-call-parser",
                    param="tool_choice",
                )
            self.tools = HermesToolParser()
        elif tool_choice not in ("none", "auto"):
            self.tools = HermesToolParser()
        else:
            self.tools = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole output and the choice's finish_reason."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tools is not None and content:
            content, calls = self.tools.extract_tool_calls(content)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        return message, finish_reason

    def stream(self) -> ChatStreamParser:
        return ChatStreamParser(self)


class ChatStreamParser:
    """One choice's streaming deltas: ``feed(text)`` and ``finish()`` return delta dicts
    (``reasoning_content``, ``content`` or ``tool_calls``), in output order."""

    def __init__(self, parser: ChatOutputParser):
        self._reasoning = parser.reasoning.streaming() if parser.reasoning is not None else None
        self._tools = parser.tools.streaming() if parser.tools is not None else None

    @property
    def tools_called(self) -> bool:
        return self._tools is not None and bool(self._tools.tool_calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(*self._split(text, final=False), final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(*self._split("", final=True), final=True)

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self._reasoning is None:
            return None, text
        if not final:
            return self._reasoning.feed(text)
        return self._reasoning.finish()

    def _deltas(self, reasoning: str | None, content: str | None, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        if self._tools is None:
            if content:
                deltas.append({"content": content})
            return deltas
        if content:
            deltas += self._tools.feed(content)
        if final:
            deltas += self._tools.finish()
        return deltas
