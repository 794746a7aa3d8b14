"""Pure-PyTorch paged attention: the reference every fast kernel is tested against, and the CPU path.

KV cache layout (per layer): ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A token's *slot* is ``block_id * block_size + offset``; ``slot_mapping`` holds one slot per new token
(-1 marks a padding row that must write nothing).
"""

import torch
import torch.nn.functional as F


def store_kvcache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], int, -1 = skip
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, contiguous: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rows grouped by sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [batch + 1], cumulative query lengths
    seq_lens: torch.Tensor,  # [batch], context length including this step's tokens
    block_tables: torch.Tensor,  # [batch, max_blocks]
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    The queries of sequence ``b`` are its last ``q_len`` positions: query ``i`` sits at position
    ``seq_lens[b] - q_len + i`` and sees keys ``0..position``. Decode is the case ``q_len == 1``;
    prefill with a cached prefix or a later chunk is ``q_len < seq_lens[b]``. Math in float32.
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len).float()
        v = gather_kv_ref(v_cache, block_tables[b], seq_len).float()
        q = query[q_start:q_end].float()
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [heads, q_len, D]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out
