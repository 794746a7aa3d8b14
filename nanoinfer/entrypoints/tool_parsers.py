"""Tool calls in model output, in the Hermes / Qwen format (vLLM's ``--tool-call-parser hermes``):

    Some text.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call is ``<tool_call>``, a JSON object whose keys are exactly ``"name"`` (a string) then
``"arguments"`` (an object), optional whitespace, and ``</tool_call>`` (which may be missing at the very
end of the output). Its ``arguments`` are passed on as the exact text the model wrote. Text outside
calls is content, less the whitespace before a call and the whitespace that ends the output after a
call; a malformed call stays in the content as it was written.

``HermesToolParser.extract_tool_calls`` parses a whole output; ``HermesToolParser.streaming()`` returns
a parser fed text deltas that produces OpenAI's streaming deltas (``content``, and ``tool_calls``
entries: index, id, type and name first, then argument fragments), which the ``openai`` client
assembles into the same calls. For every well-formed output, however it is split into deltas, the
assembled stream equals the whole-output parse. A call is committed once ``<tool_call>{"name": ...,
"arguments": {`` has been seen: if it is malformed after that point (the model broke the JSON or
stopped inside it), what was streamed cannot be taken back, while the whole-output parse turns it into
content.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from nanoinfer.entrypoints.reasoning_parsers import partial_suffix

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_WHITESPACE = " \t\n\r"
_OK = "ok"
_NEED_MORE = "need more"
_FAIL = "fail"


def make_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ToolCall:
    function: FunctionCall
    id: str
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls`` entry."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


# -- scanning ------------------------------------------------------------------------------------------------


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _scan_string(text: str, pos: int) -> tuple[str, int]:
    """The JSON string starting at ``text[pos] == '"'``: (status, end) with status _OK, _NEED_MORE or
    _FAIL; end is just past the closing quote."""
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return _OK, i + 1
        if char < " ":
            return _FAIL, i
        i += 1
    return _NEED_MORE, i


def scan_call_header(text: str, pos: int) -> tuple[str, str | None, int]:
    """Matches ``{"name": <string>, "arguments": {`` (any JSON whitespace between) at ``text[pos:]``.

    Returns (status, name, end): status _OK with the function name and the position of the arguments'
    opening brace, _NEED_MORE when ``text`` ends inside a possible header, or _FAIL.
    """
    name = None
    for expected in ("{", '"name"', ":", None, ",", '"arguments"', ":", "{"):
        pos = _skip_whitespace(text, pos)
        if pos == len(text):
            return _NEED_MORE, None, pos
        if expected is None:  # the name
            if text[pos] != '"':
                return _FAIL, None, pos
            status, end = _scan_string(text, pos)
            if status != _OK:
                return status, None, end
            try:
                name = json.loads(text[pos:end])
            except ValueError:
                return _FAIL, None, pos
            if not name:
                return _FAIL, None, pos
            pos = end
            continue
        part = text[pos : pos + len(expected)]
        if part != expected:
            could_continue = expected.startswith(part) and pos + len(part) == len(text)
            return (_NEED_MORE if could_continue else _FAIL), None, pos
        pos += len(expected)
    return _OK, name, pos - 1  # the position of the arguments' opening brace


class _JsonValueEnd:
    """Finds where a JSON object fed piece by piece ends: tracks nesting, strings and escapes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """Consumes ``text``; returns the index just past the object's closing brace, or None if the
        object is not complete yet (all of ``text`` belongs to it)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _parse_call(text: str, pos: int) -> tuple[str, str, int] | None:
    """A complete call body at ``text[pos:]`` (just after ``<tool_call>``): (name, arguments, end), end
    just past ``</tool_call>`` or at the end of text when the call ends the output unclosed."""
    status, name, brace = scan_call_header(text, pos)
    if status != _OK:
        return None
    try:
        arguments, end = json.JSONDecoder().raw_decode(text, brace)
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    close = _skip_whitespace(text, end)
    if not text.startswith("}", close):
        return None
    close = _skip_whitespace(text, close + 1)
    if text.startswith(TOOL_CALL_END, close):
        return name, text[brace:end], close + len(TOOL_CALL_END)
    if close == len(text):
        return name, text[brace:end], close
    return None


class HermesToolParser:
    """Parses Hermes / Qwen tool calls (see the module docstring)."""

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None when empty, tool calls) of a whole output."""
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        after_call = False  # the last content segment follows a call
        while True:
            start = text.find(TOOL_CALL_START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            parsed = _parse_call(text, start + len(TOOL_CALL_START))
            if parsed is None:
                close = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
                end = len(text) if close < 0 else close + len(TOOL_CALL_END)
                content.append(text[start:end])
                pos = end
                after_call = False
                continue
            name, arguments, end = parsed
            calls.append(ToolCall(FunctionCall(name, arguments), make_tool_call_id()))
            # The whitespace before a call only separates it from the content.
            content.append(content.pop().rstrip(_WHITESPACE))
            pos = end
            after_call = True
        if after_call and not content[-1].strip(_WHITESPACE):
            content.pop()  # the whitespace after the last call
        joined = "".join(content)
        return (joined or None), calls

    def streaming(self) -> HermesToolStreamParser:
        return HermesToolStreamParser()


class HermesToolStreamParser:
    """Fed the output's text deltas, returns OpenAI streaming deltas. One per request choice.

    ``feed(text)`` and ``finish()`` return a list of delta dicts, each ``{"content": str}`` or
    ``{"tool_calls": [entry]}``, in output order; a call's first entry carries index, id, type, name and
    empty arguments, later ones ``{"index": i, "function": {"arguments": fragment}}``. Whitespace that
    may precede a call or end the output and text that may start ``<tool_call>`` are held back until
    the following text decides; ``finish()`` releases what is left at the end of the output.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet emitted
        self._in_call = False  # _pending starts just after a <tool_call>, no call committed yet
        self._arguments: _JsonValueEnd | None = None  # inside a committed call's arguments
        self._after_arguments = False  # a committed call's arguments are complete; expect } and the end tag
        self._after_call = False  # no content was emitted since the last call
        self._held_whitespace = ""  # content whitespace: dropped if a call or (after a call) the end follows
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._pending += text
        deltas: list[dict[str, Any]] = []
        while self._step(deltas, final=False):
            pass
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self._step(deltas, final=True):
            pass
        # At the end every call is decided; what is held back in content is content, except the
        # whitespace that ends the output after a call.
        in_call = self._arguments is not None or self._after_arguments
        if not in_call and (self._pending or not self._after_call):
            self._emit_content(deltas, self._held_whitespace + self._pending)
        self._pending = self._held_whitespace = ""
        return deltas

    # One transition of the state machine; True when it made progress and should run again.
    def _step(self, deltas: list[dict[str, Any]], final: bool) -> bool:
        if self._arguments is not None:
            return self._step_arguments(deltas)
        if self._after_arguments:
            return self._step_call_end(final)
        if self._in_call:
            return self._step_header(deltas, final)
        return self._step_content(deltas)

    def _step_content(self, deltas: list[dict[str, Any]]) -> bool:
        text = self._pending
        start = text.find(TOOL_CALL_START)
        if start >= 0:
            self._hold_trailing_whitespace(deltas, text[:start])
            self._pending = text[start + len(TOOL_CALL_START) :]
            self._in_call = True
            return True
        # Hold back a possible start of <tool_call> and the whitespace before it.
        body = text[: len(text) - partial_suffix(text, TOOL_CALL_START)]
        self._hold_trailing_whitespace(deltas, body)
        self._pending = text[len(body) :]
        return False

    def _hold_trailing_whitespace(self, deltas: list[dict[str, Any]], text: str) -> None:
        """Emits ``text`` as content except its trailing whitespace, which is held with what was held."""
        kept = text.rstrip(_WHITESPACE)
        if kept:
            self._emit_content(deltas, self._held_whitespace + kept)
            self._held_whitespace = ""
        self._held_whitespace += text[len(kept) :]

    def _step_header(self, deltas: list[dict[str, Any]], final: bool) -> bool:
        status, name, brace = scan_call_header(self._pending, 0)
        if status == _NEED_MORE and not final:
            return False
        if status == _OK:
            call = ToolCall(FunctionCall(name, ""), make_tool_call_id())
            self.tool_calls.append(call)
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": len(self.tool_calls) - 1,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            self._held_whitespace = ""
            self._in_call = False
            self._pending = self._pending[brace:]
            self._arguments = _JsonValueEnd()
            return True
        # Not a valid call: content up to and including its end tag, as the whole-output parse does.
        close = self._pending.find(TOOL_CALL_END)
        if close < 0 and not final:
            return False
        end = len(self._pending) if close < 0 else close + len(TOOL_CALL_END)
        self._emit_content(deltas, self._held_whitespace + TOOL_CALL_START + self._pending[:end])
        self._held_whitespace = ""
        self._pending = self._pending[end:]
        self._in_call = False
        return True

    def _step_arguments(self, deltas: list[dict[str, Any]]) -> bool:
        if not self._pending:
            return False
        end = self._arguments.feed(self._pending)
        fragment = self._pending if end is None else self._pending[:end]
        call = self.tool_calls[-1]
        call.function.arguments += fragment
        deltas.append(
            {"tool_calls": [{"index": len(self.tool_calls) - 1, "function": {"arguments": fragment}}]}
        )
        self._pending = "" if end is None else self._pending[end:]
        if end is None:
            return False
        self._arguments = None
        self._after_arguments = True
        return True

    def _step_call_end(self, final: bool) -> bool:
        # Expect whitespace, "}", whitespace, "</tool_call>" (or the end of the output).
        text = self._pending
        pos = _skip_whitespace(text, 0)
        if pos == len(text):
            return False
        if text[pos] == "}":
            pos = _skip_whitespace(text, pos + 1)
            if pos == len(text):
                return False
            if text.startswith(TOOL_CALL_END, pos):
                pos += len(TOOL_CALL_END)
            elif TOOL_CALL_END.startswith(text[pos:]) and not final:
                return False
        # Whatever follows a committed call (well-formed or not) is parsed as content again.
        self._pending = text[pos:]
        self._after_arguments = False
        self._after_call = True
        return True

    def _emit_content(self, deltas: list[dict[str, Any]], text: str) -> None:
        if text:
            deltas.append({"content": text})
            self._after_call = False
