"""Builders for tiny test checkpoints: random-weight models saved with transformers and a small BPE
tokenizer trained on the spot. Nothing is downloaded."""

from __future__ import annotations

import os

import torch

from nanoinfer.benchmarks.random_checkpoint import CHAT_TEMPLATE
from nanoinfer.benchmarks.random_checkpoint import write_toy_tokenizer as build_tokenizer

__all__ = ["CHAT_TEMPLATE", "build_model", "build_tokenizer"]


def build_model(
    directory: str,
    architecture: str = "Qwen3ForCausalLM",
    tie_word_embeddings: bool = False,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 512,
    seed: int = 0,
    weight_std: float = 0.08,
    **extra,
) -> str:
    """Saves a random model plus the tiny tokenizer in ``directory``; returns the directory."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_cls(
        # A larger vocab_size than the tokenizer's gives the model ids no token has, as real checkpoints
        # do (Qwen pads its embedding to a multiple of 128).
        vocab_size=extra.pop("vocab_size", len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        architectures=[architecture],
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    # Larger-than-default random weights make the next-token distribution peaked, so greedy decoding
    # rarely meets near-ties and token-for-token comparisons are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, weight_std if "embed" not in name else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def engine_requests(processor, prefix: str, count: int = 3, **params) -> list:
    """The EngineRequests of ``count`` prompts ("hello world" i + 1 times, ids ``prefix0``...) through an
    InputProcessor: greedy, 8 tokens ignoring EOS, unless ``params`` (SamplingParams fields) say
    otherwise."""
    from nanoinfer.sampling_params import SamplingParams

    params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **params}
    sampling = SamplingParams(**params)
    return [
        child
        for i in range(count)
        for child in processor.process(f"{prefix}{i}", "hello world " * (i + 1), sampling).children
    ]
