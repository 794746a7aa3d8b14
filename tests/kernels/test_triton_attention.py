"""Triton paged-attention kernels against the pure-PyTorch reference (GPU, or Triton's interpreter)."""

import pytest
import torch

from nanoinfer.kernels.attention_ref import FP8_DTYPE, paged_attention_ref, store_kvcache_ref
from tests.kernels.helpers import (
    DEVICE,
    DTYPE,
    DTYPES,
    fp8_scales,
    fp8_store,
    generator,
    gpu_only,
    head_major,
    randn,
    random_cache,
    random_tables,
    rel_error,
    tolerance,
    triton_module,
)


def _kernels():
    return triton_module("triton_attention")


def _qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """query/key/value as non-contiguous views of one fused projection output, as the model makes them."""
    qkv = randn(gen, num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    return (
        qkv[:, :num_heads],
        qkv[:, num_heads : num_heads + num_kv_heads],
        qkv[:, num_heads + num_kv_heads :],
    )


def _attention_tolerance(dtype):
    return max(tolerance(dtype), 1e-3)  # softmax-weighted sums: a few roundings more than one op


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 3, 64), (256, 1, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    kernels = _kernels()
    gen = generator(block_size)
    num_blocks, num_tokens = 3, 20
    k_cache, v_cache = random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    _, key, value = _qkv_views(gen, num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[::3] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, expected_k, expected_v, slots)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots.int())
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@fp8_store
@pytest.mark.parametrize("scales", [(0.05, 0.02), None])
def test_store_kvcache_fp8_matches_reference(scales):
    kernels = _kernels()
    gen = generator(3)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 8, 128, 60
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(FP8_DTYPE)
    v_cache = k_cache.clone()
    _, key, value = _qkv_views(gen, num_tokens, 16, num_kv_heads, head_dim, DTYPE)
    key.mul_(20)  # past 448 / k_scale for some values: clamped, never NaN
    k_scale, v_scale = fp8_scales(*scales) if scales else (None, None)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[::5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, expected_k, expected_v, slots, k_scale, v_scale)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


DECODE_CASES = [
    # seq_lens, num_heads, num_kv_heads, head_dim, block_size
    ([1, 7, 16, 17, 100], 6, 3, 64, 16),
    ([0, 33, 300, 0], 4, 4, 64, 16),  # MHA; seq_len 0: CUDA-graph padding rows
    ([129, 2, 64], 8, 1, 64, 256),  # group of 8 (MQA)
    ([250], 8, 2, 128, 16),  # batch 1: many splits
    ([40, 90], 14, 2, 64, 16),  # group of 7: padded query rows
]
DECODE_CONFIGS = {
    "default": None,
    "merge_kernel": "MERGE_KERNEL_DECODE",
    "fused": "FUSED_DECODE",
    "fused_small_tiles": dict(block_n=16, min_split_tiles=2),
    # A register cap is a compiler option (the interpreter ignores it): the results must not change.
    "merge_capped_registers": dict(mode="merge_kernel", block_n=16, num_warps=1, max_registers=128),
    # One split length for the batch: short sequences use fewer splits, and one split writes directly.
    "balanced": dict(mode="balanced", block_n=16),
    "balanced_min_splits": dict(mode="balanced", block_n=16, min_splits=4),
    "fp8_balanced": "FP8_BALANCED_DECODE",
    # cuda_decode's kernel on a GPU; elsewhere the Triton kernel with the same splits.
    "fp8_cuda": "FP8_CUDA_DECODE",
}


def _decode_config(kernels, name):
    spec = DECODE_CONFIGS[name]
    if spec is None:
        return None
    if isinstance(spec, str):
        return getattr(kernels, spec)
    return kernels.DecodeConfig(**spec)


# FP8 dequantization is the same code in every mode: the two merge schemes are enough.
DECODE_VARIANTS = [(name, False) for name in sorted(DECODE_CONFIGS)] + [
    ("default", True),
    ("merge_kernel", True),
    ("balanced", True),
    ("fp8_balanced", True),
    ("fp8_cuda", True),
]


