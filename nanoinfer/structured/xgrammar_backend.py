"""xgrammar matchers for JSON schemas: the fast path of structured outputs (see backend.py).

xgrammar works out, when it compiles a grammar, which tokens each position of the grammar allows (its
adaptive token-mask cache), so that a step's mask is mostly a copy: about 10 microseconds a row at
Qwen3's 150k vocabulary for a realistic schema, against hundreds for llguidance, which walks the token
trie at every step (benchmarks/structured_backends.py). The price is paid up front, and it grows with
the grammar: tens of milliseconds for a realistic schema, seconds for a deeply nested or huge one, and
the engine compiles on its loop thread. ``unsuitable_reason`` therefore lets only schemas whose compile
time is bounded through (the limits and their measurements are next to it); everything else stays on
llguidance, which bounds its own work.

Semantics follow llguidance's (the reference; ``GrammarCompiler`` validates every schema with it first):
properties in the schema's order, additional properties allowed unless ``additionalProperties`` says
otherwise (JSON Schema's default; xgrammar's ``strict_mode`` would forbid them, and make ``json_object``
take "{}" only, so it is off; the objects that declare properties and allow others are llguidance's,
see the limits), the compact layout (separators "," and ":", no whitespace) unless flexible whitespace
is asked for, the tokenizer's added tokens never allowed as text, forced text (property names) written
in the tokenizer's tokens (``canonical_forced_token``). End of output as in backend.py's docstring.
Where the masks differ from llguidance's (a bounded string's escapes, see ``fix_strings``), xgrammar
allows fewer tokens, never others.

Threads: as llguidance's, a matcher may be used from any thread but by one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import xgrammar

from nanoinfer.structured.backend import (
    BITS_PER_WORD,
    Grammar,
    bitmask_words,
    check_bitmask,
    check_row,
    default_num_threads,
    set_only,
)

# The compiled grammars xgrammar keeps for reuse (requests that share a schema compile it once): about
# 0.5 MB per realistic schema at a 150k vocabulary, bounded here.
XGRAMMAR_CACHE_LIMIT_BYTES = 256 * 1024 * 1024
# Forced texts whose first token is kept (canonical_forced_token); all are forgotten past it.
_FORCED_TOKENS_KEPT = 16384

# -- which schemas xgrammar compiles quickly -------------------------------------------------------------
#
# xgrammar precomputes masks for every position of the grammar when it compiles, so its compile time
# grows with what the schema makes the grammar repeat. Measured with xgrammar 0.2.9 at Qwen3's vocabulary
# (151,936 ids) on one thread of a shared 2-core AMD EPYC, best of 3, cache off
# (``benchmarks/structured_backends.py --limits``); every schema routed to xgrammar must compile well
# under 0.2 s there:
#
# - an object that declares properties and allows others (``additionalProperties`` absent, true or a
#   schema: JSON Schema's default) costs 40-800 ms (xgrammar builds the "any other key" string rule for
#   it, which grows with the names' first letters: 16 real-word names 0.8 s, a pydantic model with a
#   nested one 0.4 s); such a schema stays on llguidance. Objects that close their properties
#   (``"additionalProperties": false``, as OpenAI's strict schemas and pydantic's ``extra="forbid"``
#   do) cost ~0.1 ms each; free-form objects (no properties) share one rule (~10 ms once).
# - nesting: closed objects nested n deep: 32 levels 6 ms, 64: 37 ms, 128: 0.22 s (900 levels of open
#   ones: > 20 s): at most MAX_DEPTH schema levels.
# - enum/const values: 512 strings 5 ms, 2,500: 24 ms, 20k: 1.8 s and 13 ms masks: at most
#   MAX_ENUM_VALUES in the schema.
# - properties: 256 optional ones of a closed object 39 ms, 512: 0.14 s (optional ones grow faster than
#   linearly): at most MAX_PROPERTIES in the schema.
# - anyOf alternatives: 32 closed objects of 8 properties 31 ms, 128 of 1: 7 ms: at most MAX_ALTERNATIVES.
# - patterns: xgrammar unrolls a counted repetition, and each copy costs with the number of tokens that
#   its characters spell: [a-z]{1,32} 41 ms, \w{1,32} 86 ms, [ -~]{1,16} 0.12 s, [0-9]{1,255} 3 ms
#   (digits are single tokens in Qwen3's vocabulary), ^(([a-z]{1,32}\-){1,32}x)$ 1.5 s. A pattern's
#   weight is the sum over its parts of (repetitions) x (letters it may match, + 16 for the space, the
#   start of many tokens); the distinct patterns of a schema may weigh PATTERN_BUDGET (about 40-90 ms).
# - size: at most MAX_SCHEMA_BYTES of schema JSON, whatever it holds.
#
# Keywords: only those in SCHEMA_KEYWORDS, which xgrammar implements as llguidance does. Others (format,
# uniqueItems, patternProperties, minProperties, multipleOf, if/then/else, allOf, oneOf, ...) stay on
# llguidance, which implements more of them and rejects what it does not implement. Strings are checked
# in ``fix_strings`` below.
MAX_SCHEMA_BYTES = 16 * 1024
MAX_DEPTH = 32
MAX_ENUM_VALUES = 512
MAX_PROPERTIES = 256
MAX_ALTERNATIVES = 64
MAX_PATTERN_BYTES = 256
PATTERN_LETTERS = 800
PATTERN_SIZE = 1024

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_SUBSCHEMA = {"items", "additionalProperties"}
_SUBSCHEMA_LIST = {"anyOf"}
_SUBSCHEMA_MAP = {"properties", "$defs", "definitions"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment"}
SCHEMA_KEYWORDS = frozenset(
    _SUBSCHEMA
    | _SUBSCHEMA_LIST
    | _SUBSCHEMA_MAP
    | _ANNOTATIONS
    | {"type", "required", "enum", "const", "$ref", "pattern", "minLength", "maxLength"}
    | {"minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
)


class _Unsuitable(Exception):
    pass


class _Tally:
    def __init__(self) -> None:
        self.enum_values = 0
        self.properties = 0
        self.alternatives = 0
        self.patterns: set[str] = set()
        self.pattern_letters = 0
        self.pattern_size = 0


def unsuitable_reason(schema: Any, schema_bytes: int) -> str | None:
    """Why xgrammar should not compile ``schema`` (its compile time is not known to be small, or it uses
    something xgrammar does not implement as llguidance does); None when it may."""
    if schema_bytes > MAX_SCHEMA_BYTES:
        return f"the schema has {schema_bytes} bytes (more than {MAX_SCHEMA_BYTES})"
    tally = _Tally()
    try:
        _walk(schema, 1, tally)
    except _Unsuitable as e:
        return str(e)
    return None


def _walk(schema: Any, depth: int, tally: _Tally) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _Unsuitable(f"a subschema is a {type(schema).__name__}")
    if depth > MAX_DEPTH:
        raise _Unsuitable(f"the schema nests more than {MAX_DEPTH} levels")
    if schema.get("properties") and schema.get("additionalProperties", True) is not False:
        raise _Unsuitable("an object declares properties and allows others (additionalProperties)")
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            raise _Unsuitable(f"keyword {key!r}")
        if key in _SUBSCHEMA:
            _walk(value, depth + 1, tally)
        elif key in _SUBSCHEMA_LIST:
            if not isinstance(value, list):
                raise _Unsuitable(f"{key} is not a list")
            tally.alternatives += len(value)
            if tally.alternatives > MAX_ALTERNATIVES:
                raise _Unsuitable(f"more than {MAX_ALTERNATIVES} anyOf alternatives")
            for item in value:
                _walk(item, depth + 1, tally)
        elif key in _SUBSCHEMA_MAP:
            if not isinstance(value, dict):
                raise _Unsuitable(f"{key} is not an object")
            if key == "properties":
                tally.properties += len(value)
                if tally.properties > MAX_PROPERTIES:
                    raise _Unsuitable(f"more than {MAX_PROPERTIES} properties")
            for item in value.values():
                _walk(item, depth + 1, tally)
        elif key in ("enum", "const"):
            tally.enum_values += len(value) if key == "enum" and isinstance(value, list) else 1
            if tally.enum_values > MAX_ENUM_VALUES:
                raise _Unsuitable(f"more than {MAX_ENUM_VALUES} enum/const values")
        elif key == "required":
            # xgrammar ignores a required property that "properties" does not name (llguidance requires
            # it, with the additional properties' schema).
            properties = schema.get("properties", {})
            if not isinstance(value, list) or not all(name in properties for name in value):
                raise _Unsuitable("required names a property that properties does not")
        elif key == "pattern" and value not in tally.patterns:
            if not isinstance(value, str) or len(value.encode()) > MAX_PATTERN_BYTES:
                raise _Unsuitable(f"a pattern is not a string of at most {MAX_PATTERN_BYTES} bytes")
            try:
                letters, size = _PatternWeigher(value).weigh()
            except _Unsuitable as e:
                raise _Unsuitable(f"pattern {value!r:.60}: {e}") from None
            tally.patterns.add(value)
            tally.pattern_letters += letters
            tally.pattern_size += size
            if tally.pattern_letters > PATTERN_LETTERS or tally.pattern_size > PATTERN_SIZE:
                raise _Unsuitable(
                    f"its patterns weigh more than {PATTERN_LETTERS} (repeated letters) or "
                    f"{PATTERN_SIZE} (repeated parts)"
                )


_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# Escapes a pattern may use: \d \w \s (ASCII in xgrammar, as in JSON Schema's ECMA-262 regexes; a
# subset of llguidance's Unicode ones) and escaped punctuation. \D \W \S, \p{..}, \u.. and \x.. can match
# what "." matches (see _PatternWeigher).
_ESCAPE_CLASSES = {
    "d": frozenset("0123456789"),
    "w": _LETTERS | frozenset("0123456789_"),
    "s": frozenset(" "),
}
_ESCAPE_CHARS = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}


class _PatternWeigher:
    r"""Checks that xgrammar may take a pattern and weighs it (see the limits above).

    Taken: ASCII literals, classes [...] of them with ranges, \d \w \s, groups (...) and (?:...),
    alternatives, anchors, and the quantifiers * + ? {m} {m,} {m,n}. Not taken: "." and negated
    classes, because xgrammar's automaton for them takes the UTF-8 encodings of surrogates and some
    overlong ones, which are not UTF-8; anything else (look-around, back-references, \b, ...). Whatever is
    taken matches only what it spells, and xgrammar writes the strings of a pattern without escapes and
    matches the whole string (as if anchored): it allows fewer strings than llguidance, never others.
    """

    def __init__(self, pattern: str):
        if not pattern.isascii():
            raise _Unsuitable("not ASCII")
        self.text = pattern
        self.pos = 0

    def weigh(self) -> tuple[int, int]:
        """(letters weight, size): the sums over the pattern's parts of (repetitions) x (the letters it
        may match, + 16 for the space) and of the repetitions."""
        weight = self._alternatives()
        if self.pos != len(self.text):
            raise _Unsuitable(f"unexpected {self.text[self.pos]!r} at {self.pos}")
        return weight

    def _peek(self) -> str:
        return self.text[self.pos : self.pos + 1]

    def _alternatives(self) -> tuple[int, int]:
        letters, size = self._sequence()
        while self._peek() == "|":
            self.pos += 1
            more = self._sequence()
            letters, size = letters + more[0], size + more[1]
        return letters, size

    def _sequence(self) -> tuple[int, int]:
        letters = size = 0
        while self._peek() not in ("", "|", ")"):
            atom_letters, atom_size = self._atom()
            count = self._repetitions()
            letters, size = letters + count * atom_letters, size + count * atom_size
        return letters, size

    def _atom(self) -> tuple[int, int]:
        char = self._peek()
        self.pos += 1
        if char in "^$":
            return 0, 0
        if char == "(":
            if self.text.startswith("?:", self.pos):
                self.pos += 2
            elif self._peek() == "?":
                raise _Unsuitable("a group with (?")
            weight = self._alternatives()
            if self._peek() != ")":
                raise _Unsuitable("an unclosed group")
            self.pos += 1
            return weight
        if char == "[":
            return self._width(self._class())
        if char == "\\":
            return self._width(self._escape())
        if char == ".":
            raise _Unsuitable('"."')
        if char in "*+?{)]|":
            raise _Unsuitable(f"unexpected {char!r}")
        return self._width(frozenset(char))

    def _escape(self) -> frozenset[str]:
        char = self._peek()
        self.pos += 1
        if char in _ESCAPE_CLASSES:
            return _ESCAPE_CLASSES[char]
        if char in _ESCAPE_CHARS:
            return frozenset(_ESCAPE_CHARS[char])
        if not char or char.isalnum():
            raise _Unsuitable(f"escape \\{char}")
        return frozenset(char)

    def _class(self) -> frozenset[str]:
        if self._peek() == "^":
            raise _Unsuitable("a negated class")
        chars: set[str] = set()
        while True:
            char = self._peek()
            if not char:
                raise _Unsuitable("an unclosed class")
            self.pos += 1
            if char == "]":
                if not chars:
                    raise _Unsuitable("an empty class")  # or one that starts with "]": dialects differ
                return frozenset(chars)
            if char == "[":
                raise _Unsuitable("a nested class")
            members = self._escape() if char == "\\" else frozenset(char)
            if self._peek() == "-" and self.text[self.pos + 1 : self.pos + 2] not in ("]", ""):
                if len(members) != 1:
                    raise _Unsuitable("a range from a class")
                self.pos += 1
                end = self._peek()
                self.pos += 1
                if end == "\\":
                    end_members = self._escape()
                    if len(end_members) != 1:
                        raise _Unsuitable("a range to a class")
                    (end,) = end_members
                (start,) = members
                if ord(end) < ord(start):
                    raise _Unsuitable("a reversed range")
                members = frozenset(map(chr, range(ord(start), ord(end) + 1)))
            chars |= members

    @staticmethod
    def _width(chars: frozenset[str]) -> tuple[int, int]:
        return len(chars & _LETTERS) + (16 if " " in chars else 0), 1

    def _repetitions(self) -> int:
        char = self._peek()
        if char in ("*", "+", "?"):
            self.pos += 1
            count = 1
        elif char == "{":
            end = self.text.find("}", self.pos)
            bounds = self.text[self.pos + 1 : end].split(",") if end > 0 else []
            if not 1 <= len(bounds) <= 2 or not all(b.isdigit() for b in bounds if b) or not bounds[0]:
                raise _Unsuitable("a malformed {m,n}")
            self.pos = end + 1
            count = int(bounds[-1] or bounds[0])
        else:
            return 1
        if self._peek() == "?":  # lazy: the same strings
            self.pos += 1
        return count


# -- JSON strings --------------------------------------------------------------------------------------------
#
# xgrammar 0.2.9's JSON strings differ from JSON and from llguidance's, which is fixed by rewriting the
# grammar it writes for a schema (``XGrammarCompiler`` checks when it starts that the rewrite works):
#
# - its string characters include the UTF-8 encodings of the surrogates U+D800-U+DFFF, which are not
#   UTF-8 (a byte-level vocabulary spells them byte by byte): left out;
# - a string with minLength/maxLength is ``"\"" chars{min, max} "\""`` with ``chars ::= [^"\\\r\n]``,
#   which takes raw control characters (invalid JSON). They are left out; such a string still takes
#   no escapes (it cannot contain '"', '\' or a control character: fewer strings than llguidance allows,
#   never others). xgrammar's fast repetition needs a character class there: with escapes as an
#   alternative, every mask costs ~50 ms at a 150k vocabulary, and unrolled rules ~30 ms of compile
#   time per character;
# - what llguidance never writes is left out too: U+007F raw, the escape "\/", and "\u" escapes of other
#   characters than U+0000-U+001F and U+007F; so that, bounded strings aside, xgrammar's masks are
#   llguidance's (tests compare them).
_STRING_CLASS = r"[^\0-\x1f\"\\\r\n"  # how xgrammar's classes of (unbounded) string characters start
_JSON_STRING_CLASS = r"[^\0-\x1f\x7f\"\\\ud800-\udfff"
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_ESCAPES = r'basic_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
_JSON_ESCAPES = r'basic_escape ::= (([\"\\bfnrt]) | ("u00" (([01] [A-Fa-f0-9]) | ("7" [Ff]))))'


def fix_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's grammar of a JSON schema) with its strings as described above."""
    ebnf = ebnf.replace(_STRING_CLASS, _JSON_STRING_CLASS).replace(_ESCAPES, _JSON_ESCAPES)
    return ebnf.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS + "]")


