"""Counter-based sampling noise (statistics, bit-exactness against MurmurHash3) and the inverse-CDF
sampler: the Triton kernels against the torch reference."""

import math
import struct

import pytest
import torch

from nanoinfer.kernels.sampling_ref import (
    inverse_cdf_sample_ref,
    noise_hash_ref,
    row_uniform_ref,
    uniform_noise_ref,
)
from tests.kernels.helpers import DEVICE, DTYPES, generator, triton_module

_MASK32 = 0xFFFFFFFF


def _murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 written out from its specification, on bytes."""

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & _MASK32

    def scramble(k):
        return rotl((k * 0xCC9E2D51) & _MASK32, 15) * 0x1B873593 & _MASK32

    h = seed
    full = len(data) // 4
    for i in range(full):
        h = (rotl(h ^ scramble(struct.unpack_from("<I", data, 4 * i)[0]), 13) * 5 + 0xE6546B64) & _MASK32
    tail = data[4 * full :]
    if tail:
        h ^= scramble(sum(b << (8 * i) for i, b in enumerate(tail)))
    h ^= len(data)
    h ^= h >> 16
    h = h * 0x85EBCA6B & _MASK32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & _MASK32
    return h ^ (h >> 16)


SEEDS = [0, 1, -1, 12345, 2**62 + 7, -(2**40) + 3, 2**63 - 1, -(2**63)]
OFFSETS = [0, 1, 2**33 + 5, 17, 123456789, 2**40, 3, 2**63 - 1]


def test_murmur3_implementation_matches_published_values():
    assert _murmur3_32(b"") == 0
    assert _murmur3_32(b"", 1) == 0x514E28B7
    assert _murmur3_32(b"\0\0\0\0") == 0x2362F9DE
    assert _murmur3_32(b"Hello, world!", 1234) == 0xFAF6CDB3
    assert _murmur3_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723


def test_noise_hash_is_murmur3_of_seed_offset_token():
    seeds = torch.tensor(SEEDS, dtype=torch.int64)
    offsets = torch.tensor(OFFSETS, dtype=torch.int64)
    hashes = noise_hash_ref(seeds, offsets, 40)
    for row, (seed, offset) in enumerate(zip(SEEDS, OFFSETS, strict=True)):
        for token in (0, 1, 39):
            message = struct.pack("<qqI", seed, offset, token)  # seed lo, hi, offset lo, hi, token
            assert hashes[row, token].item() == _murmur3_32(message)


def _uniform_rows(seeds, offsets, vocab):
    return uniform_noise_ref(torch.tensor(seeds), torch.tensor(offsets), vocab).double()


def test_uniform_noise_moments_and_open_interval():
    u = _uniform_rows([3, 4, 5, 6], [0, 0, 0, 0], 1 << 16)
    assert u.min() > 0 and u.max() < 1
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 / math.sqrt(12 * n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u.float(), bins=64, min=0, max=1)
    expected = n / 64
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)  # 63 degrees of freedom, about 6 standard deviations


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def test_uniform_noise_has_no_correlation_between_neighbours():
    vocab = 1 << 16
    bound = 5 / math.sqrt(vocab)
    base = _uniform_rows([1000], [7], vocab)[0]
    assert abs(_corr(base[:-1], base[1:])) < bound  # neighbouring tokens
    neighbours = {
        "next seed": _uniform_rows([1001], [7], vocab)[0],
        "next offset": _uniform_rows([1000], [8], vocab)[0],
        "seed high half": _uniform_rows([1000 + (1 << 32)], [7], vocab)[0],
        "offset high half": _uniform_rows([1000], [7 + (1 << 32)], vocab)[0],
        "seed sign bit": _uniform_rows([1000 - (1 << 63)], [7], vocab)[0],
    }
    for name, other in neighbours.items():
        assert abs(_corr(base, other)) < bound, name
        assert (base == other).double().mean() < 1e-3, name  # different streams, not shifted copies
    # Token j of a row against token j + 1 of the next offset (a stream that merely shifted).
    assert abs(_corr(base[1:], neighbours["next offset"][:-1])) < bound


def test_row_uniform_is_token_zeros_draw():
    seeds, offsets = torch.tensor(SEEDS), torch.tensor(OFFSETS)
    assert torch.equal(row_uniform_ref(seeds, offsets), uniform_noise_ref(seeds, offsets, 3)[:, 0])


def test_inverse_cdf_sample_ref_draws_from_the_softmax():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, float("-inf"), 1.5])
    temperature = 0.7
    draws = 20000
    tokens = inverse_cdf_sample_ref(
        logits.expand(draws, -1),
        torch.full((draws,), temperature),
        torch.full((draws,), 42, dtype=torch.int64),
        torch.arange(draws),  # one draw per generation step of one request
    )
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[5] == 0  # a token of weight 0 is never drawn
    expected = torch.softmax(logits.double() / temperature, dim=0) * draws
    kept = expected > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    assert chi2 < 5 + 6 * math.sqrt(2 * 5)


def test_inverse_cdf_sample_ref_picks_the_token_where_the_draw_falls():
    """Equal weights: token floor(u * V) (u the row's draw), the boundaries exact in float32."""
    seeds, offsets = torch.tensor(SEEDS), torch.tensor(OFFSETS)
    vocab = 64
    tokens = inverse_cdf_sample_ref(torch.zeros(len(SEEDS), vocab), torch.ones(len(SEEDS)), seeds, offsets)
    assert torch.equal(tokens, (row_uniform_ref(seeds, offsets) * vocab).floor().long())


def test_inverse_cdf_sample_ref_greedy_rows_degenerate_rows_and_reproducibility():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 500, generator=gen)
    logits[1, 10] = logits[1, 400] = logits[1].max() + 1  # a tie: the lowest index wins
    logits[3] = float("-inf")  # no token has a weight: the argmax (0) stands
    logits[4, :] = float("-inf")
    logits[4, 250] = 0.0  # one token left: drawn at any temperature
    temperature = torch.tensor([0.8, 0.0, 1.3, 1.0, 1e-6])
    seeds, offsets = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([3, 0, 9, 1, 2])
    tokens = inverse_cdf_sample_ref(logits, temperature, seeds, offsets)
    assert tokens[1] == 10 and tokens[3] == 0 and tokens[4] == 250
    # A row's draw depends on its own seed and offset only, not on the rest of the batch.
    alone = inverse_cdf_sample_ref(logits[2:3], temperature[2:3], seeds[2:3], offsets[2:3])
    assert alone[0] == tokens[2]
    # A tiny temperature draws the argmax.
    assert (
        inverse_cdf_sample_ref(logits[:1], torch.tensor([1e-6]), seeds[:1], offsets[:1]) == logits[0].argmax()
    )