@pytest.mark.parametrize("config_name,fp8", DECODE_VARIANTS)
@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", DECODE_CASES)
def test_paged_decode_matches_reference(
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, fp8, config_name
):
    kernels = _kernels()
    config = _decode_config(kernels, config_name)
    gen = generator(len(seq_lens) * 1000 + block_size)
    batch = len(seq_lens)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.5, 0.25) if fp8 else (None, None)
    k_cache, v_cache = random_cache(
        gen, num_blocks, block_size, num_kv_heads, head_dim, DTYPE, scales if fp8 else None
    )
    query, _, _ = _qkv_views(gen, batch, num_heads, num_kv_heads, head_dim, DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full((batch, num_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE)
    workspace = kernels.DecodeWorkspace.allocate(
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        tables.shape[1] * block_size,
        DEVICE,
        config,
        cache_dtype=k_cache.dtype,
    )
    kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, scale, out=out, workspace=workspace, k_scale=scales[0],
        v_scale=scales[1], config=config,
    )  # fmt: skip
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, scale, *scales)
    assert not out.isnan().any()
    assert rel_error(out, ref) < _attention_tolerance(DTYPE)
    assert torch.equal(out[lens == 0], torch.zeros_like(out[lens == 0]))
    assert not workspace.counters.any(), "the fused merge must leave its counters at zero"


def test_tuned_fp8_decode_config_reads_the_gpu_models_file(tmp_path):
    kernels = _kernels()
    assert kernels.device_config_file("NVIDIA H200") == "NVIDIA_H200.json"
    assert kernels.device_config_file(" NVIDIA H100 80GB HBM3 ") == "NVIDIA_H100_80GB_HBM3.json"
    # No file: FP8_CUDA_DECODE itself.
    assert kernels.tuned_fp8_decode_config("NVIDIA H100 80GB HBM3", tmp_path) is kernels.FP8_CUDA_DECODE
    (tmp_path / "NVIDIA_H200.json").write_text('{"stage_in_shared": true, "num_stages": 3}')
    tuned = kernels.tuned_fp8_decode_config("NVIDIA H200", tmp_path)
    assert tuned.stage_in_shared and tuned.num_stages == 3 and tuned.kernel == "cuda"
    assert tuned.kv_heads_first == kernels.FP8_CUDA_DECODE.kv_heads_first
    (tmp_path / "GPU_A.json").write_text('{"max_registers": 128}')
    assert kernels.tuned_fp8_decode_config("GPU A", tmp_path).max_registers == 128
    bad = {
        "GPU_B.json": ('{"tiles": 3}', "has no field 'tiles'"),
        "GPU_C.json": ('{"num_stages": "3"}', "num_stages must be int"),
        "GPU_D.json": ('{"stage_in_shared": 1}', "stage_in_shared must be bool"),
        "GPU_E.json": ('{"num_stages": 5}', "num_stages <= 4"),
        "GPU_F.json": ("[3]", "JSON object"),
        "GPU_G.json": ('{"num_stages": 3,', "not JSON"),
    }
    for file_name, (text, message) in bad.items():
        (tmp_path / file_name).write_text(text)
        with pytest.raises(ValueError, match=message) as caught:
            kernels.tuned_fp8_decode_config(file_name.removesuffix(".json").replace("_", " "), tmp_path)
        assert file_name in str(caught.value)
    # The engine's path: no CUDA device, no lookup.
    assert kernels.default_decode_config(64, FP8_DTYPE, torch.device("cpu")) is kernels.FP8_CUDA_DECODE


def test_default_decode_config_follows_the_cache_dtype_and_the_grid():
    kernels = _kernels()
    # bf16 at any batch and a single FP8 row: splits (where needed) merged by a second kernel.
    for batch in (1, 8, 256):
        assert kernels.default_decode_config(batch, DTYPE) is kernels.MERGE_KERNEL_DECODE
    assert kernels.default_decode_config(1, FP8_DTYPE) is kernels.MERGE_KERNEL_DECODE
    for batch in (2, 16, 17, 64, 256):
        assert kernels.default_decode_config(batch, FP8_DTYPE) is kernels.FP8_CUDA_DECODE
    # Towards 64 programs per SM, 16 splits at most (powers of two).
    splits = [
        kernels.decode_num_splits(b, 8, 4096, 132, kernels.FP8_BALANCED_DECODE) for b in (24, 64, 128, 256)
    ]
    assert splits == [16, 16, 8, 4]


