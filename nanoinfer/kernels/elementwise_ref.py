"""Pure-PyTorch definitions of the fused elementwise kernels of a decoder layer (the references the
Triton kernels in `triton_elementwise` are tested against).

Rounding follows the layers the kernels replace (nanoinfer/layers, and transformers): RMSNorm normalises
in float32, rounds to the activation dtype, then multiplies by the weight (rounded again); the residual
sum is rounded to the activation dtype before it is normalised; SiLU is rounded before the product;
RoPE rotates in float32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoinfer.kernels.attention_ref import store_kvcache_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; the result has ``x``'s dtype."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * normed.float()).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual <- x + residual`` (rounded to the activation dtype), then
    ``x <- rms_norm(residual)``. Returns ``(x, residual)``, the same tensors."""
    residual.copy_(x + residual)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def add_partials_rms_norm_ref(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts`` [S, T, H] float32, a projection's partial products over S ranges of its input: their
    sum (in split order, rounded to the activation dtype as the whole projection's output would be)
    is added to ``residual`` in place as :func:`add_rms_norm_ref` adds ``x``. Returns a new normed
    [T, H] tensor and ``residual``."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return add_rms_norm_ref(total.to(residual.dtype), residual, weight, eps)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, num_heads, D], k and v [T, num_kv_heads, D]: views into the fused projection output."""
    heads = qkv.unflatten(-1, (num_heads + 2 * num_kv_heads, head_dim))
    return (
        heads[:, :num_heads],
        heads[:, num_heads : num_heads + num_kv_heads],
        heads[:, num_heads + num_kv_heads :],
    )


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [T, heads, D] at ``positions``; ``cos_sin`` [max_position, D] holds
    the cos half then the sin half. Computed in float32, rounded once to ``x``'s dtype."""
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope_store_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of ``qkv`` [T, (num_heads + 2 * num_kv_heads) * head_dim] RMS-normalised per head (each
    only when its weight is given), then rotated; k and v then written to the paged cache at
    ``slot_mapping`` (-1: nothing), quantized when the cache is FP8. The rotated q goes back into
    ``qkv``, or to ``q_out`` [T, num_heads, head_dim] when given; the rotated k goes back into ``qkv``
    only when the cache is empty (numel 0: nothing is stored). Returns q (``q_out`` when given), k, v:
    views into ``qkv``."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q_in = rms_norm_ref(q, q_norm_weight, eps) if q_norm_weight is not None else q
    k_in = rms_norm_ref(k, k_norm_weight, eps) if k_norm_weight is not None else k
    if q_out is not None:
        q = q_out
    q.copy_(rope_ref(q_in, positions, cos_sin))
    k_rotated = rope_ref(k_in, positions, cos_sin)
    if k_cache.numel() > 0:
        store_kvcache_ref(k_rotated, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        k.copy_(k_rotated)
    return q, k, v
