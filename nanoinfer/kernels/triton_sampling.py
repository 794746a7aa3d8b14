"""Inverse-CDF sampling on CUDA in two kernels, the row's draw bit-identical to `sampling_ref`'s.

A grid of (row, vocabulary chunk) programs reads the logits once: each writes its chunk's max, argmax
and (for sampled rows) sum of 2^((x - max) * log2(e) / T) to a small workspace. Then one program per
row rescales the chunk sums to the row's max, walks their running sum to the chunk where u times the
total falls, and walks that chunk's weights (its logits read a second time, one chunk per row) to the
token. Greedy rows (temperature 0) take the argmax of the chunk maxima. No softmax written out, no
host read of a device value.

Why not Gumbel-max (the argmax of x / T - log(-log(u)) over the row): it hashes a uniform and takes
two logarithms for every token, and at 256 rows x 151,936 those instructions bound it (85 us on the
H100, 36 us for the argmax alone). The inverse CDF needs one exponential per token and one uniform per
row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.sampling_ref import LOG2E, UNIFORM_BITS
from nanoinfer.kernels.triton_elementwise import launch_options, pdl_prologue

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_UNIFORM_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
_UNIFORM_STEP = tl.constexpr(2.0**-UNIFORM_BITS)
_LOG2E = tl.constexpr(LOG2E)
_CHUNK_SIZES = (1024, 2048, 4096)
_TARGET_PROGRAMS = 264  # two per SM on a 132-SM H200


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _mix_word(h, word):
    k = word * 0xCC9E2D51
    k = _rotl32(k, 15) * 0x1B873593
    h = _rotl32(h ^ k, 13)
    return h * 5 + 0xE6546B64


@triton.jit
def _row_key(seed_ptr, offset_ptr, row):
    """The hash state after the four per-row words (seed lo/hi, offset lo/hi), uint32."""
    seed = tl.load(seed_ptr + row).to(tl.int64)
    offset = tl.load(offset_ptr + row).to(tl.int64)
    h = tl.zeros([], dtype=tl.uint32)
    h = _mix_word(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _mix_word(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix_word(h, (offset & 0xFFFFFFFF).to(tl.uint32))
    return _mix_word(h, ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _uniform_bits(key, tokens):
    """The top UNIFORM_BITS bits of the noise hash of the tokens (int32 vector) of the row keyed ``key``."""
    h = _mix_word(key, tokens.to(tl.uint32)) ^ 20
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return h >> _UNIFORM_SHIFT


@triton.jit
def _unit(bits):
    """(bits + 0.5) / 2^UNIFORM_BITS: strictly inside (0, 1), exact in float32."""
    return (bits.to(tl.float32) + 0.5) * _UNIFORM_STEP


@triton.jit
def _softmax_chunk_kernel(
    logits_ptr,
    temperature_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    chunk_sum_ptr,
    vocab_size,
    stride_l,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one (row, chunk of the vocabulary): the chunk's max logit, its index (the lowest on
    a tie) and, for a sampled row, the sum of 2^((x - max) * log2(e) / T) over the chunk."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    tokens = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_l + tokens, mask=tokens < vocab_size, other=float("-inf")
    )
    x = x.to(tl.float32)
    best, arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    slot = row.to(tl.int64) * num_chunks + chunk
    tl.store(chunk_max_ptr + slot, best)
    tl.store(chunk_arg_ptr + slot, chunk * BLOCK + arg)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        scale = tl.math.div_rn(_LOG2E, temperature)
        # NaN for a chunk of -inf logits: the pick gives such a chunk no weight.
        tl.store(chunk_sum_ptr + slot, tl.sum(tl.exp2((x - best) * scale), axis=0))


@triton.jit
def _inverse_cdf_pick_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    offset_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    chunk_sum_ptr,
    out_ptr,
    vocab_size,
    stride_l,
    num_chunks,
    BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one row: the argmax (greedy rows), or the inverse-CDF draw over the chunk sums and
    then within the chosen chunk. A row without a positive finite total (every logit -inf, or a NaN)
    keeps the argmax."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    in_row = chunks < num_chunks
    base = row.to(tl.int64) * num_chunks
    maxima = tl.load(chunk_max_ptr + base + chunks, mask=in_row, other=float("-inf"))
    winner = tl.argmax(maxima, axis=0, tie_break_left=True)
    token = tl.load(chunk_arg_ptr + base + winner).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        scale = tl.math.div_rn(_LOG2E, temperature)
        top = tl.max(maxima, axis=0)
        sums = tl.load(chunk_sum_ptr + base + chunks, mask=in_row, other=0.0)
        weights = tl.where(in_row & (maxima > float("-inf")), sums * tl.exp2((maxima - top) * scale), 0.0)
        running = tl.cumsum(weights, axis=0)
        total = tl.sum(weights, axis=0)  # a sum, unlike a max, keeps a NaN
        target = (
            _unit(_uniform_bits(_row_key(seed_ptr, offset_ptr, row), tl.zeros([], dtype=tl.int32))) * total
        )
        last_chunk = tl.max(tl.where(weights > 0.0, chunks, -1), axis=0)
        chosen = tl.minimum(tl.sum((in_row & (running <= target)).to(tl.int32), axis=0), last_chunk)
        before = tl.sum(tl.where(chunks == chosen - 1, running, 0.0), axis=0)
        positions = tl.arange(0, BLOCK)
        tokens = chosen * BLOCK + positions
        x = tl.load(
            logits_ptr + row.to(tl.int64) * stride_l + tokens,
            mask=(tokens < vocab_size) & (chosen >= 0),
            other=float("-inf"),
        )
        weights_in_chunk = tl.exp2((x.to(tl.float32) - top) * scale)
        running_in_chunk = tl.cumsum(weights_in_chunk, axis=0)
        last_token = tl.max(tl.where(weights_in_chunk > 0.0, positions, -1), axis=0)
        index = tl.minimum(tl.sum((running_in_chunk <= target - before).to(tl.int32), axis=0), last_token)
        # total > 0 is false for a NaN total; no token weighs more than 1, so a total is finite.
        drawn = (total > 0.0) & (last_chunk >= 0) & (last_token >= 0)
        token = tl.where(drawn, chosen.to(tl.int64) * BLOCK + index, token)
    tl.store(out_ptr + row, token)


def _check_rows(seeds: torch.Tensor, offsets: torch.Tensor, batch: int) -> None:
    if seeds.shape != (batch,) or offsets.shape != (batch,):
        raise ValueError(
            f"seeds and offsets must be [{batch}], got {tuple(seeds.shape)} and {tuple(offsets.shape)}"
        )
    if seeds.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError(f"seeds and offsets must be int64, got {seeds.dtype} and {offsets.dtype}")


def sample_chunk_size(batch: int, vocab_size: int) -> int:
    """Vocabulary chunk per program: the largest that still gives about two programs per SM."""
    for block in reversed(_CHUNK_SIZES):
        if batch * triton.cdiv(vocab_size, block) >= _TARGET_PROGRAMS:
            return block
    return _CHUNK_SIZES[0]


def inverse_cdf_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    chunk_size: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Token ids [B] int64 (or into ``out``): a draw from softmax(logits / T) by the inverse CDF for rows
    with temperature T > 0, argmax(logits) for T == 0 (ties to the lowest index); the same tokens as
    ``sampling_ref.inverse_cdf_sample_ref`` up to the rounding of the running sums. ``logits`` [B, V]
    bf16/fp16/fp32 with a unit last stride (any row stride); ``temperature`` [B] float32; ``seeds`` and
    ``offsets`` [B] int64 key each row's draw (see `sampling_ref`)."""
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(
            f"logits must be 2-D [B, V] of {_LOGIT_DTYPES}, got {tuple(logits.shape)} {logits.dtype}"
        )
    batch, vocab_size = logits.shape
    if vocab_size < 1 or vocab_size >= 2**31:
        raise ValueError(f"logits vocabulary size must be in [1, 2^31), got {vocab_size}")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary (stride(1) == 1)")
    if temperature.shape != (batch,) or temperature.dtype != torch.float32:
        raise ValueError(
            f"temperature must be [{batch}] float32, got {tuple(temperature.shape)} {temperature.dtype}"
        )
    _check_rows(seeds, offsets, batch)
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    elif out.shape != (batch,) or out.dtype != torch.int64:
        raise ValueError(f"out must be [{batch}] int64, got {tuple(out.shape)} {out.dtype}")
    if batch == 0:
        return out
    block = chunk_size or sample_chunk_size(batch, vocab_size)
    if block < 16 or block & (block - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {block}")
    num_chunks = triton.cdiv(vocab_size, block)
    chunk_max = torch.empty(batch * num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(batch * num_chunks, dtype=torch.int32, device=logits.device)
    chunk_sum = torch.empty(batch * num_chunks, dtype=torch.float32, device=logits.device)
    warps = 4 if block <= 2048 else 8
    _softmax_chunk_kernel[(batch, num_chunks)](
        logits,
        temperature,
        chunk_max,
        chunk_arg,
        chunk_sum,
        vocab_size,
        logits.stride(0),
        num_chunks,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=warps,
        **launch_options(pdl, logits.device),
    )
    _inverse_cdf_pick_kernel[(batch,)](
        logits,
        temperature,
        seeds,
        offsets,
        chunk_max,
        chunk_arg,
        chunk_sum,
        out,
        vocab_size,
        logits.stride(0),
        num_chunks,
        BLOCK=block,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        USE_PDL=pdl,
        num_warps=warps,
        **launch_options(pdl, logits.device),
    )
    return out
