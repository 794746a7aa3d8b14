import random

from nanoinfer.frontend.detokenizer import IncrementalDetokenizer, backend_decoder
from tests.fixtures import build_tokenizer

TEXT = "Prefix caching 你好，世界！ 🚀🔥 café naïve — done."


def test_incremental_text_equals_full_decode(tmp_path):
    tok = build_tokenizer(str(tmp_path))
    prompt = tok.encode("Hello")
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_token(t) for t in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_split_multibyte_character_is_held_back(tmp_path):
    tok = build_tokenizer(str(tmp_path))
    ids = tok.encode("🚀")
    assert len(ids) > 1, "the fixture tokenizer should split the emoji into byte tokens"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_token(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_token(ids[-1]) == "🚀"


def test_special_tokens_skipped(tmp_path):
    tok = build_tokenizer(str(tmp_path))
    detok = IncrementalDetokenizer(tok, [])
    ids = tok.encode("done") + [tok.eos_token_id]
    for t in ids:
        detok.add_token(t)
    assert detok.text == "done"


def assert_backend_decode_matches(tok) -> None:
    """The fast path decodes with the Rust backend directly: it must give tokenizer.decode's text,
    special tokens skipped or not, on arbitrary ids (random models emit any id)."""
    backend = backend_decoder(tok)
    assert backend is not None
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert backend.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_backend_decode_matches_the_tokenizer(tmp_path):
    assert_backend_decode_matches(build_tokenizer(str(tmp_path)))


def test_slow_path_when_spaces_are_cleaned_up(tmp_path):
    tok = build_tokenizer(str(tmp_path))
    tok.clean_up_tokenization_spaces = True
    assert backend_decoder(tok) is None
    detok = IncrementalDetokenizer(tok, [])
    for t in tok.encode("a , b"):
        detok.add_token(t)
    assert detok.text == tok.decode(tok.encode("a , b"))