def test_fused_decode_splits_short_contexts_on_the_device():
    kernels = _kernels()
    config = kernels.DecodeConfig(block_n=16, min_split_tiles=1)
    # The grid is sized from the block table's width; a short sequence uses only the splits it needs.
    assert kernels.decode_num_splits(1, 8, 4096, 132, config) == 64
    assert kernels.decode_num_splits(256, 8, 4096, 132, config) == 1
    assert kernels.decode_num_splits(1, 8, 4096, 132, kernels.MERGE_KERNEL_DECODE) == 64
    assert kernels.decode_num_splits(4, 8, 100, 132, kernels.MERGE_KERNEL_DECODE) == 2
    gen = generator(11)
    seq_lens = [5, 70, 33]
    tables, num_blocks = random_tables(gen, [1024] * 3, 16)  # wide tables: many grid splits
    k_cache, v_cache = random_cache(gen, num_blocks, 16, 2, 64, DTYPE)
    query = randn(gen, 3, 4, 64, dtype=DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, out=out, config=config)
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.125)
    assert rel_error(out, ref) < _attention_tolerance(DTYPE)


def test_balanced_decode_splits_follow_the_longest_sequence():
    kernels = _kernels()
    config = kernels.DecodeConfig(mode="balanced", block_n=16, min_splits=4)
    # However full the grid, balanced mode keeps its minimum split count (a power of two).
    assert kernels.decode_num_splits(256, 8, 4096, 132, config) == 4
    assert kernels.decode_num_splits(256, 8, 32, 132, config) == 2  # never more than the context's tiles
    assert kernels.decode_num_splits(256, 8, 4096, 132, kernels.DecodeConfig(mode="balanced")) == 1
    assert kernels.decode_num_splits(8, 8, 4096, 132, kernels.DecodeConfig(mode="balanced")) == 8
    # A batch of mixed lengths: the longest uses every split, the shortest one (written directly), and a
    # batch longer than one block of lengths (the kernel scans them all for the longest).
    gen = generator(12)
    seq_lens = [3] * 300 + [640, 0, 17, 300]
    batch = len(seq_lens)
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    k_cache, v_cache = random_cache(gen, num_blocks, 16, 1, 32, DTYPE)
    query = randn(gen, batch, 2, 32, dtype=DTYPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, out=out, config=config)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.125)
    assert not out.isnan().any()
    assert rel_error(out, ref) < _attention_tolerance(DTYPE)
    assert torch.equal(out[batch - 3], torch.zeros_like(out[batch - 3]))


def test_decode_config_rejects_a_bad_mode_or_split_floor():
    kernels = _kernels()
    with pytest.raises(ValueError, match="DecodeConfig.mode"):
        kernels.DecodeConfig(mode="even")
    with pytest.raises(ValueError, match="DecodeConfig.min_splits"):
        kernels.DecodeConfig(mode="balanced", min_splits=128)


@gpu_only
@pytest.mark.parametrize("config_name", ["fused", "merge_kernel", "balanced"])
def test_paged_decode_with_workspace_replays_in_cuda_graph(config_name):
    kernels = _kernels()
    config = _decode_config(kernels, config_name)
    gen = generator(7)
    batch, num_heads, num_kv_heads, head_dim, block_size = 4, 16, 8, 128, 16
    tables, num_blocks = random_tables(gen, [512] * batch, block_size)
    k_cache, v_cache = random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, DTYPE)
    query = randn(gen, batch, num_heads, head_dim, dtype=DTYPE)
    lens = torch.full((batch,), 100, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(query)
    workspace = kernels.DecodeWorkspace.allocate(
        batch, num_heads, num_kv_heads, head_dim, tables.shape[1] * block_size, DEVICE, config
    )
    args = (query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    kernels.paged_decode_attention(*args, out=out, workspace=workspace, config=config)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_decode_attention(*args, out=out, workspace=workspace, config=config)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    for new_lens in ([512, 1, 0, 300], [17, 511, 64, 0]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=gen, device=DEVICE))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, head_dim**-0.5)
        assert not out.isnan().any()
        assert rel_error(out, ref) < _attention_tolerance(DTYPE)
    assert not workspace.counters.any()


PREFILL_CASES = [
    # seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size
    ([40, 1, 70], [40, 1, 70], 4, 4, 64, 16),  # plain prefill, MHA
    ([150, 30, 60], [22, 30, 1], 6, 2, 64, 16),  # cached prefix, decode row mixed in, group 3
    ([200, 20], [40, 7], 4, 1, 128, 256),  # chunked prefill over a long prefix, MQA
]
PREFILL_CONFIGS = {
    "default": None,
    "m64_n64_unpacked": dict(),
    "m16_n16": dict(block_m=16, block_n=16),
    "m128_n64_8warps": dict(block_m=128, block_n=64, num_warps=8),
    "packed_m64_n32": dict(block_m=64, block_n=32, pack_gqa=True),
}