# -- compiler and matcher ------------------------------------------------------------------------------------


# xgrammar's threads for a batched mask fill. On the H200's 16-core host (benchmarks/structured_backends.py
# --fill-threads, 64 rows of the engine benchmark's schema): 1482 us with 1 thread, 927 with 2, 682 with
# 4, 607 with 8, 696 with 12, 855 with 16.
MAX_FILL_THREADS = 8


class XGrammarCompiler:
    """xgrammar's side of ``GrammarCompiler``: its tokenizer info (about 0.3 s for a 150k vocabulary),
    its compiler with a bounded cache, and the batched mask filler.

    ``special_token_ids``: the ids that are never text (llguidance's special tokens: the tokenizer's
    added tokens); xgrammar would otherwise let a string contain them as their text.
    ``tokenize``: a text's tokens as the tokenizer writes them (``llguidance.LLTokenizer.tokenize_str``),
    for ``canonical_forced_token``.
    ``num_threads``: the batched fill's threads (at most ``MAX_FILL_THREADS``); ``compile_threads``: the
    compiler's. Both default to ``default_num_threads()``.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        special_token_ids: Iterable[int] = (),
        num_threads: int | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
        compile_threads: int | None = None,
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._words = bitmask_words(vocab_size)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        special = set(special_token_ids) - set(eos_token_ids)
        if not special <= set(info.special_token_ids):
            # xgrammar takes a token with no text for a special one.
            encoded = [""] * vocab_size
            for token, token_id in tokenizer.get_vocab().items():
                if token_id < vocab_size and token_id not in special:
                    encoded[token_id] = token
            info = xgrammar.TokenizerInfo(
                encoded,
                info.vocab_type,
                vocab_size=vocab_size,
                stop_token_ids=list(eos_token_ids),
                add_prefix_space=info.add_prefix_space,
            )
        # Tokens the matcher refuses (with a warning on stderr, so they are refused here first).
        self.never_text = frozenset(info.special_token_ids) - set(eos_token_ids)
        self.num_threads = num_threads or default_num_threads()
        self._compiler = xgrammar.GrammarCompiler(
            info,
            max_threads=compile_threads or default_num_threads(),
            cache_enabled=True,
            cache_limit_bytes=XGRAMMAR_CACHE_LIMIT_BYTES,
        )
        self.num_fill_threads = min(MAX_FILL_THREADS, self.num_threads)
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        # A text's tokens as the tokenizer writes them; None: no forced tokens (see canonical_forced_token).
        self._tokenize = tokenize
        self._forced_tokens: dict[str, int | None] = {}  # forced text: its first token (None: leave it)
        eos_only = torch.zeros(1, self._words, dtype=torch.int32)
        set_only(eos_only, 0, eos_token_ids)
        self.eos_only = eos_only
        self._check_string_fixes()

    def _check_string_fixes(self) -> None:
        """Raises RuntimeError unless ``fix_strings`` works on this version of xgrammar (it rewrites the
        text of xgrammar's grammars, which another version may write otherwise)."""
        schema = {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 4}, "b": {"type": "string"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        }
        compiled = self._compile(json.dumps(schema), flexible_whitespace=False)
        cases = {
            '{"a":"\u00e9x","b":"\\"\\u001f\\n\u00e9"}'.encode(): True,
            b'{"a":"","b":"\\u00e9"}': False,
            b'{"a":"\x01","b":""}': False,
            b'{"a":"","b":"\x01"}': False,
            b'{"a":"\xed\xa0\x80","b":""}': False,
            b'{"a":"","b":"\xed\xa0\x80"}': False,
            b'{"a":"\\/","b":""}': False,
            b'{"a":"","b":"\x7f"}': False,
        }
        for text, valid in cases.items():
            matcher = xgrammar.GrammarMatcher(compiled)
            if (matcher.accept_string(text) and matcher.is_completed()) is not valid:
                raise RuntimeError(
                    f"this xgrammar's JSON strings are not fixed as expected ({text!r} is "
                    f"{'refused' if valid else 'allowed'})"
                )

    def _compile(self, schema_text: str, flexible_whitespace: bool) -> xgrammar.CompiledGrammar:
        layout: dict[str, Any] = {"any_whitespace": flexible_whitespace}
        if not flexible_whitespace:
            layout["separators"] = (",", ":")
        grammar = xgrammar.Grammar.from_json_schema(schema_text, strict_mode=False, **layout)
        return self._compiler.compile_grammar(xgrammar.Grammar.from_ebnf(fix_strings(str(grammar))))

    def clear_cache(self) -> None:
        """Forgets the compiled grammars (benchmarks)."""
        self._compiler.clear_cache()

    def compile_json(self, schema_text: str | None, flexible_whitespace: bool) -> XGrammarGrammar:
        """A matcher of ``schema_text`` (None: any JSON object). Raises what xgrammar raises when it
        cannot compile the schema (RuntimeError and others)."""
        return self.matcher(self.compile_json_grammar(schema_text, flexible_whitespace))

    def compile_json_grammar(
        self, schema_text: str | None, flexible_whitespace: bool
    ) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``schema_text`` (as :meth:`compile_json`), for :meth:`matcher`."""
        return self._compile(schema_text or '{"type":"object"}', flexible_whitespace)

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarGrammar:
        """A fresh matcher of a compiled grammar (tens of microseconds)."""
        return XGrammarGrammar(xgrammar.GrammarMatcher(compiled), self)

    def canonical_forced_token(self, matcher: xgrammar.GrammarMatcher, words: np.ndarray, row: int) -> None:
        """Where the grammar forces the next bytes (a property name, the separators around it), the
        mask ``words[row]`` (a numpy view of the bitmask) allows only the first token of the
        tokenizer's tokenization of them, as llguidance's masks do.

        xgrammar allows every token that spells a prefix of them ("r", "ro" and "role" before "role"),
        and a sampler that takes another writes the text in more tokens than the tokenizer would, in
        tokenizations a model has not seen. A forced text that is one token is left alone (a longer
        token may extend it past the forced part). About 2 us a row (the forced texts of a schema recur
        across steps and requests, so their first tokens are kept).
        """
        if self._tokenize is None:
            return
        forced = matcher.find_jump_forward_string()
        if not forced:
            return
        token_id = self._forced_tokens.get(forced, -1)
        if token_id == -1:
            tokens = self._tokenize(forced)
            token_id = tokens[0] if len(tokens) > 1 else None
            if len(self._forced_tokens) >= _FORCED_TOKENS_KEPT:
                self._forced_tokens.clear()
            self._forced_tokens[forced] = token_id
        if token_id is not None:
            word, bit = divmod(token_id, BITS_PER_WORD)
            if (int(words[row, word]) >> bit) & 1:
                words[row] = 0
                # The allowed bit alone, as an int32 (bit 31 is the sign bit).
                value = 1 << bit
                words[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def fill_bitmasks(self, grammars: Sequence[tuple[XGrammarGrammar, int]], bitmask: torch.Tensor) -> None:
        """Fills the rows of ``grammars`` (checked by the caller) on xgrammar's threads."""
        live = [(g, row) for g, row in grammars if not g._stopped and g._error is None]
        if len(live) == 1:
            live[0][0]._fill(bitmask, live[0][1])
        elif live:
            if self._batch is None:
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=self.num_fill_threads)
            try:
                self._batch.batch_fill_next_token_bitmask(
                    [g._matcher for g, _ in live], bitmask, [row for _, row in live]
                )
            except Exception:  # noqa: BLE001 (one by one, so that only the failing rows fail)
                for grammar, row in live:
                    grammar._fill(bitmask, row)
            else:
                words = bitmask.numpy()
                for grammar, row in live:
                    self.canonical_forced_token(grammar._matcher, words, row)
        for grammar, row in grammars:
            if grammar._stopped or grammar._error is not None:
                set_only(bitmask, row, self.eos_token_ids)


