"""The constraint behind ``tool_choice="required"`` and a named ``tool_choice``: the output is one or more
tool calls in the Hermes / Qwen format, each with arguments that follow its tool's parameter schema.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Calls are separated by one newline. Where the tokenizer has ``<tool_call>`` and ``</tool_call>`` as
special tokens (Qwen3 has), the constraint allows the token as well as the text (pass
``GrammarCompiler.special_tokens``): models emit the token. The JSON uses the separators ``", "`` and
``": "`` (what the chat templates of these models render, so what they were trained on) and no other
whitespace; the envelope is fixed text, so ``HermesToolParser`` (entrypoints/tool_parsers.py) parses
every constrained output.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection
from typing import Any

import llguidance

from nanoinfer.structured.backend import json_string
from nanoinfer.structured.params import MAX_GRAMMAR_BYTES, StructuredOutputsParams

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def validate_tools(tools: object) -> list[dict[str, Any]]:
    """Checks OpenAI's ``tools`` list; returns each tool's ``function`` object. ValueError names the field."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of tools, got {tools!r:.80}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools must have at most {MAX_TOOLS} entries, got {len(tools)}")
    functions = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where} must be an object with "type": "function", got {tool!r:.80}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object, got {function!r:.80}")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise ValueError(
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                f"got {name!r:.80}"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is used by two tools")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string, got {description!r:.80}")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(
                    f"{where}.function.parameters must be a JSON schema object, got {parameters!r:.80}"
                )
            if parameters.get("type", "object") != "object":
                raise ValueError(
                    f'{where}.function.parameters must describe an object ("type": "object"), '
                    f"got type {parameters['type']!r}"
                )
        functions.append(function)
    return functions


def tool_call_constraint(
    tools: object, tool_choice: object, special_tokens: Collection[str] = ()
) -> StructuredOutputsParams | None:
    """The constraint that enforces ``tool_choice``, or None when it constrains nothing.

    ``tool_choice``: None, "none" or "auto" (no constraint: the model decides; "auto" output is parsed
    with HermesToolParser), "required" (one or more calls, of any of the tools), or
    ``{"type": "function", "function": {"name": NAME}}`` (exactly one call of that tool). ``tools`` is
    validated whenever it is non-empty. ValueError names ``tools`` or ``tool_choice``.
    ``special_tokens``: ``GrammarCompiler.special_tokens`` of the tokenizer the constraint is for.
    """
    # An empty list is the OpenAI clients' way of sending no tools.
    functions = validate_tools(tools) if tools else None
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if isinstance(tool_choice, str):
        if tool_choice != "required":
            raise ValueError(
                f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r:.80}'
            )
        if functions is None:
            raise ValueError('tool_choice "required" needs tools')
        chosen = functions
        start = 'start: tool_call ("\\n" tool_call)*'
    else:
        name = _named_choice(tool_choice)
        if functions is None:
            raise ValueError(f"tool_choice names function {name!r} but no tools were given")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            known = ", ".join(repr(f["name"]) for f in functions)
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools ({known})")
        start = "start: tool_call"
    calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
    opening, closing = _tag(TOOL_CALL_START, special_tokens), _tag(TOOL_CALL_END, special_tokens)
    rules = [start, f'tool_call: {opening} "\\n" ({calls}) "\\n" {closing}']
    for i, function in enumerate(chosen):
        index = functions.index(function)
        schema = _arguments_schema(function, index)
        envelope = json_string(
            '{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": '
        )
        rules.append(f'call_{i}: {envelope} arguments_{i} "}}"')
        rules.append(f"arguments_{i}: %json {schema}")
    grammar = "\n".join(rules) + "\n"
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(
            f"tools: the parameter schemas of the chosen tools are too large for one constraint "
            f"({size} bytes, at most {MAX_GRAMMAR_BYTES})"
        )
    return StructuredOutputsParams(grammar=grammar)


def _tag(tag: str, special_tokens: Collection[str]) -> str:
    """The Lark expression for ``tag``: its text, or also its special token where it is one."""
    return f"({json_string(tag)} | {tag})" if tag in special_tokens else json_string(tag)


def _named_choice(tool_choice: object) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r:.120}'
        )
    return name


def _arguments_schema(function: dict[str, Any], index: int) -> str:
    """The tool's parameter schema as JSON text for ``%json``, with the whitespace layout set, checked
    by llguidance (so a bad schema is reported as the tool's, not as the grammar's)."""
    parameters = function.get("parameters")
    schema = copy.deepcopy(parameters) if parameters else dict(_NO_PARAMETERS)
    schema.setdefault("type", "object")
    schema["x-guidance"] = dict(_JSON_LAYOUT)
    field = f"tools[{index}].function.parameters"
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{field} is not serializable as JSON: {e}") from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    except ValueError as e:  # its JSON parser's nesting limit (128 levels)
        raise ValueError(f"{field} is invalid: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(
            f"{field} is invalid: {messages[0].splitlines()[0] if messages else 'unknown error'}"
        )
    return text
