"""Builders for tiny test checkpoints: random-weight models saved with transformers and a small BPE
tokenizer trained on the spot. Nothing is downloaded."""

from __future__ import annotations

import os

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch.",
    "Prefix caching reuses the KV cache of shared prompt prefixes.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "你好，世界！大语言模型推理引擎。 Emoji: 🚀🔥✨ café naïve",
]


def build_tokenizer(directory: str, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


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
    **extra,
) -> str:
    """Saves a random model plus the tiny tokenizer in ``directory``; returns the directory."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=len(tokenizer),
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
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
