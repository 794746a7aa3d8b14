"""Random-weight checkpoints in real model shapes, for benchmarks on machines without a model hub.

Weights are drawn directly as tensors and written with safetensors (instantiating a transformers model
of several billion parameters just to save noise would take minutes)."""

from __future__ import annotations

import json
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


def write_toy_tokenizer(directory: str, vocab_size: int = 384):
    """Trains and saves a small byte-level BPE tokenizer with ChatML special tokens and a chat template."""
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


# Shapes of the published Qwen3 checkpoints (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-8B).
QWEN3_SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
}  # fmt: skip


def _parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (nq * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_random_qwen3(
    directory: str, shape: str | dict = "qwen3-0.6b", device: str = "cpu", seed: int = 0,
    shard_bytes: int = 4 << 30, max_position_embeddings: int = 40960,
) -> str:  # fmt: skip
    """Writes config.json, bf16 safetensors shards (with an index) and a toy tokenizer of a random
    Qwen3 model."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    cfg = dict(QWEN3_SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    os.makedirs(directory, exist_ok=True)
    # Benchmarks feed token ids; the toy tokenizer only turns outputs into (meaningless) text.
    write_toy_tokenizer(directory)
    Qwen3Config(
        **cfg, max_position_embeddings=max_position_embeddings, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        dtype="bfloat16", architectures=["Qwen3ForCausalLM"], eos_token_id=151645, bos_token_id=None,
    ).save_pretrained(directory)  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shp in _parameter_shapes(cfg).items():
        if len(shp) == 1:
            t = torch.ones(shp, dtype=torch.bfloat16, device=device)
        else:
            # std 0.02 like real initialisations; embeddings larger so logits are not flat.
            std = 0.5 if "embed" in name else 0.02
            t = (torch.randn(shp, generator=gen, device=device) * std).to(torch.bfloat16)
        nbytes = t.numel() * 2
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return directory
