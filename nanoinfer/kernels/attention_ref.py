"""Pure-PyTorch paged attention: the reference every fast kernel is tested against, and the CPU path.

KV cache layout (per layer): ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; ``slot_mapping`` holds one slot per new token
(-1 marks a padding row that must write nothing).

FP8 KV cache: a ``torch.float8_e4m3fn`` cache stores ``clamp(x * (1 / scale), -448, 448)`` rounded to
e4m3 (the reciprocal rounded to float32 first, then the product: one division per scale rather than per
element, in the kernels as here), with one float32 scale per layer for K and one for V (1-element
tensors; None means 1.0); readers multiply by the scale again. Scales are only accepted with an FP8
cache.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def check_kv_scales(cache_dtype: torch.dtype, k_scale, v_scale) -> None:
    """Scales make sense only for an FP8 cache; each is a 1-element float32 tensor or None."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if cache_dtype != FP8_DTYPE:
            raise ValueError(
                f"{name} is only accepted with a {FP8_DTYPE} KV cache, got a {cache_dtype} cache"
            )
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be a 1-element float32 tensor, got {scale!r}")


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` (any float dtype) as e4m3: times the float32 reciprocal of ``scale``, clamped to the finite
    range, rounded."""
    x = x.float()
    if scale is not None:
        x = x * (1.0 / scale.to(device=x.device, dtype=torch.float32))
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_cache_dtype(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return quantize_fp8_ref(x, scale) if cache.dtype == FP8_DTYPE else x.to(cache.dtype)


def dequantize_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache contents as float32 (times the FP8 scale when there is one)."""
    x = x.float()
    return x * scale.to(x.device) if scale is not None else x


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], int, -1 = skip
    k_scale: torch.Tensor | None = None,  # FP8 cache only: [1] float32
    v_scale: torch.Tensor | None = None,
) -> None:
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    # (block, offset) indexing rather than a flat view: the caches may be strided views (see
    # ModelRunner._allocate_kv_cache).
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = _to_cache_dtype(key[valid], k_cache, k_scale)
    v_cache[blocks, offsets] = _to_cache_dtype(value[valid], v_cache, v_scale)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, contiguous: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def _grouped_attention(q, k, v, mask, scale):
    """q: [..., n, Hq, D]; k, v: [..., L, Hkv, D]; mask: broadcastable to [..., Hkv, group, n, L]."""
    *lead, n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    group = num_heads // num_kv_heads
    qg = q.reshape(*lead, n, num_kv_heads, group, head_dim).movedim(-4, -2)  # [..., Hkv, group, n, D]
    kt = k.movedim(-3, -1).unsqueeze(-3)  # [..., Hkv, 1, D, L]
    scores = (qg @ kt) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows (padding) give zeros
    out = probs @ v.movedim(-3, -2).unsqueeze(-3)  # [..., Hkv, group, n, D]
    return out.movedim(-2, -4).reshape(*lead, n, num_heads, head_dim)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows grouped by sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [batch + 1], cumulative query lengths
    seq_lens: torch.Tensor,  # [batch], context length including this step's tokens
    block_tables: torch.Tensor,  # [batch, max_blocks]
    scale: float,
    k_scale: torch.Tensor | None = None,  # FP8 cache only: [1] float32
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    The queries of sequence ``b`` are its last ``q_len`` positions: query ``i`` sits at position
    ``seq_lens[b] - q_len + i`` and sees keys ``0..position``. Decode is the case ``q_len == 1``;
    prefill with a cached prefix or a later chunk is ``q_len < seq_lens[b]``. Math in float32; an FP8
    cache is dequantized (times ``k_scale`` / ``v_scale``) first.
    """
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    batch = len(lens)
    if query.shape[0] == batch == starts[-1]:  # one query per sequence (decode): one batched computation
        return _decode_ref(
            query, k_cache, v_cache, seq_lens, block_tables, max(lens), scale, k_scale, v_scale
        )
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        k = dequantize_ref(gather_kv_ref(k_cache, block_tables[b], seq_len), k_scale)
        v = dequantize_ref(gather_kv_ref(v_cache, block_tables[b], seq_len), v_scale)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        out[q_start:q_end] = _grouped_attention(query[q_start:q_end].float(), k, v, mask, scale).to(
            query.dtype
        )
    return out


def _decode_ref(query, k_cache, v_cache, seq_lens, block_tables, max_len, scale, k_scale, v_scale):
    if max_len == 0:
        return torch.zeros_like(query)
    block_size = k_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    k = dequantize_ref(k_cache[tables].flatten(1, 2)[:, :max_len], k_scale)  # [batch, max_len, Hkv, D]
    v = dequantize_ref(v_cache[tables].flatten(1, 2)[:, :max_len], v_scale)
    k_pos = torch.arange(max_len, device=query.device)
    valid = k_pos[None, :] < seq_lens[:, None]  # [batch, L]
    # Padding positions of shorter rows hold whatever the pool holds there (possibly NaN); their
    # probability is 0, but 0 * NaN is NaN, so their values are zeroed too.
    v = v.masked_fill(~valid[:, :, None, None], 0.0)
    mask = valid.view(-1, 1, 1, 1, max_len)  # [batch, Hkv, group, 1, L]
    out = _grouped_attention(query.float().unsqueeze(1), k, v, mask, scale)  # [batch, 1, Hq, D]
    return out.squeeze(1).to(query.dtype)
