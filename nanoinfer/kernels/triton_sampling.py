"""One-pass Gumbel-max sampling and the counter-based noise on CUDA: the uniform noise bit-identical to
`sampling_ref`'s, the Gumbel noise within 2e-6 of it.

``gumbel_sample`` reads the logits once: a grid of (row, vocabulary chunk) programs each computes
``logits * (1 / T) + g`` (the noise hashed on the fly, nothing stored) and writes its chunk's
(max, argmax) to a small workspace; a second, tiny kernel picks each row's winner. Greedy rows
(temperature 0) skip the noise. No softmax, no division pass, no host read of a device value.

The Gumbel noise -log(-log(u)) takes its two logarithms from the multiprocessor's ``lg2.approx``
(absolute error about 2^-22) instead of libdevice's accurate ``logf``, which cost the sampler about 50
instructions per token: it was bound by them, not by its bytes. Where u is near 1 that would lose
-log(u)'s relative precision (and the winners come from there), so for 1 - u < 1/8 -log(u) =
-log(1 - v) is its series in v = 1 - u (exact in float32) up to v^7 (truncation below 1e-7 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.sampling_ref import UNIFORM_BITS
from nanoinfer.kernels.triton_elementwise import launch_options, pdl_prologue

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_UNIFORM_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
_UNIFORM_STEP = tl.constexpr(2.0**-UNIFORM_BITS)
_UNIFORM_MAX = tl.constexpr(2**UNIFORM_BITS - 1)
_LN2 = tl.constexpr(0.6931471805599453)
# Below this 1 - u, -log(u) is computed as the series of -log(1 - v).
_SERIES_BELOW = tl.constexpr(0.125)
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
def _uniform(key, tokens):
    """u in (0, 1) for the tokens (int32 vector) of the row whose key is ``key``."""
    return _unit(_uniform_bits(key, tokens))


@triton.jit
def _log2(x, APPROX: tl.constexpr):
    """log2(x): the multiprocessor's ``lg2.approx`` with APPROX (on CUDA), else the accurate one (for
    Triton's interpreter, which runs no PTX)."""
    if APPROX:
        y = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = tl.log2(x)
    return y


@triton.jit
def _gumbel(key, tokens, APPROX_LOG2: tl.constexpr):
    """Gumbel noise -log(-log(u)) for the tokens of the row keyed ``key``, u as ``_uniform`` gives it,
    and v = 1 - u exactly (the unit of the complementary bits, 2^BITS - 1 - bits)."""
    bits = _uniform_bits(key, tokens)
    u = _unit(bits)
    v = _unit(bits ^ _UNIFORM_MAX)
    series = 1.0 / 6.0 + v * (1.0 / 7.0)
    series = 1.0 / 5.0 + v * series
    series = 1.0 / 4.0 + v * series
    series = 1.0 / 3.0 + v * series
    series = 0.5 + v * series
    series = v * (1.0 + v * series)
    exponential = tl.where(v < _SERIES_BELOW, series, -_LN2 * _log2(u, APPROX_LOG2))
    return -_LN2 * _log2(exponential, APPROX_LOG2)


@triton.jit
def _noise_kernel(
    seed_ptr, offset_ptr, out_ptr, vocab_size, stride_o, BLOCK: tl.constexpr, GUMBEL: tl.constexpr,
    APPROX_LOG2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _row_key(seed_ptr, offset_ptr, row)
    noise = _gumbel(key, tokens, APPROX_LOG2) if GUMBEL else _uniform(key, tokens)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + tokens, noise, mask=tokens < vocab_size)


def _check_rows(seeds: torch.Tensor, offsets: torch.Tensor, batch: int | None = None) -> None:
    if seeds.dim() != 1 or offsets.shape != seeds.shape or (batch is not None and seeds.shape[0] != batch):
        raise ValueError(
            f"seeds and offsets must be 1-D [{batch if batch is not None else 'B'}], got "
            f"{tuple(seeds.shape)} and {tuple(offsets.shape)}"
        )
    if seeds.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError(f"seeds and offsets must be int64, got {seeds.dtype} and {offsets.dtype}")


