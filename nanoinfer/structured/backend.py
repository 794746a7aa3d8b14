"""Grammar matching: one compiler per engine, one matcher (``Grammar``) per request.

Two libraries back the matchers (``GrammarCompiler`` picks; the engine does not care which): xgrammar
(``xgrammar_backend.py``) for the JSON schemas that it compiles quickly, llguidance for everything
else (regexes, choices, grammars, tool calls, and the schemas that xgrammar would take long to compile or
does not implement as llguidance does). Both follow the semantics below, and llguidance's: the same
schemas are accepted and rejected, and xgrammar's masks are llguidance's but for a bounded string's
escapes (see ``xgrammar_backend.py``).

Each step the engine asks every constrained request's ``Grammar`` for the bitmask of the tokens it
allows next (``fill_bitmask``, or ``GrammarCompiler.fill_bitmasks`` for many rows in parallel), applies
it to the logits (``apply_token_bitmask``), samples, and feeds the sampled token back
(``accept_token``).

Bitmask layout (llguidance's and xgrammar's): int32 words, ``ceil(vocab_size / 32)`` per row; bit
``j % 32`` of word ``j // 32`` set means token ``j`` is allowed.

End of output: once the constraint is complete and nothing can extend it, only the EOS tokens are
allowed (``is_terminated()`` is then True), so a normal request samples EOS and finishes with reason
"stop". When the constraint is complete but could go on (a JSON array that may take more items, a
choice that is a prefix of another), EOS is allowed beside the tokens that continue it. Two engine
settings meet an EOS-only mask: ``ignore_eos`` (the sampled EOS does not stop the request, and every
later mask allows EOS again, so the output continues with EOS tokens up to ``max_tokens``) and
``min_tokens`` (its EOS ban would leave no token allowed at all): the engine should finish a request
whose grammar ``is_terminated()`` instead of sampling from such a row.

Cost (at Qwen3's 150k vocabulary; benchmarks/structured_backends.py): llguidance compiles lazily and
cheaply (about a millisecond for a realistic schema: its lexer is built as tokens arrive), and each mask
costs tens to hundreds of microseconds (more on the first visit of a lexer state), bounded by its
per-step fuel. xgrammar precomputes masks when it compiles (5-50 ms for the schemas routed to it, once
per schema: compiled grammars are cached), and then a mask costs about 10 microseconds.

Threads: a ``Grammar`` may be used from any thread but by one at a time; both libraries release the GIL
while they compile and compute masks, so compiling in a worker thread does not stall the event loop.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from nanoinfer.structured.params import ReasoningSpan, StructuredOutputsParams

if TYPE_CHECKING:
    from nanoinfer.structured.xgrammar_backend import XGrammarCompiler

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32

# llguidance's resource limits, set explicitly so that no request can make a step slow. Building the
# lexer's initial state is bounded by initial_lexer_fuel, each later mask by step_lexer_fuel and
# step_max_items; the grammar's size and the number of lexer states (1-2 kB each, built lazily) bound the
# memory of one request. The fuels are 5x what the most demanding realistic constraint of
# ``benchmarks/structured_backends.py --fuel`` needs at Qwen3's vocabulary (20k initial for an IPv4
# regex, 10k per step for JSON schemas), and bound the costliest masks measured there (nested counted
# repeats) to 30-45 ms on the CPU box, where the library's default initial fuel (1M) let one mask take
# 0.5-0.7 s, holding up the whole step. A constraint whose first mask exceeds a limit is refused when its
# request is validated (``GrammarCompiler.compile(validate=True)``); one that exceeds a limit at a later
# step ends its request (``Grammar.error``).
PARSER_LIMITS = dict(
    initial_lexer_fuel=100_000,
    step_lexer_fuel=50_000,
    step_max_items=50_000,
    max_items_in_row=2_000,
    max_grammar_size=500_000,
    max_lexer_states=100_000,
    # Errors then say what is wrong without echoing the parser state and the whole grammar.
    verbose_errors=False,
)


def default_num_threads() -> int:
    """llguidance's default for its mask threads: 80% of the cores, at most 32."""
    return max(1, min(32, (os.cpu_count() or 1) * 4 // 5))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An int32 CPU bitmask [rows, ceil(vocab_size / 32)] with every token allowed (all bits set), so
    that rows left unfilled leave their logits untouched. ``pin_memory`` for fast copies to a GPU."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"the bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)} "
            f"on {bitmask.device}"
        )
    if bitmask.shape[1] != words or not bitmask.is_contiguous():
        raise ValueError(
            f"the bitmask must be a contiguous [rows, {words}] tensor, got {tuple(bitmask.shape)} "
            f"with strides {bitmask.stride()}"
        )


