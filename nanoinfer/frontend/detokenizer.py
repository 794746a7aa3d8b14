"""Incremental detokenization that is safe for byte-level BPE.

Decoding one token at a time breaks multi-byte UTF-8 characters (a Chinese character or an emoji is
often split over several tokens) and loses the leading-space rules of SentencePiece-style tokenizers.
So each step decodes a short window twice, with and without the new token, emits the difference, and
holds it back while it still ends in an incomplete character (U+FFFD).

With a fast tokenizer that does no clean-up of tokenization spaces, the windows are decoded by its Rust
backend directly: the same text without transformers' per-call conversions, which cost more than the
decoding itself at one call pair per token per request.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context for the first decoded tokens.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


def backend_decoder(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` whose ``decode`` gives what ``tokenizer.decode`` gives, or None when
    there is none (a slow tokenizer) or transformers post-processes the text (clean-up of spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend_decoder(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: text before read_offset is already emitted
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Appends one generated token; returns the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        return self.flush()

    def defer_tokens(self, token_ids: list[int]) -> None:
        """Appends tokens without decoding them yet: the next :meth:`flush` or :meth:`add_token` decodes
        all deferred tokens in one window, which is much cheaper than one decode pair per token."""
        self._ids += token_ids

    def flush(self, final: bool = False) -> str:
        """Decodes the tokens added since the text was last advanced; returns the new text. With
        ``final`` no more tokens will come, so a trailing incomplete character is dropped and the rest
        emitted (instead of all of it being held back)."""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if final:
            window = window.rstrip(_INCOMPLETE)
        elif window.endswith(_INCOMPLETE):
            return ""
        if len(window) <= len(emitted):
            return ""
        delta = window[len(emitted) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta
