"""Small-batch projection (GEMV-like GEMM) for decode: ``out = x @ weight.T (+ bias)`` for 1-16 rows.

At batch 1-16 a projection reads its whole weight for a few rows of output, so it is bound by the
weight read. One program = one block of ``block_n`` output columns (weight rows, contiguous along K,
so the loads are coalesced) over a range of K; with ``split_k`` > 1 the K ranges of one column block
run in separate programs, each writing a float32 partial, and the last of them to finish (an atomic
counter) sums the partials in split order (deterministic) and writes the output. The product is
either a broadcast multiply-and-sum on the CUDA cores (``use_dot=False``, for 1-4 rows) or a tensor-core
``tl.dot`` with the rows padded to 16. With ``gated`` the input is a gated MLP's [gate | up] and the
product is over silu(gate) * up, computed as the tiles load (the MLP's down projection without a
separate activation kernel).

The split-K counters live in one zeroed int32 buffer per device, created on the first split-K call
(make that call before CUDA-graph capture) and left at zero after every call; launches that share it
must run on one stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.triton_elementwise import launch_options

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Above 16 rows cuBLAS was as fast or faster on every projection, but for the MLP's down projection at
# 32-64 rows, where this kernel won by 1 us (docs/benchmarks.md, run 31).
MAX_ROWS = 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MIN_COUNTERS = 1 << 14


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.use_dot and min(self.block_n, self.block_k) < 16:
            raise ValueError("GemvConfig with use_dot needs block_n and block_k >= 16")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("GemvConfig.split_k, num_warps and num_stages must be >= 1")


def gemv_config(m: int, n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """The default configuration for an [m, k] x [n, k]^T product: CUDA cores for up to 4 rows (a
    transient product of at most 4096 elements per program), tensor cores above; split-K only when
    the column blocks alone would leave SMs idle."""
    if m <= 4:
        block_n, block_k, use_dot = 8, min(512 // triton.next_power_of_2(m), triton.next_power_of_2(k)), False
    else:
        block_n, block_k, use_dot = 32, min(128, max(16, triton.next_power_of_2(k))), True
    column_blocks = triton.cdiv(n, block_n)
    split_k = 1
    while column_blocks * split_k < num_sms and split_k < 8 and k >= 2 * split_k * block_k:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, use_dot=use_dot)


def preferred_config(m: int, n: int, k: int) -> GemvConfig | None:
    """The configuration that beat cuBLAS for this shape on an H200 (bf16, Qwen3-0.6B projections, M =
    1..16; docs/benchmarks.md), or None where cuBLAS was as fast or faster. Projections that reduce
    (K > N: attention output, MLP down) are where cuBLAS is slowest at small M (12.6 us for 2048->1024
    at M=1 against 3.0 here); wide ones (qkv, gate_up) only gain at M=1, the vocabulary projection at
    every M."""
    if m > MAX_ROWS:
        return None
    if n >= 32768:  # the vocabulary projection
        return GemvConfig(block_n=32 if m <= 4 else 64, block_k=128, use_dot=True)
    if k > n:
        if m <= 4:
            return GemvConfig(block_n=4, block_k=1024, num_warps=2)
        return GemvConfig(block_n=32, block_k=128, split_k=4, use_dot=True)
    if m == 1:
        return GemvConfig(block_n=8, block_k=1024)
    return None


@triton.jit
def _load_weight_tile(w_rows, k0, k_stop, col_mask, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at k0 (zeros past k_stop)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < k_stop)[None, :], other=0.0)


@triton.jit
def _load_input_tile(
    x_rows, k0, k_stop, K, row_mask, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr
):
    """The x tile [BLOCK_M, BLOCK_K] at k0 (zeros past k_stop); with GATED it is silu(gate) * up of the
    gate columns at k0 and the up columns at K + k0, rounded as the separate activation kernel rounds
    (silu, then the product, to x's dtype)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    x_mask = row_mask[:, None]
    if not EVEN:
        x_mask = x_mask & (ks < k_stop)[None, :]
    x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
    if GATED:
        gate = x.to(tl.float32)
        up = tl.load(x_rows + K + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(x.dtype).to(tl.float32)
        x = (silu * up).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    GATED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_mask = cols < N
    row_mask = rows < M
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_span
    k_stop = tl.minimum(K, k_start + k_span)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # No earlier kernel writes the weights, so under programmatic dependent launch their first tile is
    # requested before the wait for the previous kernel (whose output x is): the weight read, most of
    # this kernel's time at a few rows, overlaps the previous kernel's tail. Everything else (x, the
    # split-K partials and counters) is read after the wait.
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = _load_weight_tile(w_rows, k_start, k_stop, col_mask, BLOCK_K, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = _load_input_tile(x_rows, k_start, k_stop, K, row_mask, BLOCK_K, EVEN, GATED)
    if USE_DOT:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        # Triton pipelines these loads through shared memory (num_stages).
        for k0 in range(k_start + BLOCK_K, k_stop, BLOCK_K):
            w = _load_weight_tile(w_rows, k0, k_stop, col_mask, BLOCK_K, EVEN)
            x = _load_input_tile(x_rows, k0, k_stop, K, row_mask, BLOCK_K, EVEN, GATED)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        # Loads that do not feed a dot are not pipelined by Triton: the next tile is requested before
        # the current one is used, so that two tiles per program are in flight. One row accumulates
        # elementwise and reduces once at the end; more rows reduce every tile (registers).
        acc_k = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            w_next = _load_weight_tile(w_rows, k0 + BLOCK_K, k_stop, col_mask, BLOCK_K, False)
            x_next = _load_input_tile(x_rows, k0 + BLOCK_K, k_stop, K, row_mask, BLOCK_K, False, GATED)
            if BLOCK_M == 1:
                acc_k += w.to(tl.float32) * x.to(tl.float32)
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            w, x = w_next, x_next
        if BLOCK_M == 1:
            acc = tl.sum(acc_k, axis=1)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial_offsets = rows[:, None] * N + cols[None, :]
        tl.store(partial_ptr + pid_k * M * N + partial_offsets, acc, mask=out_mask)
        # Every thread's partial stores come before the counter's release; the last split to arrive
        # (acquire) sums all partials and resets the counter for the next launch.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                split_ptrs = partial_ptr + split * M * N + partial_offsets
                total += tl.load(split_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counters_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def _split_k_counters(device: torch.device, count: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "gemv with split_k > 1 allocates its counters on first use: call it once before CUDA-graph "
                "capture"
            )
        counters = torch.zeros(max(count, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
    gated: bool = False,
) -> torch.Tensor:
    """``x`` [M, K] (1 <= M <= 16, unit last stride) @ ``weight`` [N, K].T (row-major, as nn.Linear
    stores it) + ``bias`` [N]: a new [M, N] tensor of ``x``'s dtype (or ``out``), float32 accumulation.
    ``gated``: ``x`` is [M, 2K] = [gate | up] and the product is silu(gate) * up @ ``weight``.T."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] * (2 if gated else 1):
        expected = "[M, 2K] ([gate | up])" if gated else "[M, K]"
        raise ValueError(
            f"need x {expected} and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    m = x.shape[0]
    n, k = weight.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows of x, got {m}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of {_DTYPES}, got {x.dtype} and {weight.dtype}")
    if k < 1 or n < 1 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be non-empty and contiguous along K (stride(1) == 1)")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be ({m}, {n}) {x.dtype} with stride(1) == 1")
    config = config or gemv_config(m, n, k)
    column_blocks = triton.cdiv(n, config.block_n)
    if config.split_k > 1:
        partial = torch.empty(config.split_k * m * n, dtype=torch.float32, device=x.device)
        counters = _split_k_counters(x.device, column_blocks)
    else:
        partial = counters = out
    block_m = 16 if config.use_dot else triton.next_power_of_2(m)
    _gemv_kernel[(column_blocks, config.split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        USE_DOT=config.use_dot,
        HAS_BIAS=bias is not None,
        EVEN=n % config.block_n == 0 and k % (config.block_k * config.split_k) == 0,
        GATED=gated,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl, x.device),
    )
    return out
