"""Counter-based sampling noise (statistics, bit-exactness against MurmurHash3) and the one-pass
Gumbel-max sampler: the Triton kernels against the torch reference."""

import math
import struct

import pytest
import torch

from nanoinfer.kernels.sampling_ref import (
    gumbel_noise,
    gumbel_sample_ref,
    gumbel_scores_ref,
    noise_hash_ref,
    uniform_noise_ref,
)
from tests.kernels.helpers import DEVICE, DTYPES, ON_GPU, generator, triton_module

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


def test_gumbel_noise_moments():
    g = gumbel_noise(torch.tensor([11, 12]), torch.tensor([0, 5]), 1 << 16, "cpu").double()
    n = g.numel()
    euler_gamma, variance = 0.5772156649, math.pi**2 / 6
    assert abs(g.mean().item() - euler_gamma) < 5 * math.sqrt(variance / n)
    assert abs(g.var().item() - variance) < 0.05
    assert torch.isfinite(g).all()


def test_gumbel_sample_ref_draws_from_the_softmax():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    temperature = 0.7
    draws = 20000
    tokens = gumbel_sample_ref(
        logits.expand(draws, -1),
        torch.full((draws,), temperature),
        torch.full((draws,), 42, dtype=torch.int64),
        torch.arange(draws),  # one draw per generation step of one request
    )
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 5 + 6 * math.sqrt(2 * 5)


def test_gumbel_sample_ref_greedy_rows_and_reproducibility():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=gen)
    logits[1, 10] = logits[1, 400] = logits[1].max() + 1  # a tie: the lowest index wins
    temperature = torch.tensor([0.8, 0.0, 1.3])
    seeds, offsets = torch.tensor([5, 6, 7]), torch.tensor([3, 0, 9])
    tokens = gumbel_sample_ref(logits, temperature, seeds, offsets)
    assert tokens[1] == 10
    # A row's draw depends on its own seed and offset only, not on the rest of the batch.
    alone = gumbel_sample_ref(logits[2:], temperature[2:], seeds[2:], offsets[2:])
    assert alone[0] == tokens[2]


# -- the Triton kernels ------------------------------------------------------------------------------------


def _kernels():
    return triton_module("triton_sampling")


def test_uniform_noise_kernel_is_bit_identical():
    kernels = _kernels()
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=DEVICE)
    offsets = torch.tensor(OFFSETS, dtype=torch.int64, device=DEVICE)
    got = kernels.uniform_noise(seeds, offsets, 2500)
    assert torch.equal(got, uniform_noise_ref(seeds, offsets, 2500))


def test_gumbel_noise_kernel_is_within_2e_6_of_the_exact_noise():
    """The kernel's Gumbel noise (``lg2.approx``, and -log(1 - v)'s series where u is near 1) against
    -log(-log(u)) in float64 over 8M tokens (256K in the CPU's interpreter, which takes its logs from
    numpy), u's largest values (where the winners come from) included."""
    kernels = _kernels()
    seeds = torch.tensor(SEEDS, device=DEVICE)
    offsets = torch.tensor(OFFSETS, device=DEVICE)
    vocab = 2**20 if ON_GPU else 2**15
    got = kernels.gumbel_noise(seeds, offsets, vocab).double()
    u = uniform_noise_ref(seeds, offsets, vocab).double()
    assert (1 - u).min() < 2**-17 and ((1 - u - 0.125).abs() < 1e-3).any()  # both ends of the series
    assert (got - (-torch.log(-torch.log(u)))).abs().max() < 2e-6


def _check_tokens(tokens, logits, temperature, seeds, offsets):
    """Each token is the reference's, or (a near-tie within the noise's error) scores as well."""
    scores = gumbel_scores_ref(logits, temperature, seeds, offsets)
    best = scores.max(dim=1).values
    achieved = scores.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert torch.all(achieved >= best - 1e-5 * best.abs().clamp_min(1.0))
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(dim=1))


@pytest.mark.parametrize("chunk_size", [None, 1024, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gumbel_sample_kernel_matches_reference(dtype, chunk_size):
    kernels = _kernels()
    gen = generator(1)
    batch, vocab = 6, 3000
    logits = (torch.randn(batch, vocab + 40, generator=gen, device=DEVICE) * 3).to(dtype)[
        :, :vocab
    ]  # row stride
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.0, 0.05], device=DEVICE)
    seeds = torch.tensor(SEEDS[:batch], device=DEVICE)
    offsets = torch.tensor(OFFSETS[:batch], device=DEVICE)
    out = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    kernels.gumbel_sample(logits, temperature, seeds, offsets, out=out, chunk_size=chunk_size)
    assert (out >= 0).all() and (out < vocab).all()
    _check_tokens(out, logits, temperature, seeds, offsets)
    agree = (out == gumbel_sample_ref(logits, temperature, seeds, offsets)).float().mean()
    assert agree == 1.0 or batch * (1 - agree) <= 1  # at most one near-tie


def test_gumbel_sample_kernel_ties_take_the_lowest_index():
    kernels = _kernels()
    logits = torch.zeros(2, 2100, device=DEVICE)
    logits[1, 1500] = logits[1, 30] = 1.0  # equal maxima in different chunks
    temperature = torch.zeros(2, device=DEVICE)
    seeds = offsets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    tokens = kernels.gumbel_sample(logits, temperature, seeds, offsets, chunk_size=1024)
    assert tokens.tolist() == [0, 30]


def test_gumbel_sample_validation_names_the_field():
    kernels = _kernels()
    logits = torch.zeros(2, 10, device=DEVICE)
    rows = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        kernels.gumbel_sample(logits, torch.zeros(2, dtype=torch.float64, device=DEVICE), rows, rows)
    with pytest.raises(ValueError, match="seeds"):
        kernels.gumbel_sample(logits, torch.zeros(2, device=DEVICE), rows.int(), rows)
