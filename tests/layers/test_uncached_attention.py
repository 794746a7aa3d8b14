"""The attention layer before its KV pool exists (the warm-up pass and the FP8 scale calibration): queries
taken a chunk at a time against their keys so far give the causal attention of each whole sequence."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.layers.attention import Attention, AttentionMetadata


@pytest.mark.parametrize("query_chunk", [1, 5, 64, 256])
def test_uncached_attention_in_query_chunks_is_causal_attention_per_sequence(query_chunk):
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, lengths = 6, 2, 16, [37, 1, 130]
    layer = Attention(num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
    tokens = sum(lengths)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    starts = [0, 37, 38, tokens]
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.zeros(3, 1, dtype=torch.int32),
        num_decode_rows=0,
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )
    out = layer._attend_uncached(q, k, v, meta, query_chunk=query_chunk)
    for s, e in zip(starts, starts[1:], strict=False):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            k[s:e].transpose(0, 1),
            v[s:e].transpose(0, 1),
            is_causal=True,
            scale=head_dim**-0.5,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], expected, rtol=1e-5, atol=1e-5)
