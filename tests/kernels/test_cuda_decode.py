"""The CUDA FP8 decode kernel (``cuda_decode``) against the pure-PyTorch reference (GPU), and the rules
that route a call to it (CPU)."""

from dataclasses import replace

import pytest
import torch

from nanoinfer.kernels.attention_ref import FP8_DTYPE, paged_attention_ref, quantize_fp8_ref
from tests.kernels.helpers import (
    DEVICE,
    fp8_scales,
    generator,
    gpu_only,
    head_major,
    randn,
    random_tables,
    rel_error,
    triton_module,
)


def _kernels():
    return triton_module("triton_attention")


def _fp8_cache(gen, tables, seq_lens, num_blocks, block_size, num_kv_heads, head_dim, scales, layout):
    """(k_cache, v_cache) in e4m3 holding random values in each sequence's slots and e4m3's NaN code in
    every other slot, so that a kernel that lets a slot past a sequence's end into its arithmetic shows."""
    caches = []
    for scale in scales:
        values = quantize_fp8_ref(randn(gen, num_blocks, block_size, num_kv_heads, head_dim), scale)
        cache = torch.full_like(values.view(torch.uint8), 0x7F).view(FP8_DTYPE)
        for row, length in enumerate(seq_lens):
            slots = torch.arange(length, device=DEVICE)
            blocks = tables[row].long()[slots // block_size]
            cache[blocks, slots % block_size] = values[blocks, slots % block_size]
        caches.append(head_major(cache) if layout == "head_major" else cache)
    return caches


CASES = [
    # seq_lens, num_heads, num_kv_heads, head_dim, block_size
    ([1, 15, 16, 17, 31, 33, 1000, 0], 16, 8, 128, 16),  # Qwen3-0.6B's groups of 2
    ([300, 5, 64, 129], 8, 1, 128, 32),  # group of 8 (MQA), 32-slot blocks
    ([250, 700], 12, 3, 64, 16),  # group of 4, head_dim 64
    ([77, 3, 0, 512], 4, 4, 128, 64),  # MHA
    ([40, 90, 2], 14, 2, 64, 16),  # group of 7
]


# The engine's tiles (in registers, the grid's KV heads first) and the tiles staged in shared memory, 2 to
# 4 in flight; the grid's KV heads or its sequences first; FP8 converted by bit moves (K, V or both);
# the accumulators rescaled lazily.
TILINGS = {
    "registers": {},
    "registers_sequences_first": {"kv_heads_first": False},
    "shared_2": {"stage_in_shared": True, "num_stages": 2},
    "shared_3": {"stage_in_shared": True, "num_stages": 3},
    "shared_4": {"stage_in_shared": True, "num_stages": 4},
    "shared_3_sequences_first": {"stage_in_shared": True, "num_stages": 3, "kv_heads_first": False},
    "registers_bitwise": {"fp8_convert": "bits"},
    "shared_3_bitwise": {"stage_in_shared": True, "num_stages": 3, "fp8_convert": "bits"},
    "registers_bitwise_keys": {"fp8_convert": "bits_keys"},
    "registers_bitwise_values": {"fp8_convert": "bits_values"},
    "registers_lazy": {"lazy_rescale": True},
    "shared_3_lazy_bitwise": {
        "stage_in_shared": True,
        "num_stages": 3,
        "lazy_rescale": True,
        "fp8_convert": "bits",
    },
}


def _cuda_config(kernels, tiling):
    return replace(kernels.FP8_CUDA_DECODE, **TILINGS[tiling])


@gpu_only
@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("splits", [1, 2, 16])
@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_cuda_fp8_decode_matches_reference(
    seq_lens, num_heads, num_kv_heads, head_dim, block_size, splits, layout, tiling
):
    kernels = _kernels()
    gen = generator(len(seq_lens) * 100 + head_dim + splits)
    batch = len(seq_lens)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.5, 0.25)
    k_cache, v_cache = _fp8_cache(
        gen, tables, seq_lens, num_blocks, block_size, num_kv_heads, head_dim, scales, layout
    )
    query = randn(gen, batch, num_heads, head_dim, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    group = num_heads // num_kv_heads
    kernels._launch_decode(
        query, k_cache, v_cache, tables, lens, head_dim**-0.5, out, None, splits, group,
        _cuda_config(kernels, tiling), *scales,
    )  # fmt: skip
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, head_dim**-0.5, *scales)
    assert not out.isnan().any()
    assert rel_error(out, ref) < 1e-2
    assert torch.equal(out[lens == 0], torch.zeros_like(out[lens == 0]))


