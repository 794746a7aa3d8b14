"""Reasoning output: Qwen3's ``<think>...</think>`` split off the answer (vLLM's
``--reasoning-parser qwen3``).

    <think>
    The user wants ...
    </think>

    The answer.

gives ``reasoning_content`` "The user wants ..." and ``content`` "The answer.". Rules:

- The reasoning starts at a ``<think>`` that opens the output (after optional whitespace), or at the
  very start when the prompt already opened it (``in_reasoning=True``, see ``prompt_opens_reasoning``:
  templates that put ``<think>`` at the end of the generation prompt).
- It ends at the first ``</think>``; an output that ends before it is all reasoning.
- An output that does not start in reasoning is all content, unchanged, tags and all.
- The reasoning is stripped of surrounding whitespace, the content of the whitespace after ``</think>``;
  empty parts are None.

``Qwen3ReasoningParser.streaming()`` returns a parser fed text deltas; the concatenated stream equals
the whole-output split for every way of cutting the output into deltas (tags split across deltas
included): whitespace and a possible partial tag are held back until the following text decides.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
_WHITESPACE = " \t\n\r"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the prompt ends inside a ``<think>`` block (the template opened it for the model)."""
    start = prompt.rfind(THINK_START)
    return start >= 0 and prompt.find(THINK_END, start) < 0


def prompt_closes_reasoning(prompt: str) -> bool:
    """Whether the prompt ends with a closed ``<think>...</think>`` block (a template that turns the
    reasoning off writes an empty one: Qwen3's with ``enable_thinking=False``)."""
    return prompt.rstrip(_WHITESPACE).endswith(THINK_END)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (how much of a
    tag a stream may have begun; the tool-call parser uses it too)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class Qwen3ReasoningParser:
    def __init__(self, in_reasoning: bool = False):
        self.in_reasoning = in_reasoning

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        if self.in_reasoning:
            rest = text
        else:
            opened = text.lstrip(_WHITESPACE)
            if not opened.startswith(THINK_START):
                return None, text or None
            rest = opened[len(THINK_START) :]
        reasoning, closed, content = rest.partition(THINK_END)
        content = content.lstrip(_WHITESPACE) if closed else ""
        return reasoning.strip(_WHITESPACE) or None, content or None

    def streaming(self) -> Qwen3ReasoningStreamParser:
        return Qwen3ReasoningStreamParser(self.in_reasoning)


# The stream's states.
_START = "start"  # nothing decided: whitespace or a partial <think> so far
_REASONING_START = "reasoning start"  # in the reasoning, before its first non-whitespace character
_REASONING = "reasoning"
_CONTENT_START = "content start"  # after </think>, before the content's first non-whitespace character
_CONTENT = "content"


class Qwen3ReasoningStreamParser:
    """``feed(delta)`` and ``finish()`` return (reasoning_delta, content_delta), each None when empty."""

    def __init__(self, in_reasoning: bool = False):
        self._state = _REASONING_START if in_reasoning else _START
        self._pending = ""  # text held back: undecided, whitespace, or a possible partial tag

    def feed(self, text: str) -> tuple[str | None, str | None]:
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        """What was held back, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == _START:
            return None, pending or None
        if self._state == _REASONING:
            # Held back: trailing whitespace (dropped) and maybe a partial </think> (reasoning text).
            return pending.rstrip(_WHITESPACE) or None, None
        if self._state == _CONTENT:
            return None, pending or None
        return None, None

    # One transition; True when it made progress and should run again.
    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        text = self._pending
        if self._state == _START:
            opened = text.lstrip(_WHITESPACE)
            if opened.startswith(THINK_START):
                self._pending = opened[len(THINK_START) :]
                self._state = _REASONING_START
                return True
            if THINK_START.startswith(opened):
                return False  # whitespace and maybe a partial <think>: undecided
            self._state = _CONTENT
            return True
        if self._state in (_REASONING_START, _CONTENT_START):
            stripped = text.lstrip(_WHITESPACE)
            self._pending = stripped
            if not stripped:
                return False
            self._state = _REASONING if self._state == _REASONING_START else _CONTENT
            return True
        if self._state == _CONTENT:
            if text:
                content.append(text)
            self._pending = ""
            return False
        end = text.find(THINK_END)
        if end >= 0:
            reasoning.append(text[:end].rstrip(_WHITESPACE))
            self._pending = text[end + len(THINK_END) :]
            self._state = _CONTENT_START
            return True
        # Hold back a possible partial </think> and the whitespace before it.
        body = text[: len(text) - partial_suffix(text, THINK_END)]
        kept = body.rstrip(_WHITESPACE)
        reasoning.append(kept)
        self._pending = text[len(kept) :]
        return False