# FP8 dequantization is the same code in every tiling: two of them are enough.
PREFILL_VARIANTS = [(name, False) for name in sorted(PREFILL_CONFIGS)] + [
    ("default", True),
    ("packed_m64_n32", True),
]


@pytest.mark.parametrize("config_name,fp8", PREFILL_VARIANTS)
@pytest.mark.parametrize("seq_lens,q_lens,num_heads,num_kv_heads,head_dim,block_size", PREFILL_CASES)
def test_paged_prefill_matches_reference(
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, fp8, config_name
):
    kernels = _kernels()
    spec = PREFILL_CONFIGS[config_name]
    config = kernels.PrefillConfig(**spec) if spec is not None else None
    gen = generator(sum(seq_lens) + block_size)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.3, 0.6) if fp8 else (None, None)
    k_cache, v_cache = random_cache(
        gen, num_blocks, block_size, num_kv_heads, head_dim, DTYPE, scales if fp8 else None
    )
    num_padding_rows = 3  # rows past query_start_loc[-1] must come out as zeros, as in the reference
    num_tokens = sum(q_lens) + num_padding_rows
    query, _, _ = _qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim, DTYPE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), dtype=DTYPE, device=DEVICE)
    kernels.paged_prefill_attention(
        query, k_cache, v_cache, qsl, lens, tables, max(q_lens), scale, out=out, k_scale=scales[0],
        v_scale=scales[1], config=config,
    )  # fmt: skip
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, scale, *scales)
    assert not out.isnan().any()
    assert rel_error(out, ref) < _attention_tolerance(DTYPE)
    assert torch.equal(out[-num_padding_rows:], torch.zeros_like(out[-num_padding_rows:]))


def test_default_prefill_tiling_takes_a_group_wider_than_its_rows():
    """The default tile packs a GQA group into its 64 rows; a group of 128 query heads per KV head does
    not fit, and the default then tiles the heads unpacked (an explicit packed config is refused)."""
    kernels = _kernels()
    gen = generator(23)
    seq_lens, num_heads, head_dim = [20, 33], 128, 16
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    k_cache, v_cache = random_cache(gen, num_blocks, 16, 1, head_dim, DTYPE, None)
    query = randn(gen, sum(seq_lens), num_heads, head_dim, dtype=DTYPE)
    qsl = torch.tensor([0, 20, 53], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill_attention(query, k_cache, v_cache, qsl, lens, tables, 33, 0.25)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.25)
    assert rel_error(out, ref) < _attention_tolerance(DTYPE)
    with pytest.raises(ValueError, match="block_m"):
        kernels.paged_prefill_attention(
            query, k_cache, v_cache, qsl, lens, tables, 33, 0.25, config=kernels.DEFAULT_PREFILL
        )


def test_default_prefill_tiling_follows_the_cache_dtype():
    """32-key tiles over a 16-bit cache, 64-key tiles over an FP8 one (the faster of each on the H200);
    short queries take the 16-row tile whatever the cache, and a group wider than the rows is unpacked."""
    kernels = _kernels()
    assert kernels._prefill_config(300, 2, fp8_cache=False) == kernels.DEFAULT_PREFILL
    assert kernels._prefill_config(300, 2, fp8_cache=True) == kernels.FP8_PREFILL
    assert kernels.DEFAULT_PREFILL.block_n == 32 and kernels.FP8_PREFILL.block_n == 64
    for fp8_cache in (False, True):
        assert kernels._prefill_config(16, 2, fp8_cache) == kernels.SHORT_QUERY_PREFILL
        assert not kernels._prefill_config(300, 128, fp8_cache).pack_gqa


def test_fp8_cache_with_bf16_queries_matches_reference():
    """Against an FP8 cache a bf16 query is multiplied in float16 (the kernels' _matmul_dtype): the
    decode and prefill kernels still match the reference at bf16's tolerance."""
    kernels = _kernels()
    gen = generator(17)
    seq_lens, q_lens = [37, 130, 1], [5, 64, 1]
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    scales = fp8_scales(0.5, 0.25)
    k_cache, v_cache = random_cache(gen, num_blocks, 16, 2, 64, torch.bfloat16, scales)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = randn(gen, 3, 4, 64, dtype=torch.bfloat16)
    out = kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.125, k_scale=scales[0], v_scale=scales[1]
    )
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.125, *scales)
    assert rel_error(out, ref) < _attention_tolerance(torch.bfloat16)
    query = randn(gen, sum(q_lens), 4, 64, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 5, 69, 70], dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill_attention(
        query, k_cache, v_cache, qsl, lens, tables, max(q_lens), 0.125, k_scale=scales[0], v_scale=scales[1]
    )
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.125, *scales)
    assert rel_error(out, ref) < _attention_tolerance(torch.bfloat16)


