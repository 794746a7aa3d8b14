"""Fused elementwise Triton kernels against their references (GPU, or Triton's interpreter)."""

import pytest
import torch

from nanoinfer.kernels.attention_ref import FP8_DTYPE
from nanoinfer.kernels.elementwise_ref import (
    add_partials_rms_norm_ref,
    add_rms_norm_ref,
    qk_norm_rope_store_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from nanoinfer.layers.rotary import RotaryEmbedding
from tests.kernels.helpers import (
    DEVICE,
    DTYPE,
    DTYPES,
    ON_GPU,
    assert_close,
    fp8_scales,
    fp8_store,
    generator,
    randn,
    triton_module,
)


def _kernels():
    return triton_module("triton_elementwise")


def _rows(gen, num_rows, hidden, dtype, row_stride_pad=0):
    """[num_rows, hidden], a row-strided view when row_stride_pad > 0."""
    return randn(gen, num_rows, hidden + row_stride_pad, dtype=dtype)[:, :hidden]


@pytest.mark.parametrize("num_rows,hidden,pad", [(0, 64, 0), (1, 1024, 0), (7, 100, 3), (33, 64, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(num_rows, hidden, pad, dtype):
    kernels = _kernels()
    gen = generator(num_rows + hidden)
    x = _rows(gen, num_rows, hidden, dtype, pad)
    weight = randn(gen, hidden, dtype=dtype)
    out = torch.full((num_rows, hidden), float("nan"), dtype=dtype, device=DEVICE)
    assert kernels.rms_norm(x, weight, 1e-6, out=out) is out
    assert_close(out, rms_norm_ref(x, weight, 1e-6), dtype)
    assert_close(kernels.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("num_rows,hidden,pad", [(0, 64, 0), (1, 1024, 0), (7, 100, 3), (33, 64, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(num_rows, hidden, pad, dtype):
    kernels = _kernels()
    gen = generator(num_rows * 7 + hidden)
    x = _rows(gen, num_rows, hidden, dtype, pad)
    residual = _rows(gen, num_rows, hidden, dtype, 2 * pad)
    weight = randn(gen, hidden, dtype=dtype)
    expected_x, expected_residual = add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-5)
    got_x, got_residual = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert got_x is x and got_residual is residual
    assert_close(residual, expected_residual, dtype)
    assert_close(x, expected_x, dtype)


@pytest.mark.parametrize("num_rows,hidden,splits", [(0, 64, 2), (1, 1024, 4), (7, 100, 3), (33, 64, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_partials_rms_norm(num_rows, hidden, splits, dtype):
    """A split-K projection's float32 partials summed into the residual add: the same rows as the
    reference (the sum in split order, rounded to the activation dtype as one projection's output)."""
    kernels = _kernels()
    gen = generator(num_rows * 5 + hidden + splits)
    parts = randn(gen, splits, num_rows, hidden, dtype=torch.float32)
    residual = _rows(gen, num_rows, hidden, dtype, 3)
    weight = randn(gen, hidden, dtype=dtype)
    expected_x, expected_residual = add_partials_rms_norm_ref(parts, residual.clone(), weight, 1e-5)
    out = torch.full((num_rows, hidden), float("nan"), dtype=dtype, device=DEVICE)
    got_x, got_residual = kernels.add_partials_rms_norm(parts, residual, weight, 1e-5, out=out)
    assert got_x is out and got_residual is residual
    assert_close(residual, expected_residual, dtype)
    assert_close(out, expected_x, dtype)


@pytest.mark.parametrize("num_rows,inter,pad", [(0, 64, 0), (1, 1500, 0), (7, 300, 5), (33, 64, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(num_rows, inter, pad, dtype):
    kernels = _kernels()
    gen = generator(num_rows + inter)
    x = _rows(gen, num_rows, 2 * inter, dtype, pad)
    out = torch.full((num_rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    kernels.silu_and_mul(x, out=out)
    assert_close(out, silu_and_mul_ref(x), dtype)


ROPE_CASES = [
    # num_tokens, num_heads, num_kv_heads, head_dim, block_size, qk_norm, heads_per_program
    (1, 4, 2, 64, 16, True, None),
    (7, 5, 1, 64, 16, False, None),  # odd head count, MQA, no QK-norm (Llama, Qwen2)
    (33, 4, 4, 64, 256, True, 4),
    (7, 6, 3, 128, 16, True, 16),  # more heads per program than heads: masked rows
    (0, 4, 2, 64, 16, True, None),
]


def _rope_inputs(gen, num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(gen, num_tokens, width + 16, dtype=dtype)[:, :width]  # row-strided, as a view of a buffer
    max_position = 200
    rotary = RotaryEmbedding(head_dim, max_position, 10000.0).to(DEVICE)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen, device=DEVICE)
    num_blocks = 4
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[::3] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)  # unwritten slots stay NaN
    v_cache = k_cache.clone()
    return qkv, positions, rotary.cos_sin, slots, k_cache, v_cache


def _assert_same_cache(got, expected, dtype):
    if got.dtype == FP8_DTYPE:
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        return
    written = ~expected.isnan()
    assert torch.equal(got.isnan(), ~written), "a slot other than the mapped ones was written"
    assert_close(got[written], expected[written], dtype)


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store(case, dtype):
    kernels = _kernels()
    num_tokens, num_heads, num_kv_heads, head_dim, block_size, qk_norm, per_program = case
    gen = generator(num_tokens * 31 + num_heads)
    qkv, positions, cos_sin, slots, k_cache, v_cache = _rope_inputs(
        gen, num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, dtype
    )
    q_weight = randn(gen, head_dim, dtype=dtype) if qk_norm else None
    k_weight = randn(gen, head_dim, dtype=dtype) if qk_norm else None
    args = (positions, cos_sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight, 1e-6)
    expected_qkv, expected_k, expected_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    qk_norm_rope_store_ref(expected_qkv, *args, expected_k, expected_v, slots)
    q, k, v = kernels.qk_norm_rope_store(qkv, *args, k_cache, v_cache, slots, heads_per_program=per_program)
    assert q.shape == (num_tokens, num_heads, head_dim) and k.shape == v.shape == (
        num_tokens,
        num_kv_heads,
        head_dim,
    )
    assert q.data_ptr() == qkv.data_ptr()
    assert_close(qkv, expected_qkv, dtype)
    _assert_same_cache(k_cache, expected_k, dtype)
    _assert_same_cache(v_cache, expected_v, dtype)


# Query and KV heads and head size of the small rope cases below (4 query heads over 2 KV heads).
SMALL_HEADS = (4, 2, 64)


def _small_rope_case(seed: int, num_tokens: int, dtype):
    """qkv, the kernel's arguments from positions to eps (one norm weight for q and k), the slots and
    the 16-token-block caches of a small case."""
    gen = generator(seed)
    qkv, positions, cos_sin, slots, k_cache, v_cache = _rope_inputs(
        gen, num_tokens, *SMALL_HEADS, 16, dtype, dtype
    )
    weight = randn(gen, SMALL_HEADS[2], dtype=dtype)
    return qkv, (positions, cos_sin, *SMALL_HEADS, weight, weight, 1e-6), slots, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_writes_q_to_q_out(dtype):
    """With q_out (a static buffer the attention reads, strided per token) q lands there, qkv's q part
    is untouched, and k, v and the cache are as without it; the reference does the same."""
    kernels = _kernels()
    num_tokens = 9
    num_heads, _, head_dim = SMALL_HEADS
    qkv, args, slots, k_cache, v_cache = _small_rope_case(11, num_tokens, dtype)
    original, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()  # for the reference's run
    expected_qkv, expected_k, expected_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    expected_q, _, _ = qk_norm_rope_store_ref(expected_qkv, *args, expected_k, expected_v, slots)
    q_out = torch.full((num_tokens + 3, num_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    q, k, v = kernels.qk_norm_rope_store(qkv, *args, k_cache, v_cache, slots, q_out=q_out[:num_tokens])
    assert q.data_ptr() == q_out.data_ptr()
    assert_close(q, expected_q, dtype)
    assert q_out[num_tokens:].isnan().all()
    # With q_out and a cache nothing goes back into qkv: k reaches the attention through the cache.
    assert torch.equal(qkv, original)
    _assert_same_cache(k_cache, expected_k, dtype)
    _assert_same_cache(v_cache, expected_v, dtype)
    ref_qkv, ref_q_out = original.clone(), torch.empty_like(q_out[:num_tokens])
    ref_q, _, _ = qk_norm_rope_store_ref(ref_qkv, *args, ref_k, ref_v, slots, q_out=ref_q_out)
    assert ref_q.data_ptr() == ref_q_out.data_ptr()
    assert_close(ref_q, expected_q, dtype)
    assert torch.equal(ref_qkv[:, : num_heads * head_dim], original[:, : num_heads * head_dim])
    _assert_same_cache(ref_k, expected_k, dtype)
    with pytest.raises(ValueError, match="q_out"):
        kernels.qk_norm_rope_store(qkv, *args, k_cache, v_cache, slots, q_out=q_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_without_cache_only_rotates(dtype):
    # Before the KV pool exists (the warm-up pass) the caches are empty tensors: nothing is stored.
    kernels = _kernels()
    qkv, rope_args, slots, _, _ = _small_rope_case(5, 6, dtype)
    empty = torch.empty(0, dtype=dtype, device=DEVICE)
    args = (*rope_args, empty, empty, slots)
    original, expected = qkv.clone(), qkv.clone()
    qk_norm_rope_store_ref(expected, *args)
    kernels.qk_norm_rope_store(qkv, *args)
    assert_close(qkv, expected, dtype)
    # k is rotated in place here: the warm-up's attention reads it from qkv.
    num_heads, num_kv_heads, head_dim = SMALL_HEADS
    k_part = slice(num_heads * head_dim, (num_heads + num_kv_heads) * head_dim)
    assert not torch.equal(qkv[:, k_part], original[:, k_part])
    # An FP8 model's scales are passed from the start; with no cache yet they have nothing to apply to.
    scales = fp8_scales(0.1, 0.1)
    kernels.qk_norm_rope_store(qkv.clone(), *args, *scales)


@fp8_store
@pytest.mark.parametrize("scales", [(0.03, 0.01), None])
def test_qk_norm_rope_store_fp8(scales):
    kernels = _kernels()
    gen = generator(9)
    # Qwen3-0.6B's heads on the GPU; fewer under the interpreter.
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = (
        (33, 16, 8, 128, 16) if ON_GPU else (7, 4, 2, 64, 16)
    )
    qkv, positions, cos_sin, slots, k_cache, v_cache = _rope_inputs(
        gen, num_tokens, num_heads, num_kv_heads, head_dim, block_size, DTYPE, FP8_DTYPE
    )
    qkv.mul_(10)
    k_scale, v_scale = fp8_scales(*scales) if scales else (None, None)
    weight = randn(gen, head_dim, dtype=DTYPE)
    args = (positions, cos_sin, num_heads, num_kv_heads, head_dim, weight, weight, 1e-6)
    expected_qkv, expected_k, expected_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    qk_norm_rope_store_ref(expected_qkv, *args, expected_k, expected_v, slots, k_scale, v_scale)
    kernels.qk_norm_rope_store(qkv, *args, k_cache, v_cache, slots, k_scale, v_scale)
    assert_close(qkv, expected_qkv, DTYPE)
    # The stored k is the kernel's own rounded k: equal to the reference's wherever the two agree.
    same_k = (qkv == expected_qkv).view(num_tokens, -1, head_dim)[:, num_heads : num_heads + num_kv_heads]
    valid = slots >= 0
    got_k = k_cache.view(-1, num_kv_heads, head_dim)[slots[valid]].view(torch.uint8)
    ref_k = expected_k.view(-1, num_kv_heads, head_dim)[slots[valid]].view(torch.uint8)
    assert torch.equal(got_k[same_k[valid]], ref_k[same_k[valid]])
    _assert_same_cache(v_cache, expected_v, DTYPE)


def test_validation_names_the_field():
    kernels = _kernels()
    x = torch.zeros(2, 64, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.zeros(32, dtype=DTYPE, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kernels.add_rms_norm(x, x[:1], torch.zeros(64, dtype=DTYPE, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="intermediate"):
        kernels.silu_and_mul(torch.zeros(2, 63, dtype=DTYPE, device=DEVICE))
    norm_weight = torch.zeros(64, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="parts must be a contiguous float32"):
        kernels.add_partials_rms_norm(torch.zeros(2, 2, 64, dtype=DTYPE, device=DEVICE), x, norm_weight, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        kernels.add_partials_rms_norm(torch.zeros(2, 3, 64, device=DEVICE), x, norm_weight, 1e-6)
    empty = torch.empty(0, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    cos_sin = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="qkv"):
        kernels.qk_norm_rope_store(x, positions, cos_sin, 2, 1, 32, None, None, 1e-6, empty, empty, positions)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="pdl"):
            kernels.rms_norm(x, torch.zeros(64, dtype=DTYPE, device=DEVICE), 1e-6, pdl=True)