@gpu_only
@pytest.mark.parametrize("splits", [1, 16])
@pytest.mark.parametrize("convert", ["bits", "bits_keys", "bits_values"])
def test_cuda_fp8_decode_bitwise_dequant_is_bit_identical_to_cvt(splits, convert):
    """Bit moves give 2^-8 of each e4m3 value exactly and the scales take the 2^8 back: every product and
    sum is the cvt path's times a power of two, so the outputs are equal bit for bit."""
    kernels = _kernels()
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = CASES[0]
    gen = generator(7)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.5, 0.25)
    caches = _fp8_cache(
        gen, tables, seq_lens, num_blocks, block_size, num_kv_heads, head_dim, scales, "head_major"
    )
    query = randn(gen, len(seq_lens), num_heads, head_dim, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for config in (kernels.FP8_CUDA_DECODE, replace(kernels.FP8_CUDA_DECODE, fp8_convert=convert)):
        out = torch.full_like(query, float("nan"))
        kernels._launch_decode(
            query, *caches, tables, lens, head_dim**-0.5, out, None, splits, num_heads // num_kv_heads,
            config, *scales,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@gpu_only
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("tiling", ["registers", "registers_lazy", "shared_3_lazy_bitwise"])
def test_cuda_fp8_decode_follows_a_max_that_moves_late(tiling, splits):
    """Scores that climb by about 65 (log2 units) over most of a sequence and fall back at its end: the
    lazily rescaled accumulators move their max every few tiles long after the first, the eager ones every
    tile, and both match the reference."""
    kernels = _kernels()
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = [700, 33, 170], 16, 8, 128, 16
    gen = generator(11)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.5, 0.25)
    k_cache, v_cache = _fp8_cache(
        gen, tables, seq_lens, num_blocks, block_size, num_kv_heads, head_dim, scales, "token_major"
    )
    direction = torch.randint(0, 2, (head_dim,), generator=gen, device=DEVICE).float() * 2 - 1
    for row, length in enumerate(seq_lens):
        position = torch.arange(length, device=DEVICE).float()
        ramp = torch.where(position < 0.8 * length, position / (0.8 * length), torch.full_like(position, 0.2))
        keys = 2 * ramp[:, None, None] * direction + 0.3 * randn(gen, length, num_kv_heads, head_dim)
        slots = torch.arange(length, device=DEVICE)
        blocks = tables[row].long()[slots // block_size]
        k_cache[blocks, slots % block_size] = quantize_fp8_ref(keys, scales[0])
    query = (2 * direction).expand(len(seq_lens), num_heads, head_dim).to(torch.bfloat16).contiguous()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    kernels._launch_decode(
        query, k_cache, v_cache, tables, lens, head_dim**-0.5, out, None, splits,
        num_heads // num_kv_heads, _cuda_config(kernels, tiling), *scales,
    )  # fmt: skip
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, head_dim**-0.5, *scales)
    assert rel_error(out, ref) < 1e-2


@gpu_only
@pytest.mark.parametrize("tiling", ["registers", "shared_3"])
def test_cuda_fp8_decode_reads_the_newest_key_the_store_before_it_writes(tiling):
    """The engine's order under programmatic dependent launch: ``qk_norm_rope_store`` writes each
    sequence's newest key and value (and its query), and the decode kernel, which may start while that
    kernel runs, reads them. Before each store the newest slots hold e4m3's NaN code, so a tile read
    before the store finished would show as NaN."""
    elementwise = triton_module("triton_elementwise")
    kernels = _kernels()
    gen = generator(11)
    seq_lens = [1, 2, 16, 17, 32, 33, 500, 1000] * 16
    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 16
    batch = len(seq_lens)
    tables, num_blocks = random_tables(gen, seq_lens, block_size)
    scales = fp8_scales(0.5, 0.25)
    older = [n - 1 for n in seq_lens]  # every slot but the newest; that one holds the NaN code
    k_cache, v_cache = _fp8_cache(
        gen, tables, older, num_blocks, block_size, num_kv_heads, head_dim, scales, "head_major"
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = lens.long() - 1
    newest_blocks = tables.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = newest_blocks * block_size + positions % block_size
    cos_sin = randn(gen, max(seq_lens), head_dim)
    workspace = kernels.DecodeWorkspace.allocate(
        batch, num_heads, num_kv_heads, head_dim, tables.shape[1] * block_size, DEVICE, cache_dtype=FP8_DTYPE
    )
    q_out = torch.empty(batch, num_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty_like(q_out)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    for step in range(4):
        qkv = randn(gen, batch, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16)
        for cache in (k_cache, v_cache):  # the newest slots back to the NaN code
            cache.view(torch.uint8)[newest_blocks, positions % block_size] = 0x7F
        torch.cuda.synchronize()
        elementwise.qk_norm_rope_store(
            qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim, None, None, 1e-6, k_cache, v_cache,
            slots, *scales, pdl=True, q_out=q_out,
        )  # fmt: skip
        kernels.paged_decode_attention(
            q_out, k_cache, v_cache, tables, lens, head_dim**-0.5, out=out, workspace=workspace,
            k_scale=scales[0], v_scale=scales[1], config=_cuda_config(kernels, tiling), pdl=True,
        )  # fmt: skip
        ref = paged_attention_ref(q_out, k_cache, v_cache, qsl, lens, tables, head_dim**-0.5, *scales)
        assert not out.isnan().any(), f"step {step}"
        assert rel_error(out, ref) < 1e-2, f"step {step}"


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_fp8_decode_takes_float16_and_float32_queries(dtype):
    kernels = _kernels()
    gen = generator(5)
    seq_lens = [100, 33]
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    k_cache, v_cache = _fp8_cache(gen, tables, seq_lens, num_blocks, 16, 2, 128, (None, None), "head_major")
    query = randn(gen, 2, 4, 128, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.1, config=kernels.FP8_CUDA_DECODE
    )
    qsl = torch.arange(3, dtype=torch.int32, device=DEVICE)
    assert rel_error(out, paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.1)) < 1e-2


@gpu_only
@pytest.mark.parametrize("tiling", ["registers", "registers_sequences_first", "shared_3"])
def test_cuda_fp8_decode_replays_in_a_cuda_graph(tiling):
    kernels = _kernels()
    gen = generator(9)
    seq_lens = [200, 1, 64, 900] * 40
    tables, num_blocks = random_tables(gen, seq_lens, 16)
    scales = fp8_scales(0.5, 0.25)
    k_cache, v_cache = _fp8_cache(gen, tables, seq_lens, num_blocks, 16, 8, 128, scales, "head_major")
    query = randn(gen, len(seq_lens), 16, 128, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    workspace = kernels.DecodeWorkspace.allocate(
        len(seq_lens), 16, 8, 128, tables.shape[1] * 16, DEVICE, cache_dtype=FP8_DTYPE
    )
    out = torch.empty_like(query)

    def call():
        kernels.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.088, out=out, workspace=workspace, k_scale=scales[0],
            v_scale=scales[1], config=_cuda_config(kernels, tiling), pdl=True,
        )  # fmt: skip

    call()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.zero_()
    lens[::2] -= 1  # new lengths: the graph reads them on the device
    graph.replay()
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_ref(query, k_cache, v_cache, qsl, lens, tables, 0.088, *scales)
    assert rel_error(out, ref) < 1e-2
    assert not torch.equal(out, eager)
    # The last split of each (sequence, KV head) merged and reset its counter for the next call.
    assert workspace.counters.count_nonzero() == 0


def test_cuda_kernel_config_needs_balanced_sixteen_key_tiles():
    kernels = _kernels()
    with pytest.raises(ValueError, match="kernel"):
        kernels.DecodeConfig(kernel="cutlass")
    with pytest.raises(ValueError, match="balanced"):
        kernels.DecodeConfig(kernel="cuda", mode="merge_kernel", block_n=16)
    with pytest.raises(ValueError, match="block_n=16"):
        kernels.DecodeConfig(kernel="cuda", mode="balanced", block_n=32)
    with pytest.raises(ValueError, match="stage_in_shared"):
        kernels.DecodeConfig(stage_in_shared=True)
    with pytest.raises(ValueError, match="kv_heads_first"):
        kernels.DecodeConfig(kv_heads_first=True)
    with pytest.raises(ValueError, match="fp8_convert"):
        kernels.DecodeConfig(fp8_convert="bits")
    with pytest.raises(ValueError, match="fp8_convert.*'cvt'"):
        kernels.DecodeConfig(kernel="cuda", mode="balanced", block_n=16, fp8_convert="lut")
    with pytest.raises(ValueError, match="lazy_rescale"):
        kernels.DecodeConfig(lazy_rescale=True)
    assert kernels.FP8_CUDA_DECODE.kernel == "cuda"
    staged = kernels.DecodeConfig(
        kernel="cuda", mode="balanced", block_n=16, num_stages=3, stage_in_shared=True, kv_heads_first=True
    )
    assert staged.cuda_tiling == (3, None, True, True, "cvt", False)


def test_cuda_kernel_takes_only_calls_it_supports():
    from nanoinfer.kernels import cuda_decode

    fp8 = torch.zeros(4, 16, 2, 128).to(FP8_DTYPE)
    query = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.zeros(3, dtype=torch.int32)
    # On the CPU (as on CI) the Triton kernel takes every call.
    assert cuda_decode.kernel_for(query, fp8, fp8, query, tables, lens) is None
    if DEVICE == "cuda":
        on = {"device": "cuda"}
        fp8, query, tables, lens = (t.to(**on) for t in (fp8, query, tables, lens))
        assert cuda_decode.kernel_for(query, fp8, fp8, query, tables, lens).shared_mem == 0
        staged = cuda_decode.kernel_for(
            query, fp8, fp8, query, tables, lens, tiling=(3, None, True, False, "cvt", False)
        )
        assert staged.shared_mem == 3 * 2 * 16 * 128  # three 16-key tiles of K and V, one byte each
        bf16 = fp8.to(torch.bfloat16)
        assert cuda_decode.kernel_for(query, bf16, bf16, query, tables, lens) is None
        assert cuda_decode.kernel_for(query, fp8, fp8, query, tables.long(), lens) is None
        small_blocks = torch.zeros(8, 8, 2, 128, device="cuda").to(FP8_DTYPE)
        assert cuda_decode.kernel_for(query, small_blocks, small_blocks, query, tables, lens) is None