class XGrammarGrammar(Grammar):
    """The xgrammar matcher of one request; the same interface and end-of-output semantics as
    llguidance's (see backend.py). Built by ``GrammarCompiler.compile``."""

    backend = "xgrammar"

    def __init__(self, matcher: xgrammar.GrammarMatcher, compiler: XGrammarCompiler):
        self._matcher = matcher
        self._compiler = compiler
        self._stopped = False  # an EOS was accepted: only EOS from now on
        self._error: str | None = None
        # is_terminated() of the state after ``_terminated_at`` tokens (it fills a mask to know).
        self._terminated_at = -1
        self._terminated = False
        self._scratch: torch.Tensor | None = None
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        compiler = self._compiler
        if not 0 <= token_id < compiler.vocab_size or self._error is not None:
            return False
        if self._stopped:
            # As llguidance's matcher: EOS again and again (ignore_eos), nothing else.
            if token_id not in compiler.eos_token_ids:
                return False
        elif token_id in compiler.never_text or not self._matcher.accept_token(token_id):
            return False
        elif token_id in compiler.eos_token_ids:
            self._stopped = True
        self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, self._compiler._words)
        check_row(bitmask, row)
        if self._stopped or self._error is not None:
            set_only(bitmask, row, self._compiler.eos_token_ids)
        else:
            self._fill(bitmask, row)

    def _fill(self, bitmask: torch.Tensor, row: int, canonical: bool = True) -> None:
        try:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if canonical:
                self._compiler.canonical_forced_token(self._matcher, bitmask.numpy(), row)
        except Exception as e:  # noqa: BLE001 (xgrammar's errors are RuntimeErrors of its FFI)
            self._error = f"xgrammar failed to compute the mask: {str(e).strip()[:300]}"
            set_only(bitmask, row, self._compiler.eos_token_ids)

    def is_terminated(self) -> bool:
        if self._stopped:
            return True
        if self._error is not None or not self._matcher.is_completed():
            return False
        # Complete: terminated when nothing but EOS may follow, which only the mask says. The scheduler
        # asks after every token, so the answer is kept for the state.
        if self._terminated_at != self.num_accepted:
            if self._scratch is None:
                self._scratch = torch.empty(1, self._compiler._words, dtype=torch.int32)
            self._fill(self._scratch, 0, canonical=False)
            self._terminated = self._error is None and torch.equal(self._scratch, self._compiler.eos_only)
            self._terminated_at = self.num_accepted
        return self._terminated

    def is_accepting(self) -> bool:
        return self._error is None and (self._stopped or self._matcher.is_completed())

    @property
    def error(self) -> str | None:
        return self._error