# -- the Triton kernels ------------------------------------------------------------------------------------


def _kernels():
    return triton_module("triton_sampling")


def _check_tokens(tokens, logits, temperature, seeds, offsets):
    """Every token is in the vocabulary with a positive weight, greedy rows take the argmax, and the
    tokens are the reference's but where a draw falls within the running sums' rounding of a boundary
    (at most one row here)."""
    assert (tokens >= 0).all() and (tokens < logits.shape[1]).all()
    assert (logits.float().gather(1, tokens.unsqueeze(1)) > float("-inf")).all()
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(dim=1))
    differ = (tokens != inverse_cdf_sample_ref(logits, temperature, seeds, offsets)).sum().item()
    assert differ <= 1


@pytest.mark.parametrize("chunk_size", [None, 1024, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inverse_cdf_sample_kernel_matches_reference(dtype, chunk_size):
    kernels = _kernels()
    gen = generator(1)
    batch, vocab = 8, 3000
    logits = (torch.randn(batch, vocab + 40, generator=gen, device=DEVICE) * 3).to(dtype)[
        :, :vocab
    ]  # row stride
    logits[7, 1000:] = float("-inf")  # a row whose last chunks have no weight
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 0.05, 4.0, 1.0], device=DEVICE)
    seeds = torch.tensor(SEEDS[:batch], device=DEVICE)
    offsets = torch.tensor(OFFSETS[:batch], device=DEVICE)
    out = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    kernels.inverse_cdf_sample(logits, temperature, seeds, offsets, out=out, chunk_size=chunk_size)
    _check_tokens(out, logits, temperature, seeds, offsets)


def test_inverse_cdf_sample_kernel_draws_where_the_draw_falls():
    """Equal weights over several chunks: token floor(u * V) exactly, u the reference's draw."""
    kernels = _kernels()
    seeds = torch.tensor(SEEDS, device=DEVICE)
    offsets = torch.tensor(OFFSETS, device=DEVICE)
    vocab = 4096
    logits = torch.zeros(len(SEEDS), vocab, device=DEVICE)
    tokens = kernels.inverse_cdf_sample(
        logits, torch.ones(len(SEEDS), device=DEVICE), seeds, offsets, chunk_size=1024
    )
    assert torch.equal(tokens, (row_uniform_ref(seeds, offsets) * vocab).floor().long())


def test_inverse_cdf_sample_kernel_degenerate_rows():
    kernels = _kernels()
    logits = torch.full((4, 2100), float("-inf"), device=DEVICE)
    logits[1, 5] = 0.0  # one token in the first chunk
    logits[2, 2050] = 3.0  # one token in the last chunk
    logits[3, 30] = logits[3, 1500] = 1.0
    temperature = torch.ones(4, device=DEVICE)
    rows = torch.arange(4, device=DEVICE)
    tokens = kernels.inverse_cdf_sample(logits, temperature, rows, rows, chunk_size=1024)
    assert tokens[:3].tolist() == [0, 5, 2050] and tokens[3] in (30, 1500)
    assert torch.equal(tokens, inverse_cdf_sample_ref(logits, temperature, rows, rows))


def test_inverse_cdf_sample_kernel_greedy_ties_take_the_lowest_index():
    kernels = _kernels()
    logits = torch.zeros(2, 2100, device=DEVICE)
    logits[1, 1500] = logits[1, 30] = 1.0  # equal maxima in different chunks
    temperature = torch.zeros(2, device=DEVICE)
    seeds = offsets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    tokens = kernels.inverse_cdf_sample(logits, temperature, seeds, offsets, chunk_size=1024)
    assert tokens.tolist() == [0, 30]


def test_inverse_cdf_sample_validation_names_the_field():
    kernels = _kernels()
    logits = torch.zeros(2, 10, device=DEVICE)
    rows = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        kernels.inverse_cdf_sample(logits, torch.zeros(2, dtype=torch.float64, device=DEVICE), rows, rows)
    with pytest.raises(ValueError, match="seeds"):
        kernels.inverse_cdf_sample(logits, torch.zeros(2, device=DEVICE), rows.int(), rows)
