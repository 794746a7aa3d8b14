import pytest

from tests.fixtures import build_model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """Random Qwen3 (2 layers, hidden 64, 4 query / 2 KV heads, untied) with a trained BPE tokenizer."""
    return build_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory) -> str:
    return build_model(
        str(tmp_path_factory.mktemp("tiny_qwen3_tied")), tie_word_embeddings=True, num_hidden_layers=3, seed=1
    )
