"""Fused elementwise Triton kernels of a decoder layer; each matches its reference in `elementwise_ref`.

* ``rms_norm`` and ``add_rms_norm`` (residual add + RMSNorm, in place): one program per row.
* ``silu_and_mul``: silu(gate) * up of the fused [gate | up] projection.
* ``qk_norm_rope_store``: QK-norm, RoPE and the paged KV-cache store of one layer in one launch, in
  place on the fused qkv projection output (replaces the split, the two norms, the cos/sin gather,
  the casts, the cat and the store).

Rounding is the reference's (see `elementwise_ref`), so that the fused path stays as close to
transformers as the unfused one. CUDA-graph safe: grids depend on shapes only and no device value is
read on the host. ``pdl=True`` launches with programmatic dependent launch (Hopper and later): the
kernel lets the next one launch early and waits for its predecessor's writes before reading anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.attention_ref import FP8_DTYPE, FP8_MAX, check_kv_scales

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (*_FLOAT_DTYPES, FP8_DTYPE)
_MAX_ROW = 65536
_FP8_MAX = tl.constexpr(FP8_MAX)
# Programs wanted per launch for qk_norm_rope_store (a few per SM on a 132-SM H200): with fewer tokens
# each program takes fewer heads, down to one.
_ROPE_TARGET_PROGRAMS = 528
_ROPE_MAX_HEADS_PER_PROGRAM = 16


def launch_options(pdl: bool, device: torch.device) -> dict:
    """Extra launch keywords for programmatic dependent launch (CUDA only)."""
    if not pdl:
        return {}
    if device.type != "cuda":
        raise ValueError(f"pdl=True needs a CUDA device, got {device}")
    return {"launch_pdl": True}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """With programmatic dependent launch: let the next kernel start its launch now, and wait until the
    previous kernel's writes are visible. Every program calls it unconditionally, first: a program that
    skipped the wait could let this grid finish before its predecessor, and a later kernel's wait would
    then no longer cover the predecessor."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def inverse_kv_scale(scale_ptr, SCALED: tl.constexpr):
    """The float32 reciprocal of an FP8 cache's scale (one correctly rounded division), 1.0 without one."""
    if SCALED:
        return tl.math.div_rn(1.0, tl.load(scale_ptr))
    else:
        return 1.0


@triton.jit
def kv_to_cache(x, inverse_scale, cache_ptr, FP8: tl.constexpr):
    """``x`` in the cache's dtype; into an FP8 cache clamp(x * inverse_scale, +-448) first, rounded as
    ``attention_ref.quantize_fp8_ref`` rounds (products with the reciprocal, not a division per element:
    that made the FP8 store twice as slow as the bf16 one)."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inverse_scale, -_FP8_MAX, _FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, hidden], got shape {tuple(t.shape)}")
    if t.shape[1] and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension (stride(1) == 1)")
    if t.shape[1] > _MAX_ROW:
        raise ValueError(f"{name} rows must have at most {_MAX_ROW} elements, got {t.shape[1]}")


def _row_warps(block: int) -> int:
    return min(16, max(1, block // 256))


# ----------------------------------------------------------------------------------------------------
# RMSNorm, residual add + RMSNorm
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_split,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one row. With ADD_RESIDUAL the rounded sum x + residual is written to residual
    and normalised; ``out`` may be ``x`` itself (each program reads its row before writing it). With
    SPLITS > 0, x is that many float32 partial products ``stride_split`` apart, summed in split order
    and rounded to the activation dtype first."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SPLITS > 0:
        for split in tl.static_range(1, SPLITS):
            x += tl.load(x_ptr + split * stride_split + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(dtype)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed).to(dtype), mask=mask)


def _check_norm_weight(weight: torch.Tensor, hidden: int) -> None:
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] tensor, got shape {tuple(weight.shape)}")
    _check_float("weight", weight)


def _output_rows(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``out`` checked to be [T, H] of ``like``'s shape and dtype with a unit last stride, or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or (like.shape[1] and out.stride(1) != 1):
        raise ValueError(f"out must be {tuple(like.shape)} {like.dtype} with stride(1) == 1")
    return out


def _launch_row_norm(
    x: torch.Tensor,
    row_stride: int,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    pdl: bool,
    splits: int = 0,
    split_stride: int = 0,
) -> None:
    """One ``_rms_norm_kernel`` program per row of ``out`` (non-empty): the residual add first when
    ``residual`` is given, ``x`` as ``splits`` partials ``split_stride`` apart when ``splits`` > 0."""
    num_rows, hidden = out.shape
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        hidden,
        row_stride,
        0 if residual is None else residual.stride(0),
        out.stride(0),
        split_stride,
        eps,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        SPLITS=splits,
        USE_PDL=pdl,
        num_warps=_row_warps(block),
        **launch_options(pdl, x.device),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, pdl: bool = False
) -> torch.Tensor:
    """RMSNorm of every row of ``x`` [T, H] (T may be 0; any row stride): a new tensor of ``x``'s dtype
    (or ``out``, [T, H] with a unit last stride, when given)."""
    _check_rows("x", x)
    _check_float("x", x)
    num_rows, hidden = x.shape
    _check_norm_weight(weight, hidden)
    out = _output_rows(out, x)
    if num_rows and hidden:
        _launch_row_norm(x, x.stride(0), None, weight, out, eps, pdl)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual <- x + residual`` (rounded to the activation dtype), ``x <- rms_norm(residual)``.
    Both [T, H], same dtype, any row strides. Returns ``(x, residual)``."""
    _check_rows("x", x)
    _check_rows("residual", residual)
    _check_float("x", x)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)} {x.dtype}), got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    num_rows, hidden = x.shape
    _check_norm_weight(weight, hidden)
    if num_rows and hidden:
        _launch_row_norm(x, x.stride(0), residual, weight, x, eps, pdl)
    return x, residual


