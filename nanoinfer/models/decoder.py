"""One decoder-only transformer covering the Qwen3, Qwen2 and Llama families.

The families differ only in a few switches read from the config (`DecoderVariant`): Qwen3 normalises
q and k per head (QK-norm), Qwen2 has q/k/v biases, Llama may carry biases and llama3 RoPE scaling.
The model is unaware of tensor parallelism beyond choosing the parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanoinfer.layers.attention import Attention, AttentionMetadata
from nanoinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.kernels import REFERENCE_KERNELS, SplitKPartials
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.rotary import RotaryEmbedding, rope_parameters


@dataclass(frozen=True)
class DecoderVariant:
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @staticmethod
    def for_architecture(arch: str, cfg: Any) -> DecoderVariant:
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        if arch == "Qwen3ForCausalLM":
            return DecoderVariant(
                qk_norm=True, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False
            )
        if arch == "Qwen2ForCausalLM":
            return DecoderVariant(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False)
        if arch == "LlamaForCausalLM":
            return DecoderVariant(
                qk_norm=False, qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=mlp_bias
            )
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")


SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


class DecoderAttention(nn.Module):
    def __init__(self, cfg: Any, variant: DecoderVariant, head_dim: int, max_position: int):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, variant.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * head_dim, cfg.hidden_size, variant.o_bias, ends_residual_branch=True
        )
        theta, scaling = rope_parameters(cfg)
        self.rotary = RotaryEmbedding(head_dim, max_position, theta, scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)
        self.eps = cfg.rms_norm_eps
        if variant.qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kernels = REFERENCE_KERNELS

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | SplitKPartials:
        qkv = self.qkv_proj(x)  # [tokens, (heads + 2 * kv_heads) * head_dim]
        attn = self.attn
        # One kernel: per-head QK-norm (Qwen3), RoPE, and k/v written to their paged slots.
        q, k, v = self.kernels.qk_norm_rope_store(
            qkv,
            positions,
            self.rotary.cos_sin,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.eps,
            attn.k_cache,
            attn.v_cache,
            meta.slot_mapping,
            attn.k_scale,
            attn.v_scale,
            q_out=attn.query_destination(qkv.shape[0]),
        )
        out = attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: Any, variant: DecoderVariant):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], variant.mlp_bias)
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, variant.mlp_bias, gated_input=True, ends_residual_branch=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, variant: DecoderVariant, head_dim: int, max_position: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, variant, head_dim, max_position)
        self.mlp = DecoderMLP(cfg, variant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: Any, variant: DecoderVariant, head_dim: int, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, variant, head_dim, max_position) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    # Checkpoint name fragment -> (fused parameter fragment, shard id for its weight_loader).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: Any, max_position: int):
        super().__init__()
        arch = (getattr(cfg, "architectures", None) or ["<none>"])[0]
        variant = DecoderVariant.for_architecture(arch, cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.model = DecoderModel(cfg, variant, head_dim, max_position)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