def _noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int, gumbel: bool) -> torch.Tensor:
    _check_rows(seeds, offsets)
    if vocab_size < 0 or vocab_size >= 2**31:
        raise ValueError(f"vocab_size must be in [0, 2^31), got {vocab_size}")
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    if out.numel() == 0:
        return out
    block = 1024
    _noise_kernel[(seeds.shape[0], triton.cdiv(vocab_size, block))](
        seeds, offsets, out, vocab_size, out.stride(0), BLOCK=block, GUMBEL=gumbel, APPROX_LOG2=out.is_cuda
    )
    return out


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Same as ``sampling_ref.uniform_noise_ref`` (bit for bit): float32 [B, vocab_size] in (0, 1)."""
    return _noise(seeds, offsets, vocab_size, gumbel=False)


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of ``uniform_noise``'s u, as ``gumbel_sample`` adds it: float32 [B,
    vocab_size], within 2e-6 of ``sampling_ref.gumbel_noise``."""
    return _noise(seeds, offsets, vocab_size, gumbel=True)


@triton.jit
def _gumbel_chunk_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,
    offset_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    vocab_size,
    stride_l,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    APPROX_LOG2: tl.constexpr,
):
    """One program = one (row, chunk of the vocabulary): the chunk's best perturbed score and its index."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    tokens = chunk * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + tokens, mask=in_vocab, other=float("-inf"))
    x = x.to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0.0:
        inverse = tl.math.div_rn(1.0, temperature)
        noise = _gumbel(_row_key(seed_ptr, offset_ptr, row), tokens, APPROX_LOG2)
        scores = tl.where(in_vocab, x * inverse + noise, float("-inf"))
    else:
        scores = x
    best, arg = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
    slot = row.to(tl.int64) * num_chunks + chunk
    tl.store(chunk_max_ptr + slot, best)
    tl.store(chunk_arg_ptr + slot, chunk * BLOCK + arg)


@triton.jit
def _gumbel_pick_kernel(
    chunk_max_ptr, chunk_arg_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr
):
    """One program = one row: the chunk with the best score (the first on a tie: lowest index)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    mask = chunks < num_chunks
    best = tl.load(chunk_max_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    # A row of -inf or NaN scores has no finite winner: its first chunk's pick stands.
    winner = tl.argmax(best, axis=0, tie_break_left=True)
    token = tl.load(chunk_arg_ptr + row * num_chunks + winner)
    tl.store(out_ptr + row, token.to(tl.int64))


def gumbel_chunk_size(batch: int, vocab_size: int) -> int:
    """Vocabulary chunk per program: the largest that still gives about two programs per SM."""
    for block in reversed(_CHUNK_SIZES):
        if batch * triton.cdiv(vocab_size, block) >= _TARGET_PROGRAMS:
            return block
    return _CHUNK_SIZES[0]


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    chunk_size: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Token ids [B] int64 (or into ``out``): argmax_j(logits_j * (1 / T) + g_j) for rows with
    temperature T > 0 (g: ``gumbel_noise``), argmax_j(logits_j) for T == 0; ties to the lowest index.
    ``logits`` [B, V] bf16/fp16/fp32 with a unit last stride (any row stride); ``temperature`` [B]
    float32; ``seeds`` and ``offsets`` [B] int64 key the noise (see `sampling_ref`)."""
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
    block = chunk_size or gumbel_chunk_size(batch, vocab_size)
    if block < 16 or block & (block - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {block}")
    num_chunks = triton.cdiv(vocab_size, block)
    chunk_max = torch.empty(batch * num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(batch * num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(batch, num_chunks)](
        logits,
        temperature,
        seeds,
        offsets,
        chunk_max,
        chunk_arg,
        vocab_size,
        logits.stride(0),
        num_chunks,
        BLOCK=block,
        USE_PDL=pdl,
        APPROX_LOG2=logits.is_cuda,
        num_warps=4 if block <= 2048 else 8,
        **launch_options(pdl, logits.device),
    )
    _gumbel_pick_kernel[(batch,)](
        chunk_max,
        chunk_arg,
        out,
        num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        USE_PDL=pdl,
        num_warps=1,
        **launch_options(pdl, logits.device),
    )
    return out
