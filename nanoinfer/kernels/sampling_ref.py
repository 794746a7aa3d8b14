"""Counter-based sampling noise and one-pass Gumbel-max sampling, in pure PyTorch (the definition the
Triton kernels in `triton_sampling` match: the uniform noise bit for bit, the Gumbel noise within 2e-6;
and the general sampler's path off CUDA).

Noise: each (row, token) gets the 32-bit MurmurHash3 (x86_32, seed 0) of the 20-byte message
``seed_lo, seed_hi, offset_lo, offset_hi, token`` (little-endian 32-bit words), where ``seed`` is the
request's 64-bit seed and ``offset`` the number of tokens the row has generated so far. No state: a
seeded request draws the same noise whatever else is batched with it, on CPU and GPU alike. Its top 23
bits give ``u = (h23 + 0.5) / 2^23``, exact in float32 and strictly inside (0, 1) (with 24 bits,
``h24 + 0.5`` needs 25 significant bits and the largest values round to 1.0).

Everything is computed with int64 tensors holding 32-bit values: xor, shifts, masks, and products
split into 16-bit halves so that no intermediate leaves the int64 range.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_MIX_ADD = 0xE6546B64
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_MESSAGE_BYTES = 20  # five 32-bit words
UNIFORM_BITS = 23


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for ``a`` in [0, 2^32) and a 32-bit constant, exact in int64."""
    low = (a & 0xFFFF) * c
    high = ((a >> 16) * (c & 0xFFFF)) << 16
    return (low + high) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix_word(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(word, _C1), 15), _C2)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + _MIX_ADD) & _MASK32


def _finalize(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _MESSAGE_BYTES
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX2)
    return h ^ (h >> 16)


def noise_hash_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The 32-bit hash of every (row, token), as int64 in [0, 2^32): [B, vocab_size]."""
    seeds = seeds.long().unsqueeze(1)
    offsets = offsets.long().to(seeds.device).unsqueeze(1)
    h = torch.zeros_like(seeds)
    for word in (seeds & _MASK32, (seeds >> 32) & _MASK32, offsets & _MASK32, (offsets >> 32) & _MASK32):
        h = _mix_word(h, word)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    return _finalize(_mix_word(h, tokens))


def uniform_noise_ref(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), float32 [B, vocab_size], keyed by (seed, offset, token); seeds and offsets [B] int64."""
    h = noise_hash_ref(seeds, offsets, vocab_size) >> (32 - UNIFORM_BITS)
    return (h.to(torch.float32) + 0.5) * (2.0**-UNIFORM_BITS)


def gumbel_noise(
    seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(-log(u)), float32 [B, vocab_size], on ``device``: the same u on every
    device (the logs may differ in their last bits between implementations; the Triton kernels' by up to
    2e-6)."""
    u = uniform_noise_ref(seeds.to(device), offsets.to(device), vocab_size)
    return -torch.log(-torch.log(u))


def gumbel_sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V]: argmax_j(logits_j * (1 / T) + g_j) with the Gumbel noise
    g of (seed, offset, j) (Gumbel-max: a draw from softmax(logits / T)); rows with temperature 0 take
    the plain argmax. Ties go to the lowest index. Returns int64 [B]."""
    scores = gumbel_scores_ref(logits, temperature, seeds, offsets)
    return scores.argmax(dim=-1)


def gumbel_scores_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The perturbed scores ``gumbel_sample_ref`` takes the argmax of: float32 [B, V]."""
    temperature = temperature.float().to(logits.device)
    sampled = temperature > 0
    inverse = 1.0 / torch.where(sampled, temperature, torch.ones_like(temperature))
    x = logits.float()
    noise = gumbel_noise(seeds, offsets, logits.shape[1], logits.device)
    return torch.where(sampled.unsqueeze(1), x * inverse.unsqueeze(1) + noise, x)
