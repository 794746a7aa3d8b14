"""The small-batch projection kernel against its reference (GPU, or Triton's interpreter)."""

import pytest
import torch

from nanoinfer.kernels.gemv_ref import gemv_ref, silu_mul_gemv_ref
from tests.kernels.helpers import DEVICE, DTYPE, DTYPES, generator, randn, rel_error, tolerance, triton_module


def _kernels():
    return triton_module("triton_gemv")


CONFIGS = {
    "default": None,
    "cuda_cores_split3": dict(block_n=8, block_k=32, split_k=3),
    "dot_split2": dict(block_n=16, block_k=32, split_k=2, use_dot=True),
    "dot": dict(block_n=32, block_k=64, use_dot=True),
}


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (2, 64, 256), (5, 33, 200), (16, 48, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_reference(rows, n, k, config_name, dtype):
    kernels = _kernels()
    spec = CONFIGS[config_name]
    config = kernels.GemvConfig(**spec) if spec else None
    gen = generator(rows * n + k)
    x = randn(gen, rows, k + 8, dtype=dtype)[:, :k]  # row-strided
    weight = randn(gen, n, k, dtype=dtype)
    bias = randn(gen, n, dtype=dtype) if rows % 2 else None
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEVICE)
    kernels.gemv(x, weight, bias, out=out, config=config)
    assert not out.isnan().any()
    assert rel_error(out, gemv_ref(x, weight, bias)) < max(tolerance(dtype), 1e-4)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (3, 64, 200), (16, 24, 64)])
def test_gated_gemv_matches_reference(rows, n, k, config_name):
    kernels = _kernels()
    spec = CONFIGS[config_name]
    config = kernels.GemvConfig(**spec) if spec else None
    gen = generator(rows * n + k + 1)
    gate_up = randn(gen, rows, 2 * k + 8, dtype=DTYPE)[:, : 2 * k]  # row-strided
    weight = randn(gen, n, k, dtype=DTYPE)
    bias = randn(gen, n, dtype=DTYPE) if rows % 2 else None
    out = torch.full((rows, n), float("nan"), dtype=DTYPE, device=DEVICE)
    kernels.gemv(gate_up, weight, bias, out=out, config=config, gated=True)
    assert not out.isnan().any()
    assert rel_error(out, silu_mul_gemv_ref(gate_up, weight, bias)) < max(tolerance(DTYPE), 1e-4)
    with pytest.raises(ValueError, match="gate"):
        kernels.gemv(gate_up[:, :k], weight, gated=True)


def test_split_k_counters_are_left_at_zero():
    kernels = _kernels()
    gen = generator(2)
    x, weight = randn(gen, 3, 128, dtype=DTYPE), randn(gen, 64, 128, dtype=DTYPE)
    config = kernels.GemvConfig(block_n=16, block_k=32, split_k=4)
    first = kernels.gemv(x, weight, config=config)
    second = kernels.gemv(x, weight, config=config)
    assert torch.equal(first, second)  # the split order of the sum is fixed
    assert not kernels._COUNTERS[x.device].any()


def test_gemv_validation_names_the_field():
    kernels = _kernels()
    weight = torch.zeros(8, 32, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="takes 1 to 16 rows"):
        kernels.gemv(torch.zeros(17, 32, dtype=DTYPE, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv(
            torch.zeros(1, 32, dtype=DTYPE, device=DEVICE), weight, torch.zeros(4, dtype=DTYPE, device=DEVICE)
        )
    with pytest.raises(ValueError, match="use_dot"):
        kernels.GemvConfig(block_n=8, block_k=32, use_dot=True)