def check_row(bitmask: torch.Tensor, row: int) -> None:
    if not 0 <= row < bitmask.shape[0]:
        raise ValueError(f"row must be in [0, {bitmask.shape[0]}), got {row}")


class Grammar(abc.ABC):
    """The matcher of one request: which tokens may come next, advanced by each accepted token.

    Built by ``GrammarCompiler.compile``, backed by llguidance (``LLGuidanceGrammar``) or, for JSON
    schemas it compiles quickly, by xgrammar (``xgrammar_backend.XGrammarGrammar``); the engine does not
    care which. ``backend`` names it.
    """

    backend: str
    num_accepted: int  # tokens accepted so far, EOS included

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances the matcher by ``token_id``; False (state unchanged) when the token is not allowed."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (an int32 CPU tensor [rows, words])."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The constraint is complete and nothing can extend it: only EOS remains allowed."""

    @abc.abstractmethod
    def is_accepting(self) -> bool:
        """What was accepted so far is a complete output (EOS is allowed now)."""

    @property
    @abc.abstractmethod
    def error(self) -> str | None:
        """Why this grammar cannot go on (a resource limit was hit, the library failed), or None."""


class LLGuidanceGrammar(Grammar):
    """A request's llguidance matcher."""

    backend = "llguidance"

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._eos_token_ids = eos_token_ids
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        matcher = self._matcher
        if not 0 <= token_id < self._vocab_size or matcher.is_error():
            return False
        if matcher.is_stopped():
            # Only EOS is allowed (again and again: see ignore_eos in the module docstring), and llguidance
            # validates nothing in this state, so it is checked here.
            if token_id not in self._eos_token_ids or not matcher.consume_token(token_id):
                return False
        elif matcher.try_consume_tokens([token_id]) != 1:
            return False
        self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, self._words)
        check_row(bitmask, row)
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._words * 4)
        self._after_fill(bitmask, row)

    def _after_fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_error():
            # A limit was hit, or the state allows nothing: EOS only, so that the request ends; the
            # engine reads ``error`` to report why.
            set_only(bitmask, row, self._eos_token_ids)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return _first_lines(self._matcher.get_error()) or "unknown error"


def set_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """``bitmask[row]`` allows exactly ``token_ids``."""
    bitmask[row].zero_()
    for token_id in token_ids:
        allow(bitmask, row, token_id)


def allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """``bitmask[row]`` allows ``token_id`` too."""
    word, bit = divmod(token_id, BITS_PER_WORD)
    # Bit 31 is the sign bit of an int32 word.
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


# Where the output of a ``ReasoningGate`` is: before its first token (it may open the reasoning or
# answer), in the reasoning, or in the answer (under the constraint).
UNDECIDED, REASONING, ANSWER = "undecided", "reasoning", "answer"


