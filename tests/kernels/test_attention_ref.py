"""The pure-PyTorch paged attention reference against a naive, independent dense implementation."""

import math
from dataclasses import dataclass

import pytest
import torch

from nanoinfer.kernels.attention_ref import (
    FP8_DTYPE,
    gather_kv_ref,
    paged_attention_ref,
    quantize_fp8_ref,
    store_kvcache_ref,
)


def _naive_attention(q, k, v, scale):
    """Dense causal attention of the last ``q_len`` positions over ``k``/``v`` ([seq_len, Hkv, D]),
    KV heads explicitly repeated, softmax written out in float64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    for i in range(q_len):
        pos = seq_len - q_len + i
        for h in range(num_heads):
            scores = (k[: pos + 1, h] @ q[i, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v[: pos + 1, h]
    return out


@dataclass
class PagedCase:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]


def _paged_case(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size) -> PagedCase:
    """Random dense K/V per sequence scattered into a shuffled block pool (written by plain indexing, not
    by the code under test); unused table entries are -1."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        block_tables[b, :nb] = blocks.int()
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = k[t]
            v_cache[blocks[t // block_size], t % block_size] = v[t]
        dense_k.append(k)
        dense_v.append(v)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(query, k_cache, v_cache, query_start_loc, seq_lens_t, block_tables, dense_k, dense_v)


CASES = [
    # seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size
    ([5, 17, 33], [5, 17, 33], 4, 4, 16, 16),  # plain prefill, MHA
    ([40, 70], [8, 70], 8, 2, 32, 16),  # cached prefix + GQA 4
    ([1, 16, 17, 100], [1, 1, 1, 1], 6, 3, 16, 16),  # decode, GQA 2
    ([130, 64, 9], [30, 1, 9], 8, 1, 16, 64),  # mixed chunk/decode/prefill, MQA, block 64
    ([200], [72], 4, 2, 64, 64),  # chunked prefill over a multi-block prefix
]


@pytest.mark.parametrize("seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_paged_attention_ref_matches_naive(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((tuple(seq_lens), block_size)) % 2**31)
    c = _paged_case(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    out = paged_attention_ref(
        c.query, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, scale
    )
    for b in range(len(seq_lens)):
        s, e = int(c.query_start_loc[b]), int(c.query_start_loc[b + 1])
        expected = _naive_attention(c.query[s:e], c.dense_k[b], c.dense_v[b], scale)
        torch.testing.assert_close(out[s:e].double(), expected, rtol=1e-4, atol=1e-5)


def test_paged_attention_ref_empty_sequence_gives_zeros():
    gen = torch.Generator().manual_seed(1)
    c = _paged_case(gen, [4, 9], [1, 1], 4, 2, 16, 16)
    c.seq_lens[0] = 0  # a CUDA-graph padding row
    out = paged_attention_ref(
        c.query, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, 0.25
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_gather_kv_ref_follows_block_table():
    gen = torch.Generator().manual_seed(2)
    c = _paged_case(gen, [37, 5], [37, 5], 2, 2, 16, 16)
    assert torch.equal(gather_kv_ref(c.k_cache, c.block_tables[0], 37), c.dense_k[0])
    assert torch.equal(gather_kv_ref(c.k_cache, c.block_tables[1], 5), c.dense_k[1])


@pytest.mark.parametrize("block_size", [16, 64])
def test_store_kvcache_ref_writes_slots_and_skips_padding(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 16, 20
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # Non-contiguous key/value views of one fused qkv tensor, as the model produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    store_kvcache_ref(key, value, k_cache, v_cache, slots)

    expected_k, expected_v = k_before.clone(), v_before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_decode_ignores_garbage_beyond_each_sequence():
    # Rows are padded to the longest context; the pool past a shorter row's end may hold NaN.
    torch.manual_seed(0)
    k_cache = torch.randn(8, 16, 2, 8)
    v_cache = torch.randn(8, 16, 2, 8)
    k_cache[3:], v_cache[3:] = float("nan"), float("nan")
    block_tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    k_cache[3, :5], v_cache[3, :5] = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    seq_lens = torch.tensor([40, 5], dtype=torch.int32)
    query = torch.randn(2, 4, 8)
    out = paged_attention_ref(
        query, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens, block_tables, 0.3
    )
    assert torch.isfinite(out).all()


# -- FP8 (e4m3) KV cache --------------------------------------------------------------------------------

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
E4M3_FINITE = E4M3_VALUES[E4M3_VALUES.isfinite()].unique()  # sorted


def test_quantize_fp8_rounds_to_the_nearest_e4m3_value_and_clamps():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4000, generator=gen) * 200
    scale = torch.tensor([0.5])
    quantized = quantize_fp8_ref(x, scale).float()
    exact = (x / 0.5).clamp(-448, 448)
    # The nearest representable value: no other e4m3 value is closer to x / scale.
    distance = (quantized - exact).abs()
    nearest = (E4M3_FINITE[None, :] - exact[:, None]).abs().min(dim=1).values
    assert torch.equal(distance, nearest)
    assert quantized.abs().max() == 448  # values past the range are clamped, never NaN
    assert torch.isfinite(quantize_fp8_ref(torch.tensor([1e9, -1e9, float("inf")]), None).float()).all()


def test_store_kvcache_ref_fp8_stores_quantized_values():
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 4, 16, 2, 16, 30
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 30
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    k_scale, v_scale = torch.tensor([0.1]), torch.tensor([0.01])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    store_kvcache_ref(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim).float()
    flat_v = v_cache.view(-1, num_kv_heads, head_dim).float()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        # Dequantized: within half an e4m3 step (2^-4 relative) of the value, or clamped.
        expected_k = key[t].clamp(-448 * 0.1, 448 * 0.1)
        torch.testing.assert_close(flat_k[slot] * 0.1, expected_k, rtol=2**-4, atol=2**-9 * 0.1)
        torch.testing.assert_close(flat_v[slot] * 0.01, value[t], rtol=2**-4, atol=2**-9 * 0.01)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert not flat_k[~written].any()


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]])
def test_paged_attention_ref_fp8_equals_attention_over_the_dequantized_cache(case):
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size = case
    gen = torch.Generator().manual_seed(5)
    c = _paged_case(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
    k_fp8, v_fp8 = quantize_fp8_ref(c.k_cache, k_scale), quantize_fp8_ref(c.v_cache, v_scale)
    args = (c.query, c.query_start_loc, c.seq_lens, c.block_tables, head_dim**-0.5)
    out = paged_attention_ref(c.query, k_fp8, v_fp8, *args[1:], k_scale, v_scale)
    dequantized = paged_attention_ref(c.query, k_fp8.float() * 0.02, v_fp8.float() * 0.03, *args[1:])
    torch.testing.assert_close(out, dequantized, rtol=1e-5, atol=1e-6)
    # And close to the unquantized attention (e4m3 keeps 3 mantissa bits).
    exact = paged_attention_ref(c.query, c.k_cache, c.v_cache, *args[1:])
    assert ((out - exact).norm() / exact.norm()).item() < 0.1


def test_kv_scales_are_rejected_without_an_fp8_cache():
    cache = torch.zeros(2, 16, 1, 16)
    key = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="k_scale"):
        store_kvcache_ref(key, key, cache, cache, torch.tensor([0]), k_scale=torch.tensor([1.0]))
    fp8 = cache.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="v_scale"):
        store_kvcache_ref(key, key, fp8, fp8, torch.tensor([0]), v_scale=torch.tensor([1.0, 2.0]))
