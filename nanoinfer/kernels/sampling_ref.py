"""Counter-based sampling noise and inverse-CDF sampling, in pure PyTorch (the definition the Triton
kernels in `triton_sampling` match: the uniform draw bit for bit, the token up to the rounding of the
cumulative sums; and the general sampler's path off CUDA).

Noise: each (row, token) gets the 32-bit MurmurHash3 (x86_32, seed 0) of the 20-byte message
``seed_lo, seed_hi, offset_lo, offset_hi, token`` (little-endian 32-bit words), where ``seed`` is the
request's 64-bit seed and ``offset`` the number of tokens the row has generated so far. No state: a
seeded request draws the same noise whatever else is batched with it, on CPU and GPU alike. Its top 23
bits give ``u = (h23 + 0.5) / 2^23``, exact in float32 and strictly inside (0, 1) (with 24 bits,
``h24 + 0.5`` needs 25 significant bits and the largest values round to 1.0). A sampled row uses one
such draw, token 0's (the inverse CDF needs one uniform per row).

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
LOG2E = 1.4426950408889634


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


def row_uniform_ref(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's one draw u in (0, 1), float32 [B]: the uniform of token 0 of its (seed, offset)."""
    return uniform_noise_ref(seeds, offsets, 1)[:, 0]


def inverse_cdf_sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], int64 [B]. A row with temperature T > 0 draws from
    softmax(logits / T) by its inverse CDF: with weights w_j = 2^((logits_j - max) * log2(e) / T) and
    their running sums c_j, the first j with c_j > u * c_(V-1), u the row's draw (``row_uniform_ref``),
    never a token of weight 0 (at most the first j whose c_j reaches the total). A row with T == 0, or
    whose weights have no positive finite sum (every logit -inf, or a NaN), takes the plain argmax (ties
    to the lowest index)."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    temperature = temperature.float().to(x.device)
    sampled = temperature > 0
    if x.numel() == 0 or not bool(sampled.any()):
        return greedy
    scale = torch.tensor(LOG2E, dtype=torch.float32, device=x.device) / torch.where(
        sampled, temperature, torch.ones_like(temperature)
    )
    top = x.max(dim=-1, keepdim=True).values
    weights = torch.exp2((x - top) * scale.unsqueeze(1))
    running = weights.cumsum(dim=-1)
    total = running[:, -1]
    target = row_uniform_ref(seeds, offsets).to(x.device) * total
    chosen = (running <= target.unsqueeze(1)).sum(dim=-1)
    # Where u * total rounds up to the total: the first token whose running sum reaches it (its weight
    # is positive, since the sums before it fall short).
    first_at_total = (running < total.unsqueeze(1)).sum(dim=-1)
    usable = sampled & (total > 0) & torch.isfinite(total)
    return torch.where(usable, torch.minimum(chosen, first_at_total), greedy)