class ReasoningGate(Grammar):
    """A constraint that applies after the model's reasoning (see ``ReasoningSpan``): ``inner`` matches
    the answer alone. Its first token may be the span's start token (beside what ``inner`` allows
    first); from there to the end token every token is allowed and none is fed to ``inner``."""

    def __init__(self, inner: Grammar, span: ReasoningSpan):
        self.inner = inner
        self.backend = inner.backend
        self.span = span
        self.state = REASONING if span.opened else UNDECIDED
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        state = self.state
        if state == REASONING or (state == UNDECIDED and token_id == self.span.start_token_id):
            if token_id == self.span.end_token_id:
                self.state = ANSWER
            elif state == UNDECIDED:
                self.state = REASONING
        elif not self.inner.accept_token(token_id):
            return False
        else:
            self.state = ANSWER
        self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == REASONING:
            check_row(bitmask, row)
        else:
            self.inner.fill_bitmask(bitmask, row)
        self.after_inner_fill(bitmask, row)

    def after_inner_fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Completes row ``row`` once ``inner`` has filled it (or, in the reasoning, instead)."""
        if self.state == REASONING:
            bitmask[row] = -1
        elif self.state == UNDECIDED and self.inner.error is None:
            allow(bitmask, row, self.span.start_token_id)

    def is_terminated(self) -> bool:
        return self.state == ANSWER and self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.state == REASONING or self.inner.is_accepting()

    @property
    def error(self) -> str | None:
        return self.inner.error


BACKENDS = ("auto", "llguidance", "xgrammar")
# Compiled constraints a GrammarCompiler keeps for the requests that repeat them.
COMPILED_KEPT = 64


def _kept_key(params: StructuredOutputsParams) -> tuple:
    return (params.kind, _constraint_text(params), params.disable_any_whitespace)


def _constraint_text(params: StructuredOutputsParams) -> str | tuple[str, ...] | None:
    """What a constraint of ``params.kind`` compiles from."""
    kind = params.kind
    if kind == "json":
        return params.schema_text
    if kind == "choice":
        return tuple(params.choice)
    return {"regex": params.regex, "grammar": params.grammar}.get(kind)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into per-request ``Grammar`` matchers for one tokenizer.

    ``vocab_size`` is the model's (its logits' width); it may exceed the tokenizer's, and ids without a
    token are never allowed. ``eos_token_ids``: the ids that end a sequence (default: the tokenizer's
    EOS); all of them are allowed when the output is complete. ``special_tokens``: the texts of the
    tokens that grammars must name as special tokens (pass it to ``tool_call_constraint``).

    ``backend``: "auto" (the default) compiles JSON schemas (``json``, ``json_object``) with xgrammar
    when ``xgrammar_backend.unsuitable_reason`` finds nothing against it (its compile time is then
    bounded, and its masks are much cheaper), everything else with llguidance; every schema is first
    validated by llguidance, so that the same schemas are accepted and rejected (with the same errors)
    whichever backend runs them, and one that xgrammar fails to compile falls back to llguidance.
    "llguidance" uses llguidance only; "xgrammar" compiles every JSON schema with xgrammar, unchecked
    (tests). Regexes, choices and grammars are llguidance's in every mode.

    ``num_threads``: the mask fill's threads; ``compile_threads``: xgrammar's compiler's (a new schema
    compiles on all of them: several grammar processes that fill on a few threads each still compile
    fast). Both default to ``default_num_threads()``.

    Building it takes up to about a second for a 150k vocabulary (llguidance's token trie); do it once
    per engine. xgrammar's tokenizer info (about 0.3 s more) is built by the first JSON schema.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int] | None = None,
        num_threads: int | None = None,
        backend: str = "auto",
        compile_threads: int | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        eos = tuple(sorted(set(eos_token_ids)))
        if not eos:
            raise ValueError(
                "structured outputs need an EOS token: the tokenizer has none, pass eos_token_ids"
            )
        if not all(0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be in [0, {vocab_size}), got {list(eos)}")
        tokenizer_vocab = len(tokenizer)
        if vocab_size < tokenizer_vocab:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be at least the tokenizer's vocabulary ({tokenizer_vocab})"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.backend = backend
        self._hf_tokenizer = tokenizer
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
        # Added tokens are special to llguidance even where the tokenizer says they are text (Qwen3's
        # <tool_call>, <think>): a grammar matches them only by name (``<tool_call>`` in Lark), not by a
        # string literal.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special_token_ids = tuple(
            token_id for token_id in added if self._tokenizer.is_special_token(token_id)
        )
        self.special_tokens = frozenset(added[token_id].content for token_id in self._special_token_ids)
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._num_threads = num_threads
        self._compile_threads = compile_threads
        self._executor: llguidance.LLExecutor | None = None
        self._xgrammar: XGrammarCompiler | None = None
        self._xgrammar_lock = threading.Lock()
        # The frontend's validation and the engine's compilation may share one compiler (one process).
        self._compiled: OrderedDict[tuple, _Compiled] = OrderedDict()
        self._compiled_lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams, validate: bool = False) -> Grammar:
        """A fresh matcher for one request. Raises ValueError naming the field when the schema, regex
        or grammar is invalid, uses something llguidance does not implement, or exceeds the limits.

        ``validate`` (the frontend's check of a request): also compute the matcher's first mask, so that
        a constraint whose lexer is too costly to build is refused here instead of failing its request
        at its first step, after that fill held up the step's batch. The engine's compile leaves that
        mask to its first fill, which overlaps the device's forward pass.

        What a valid constraint compiles to is kept (the last ``COMPILED_KEPT``): requests of a
        pipeline or a served tool repeat their schema, and its validation and conversion (1-2 ms for
        a nested schema) would otherwise be paid by every request, in the engine's add_request."""
        span = params.reasoning
        if span is not None and not all(
            0 <= t < self.vocab_size for t in (span.start_token_id, span.end_token_id)
        ):
            raise ValueError(
                f"structured_outputs.reasoning's token ids must be in [0, {self.vocab_size}), got "
                f"{span.start_token_id} and {span.end_token_id}"
            )
        key = _kept_key(params)
        with self._compiled_lock:
            kept = self._compiled.get(key)
            if kept is not None:
                self._compiled.move_to_end(key)
        if kept is None:
            kept = _Compiled(self._compile(params))
        # An invalid constraint raises here, or (validating) in its first mask, before it is kept.
        grammar = self._matcher(params, kept.compiled)
        if validate and not kept.validated:
            _compute_first_mask(params, grammar)
            kept.validated = True
        with self._compiled_lock:
            self._compiled[key] = kept
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar if span is None else ReasoningGate(grammar, span)

    def is_kept(self, params: StructuredOutputsParams) -> bool:
        """Whether what ``params`` compiles to is kept, so that :meth:`compile` only makes a matcher of
        it (tens of microseconds for xgrammar, 0.1-1 ms for llguidance, which parses its grammar again)."""
        with self._compiled_lock:
            return _kept_key(params) in self._compiled

    def _matcher(self, params: StructuredOutputsParams, compiled: str | Any) -> Grammar:
        if not isinstance(compiled, str):
            return self._xgrammar.matcher(compiled)
        matcher = llguidance.LLMatcher(self._tokenizer, compiled, log_level=0, limits=self._limits)
        if matcher.is_error():
            message = _first_lines(matcher.get_error())
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {message}")
        return LLGuidanceGrammar(matcher, self.vocab_size, self.eos_token_ids)

    def _compile(self, params: StructuredOutputsParams) -> str | Any:
        """llguidance's grammar text of a constraint, or xgrammar's compiled grammar of a JSON one."""
        field = params.kind
        try:
            grammar = self._grammar_text(params)
        except ValueError as e:
            message = str(e)
            if message.startswith("structured_outputs."):
                raise
            # llguidance parses the schema text with a nesting limit of 128 levels.
            raise ValueError(f"structured_outputs.{field} is invalid: {_first_lines(message)}") from None
        if field in ("json", "json_object") and self.backend != "llguidance":
            compiled = self._compile_xgrammar(params, grammar)
            if compiled is not None:
                return compiled
        return grammar

    def _compile_xgrammar(self, params: StructuredOutputsParams, grammar: str) -> Any | None:
        """xgrammar's compiled grammar of a JSON constraint, or None where llguidance should compile it."""
        # llguidance validates (without building its lexer: tens of microseconds), so that the schemas
        # accepted and the errors do not depend on the backend.
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            message = _first_lines(messages[0]) if messages else "unknown error"
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {message}")
        forced = self.backend == "xgrammar"
        schema_text = params.schema_text if params.kind == "json" else None
        if not forced and schema_text is not None:
            from nanoinfer.structured.xgrammar_backend import unsuitable_reason

            reason = unsuitable_reason(json.loads(schema_text), len(schema_text.encode()))
            if reason is not None:
                logger.debug("structured outputs: llguidance compiles this schema: %s", reason)
                return None
        compiler = self.xgrammar
        if compiler is None:
            return None
        try:
            return compiler.compile_json_grammar(schema_text, not params.disable_any_whitespace)
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeErrors of its FFI, among others)
            message = _first_lines(str(e)) or type(e).__name__
            if forced:
                raise ValueError(f"structured_outputs.{params.kind} is invalid: {message}") from None
            logger.debug("structured outputs: xgrammar did not compile this schema (%s): llguidance", message)
            return None

    @property
    def xgrammar(self) -> XGrammarCompiler | None:
        """xgrammar's compiler for this tokenizer, built on first use; None (with a warning, once) where
        it cannot be built, and JSON schemas then stay on llguidance ("auto")."""
        with self._xgrammar_lock:
            if self._xgrammar is None and self.backend != "llguidance":
                try:
                    from nanoinfer.structured.xgrammar_backend import XGrammarCompiler

                    self._xgrammar = XGrammarCompiler(
                        self._hf_tokenizer,
                        self.vocab_size,
                        self.eos_token_ids,
                        special_token_ids=self._special_token_ids,
                        num_threads=self._num_threads,
                        tokenize=self._tokenizer.tokenize_str,
                        compile_threads=self._compile_threads,
                    )
                except Exception as e:  # noqa: BLE001 (not installed, or not working as expected)
                    if self.backend == "xgrammar":
                        raise
                    logger.warning("structured outputs: xgrammar is not usable (%s): llguidance only", e)
                    self.backend = "llguidance"
            return self._xgrammar

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
        matcher_cls = llguidance.LLMatcher
        kind = params.kind
        if kind == "json":
            return matcher_cls.grammar_from_json_schema(params.schema_text, overrides=whitespace)
        if kind == "json_object":
            return matcher_cls.grammar_from_json_schema({"type": "object"}, overrides=whitespace)
        if kind == "regex":
            return matcher_cls.grammar_from_regex(params.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes; ensure_ascii=False keeps characters outside the
            # BMP whole instead of splitting them into surrogate escapes.
            alternatives = " | ".join(json_string(c) for c in params.choice)
            return matcher_cls.grammar_from_lark(f"start: {alternatives}")
        try:
            lark = any_to_lark(params.grammar)
        except Exception as e:  # noqa: BLE001 (the converter raises plain Exceptions on bad GBNF)
            raise ValueError(f"structured_outputs.grammar is invalid GBNF: {e}") from None
        return matcher_cls.grammar_from_lark(lark)

    def fill_bitmasks(self, grammars: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """``fill_bitmask`` of many (grammar, row) pairs at once: llguidance's rows in parallel on its
        threads (``num_threads``, default 80% of the cores up to 32), then xgrammar's on its threads (as
        many); a ``ReasoningGate``'s row as its state says. Rows not listed are left as they are."""
        words = bitmask_words(self.vocab_size)
        check_bitmask(bitmask, words)
        rows = [row for _, row in grammars]
        if len(set(rows)) != len(rows) or not all(0 <= row < bitmask.shape[0] for row in rows):
            raise ValueError(f"rows must be distinct and in [0, {bitmask.shape[0]}), got {rows}")
        gates = [(g, row) for g, row in grammars if isinstance(g, ReasoningGate)]
        if gates:
            # A gate in the reasoning fills its row alone; the others' constraints fill with the rest.
            grammars = [
                (g.inner, row) if isinstance(g, ReasoningGate) else (g, row)
                for g, row in grammars
                if not isinstance(g, ReasoningGate) or g.state != REASONING
            ]
        self._fill_matchers(grammars, bitmask, words)
        for gate, row in gates:
            gate.after_inner_fill(bitmask, row)

    def _fill_matchers(
        self, grammars: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor, words: int
    ) -> None:
        ours = [(g, row) for g, row in grammars if isinstance(g, LLGuidanceGrammar)]
        if len(ours) < len(grammars):
            theirs = [(g, row) for g, row in grammars if not isinstance(g, LLGuidanceGrammar)]
            self._xgrammar.fill_bitmasks(theirs, bitmask)
        if not ours:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        self._executor.unsafe_compute_mask_ptr(
            [(g._matcher, row) for g, row in ours], bitmask.data_ptr(), words * 4, bitmask.shape[0]
        )
        for grammar, row in ours:
            grammar._after_fill(bitmask, row)


@dataclass
class _Compiled:
    """What a constraint compiled to (llguidance's grammar text, or xgrammar's compiled grammar), and
    whether a matcher of it has computed its first mask (``GrammarCompiler.compile(validate=True)``)."""

    compiled: str | Any
    validated: bool = False


def _compute_first_mask(params: StructuredOutputsParams, grammar: Grammar) -> None:
    """ValueError naming the field when llguidance hits a limit building the matcher's first mask (the
    lexer's initial state, its costliest); xgrammar computes its masks when it compiles."""
    if isinstance(grammar, LLGuidanceGrammar):
        grammar._matcher.compute_bitmask()
        if grammar._matcher.is_error():
            message = _first_lines(grammar._matcher.get_error())
            raise ValueError(
                f"structured_outputs.{params.kind} is too complex to match (a limit of the grammar "
                f"library was hit building its first token mask): {message}"
            )


def json_string(text: str) -> str:
    """``text`` as a JSON (and Lark) string literal."""
    return json.dumps(text, ensure_ascii=False)


def _first_lines(message: str, limit: int = 600) -> str:
    # llguidance appends its parser state and the whole grammar to some errors; the first lines say
    # what is wrong.
    message = message.split("\n<state>", 1)[0].replace("<non-verbose/>", "").strip()
    return message if len(message) <= limit else message[:limit] + " ..."
