"""Shared pieces of the kernel tests: device and dtypes, tolerances, random paged KV caches."""

from __future__ import annotations

import math

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter computes float32 and float16 exactly as the GPU would; numpy has no bfloat16.
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# One dtype for the larger grids: the GPU's, or float16 (the low-precision case) on the CPU.
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _interpreter_rounds_fp8_like_the_gpu() -> bool:
    """Triton 3.6's interpreter converts float32 to e4m3 wrongly (the dropped bits are not rounded to
    nearest even and a carry out of the mantissa is lost: 31.1 becomes 16). The GPU rounds to nearest
    even (cvt.rn.satfinite), as torch does: this routes that one conversion through torch so the FP8
    store kernels can be tested on the CPU. False where it cannot (no Triton, another interpreter)."""
    if ON_GPU:
        return True
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return False
    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return False
    if getattr(convert, "rounds_fp8_like_the_gpu", False):
        return True

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(data, input_dtype, output_dtype, rounding_mode)

    convert_float.rounds_fp8_like_the_gpu = True
    interpreter._convert_float = convert_float
    return True


fp8_store = pytest.mark.skipif(
    not _interpreter_rounds_fp8_like_the_gpu(),
    reason="this Triton interpreter rounds float32 -> e4m3 wrongly",
)


def triton_module(name: str):
    """A Triton kernel module of nanoinfer.kernels; skips the test where Triton is not installed."""
    pytest.importorskip("triton")
    import importlib

    return importlib.import_module(f"nanoinfer.kernels.{name}")


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element written (no NaN left from the poison) and within the dtype's tolerance."""
    assert not out.isnan().any(), "an output element was not written (NaN poison left)"
    tol = tolerance(dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def random_tables(gen: torch.Generator, seq_lens: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Shuffled block ids, as a row-strided (non-contiguous) view; unused entries point at a junk block
    past the used ones so a kernel that reads past seq_len picks up wrong data, never a fault."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    width = max(blocks_per_seq + [1])
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).int()
    storage = torch.full((len(seq_lens), width + 3), num_blocks - 1, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        storage[b, :nb] = perm[used : used + nb]
        used += nb
    return storage[:, :width], num_blocks


def random_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype, fp8_scales=None):
    """(k_cache, v_cache) of random values; with ``fp8_scales`` (k_scale, v_scale) quantized to e4m3 by
    the reference."""
    from nanoinfer.kernels.attention_ref import quantize_fp8_ref

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype)
    if fp8_scales is None:
        return k_cache, v_cache
    k_scale, v_scale = fp8_scales
    return quantize_fp8_ref(k_cache * 3, k_scale), quantize_fp8_ref(v_cache * 3, v_scale)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a [num_blocks, block_size, num_kv_heads, head_dim] cache stored as the engine stores an
    FP8 pool: [num_blocks, num_kv_heads, block_size, head_dim], seen through the same-shaped view."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    storage = torch.empty(
        num_blocks, num_kv_heads, block_size, head_dim, dtype=cache.dtype, device=cache.device
    )
    view = storage.transpose(1, 2)
    view.copy_(cache)
    return view


def fp8_scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([k], dtype=torch.float32, device=DEVICE),
        torch.tensor([v], dtype=torch.float32, device=DEVICE),
    )