@fp8_store
def test_fp8_kernels_on_a_head_major_cache_match_the_token_major_one():
    """The engine's FP8 pool keeps each kv head's slots of a block together and hands the kernels
    [num_blocks, block_size, num_kv_heads, head_dim] views of it (ModelRunner._allocate_kv_cache): the
    store, decode and prefill kernels write and read such a view exactly as a contiguous cache."""
    kernels = _kernels()
    gen = generator(23)
    seq_lens, q_lens, num_heads, num_kv_heads, head_dim = [37, 130, 1], [5, 64, 1], 4, 2, 64
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    scales = fp8_scales(0.5, 0.25)
    k_cache, v_cache = random_cache(gen, num_blocks, 16, num_kv_heads, head_dim, DTYPE, scales)
    k_view, v_view = head_major(k_cache), head_major(v_cache)
    assert k_view.stride(2) == 16 * head_dim and k_view.stride(1) == head_dim
    _, key, value = _qkv_views(gen, 20, num_heads, num_kv_heads, head_dim, DTYPE)
    slots = torch.randperm(num_blocks * 16, generator=gen, device=DEVICE)[:20]
    slots[::4] = -1
    kernels.store_kvcache(key, value, k_cache, v_cache, slots, *scales)
    kernels.store_kvcache(key, value, k_view, v_view, slots, *scales)
    expected_k, expected_v = head_major(k_cache), head_major(v_cache)
    store_kvcache_ref(key, value, expected_k, expected_v, slots, *scales)
    for cache, view, expected in ((k_cache, k_view, expected_k), (v_cache, v_view, expected_v)):
        assert torch.equal(view.view(torch.uint8), cache.view(torch.uint8))
        assert torch.equal(expected.view(torch.uint8), cache.view(torch.uint8))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = randn(gen, len(seq_lens), num_heads, head_dim, dtype=DTYPE)
    for config in (None, kernels.MERGE_KERNEL_DECODE):
        outs = [
            kernels.paged_decode_attention(
                query, k, v, tables, lens, 0.125, k_scale=scales[0], v_scale=scales[1], config=config
            )
            for k, v in ((k_cache, v_cache), (k_view, v_view))
        ]
        assert torch.equal(outs[0], outs[1])
    query = randn(gen, sum(q_lens), num_heads, head_dim, dtype=DTYPE)
    qsl = torch.tensor([0, 5, 69, 70], dtype=torch.int32, device=DEVICE)
    outs = [
        kernels.paged_prefill_attention(
            query, k, v, qsl, lens, tables, max(q_lens), 0.125, k_scale=scales[0], v_scale=scales[1]
        )
        for k, v in ((k_cache, v_cache), (k_view, v_view))
    ]
    assert torch.equal(outs[0], outs[1])
    ref = paged_attention_ref(query, k_view, v_view, qsl, lens, tables, 0.125, *scales)
    assert rel_error(outs[1], ref) < _attention_tolerance(DTYPE)


def test_input_validation_names_the_field():
    kernels = _kernels()
    k_cache = torch.zeros(4, 16, 2, 64, dtype=DTYPE, device=DEVICE)
    query = torch.zeros(2, 3, 64, dtype=DTYPE, device=DEVICE)
    tables = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.paged_decode_attention(query, k_cache, k_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(
            query[..., :48], k_cache[..., :48], k_cache[..., :48], tables, lens, 0.1
        )
    scale = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale"):
        kernels.paged_decode_attention(query[:, :2], k_cache, k_cache, tables, lens, 0.1, k_scale=scale)
    with pytest.raises(ValueError, match="mode"):
        kernels.DecodeConfig(mode="other")
    with pytest.raises(ValueError, match="max_registers"):
        kernels.DecodeConfig(max_registers=300)
    with pytest.raises(ValueError, match="block_m"):
        kernels.PrefillConfig(block_m=48)
