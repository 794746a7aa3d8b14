"""The Triton bitmask kernel against the torch reference, on random shapes. Without CUDA it runs in
Triton's interpreter (float32 and float16 only: the interpreter has no bfloat16)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref  # noqa: E402
from nanoinfer.structured.triton_bitmask import BLOCK_SIZE, apply_token_bitmask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def random_bitmask(rows, words, generator, density):
    bits = torch.rand(rows, words, 32, generator=generator) < density
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    return ((bits.long() * weights).sum(-1) - (bits[..., 31].long() << 32)).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_matches_the_reference_on_random_shapes(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 6, (1,), generator=generator))
    vocab = int(torch.randint(1, 3 * BLOCK_SIZE, (1,), generator=generator))
    needed = (vocab + 31) // 32
    words = max(1, needed + int(torch.randint(-2, 3, (1,), generator=generator)))  # short, exact or long
    if seed % 2:
        row_indices = torch.randint(
            0, batch, (int(torch.randint(0, batch + 2, (1,), generator=generator)),), generator=generator
        ).tolist()
    else:
        row_indices = None
    rows = batch if row_indices is None else len(row_indices)
    bitmask = random_bitmask(rows, words, generator, density=[0.02, 0.5, 0.98][seed % 3])
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask, row_indices)
    got = logits.to(DEVICE)
    apply_token_bitmask(got, bitmask.to(DEVICE), row_indices)
    assert torch.equal(got.cpu(), want)


def test_strided_logits_and_device_row_indices():
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(4, 2 * 300, generator=generator)
    logits = base[:, ::2]  # a column stride of 2
    bitmask = random_bitmask(2, 10, generator, density=0.5)
    want = logits.clone()
    apply_token_bitmask_ref(want, bitmask, [3, 1])
    got = base.to(DEVICE)[:, ::2]
    apply_token_bitmask(got, bitmask.to(DEVICE), torch.tensor([3, 1], device=DEVICE))
    assert torch.equal(got.cpu(), want)


def test_bad_arguments_are_rejected():
    logits = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="row_indices must be in"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE), [5])
