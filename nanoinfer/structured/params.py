"""What a request's output must look like: one JSON schema, regex, choice list or grammar (vLLM's names).

Validated on construction: exactly one constraint, the right types, bounded sizes. Whether a schema,
regex or grammar is well-formed is checked when it is compiled (``GrammarCompiler.compile``), which
raises ValueError naming the same field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Bounds on what one request may ask for: compiling is then bounded too (with the grammar library's own
# limits on lexer and parser work, see backend.py), and a request cannot make the server hold megabytes
# of grammar per sequence.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_REGEX_BYTES = 4 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_BYTES = 1024

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def _check_text(field: str, value: object, max_bytes: int) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{field} must be a non-empty string, got {value!r:.80}")
    size = _utf8_size(value)
    if size > max_bytes:
        raise ValueError(f"structured_outputs.{field} must be at most {max_bytes} bytes, got {size}")


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a reasoning model thinks before it answers: ``<think>`` (``start_token_id``) ...
    ``</think>`` (``end_token_id``), each one token. A constraint with a span leaves the reasoning free
    and constrains what follows it, as vLLM does with a reasoning parser: the first token may open the
    reasoning (the start token is allowed beside what the constraint allows) or answer at once, and
    everything up to the end token is unconstrained. ``opened``: the prompt opened the reasoning (its
    template ends with ``<think>``), so the output starts inside it. The server sets it from
    ``--reasoning-parser``."""

    start_token_id: int
    end_token_id: int
    opened: bool = False

    def __post_init__(self) -> None:
        for name in ("start_token_id", "end_token_id"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"structured_outputs.reasoning.{name} must be a token id, got {value!r}")
        if self.start_token_id == self.end_token_id:
            raise ValueError("structured_outputs.reasoning: start_token_id and end_token_id must differ")
        if not isinstance(self.opened, bool):
            raise ValueError(f"structured_outputs.reasoning.opened must be a bool, got {self.opened!r}")


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to exactly one of:

    - ``json``: a JSON schema (a dict or its JSON text); the output is one JSON value that validates
      against it;
    - ``regex``: the whole output matches the regular expression (Rust ``regex`` crate syntax: no
      look-around, no back-references; ``^``/``$`` are optional, the match is always the whole output);
    - ``choice``: the output is exactly one of the strings;
    - ``grammar``: a context-free grammar in llguidance's Lark syntax (``start: ...``; it may embed
      JSON schemas with ``%json {...}`` and regexes ``/.../``) or in GBNF (llama.cpp's and xgrammar's
      ``root ::= ...``), which is converted to Lark;
    - ``json_object``: any JSON object.

    ``disable_any_whitespace`` (vLLM's name; True by default here, unlike vLLM): JSON is generated
    without whitespace between tokens (separators ``,`` and ``:``), so a schema whose strings, arrays and
    numbers are bounded always completes within a bounded number of tokens. False allows any amount of
    whitespace, which a weak model can fill until ``max_tokens``.

    ``reasoning`` (not a vLLM field: the server sets it from ``--reasoning-parser``): a
    ``ReasoningSpan``, so that the constraint applies to the answer after the model's reasoning.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningSpan):
            raise ValueError(
                f"structured_outputs.reasoning must be None or a ReasoningSpan, got {self.reasoning!r:.80}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            value = self.disable_any_whitespace
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, got {value!r}")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_FIELDS)}; got {got}"
            )
        if self.json is not None:
            self._schema_text = _schema_text(self.json)
        if self.regex is not None:
            _check_text("regex", self.regex, MAX_REGEX_BYTES)
        if self.grammar is not None:
            _check_text("grammar", self.grammar, MAX_GRAMMAR_BYTES)
        if self.choice is not None:
            self._check_choice()

    def _check_choice(self) -> None:
        choice = self.choice
        if not isinstance(choice, list | tuple) or not choice:
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {choice!r:.80}"
            )
        if len(choice) > MAX_CHOICES:
            raise ValueError(
                f"structured_outputs.choice must have at most {MAX_CHOICES} entries, got {len(choice)}"
            )
        for i, entry in enumerate(choice):
            if not isinstance(entry, str) or not entry:
                raise ValueError(
                    f"structured_outputs.choice[{i}] must be a non-empty string, got {entry!r:.80}"
                )
            if _utf8_size(entry) > MAX_CHOICE_BYTES:
                raise ValueError(
                    f"structured_outputs.choice[{i}] must be at most {MAX_CHOICE_BYTES} bytes, "
                    f"got {_utf8_size(entry)}"
                )
        self.choice = list(choice)

    @property
    def kind(self) -> str:
        """The constraint given: one of CONSTRAINT_FIELDS."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    @property
    def schema_text(self) -> str:
        """The JSON schema as compact JSON text (``json`` only)."""
        if self.json is None:
            raise ValueError("structured_outputs.json is not set")
        return self._schema_text


def _schema_text(schema: object) -> str:
    if isinstance(schema, str):
        _check_text("json", schema, MAX_SCHEMA_BYTES)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("structured_outputs.json is nested too deeply") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r:.80}")
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json is not serializable as JSON: {e}") from None
    except RecursionError:
        raise ValueError("structured_outputs.json is nested too deeply") from None
    size = _utf8_size(text)
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(
            f"structured_outputs.json must be at most {MAX_SCHEMA_BYTES} bytes as JSON, got {size}"
        )
    return text