def add_partials_rms_norm(
    parts: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts`` [S, T, H] float32 (contiguous), a projection's partial products over S ranges of its
    input (a split-K product): their sum, rounded to ``residual``'s dtype, is added to ``residual`` in
    place as :func:`add_rms_norm` adds ``x``, and the normed rows go to a new [T, H] tensor (or ``out``).
    Returns ``(out, residual)``: the split-K reduction without a kernel of its own."""
    if parts.dim() != 3 or parts.dtype != torch.float32 or not parts.is_contiguous() or not len(parts):
        raise ValueError(
            f"parts must be a contiguous float32 [splits >= 1, tokens, hidden] tensor, got "
            f"{tuple(parts.shape)} {parts.dtype}"
        )
    _check_rows("residual", residual)
    _check_float("residual", residual)
    if residual.shape != parts.shape[1:]:
        raise ValueError(f"residual must be {tuple(parts.shape[1:])}, got {tuple(residual.shape)}")
    num_rows, hidden = residual.shape
    _check_norm_weight(weight, hidden)
    out = _output_rows(out, residual)
    if num_rows and hidden:
        _launch_row_norm(parts, parts.stride(1), residual, weight, out, eps, pdl, len(parts), parts.stride(0))
    return out, residual


# ----------------------------------------------------------------------------------------------------
# SiLU and mul
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``x`` [T, 2I] = [gate | up] (any row stride) -> silu(gate) * up, a new [T, I] tensor (or ``out``)."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [tokens, 2 * intermediate], got shape {tuple(x.shape)}")
    _check_float("x", x)
    if x.shape[1] and x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension (stride(1) == 1)")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    elif out.shape != (num_rows, inter) or out.dtype != x.dtype or (inter and out.stride(1) != 1):
        raise ValueError(f"out must be ({num_rows}, {inter}) {x.dtype} with stride(1) == 1")
    if num_rows == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        x,
        out,
        inter,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=max(1, min(4, block // 256)),
        **launch_options(pdl, x.device),
    )
    return out


# ----------------------------------------------------------------------------------------------------
# QK-norm + RoPE + KV-cache store
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _norm_halves(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm of rows split into halves [rows, D/2] each, rounded as the reference."""
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
    n1 = (x1 * rstd[:, None]).to(dtype).to(tl.float32)
    n2 = (x2 * rstd[:, None]).to(dtype).to(tl.float32)
    return (w1 * n1).to(dtype).to(tl.float32), (w2 * n2).to(dtype).to(tl.float32)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_out_ptr,
    num_heads,
    num_kv_heads,
    eps,
    stride_qkv,
    stride_qot,
    stride_qoh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    FP8_KV: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    Q_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one token and HEADS_PER_PROGRAM consecutive heads of [q heads | k heads | v heads].
    Rows are handled as two halves (the rotate-half pairs), so no gather or permutation is needed. With
    Q_OUT the rotated q goes to ``q_out_ptr`` instead of back into qkv. With STORE_KV the rotated k goes
    to the cache only (nothing reads it from qkv then); without, back into qkv."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    num_total = num_heads + 2 * num_kv_heads
    valid = heads < num_total
    is_q = heads < num_heads
    is_k = (heads >= num_heads) & (heads < num_heads + num_kv_heads)
    is_v = valid & (heads >= num_heads + num_kv_heads)
    dims = tl.arange(0, half)
    dtype = qkv_ptr.dtype.element_ty

    # Everything a program reads is requested before any of it is used: the position and the slot
    # first (the cos/sin row depends on the position), so that their round trips overlap the rows'
    # instead of following the norm's reduction.
    position = tl.load(positions_ptr + token).to(tl.int64)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    row_ptrs = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_DIM + dims[None, :]
    x1 = tl.load(row_ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row_ptrs + half, mask=valid[:, None], other=0.0).to(tl.float32)
    cos = tl.load(cos_sin_ptr + position * stride_cs + dims).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cs + half + dims).to(tl.float32)

    if Q_NORM or K_NORM:
        if Q_NORM:
            q_w1 = tl.load(q_norm_ptr + dims).to(tl.float32)
            q_w2 = tl.load(q_norm_ptr + half + dims).to(tl.float32)
        else:
            q_w1 = tl.zeros([half], dtype=tl.float32)
            q_w2 = q_w1
        if K_NORM:
            k_w1 = tl.load(k_norm_ptr + dims).to(tl.float32)
            k_w2 = tl.load(k_norm_ptr + half + dims).to(tl.float32)
        else:
            k_w1 = tl.zeros([half], dtype=tl.float32)
            k_w2 = k_w1
        w1 = tl.where(is_q[:, None], q_w1[None, :], k_w1[None, :])
        w2 = tl.where(is_q[:, None], q_w2[None, :], k_w2[None, :])
        n1, n2 = _norm_halves(x1, x2, w1, w2, eps, HEAD_DIM, dtype)
        if Q_NORM and K_NORM:
            do_norm = is_q | is_k
        elif Q_NORM:
            do_norm = is_q
        else:
            do_norm = is_k
        x1 = tl.where(do_norm[:, None], n1, x1)
        x2 = tl.where(do_norm[:, None], n2, x2)

    rotated1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    rotated2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    if Q_OUT:
        q_ptrs = q_out_ptr + token * stride_qot + heads[:, None] * stride_qoh + dims[None, :]
        tl.store(q_ptrs, rotated1, mask=is_q[:, None])
        tl.store(q_ptrs + half, rotated2, mask=is_q[:, None])
    if not (Q_OUT and STORE_KV):
        if Q_OUT:
            in_place_rows = is_k[:, None]
        elif STORE_KV:
            in_place_rows = is_q[:, None]
        else:
            in_place_rows = (is_q | is_k)[:, None]
        tl.store(row_ptrs, rotated1, mask=in_place_rows)
        tl.store(row_ptrs + half, rotated2, mask=in_place_rows)

    if STORE_KV:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv1 = tl.where(is_v[:, None], x1.to(dtype), rotated1)
        kv2 = tl.where(is_v[:, None], x2.to(dtype), rotated2)
        if FP8_KV:
            k_inverse = inverse_kv_scale(k_scale_ptr, K_SCALED)
            v_inverse = inverse_kv_scale(v_scale_ptr, V_SCALED)
            inverse = tl.where(is_k, k_inverse, v_inverse)[:, None]
        else:
            inverse = 1.0
        kv1 = kv_to_cache(kv1, inverse, k_cache_ptr, FP8_KV)
        kv2 = kv_to_cache(kv2, inverse, k_cache_ptr, FP8_KV)
        k_rows = (is_k & (slot >= 0))[:, None]
        v_rows = (is_v & (slot >= 0))[:, None]
        k_ptrs = (
            k_cache_ptr
            + block * stride_kcb
            + offset * stride_kcs
            + (heads - num_heads)[:, None] * stride_kch
            + dims[None, :]
        )
        v_ptrs = (
            v_cache_ptr
            + block * stride_vcb
            + offset * stride_vcs
            + (heads - num_heads - num_kv_heads)[:, None] * stride_vch
            + dims[None, :]
        )
        tl.store(k_ptrs, kv1, mask=k_rows)
        tl.store(k_ptrs + half, kv2, mask=k_rows)
        tl.store(v_ptrs, kv1, mask=v_rows)
        tl.store(v_ptrs + half, kv2, mask=v_rows)


