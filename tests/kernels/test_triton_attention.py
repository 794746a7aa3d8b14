"""Triton kernels against the pure-PyTorch reference (CUDA only)."""

import math

import pytest
import torch

from nanoinfer.kernels.attention_ref import paged_attention_ref, store_kvcache_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPE = torch.bfloat16
TOLERANCE = 1e-2


def _kernels():
    from nanoinfer.kernels import triton_attention

    return triton_attention


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()


def _random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, device):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=device).to(DTYPE)
    return k_cache, v_cache


def _random_tables(gen, seq_lens, block_size, device):
    """Shuffled block ids, as a row-strided (non-contiguous) view; unused entries point at junk blocks
    past the used ones so a kernel that reads past seq_len picks up wrong data, never a fault."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    width = max(blocks_per_seq + [1])
    num_used = sum(blocks_per_seq)
    num_blocks = num_used + 4
    perm = torch.randperm(num_blocks, generator=gen, device=device).int()
    storage = torch.full((len(seq_lens), width + 3), num_blocks - 1, dtype=torch.int32, device=device)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        storage[b, :nb] = perm[used : used + nb]
        used += nb
    return storage[:, :width], num_blocks


def _qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim, device):
    """query/key/value as non-contiguous views of one fused projection output, as the model makes them."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen, device=device)
    qkv = qkv.to(DTYPE)
    return (
        qkv[:, :num_heads],
        qkv[:, num_heads : num_heads + num_kv_heads],
        qkv[:, num_heads + num_kv_heads :],
    )


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 8, 128), (64, 2, 64), (256, 1, 128)])
def test_store_kvcache_matches_reference(block_size, num_kv_heads, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    num_blocks, num_tokens = 9, 50
    k_cache, v_cache = _random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, "cuda")
    _, key, value = _qkv_views(gen, num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, "cuda")
    slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
    slots[::3] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, expected_k, expected_v, slots)
    _kernels().store_kvcache(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


DECODE_CASES = [
    # seq_lens, num_heads, num_kv_heads, head_dim, block_size
    ([1, 7, 16, 17, 300], 8, 8, 128, 16),
    ([0, 33, 1000, 0, 64], 16, 8, 128, 16),  # seq_len 0: CUDA-graph padding rows
    ([513, 2, 129], 16, 2, 64, 64),
    ([700, 1, 256, 255], 32, 4, 128, 256),
    ([4000], 16, 8, 128, 16),  # batch 1: many splits
    (list(range(1, 200, 3)), 14, 2, 64, 16),  # group of 7: padded query rows
]


@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", DECODE_CASES)
def test_paged_decode_matches_reference(seq_lens, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator(device="cuda").manual_seed(len(seq_lens) * 1000 + block_size)
    batch = len(seq_lens)
    tables, num_blocks = _random_tables(gen, seq_lens, block_size, "cuda")
    k_cache, v_cache = _random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, "cuda")
    query, _, _ = _qkv_views(gen, batch, num_heads, num_kv_heads, head_dim, "cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full((batch, num_heads, head_dim), float("nan"), dtype=DTYPE, device="cuda")
    _kernels().paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, out=out)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, scale)
    assert not out.isnan().any()
    assert _rel_error(out, ref) < TOLERANCE
    assert torch.equal(out[lens == 0], torch.zeros_like(out[lens == 0]))


def test_paged_decode_with_workspace_replays_in_cuda_graph():
    kernels = _kernels()
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, num_heads, num_kv_heads, head_dim, block_size = 4, 16, 8, 128, 16
    tables, num_blocks = _random_tables(gen, [512] * batch, block_size, "cuda")
    k_cache, v_cache = _random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, "cuda")
    query = torch.randn(batch, num_heads, head_dim, generator=gen, device="cuda").to(DTYPE)
    lens = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    workspace = kernels.DecodeWorkspace.allocate(
        batch, num_heads, num_kv_heads, head_dim, tables.shape[1] * block_size, "cuda"
    )
    args = (query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    kernels.paged_decode_attention(*args, out=out, workspace=workspace)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_decode_attention(*args, out=out, workspace=workspace)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    for new_lens in ([512, 1, 0, 300], [17, 511, 64, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, head_dim**-0.5)
        assert not out.isnan().any()
        assert _rel_error(out, ref) < TOLERANCE


PREFILL_CASES = [
    # seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size
    ([100, 1, 257], [100, 1, 257], 8, 8, 128, 16),  # plain prefill
    ([600, 90, 300], [88, 90, 1], 16, 8, 128, 16),  # cached prefix, decode row mixed in
    ([1030, 40], [500, 7], 16, 2, 64, 64),  # chunked prefill over a long prefix
    ([300, 129], [200, 129], 32, 4, 128, 256),
]


@pytest.mark.parametrize("seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size", PREFILL_CASES)
def test_paged_prefill_matches_reference(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator(device="cuda").manual_seed(sum(seq_lens) + block_size)
    tables, num_blocks = _random_tables(gen, seq_lens, block_size, "cuda")
    k_cache, v_cache = _random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, "cuda")
    num_padding_rows = 3  # rows past query_start_loc[-1] must come out as zeros, as in the reference
    num_tokens = sum(q_lens) + num_padding_rows
    query, _, _ = _qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim, "cuda")
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=DTYPE, device="cuda")
    _kernels().paged_prefill_attention(
        query, k_cache, v_cache, qsl, lens, tables, max(q_lens), scale, out=out
    )
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, scale)
    assert not out.isnan().any()
    assert _rel_error(out, ref) < TOLERANCE
    assert torch.equal(out[-num_padding_rows:], torch.zeros_like(out[-num_padding_rows:]))


def test_input_validation_names_the_field():
    kernels = _kernels()
    k_cache = torch.zeros(4, 16, 2, 64, dtype=DTYPE, device="cuda")
    query = torch.zeros(2, 3, 64, dtype=DTYPE, device="cuda")
    tables = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.paged_decode_attention(query, k_cache, k_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(
            query[..., :48], k_cache[..., :48], k_cache[..., :48], tables, lens, 0.1
        )
