"""Prefill through PyTorch's FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``).

An alternative to the Triton paged prefill kernel: the context of each sequence is first gathered out of
the paged cache into one contiguous [total_context, num_kv_heads, head_dim] buffer, then attended with
bottom-right-aligned causal masking (query ``i`` of a sequence sits at ``seq_len - q_len + i``).
It reads one device value on the host (the total context length), so it is for eager prefill only.
Kept for the comparison in scripts/gpu_kernels.py: on the H200 it measured slower than the Triton
kernel (docs/benchmarks.md), so the engine does not use it.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch


@cache
def _varlen_api() -> tuple[object, frozenset[str]]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn") from exc
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attn_available() -> bool:
    try:
        _varlen_api()
    except RuntimeError:
        return False
    return True


def gather_context_slots(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, total_context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every context token of every sequence, sequence after sequence ([total_context] int64),
    and the cumulative context lengths ([batch + 1] int32)."""
    device = seq_lens.device
    cu_seq_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=device)
    torch.cumsum(seq_lens, 0, out=cu_seq_k[1:])
    seq_ids = torch.repeat_interleave(
        torch.arange(seq_lens.shape[0], device=device), seq_lens.long(), output_size=total_context
    )
    positions = torch.arange(total_context, device=device) - cu_seq_k[seq_ids].long()
    blocks = block_tables.long()[seq_ids, positions // block_size]
    return blocks * block_size + positions % block_size, cu_seq_k


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's context K and V, contiguous ([total_context, num_kv_heads, head_dim] each), and
    the cumulative context lengths. Reads the total context length on the host."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    total_context = int(seq_lens.sum())
    slots, cu_seq_k = gather_context_slots(seq_lens, block_tables, block_size, total_context)
    key = k_cache.view(-1, num_kv_heads, head_dim)[slots]
    value = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    return key, value, cu_seq_k


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """FlashAttention varlen over contiguous K/V, causal aligned to each sequence's last position."""
    varlen_attn, params = _varlen_api()
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    kwargs: dict[str, object] = {"scale": scale}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = num_heads != num_kv_heads
    elif num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return varlen_attn(query, key, value, query_start_loc, cu_seq_k, max_query_len, max_seq_len, **kwargs)


def varlen_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Same contract as ``paged_prefill_attention``, except that rows past query_start_loc[-1] are left
    unspecified. ``max_seq_len`` must be >= every seq_len."""
    key, value, cu_seq_k = gather_context(k_cache, v_cache, seq_lens, block_tables)
    return varlen_causal_attention(
        query, key, value, query_start_loc, cu_seq_k, max_query_len, max_seq_len, scale
    )


def varlen_paged_available() -> bool:
    return varlen_attn_available() and "block_table" in _varlen_api()[1]


def varlen_prefill_attention_paged(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """As :func:`varlen_prefill_attention`, reading the paged cache through the block table (no gather).
    FlashAttention 2 accepts only block sizes that are multiples of 256."""
    varlen_attn, params = _varlen_api()
    if "block_table" not in params:
        raise RuntimeError(f"varlen_attn of torch {torch.__version__} takes no block_table")
    cu_seq_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, out=cu_seq_k[1:])
    return varlen_attn(
        query,
        k_cache,
        v_cache,
        query_start_loc,
        cu_seq_k,
        max_query_len,
        max_seq_len,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=query.shape[1] != k_cache.shape[2],
        seqused_k=seq_lens,
        block_table=block_tables,
    )