def rope_heads_per_program(num_tokens: int, num_total_heads: int) -> int:
    """Heads per program for qk_norm_rope_store: about _ROPE_TARGET_PROGRAMS programs per launch."""
    wanted = max(1, num_tokens * num_total_heads // _ROPE_TARGET_PROGRAMS)
    return min(
        1 << (wanted.bit_length() - 1), _ROPE_MAX_HEADS_PER_PROGRAM, triton.next_power_of_2(num_total_heads)
    )


def _check_cache_for_store(k_cache, v_cache, num_kv_heads, head_dim) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must have one shape and dtype, got {tuple(k_cache.shape)} {k_cache.dtype} "
            f"and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.numel() == 0:
        return
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(k_cache.shape)}"
        )
    if k_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"k_cache/v_cache dtype must be one of {_CACHE_DTYPES}, got {k_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along head_dim (stride(-1) == 1)")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"kv cache block_size must be a power of two, got {block_size}")


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    heads_per_program: int | None = None,
    pdl: bool = False,
    q_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k RMS-normalised per head where a weight is given, then rotated (RoPE, rotate-half,
    ``cos_sin`` [max_position, head_dim] = [cos | sin] at ``positions`` [T]), from ``qkv`` [T,
    (num_heads + 2 * num_kv_heads) * head_dim] (unit last stride); k and v then written to the paged
    cache at ``slot_mapping`` [T] (-1: nothing); an FP8 cache stores clamp(x * (1 / scale), +-448) in e4m3.
    The rotated q goes back into ``qkv``, or to ``q_out`` [T, num_heads, head_dim] (unit last stride)
    when given; the rotated k goes back into ``qkv`` only when the cache is empty (numel 0: nothing is
    stored, and attention reads k from ``qkv``). One launch. Returns q (``q_out`` when given), k, v:
    views into ``qkv`` (with a cache, k there is the unrotated projection)."""
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv must be [tokens, (num_heads + 2 * num_kv_heads) * head_dim] = [tokens, "
            f"{(num_heads + 2 * num_kv_heads) * head_dim}], got {tuple(qkv.shape)}"
        )
    _check_float("qkv", qkv)
    if qkv.stride(1) != 1:
        raise ValueError("qkv must be contiguous along its last dimension (stride(1) == 1)")
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {head_dim}")
    num_tokens = qkv.shape[0]
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"positions and slot_mapping must be [{num_tokens}], got {tuple(positions.shape)} and "
            f"{tuple(slot_mapping.shape)}"
        )
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be [max_position, {head_dim}] with stride(1) == 1")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor, got {tuple(weight.shape)}")
    _check_cache_for_store(k_cache, v_cache, num_kv_heads, head_dim)
    store = k_cache.numel() > 0
    fp8 = store and k_cache.dtype == FP8_DTYPE
    if store:  # without a cache yet (warm-up) the scales have nothing to apply to
        check_kv_scales(k_cache.dtype, k_scale, v_scale)
    if q_out is not None and (
        q_out.shape != (num_tokens, num_heads, head_dim) or q_out.stride(2) != 1 or q_out.dtype != qkv.dtype
    ):
        raise ValueError(
            f"q_out must be [{num_tokens}, {num_heads}, {head_dim}] of {qkv.dtype} with unit last stride, "
            f"got {tuple(q_out.shape)} of {q_out.dtype}"
        )
    heads = qkv.unflatten(1, (num_heads + 2 * num_kv_heads, head_dim))
    views = (
        heads[:, :num_heads] if q_out is None else q_out,
        heads[:, num_heads : num_heads + num_kv_heads],
        heads[:, num_heads + num_kv_heads :],
    )
    if num_tokens == 0:
        return views
    num_total = num_heads + 2 * num_kv_heads
    per_program = heads_per_program or rope_heads_per_program(num_tokens, num_total)
    if per_program < 1 or per_program & (per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two >= 1, got {per_program}")
    _qk_norm_rope_store_kernel[(num_tokens, triton.cdiv(num_total, per_program))](
        qkv,
        positions,
        cos_sin,
        q_norm_weight if q_norm_weight is not None else qkv,
        k_norm_weight if k_norm_weight is not None else qkv,
        k_cache if store else qkv,
        v_cache if store else qkv,
        slot_mapping,
        k_scale if k_scale is not None else qkv,
        v_scale if v_scale is not None else qkv,
        q_out if q_out is not None else qkv,
        num_heads,
        num_kv_heads,
        eps,
        qkv.stride(0),
        *(q_out.stride()[:2] if q_out is not None else (0, 0)),
        cos_sin.stride(0),
        *(k_cache.stride()[:3] if store else (0, 0, 0)),
        *(v_cache.stride()[:3] if store else (0, 0, 0)),
        HEAD_DIM=head_dim,
        HEADS_PER_PROGRAM=per_program,
        BLOCK_SIZE=k_cache.shape[1] if store else 1,
        Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None,
        STORE_KV=store,
        FP8_KV=fp8,
        K_SCALED=fp8 and k_scale is not None,
        V_SCALED=fp8 and v_scale is not None,
        Q_OUT=q_out is not None,
        USE_PDL=pdl,
        num_warps=max(1, min(8, per_program * head_dim // 256)),
        **launch_options(pdl, qkv.device),
    )
    return views
