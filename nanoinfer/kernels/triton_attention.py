"""Triton kernels for the paged KV cache on CUDA: cache writes, split-KV decode, paged prefill.

Every kernel matches `attention_ref` (the tests check it). The cache layout is
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is ``block * block_size + offset``.
An FP8 (``torch.float8_e4m3fn``) cache is quantized on write (``clamp(x * (1 / scale), +-448)``) and
dequantized in registers on read: K's scale folds into the softmax scale, V's into the output.

CUDA-graph safety: no function here reads a device value on the host. Launch grids depend only on
tensor shapes; per-sequence lengths are read inside the kernels, and work past a sequence's end is
skipped on the device.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import cuda_decode
from nanoinfer.kernels.attention_ref import FP8_DTYPE, check_kv_scales
from nanoinfer.kernels.triton_elementwise import inverse_kv_scale, kv_to_cache, launch_options, pdl_prologue

_LOG2E = 1.4426950408889634
_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (*_QUERY_DTYPES, FP8_DTYPE)
# With at least this many (sequence, kv head) programs per SM, splitting only adds merge work (H200,
# bf16, head_dim 128: batch 64 x 4096 context, 4.2 TB/s unsplit against 4.0 with 4 splits).
_DECODE_NO_SPLIT_PROGRAMS_PER_SM = 3
# Against an FP8 cache, batches of at least this many rows run FP8_CUDA_DECODE; a single row the
# merge-kernel tiles (H100, run 93, us per layer over the bench workload's mixed lengths: 9.9 against 7.2
# at batch 1, 10.1 against 10.5 at 2, 16.0 against 21.3 at 8, 28.7 against 38.2 at 16).
# scripts/gpu_kernels.py's decode_fp8_kernels times both.
FP8_CUDA_MIN_ROWS = 2
# Decode modes (the kernel's MODE): one split; splits merged by a second kernel; splits merged by the
# last split program of each (sequence, kv head) to finish, found with an atomic counter; splits of one
# length for the whole batch (from its longest sequence), merged by a second kernel.
_MODE_SINGLE = tl.constexpr(0)
_MODE_MERGE_KERNEL = tl.constexpr(1)
_MODE_FUSED = tl.constexpr(2)
_MODE_BALANCED = tl.constexpr(3)
_MODES = {"fused": _MODE_FUSED, "merge_kernel": _MODE_MERGE_KERNEL, "balanced": _MODE_BALANCED}
# Sequence lengths read per step when a balanced-mode program looks for the batch's longest.
_LONGEST_BLOCK = tl.constexpr(256)


@dataclass(frozen=True)
class DecodeConfig:
    """How ``paged_decode_attention`` splits and tiles the work.

    ``mode``: ``"fused"`` (one launch; each sequence's split count is chosen on the device from its own
    length, at least ``min_split_tiles`` key tiles per split, and a sequence that needs one split
    writes its output directly), ``"merge_kernel"`` (every sequence is cut into the grid's split count
    of equal parts, each writes a partial and a second kernel merges them) or ``"balanced"`` (one split
    length for the whole batch, the longest sequence over the grid's split count: a shorter sequence
    uses fewer splits, and one that needs a single split writes its output directly, so that no
    program of a batch of mixed lengths holds more than that length; the second kernel merges the
    others). The grid's split count aims at ``target_programs_per_sm`` programs per SM, at most
    ``max_splits``; in balanced mode at least ``min_splits``, however full the grid. ``max_registers``:
    a cap on the registers per thread (ptxas spills the rest), so that more programs fit on a
    multiprocessor (CUDA only; None: the compiler's choice). ``kernel="cuda"``: balanced mode's splits
    run ``cuda_decode``'s kernel, which merges up to ``cuda_decode.MERGE_IN_KERNEL_MAX_SPLITS`` splits
    itself (FP8 caches with 16-key tiles, ``num_stages`` of them in flight; a call it does not support
    runs the Triton kernel with the same splits). ``stage_in_shared`` (that kernel only): the tiles in
    flight wait in shared memory (cp.async) instead of registers, so more of them fit per program at the
    same occupancy. ``kv_heads_first`` (that kernel only): the grid's fastest axis is the KV head, so
    that the programs launched together read one block's heads, a contiguous run of a head-major cache.
    ``fp8_convert`` (that kernel only): how FP8 becomes float16: ``"cvt"`` instructions, or bit moves on
    the integer pipes (the exponent bias fixed in the scales) for K and V (``"bits"``), K only
    (``"bits_keys"``) or V only (``"bits_values"``), which share the conversions between two pipes.
    ``lazy_rescale`` (that kernel only): the online softmax moves its running max, and rescales its
    accumulators, only when a tile's scores pass it by more than 2^8.
    """

    mode: str = "fused"
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    min_split_tiles: int = 1
    target_programs_per_sm: int = 4
    max_splits: int = 64
    min_splits: int = 1
    max_registers: int | None = None
    kernel: str = "triton"
    stage_in_shared: bool = False
    kv_heads_first: bool = False
    fp8_convert: str = "cvt"
    lazy_rescale: bool = False

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"DecodeConfig.mode must be one of {sorted(_MODES)}, got {self.mode!r}")
        if self.kernel not in ("triton", "cuda"):
            raise ValueError(f"DecodeConfig.kernel must be 'triton' or 'cuda', got {self.kernel!r}")
        if self.kernel == "cuda" and (self.mode != "balanced" or self.block_n != 16 or self.num_stages > 4):
            raise ValueError(
                "DecodeConfig.kernel='cuda' needs mode='balanced', block_n=16 and num_stages <= 4"
            )
        converts = list(cuda_decode.FP8_CONVERTS)
        if self.fp8_convert not in converts:
            raise ValueError(f"DecodeConfig.fp8_convert must be one of {converts}, got {self.fp8_convert!r}")
        cuda_only = {
            "stage_in_shared": self.stage_in_shared,
            "kv_heads_first": self.kv_heads_first,
            "fp8_convert": self.fp8_convert != "cvt",
            "lazy_rescale": self.lazy_rescale,
        }
        for name, used in cuda_only.items():
            if used and self.kernel != "cuda":
                raise ValueError(f"DecodeConfig.{name} needs kernel='cuda'")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeConfig.block_n must be a power of two >= 16, got {self.block_n}")
        if not 1 <= self.min_splits <= self.max_splits:
            raise ValueError(
                f"DecodeConfig.min_splits must be in [1, max_splits={self.max_splits}], got {self.min_splits}"
            )
        for name in ("num_warps", "num_stages", "min_split_tiles", "target_programs_per_sm", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(
                f"DecodeConfig.max_registers must be None or in [24, 255], got {self.max_registers}"
            )

    @property
    def cuda_tiling(self) -> tuple[int, int | None, bool, bool, str, bool]:
        """``cuda_decode.kernel_for``'s ``tiling`` for this configuration."""
        return (
            self.num_stages,
            self.max_registers,
            self.stage_in_shared,
            self.kv_heads_first,
            self.fp8_convert,
            self.lazy_rescale,
        )


# The default wherever the grid needs splits (``default_decode_config``); its split count is rounded down
# to a power of two (H200: batch 32 x 4096, 2 splits 3.8 TB/s against 3.4-3.5 with 3, 5 or 20; batch 8
# x 8192, 8 splits 3.3 against 3.0-3.2 with 4, 9, 17 or 64).
MERGE_KERNEL_DECODE = DecodeConfig(mode="merge_kernel")
# One launch, but slower at the batches that split (H200, 4096-wide tables, PDL: 9.8 against 7.9 us per
# layer at batch 1 x 600, 15.0 against 11.2 at batch 8).
FUSED_DECODE = DecodeConfig()
# Triton's tiles against an FP8 cache once the grid holds a program per SM (FP8_CUDA_DECODE's fallback,
# and its splits): 16-key one-warp tiles capped at 128
# registers per thread (220 without the cap: 9 programs per SM; 16 with it, 24 bytes spilled), in
# balanced mode, split towards 64 programs per SM (at most 16 splits). Those small programs fill the GPU
# in one wave, so unsplit a step waits for its longest sequence. Over the bench workload's mixed lengths
# (H200, Qwen3-0.6B shape, gpu_kernels.py --only decode_mixed, docs/benchmarks.md), with the split
# counts this gives: 160.6 against 174.4 us at batch 256 (4 splits), 125.7 against 161.9 at 128 (8),
# 82.0 against 102.2 at 64 (16), 50.6 against 67.1 at 32 (16), against the previous defaults (these
# tiles unsplit from 197 rows, 32-key four-warp tiles from 50, the two-kernel merge below).
FP8_BALANCED_DECODE = DecodeConfig(
    mode="balanced",
    block_n=16,
    num_warps=1,
    num_stages=3,
    max_registers=128,
    target_programs_per_sm=64,
    max_splits=16,
)
# The same splits with cuda_decode's kernel, two tiles in flight, registers uncapped (H100, the bench
# workload's mixed lengths: 145.0 against 167.3 us per layer at batch 256, 76.4 against 90.2 at 64; the
# workload 28,169 against 25,373 tok/s; three tiles or 128 registers lost; docs/benchmarks.md, run 72),
# merging its splits in the same launch where it may (the workload 28,600-28,700 against
# 28,100-28,200, run 78), the grid's KV heads first (run 93: 130.6 against 134.5 us at batch 256, 110.2
# against 113.2 at 128; the workload 29,924 / 29,947 against 29,672 / 29,680 tok/s).
FP8_CUDA_DECODE = replace(
    FP8_BALANCED_DECODE, kernel="cuda", num_stages=2, max_registers=None, kv_heads_first=True
)
# GPU models whose memory system wants other tiles than FP8_CUDA_DECODE's: one JSON file per model,
# named by ``device_config_file``, holding the DecodeConfig fields that differ from FP8_CUDA_DECODE.
# ``scripts/gpu_kernels.py --only decode_fp8_kernels --write-config`` writes it on that GPU.
DEVICE_CONFIG_DIR = Path(__file__).parent / "configs" / "fp8_decode"


def device_config_file(device_name: str) -> str:
    """The tuned-config file name of a GPU model (``torch.cuda.get_device_name``'s name): runs of other
    characters than letters and digits become one underscore ("NVIDIA H200" -> "NVIDIA_H200.json")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.cache
def tuned_fp8_decode_config(device_name: str, directory: Path = DEVICE_CONFIG_DIR) -> DecodeConfig:
    """FP8_CUDA_DECODE with the fields of ``device_name``'s file in ``directory`` replaced, or
    FP8_CUDA_DECODE itself where the GPU model has no file. A file that is not a JSON object, names a
    field DecodeConfig lacks, gives a value of another type than the field's, or a combination
    DecodeConfig rejects raises ValueError naming the file."""
    path = directory / device_config_file(device_name)
    if not path.is_file():
        return FP8_CUDA_DECODE
    try:
        overrides = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: must hold a JSON object of DecodeConfig fields")
    known = {field.name: getattr(FP8_CUDA_DECODE, field.name) for field in fields(DecodeConfig)}
    for name, value in overrides.items():
        if name not in known:
            raise ValueError(f"{path}: DecodeConfig has no field {name!r} (fields: {sorted(known)})")
        allowed = (int, type(None)) if name == "max_registers" else (type(known[name]),)
        if type(value) not in allowed:
            raise ValueError(
                f"{path}: {name} must be {' or '.join(t.__name__ for t in allowed)}, got {value!r}"
            )
    try:
        return replace(FP8_CUDA_DECODE, **overrides)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class PrefillConfig:
    """Tiling of ``paged_prefill_attention``: ``block_m`` query rows per program (with ``pack_gqa``
    the rows are (token, query head) pairs of the heads sharing one KV head, so that each K/V tile is
    loaded once for all of them), ``block_n`` keys per tile."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pack_gqa: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"PrefillConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("PrefillConfig.num_warps and num_stages must be >= 1")


# Measured on an H200 (head_dim 128, a 16,384-token batch of 29 prompts; docs/benchmarks.md, runs 52-53):
# 64-row tiles with 4 warps beat 128-row tiles by 10-20%, and packing the GQA group into the rows (each
# K/V tile loaded once for both query heads of Qwen3-0.6B's groups) beat the unpacked tiles by 5% for
# every cache. Over a 16-bit cache 32-key tiles are 12-13% faster again (210 against 240 us with 16-token
# blocks, 219 against 252 with 256); over an FP8 cache they are 14-17% slower (294 against 258 us), so
# FP8 keeps 64-key tiles.
DEFAULT_PREFILL = PrefillConfig(block_n=32, pack_gqa=True)
FP8_PREFILL = PrefillConfig(pack_gqa=True)
SHORT_QUERY_PREFILL = PrefillConfig(block_m=16)


# ----------------------------------------------------------------------------------------------------
# Input checks (host metadata only: shapes, dtypes, strides; never device values)
# ----------------------------------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"k_cache/v_cache dtype must be one of {_CACHE_DTYPES}, got {k_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along head_dim (stride(-1) == 1)")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"kv cache block_size must be a power of two, got {block_size}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    return block_size, num_kv_heads, head_dim


def _check_heads(query: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    if query.dim() != 3 or query.shape[-1] != head_dim:
        raise ValueError(f"query must be [tokens, num_heads, {head_dim}], got {tuple(query.shape)}")
    if query.dtype not in _QUERY_DTYPES:
        raise ValueError(f"query dtype must be one of {_QUERY_DTYPES}, got {query.dtype}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _group_block(group: int) -> int:
    # tl.dot needs at least 16 rows, so small GQA groups are padded with masked query rows.
    return max(16, triton.next_power_of_2(group))


def _scale_args(k_scale, v_scale, dummy: torch.Tensor) -> dict:
    """Kernel pointers and flags for the optional FP8 scales (a dummy pointer when absent)."""
    return {
        "k_scale_ptr": k_scale if k_scale is not None else dummy,
        "v_scale_ptr": v_scale if v_scale is not None else dummy,
        "K_SCALED": k_scale is not None,
        "V_SCALED": v_scale is not None,
    }


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The paged caches' block, slot and head strides, as every kernel here names them."""
    return {
        "stride_kcb": k_cache.stride(0),
        "stride_kcs": k_cache.stride(1),
        "stride_kch": k_cache.stride(2),
        "stride_vcb": v_cache.stride(0),
        "stride_vcs": v_cache.stride(1),
        "stride_vch": v_cache.stride(2),
    }


@triton.jit
def _load_scale(scale_ptr, SCALED: tl.constexpr):
    if SCALED:
        return tl.load(scale_ptr)
    else:
        return 1.0


@triton.jit
def _matmul_dtype(q, cache_ptr):
    """``q`` in the dtype that the attention's tl.dots multiply in: against an FP8 cache a bf16 query
    becomes float16, since e4m3 converts to float16 in one instruction per pair of values and to bf16
    only through float32 (the conversion of every K/V element then costs what the halved bytes save).
    float16 holds every e4m3 value exactly, and the scores and outputs still accumulate in float32."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


# ----------------------------------------------------------------------------------------------------
# store_kvcache
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads[:, None] < num_kv_heads) & (slot >= 0)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    k_dst = (
        k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    )
    tl.store(k_dst, kv_to_cache(k, inverse_kv_scale(k_scale_ptr, K_SCALED), k_cache_ptr, FP8), mask=mask)

    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    v_dst = (
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    )
    tl.store(v_dst, kv_to_cache(v, inverse_kv_scale(v_scale_ptr, V_SCALED), v_cache_ptr, FP8), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ([tokens, num_kv_heads, head_dim], any token/head strides) into the
    cache at ``slot_mapping`` ([tokens] int32/int64); slot -1 rows are skipped. An FP8 cache stores
    clamp(x * (1 / scale), -448, 448) in e4m3 (scales: 1-element float32 tensors, None = 1)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if slot_mapping.dim() != 1 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [tokens, {num_kv_heads}, {head_dim}] with tokens == len(slot_mapping); got "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    key = _last_dim_contiguous(key)
    value = _last_dim_contiguous(value)
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads=num_kv_heads,
        stride_kt=key.stride(0),
        stride_kh=key.stride(1),
        stride_vt=value.stride(0),
        stride_vh=value.stride(1),
        **_cache_strides(k_cache, v_cache),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        FP8=k_cache.dtype == FP8_DTYPE,
        num_warps=4,
        **_scale_args(k_scale, v_scale, key),
    )


# ----------------------------------------------------------------------------------------------------
# Decode: split-KV flash decoding
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _decode_range(
    q,
    k_head,
    v_head,
    table_row,
    start,
    end,
    qk_scale,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online softmax of the query rows ``q`` [BLOCK_G, D] over keys [start, end): (acc, m, l) with
    scores in log2 units. An empty range gives l == 0."""
    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    # Every tile visited holds at least one valid key, so m_i is finite after the first tile.
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        offsets = tokens % BLOCK_SIZE
        k = tl.load(
            k_head + (block_ids * stride_kcb + offsets * stride_kcs)[:, None] + dims[None, :],
            mask=token_mask[:, None],
            other=0.0,
        )
        v = tl.load(
            v_head + (block_ids * stride_vcb + offsets * stride_vcs)[:, None] + dims[None, :],
            mask=token_mask[:, None],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_partials(
    partial_out_ptr, partial_lse_ptr, part_rows, split_mask, HEAD_DIM: tl.constexpr, BYPASS_L1: tl.constexpr
):
    """Log-sum-exp weighted sum of the normalised partial outputs of one query head: [HEAD_DIM]."""
    dims = tl.arange(0, HEAD_DIM)
    if BYPASS_L1:
        # Written by other programs of this grid: read from L2, never from a stale L1 line.
        lse = tl.load(partial_lse_ptr + part_rows, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(
            partial_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
            mask=split_mask[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
    else:
        lse = tl.load(partial_lse_ptr + part_rows, mask=split_mask, other=float("-inf"))
        parts = tl.load(
            partial_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :],
            mask=split_mask[:, None],
            other=0.0,
        )
    lse_max = tl.max(lse, axis=0)
    # All splits empty (seq_len 0, a CUDA-graph padding row): every weight is 0 and the output is 0.
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weights, axis=0)
    return tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)


@triton.jit
def _store_partial(
    partial_out_ptr,
    partial_lse_ptr,
    acc,
    m_i,
    l_i,
    seq,
    heads,
    row_mask,
    split,
    group,
    num_splits,
    HEAD_DIM: tl.constexpr,
):
    """A split's normalised output and log2-sum-exp (-inf for an empty range) in the workspace, laid out
    [batch, num_heads, num_splits, (HEAD_DIM)]."""
    num_heads = tl.num_programs(1) * group
    part_row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
    dims = tl.arange(0, HEAD_DIM)
    tl.store(partial_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(partial_lse_ptr + part_row, lse, mask=row_mask)


@triton.jit
def _balanced_splits(seq_lens_ptr, seq_len, batch, num_splits, BLOCK_N: tl.constexpr):
    """Balanced mode: (split length, splits used by a sequence of ``seq_len``). The split length is the
    batch's longest sequence over ``num_splits``, in whole key tiles; every program of the grid finds the
    same one (the lengths are a few hundred bytes in L2)."""
    offsets = tl.arange(0, _LONGEST_BLOCK)
    longest = tl.max(tl.load(seq_lens_ptr + offsets, mask=offsets < batch, other=0), axis=0)
    for start in range(_LONGEST_BLOCK, batch, _LONGEST_BLOCK):
        lens = tl.load(seq_lens_ptr + start + offsets, mask=start + offsets < batch, other=0)
        longest = tl.maximum(longest, tl.max(lens, axis=0))
    split_len = tl.maximum(tl.cdiv(tl.cdiv(longest, num_splits), BLOCK_N), 1) * BLOCK_N
    return split_len, tl.maximum(tl.cdiv(seq_len, split_len), 1)


# Triton compiles a separate variant of a kernel for each class of value of its integer arguments (1,
# a multiple of 16, other). The arguments that change from batch to batch (the split count, the
# block-table width) are left out of that, so that a new combination met in the middle of a run does
# not cost a compilation (about a second when Triton's disk cache lacks it).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    counters_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    group,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ob,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MODE: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one (sequence, kv head, split): the query heads sharing that kv head are the rows
    of one tl.dot tile. A split either writes the normalised output directly (the only split of its
    sequence) or its normalised partial output and log2-sum-exp for the merge."""
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are sized on the device (whole key tiles), so the grid only depends on static shapes. The
    # merge-kernel mode keeps every grid split (those past the end have an empty range); the fused and
    # balanced modes use only as many as the sequence needs.
    if MODE == _MODE_FUSED:
        tiles_per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits), MIN_SPLIT_TILES)
        split_len = tiles_per_split * BLOCK_N
        used_splits = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    elif MODE == _MODE_MERGE_KERNEL:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        used_splits = num_splits
    elif MODE == _MODE_BALANCED:
        batch = tl.num_programs(0)
        split_len, used_splits = _balanced_splits(seq_lens_ptr, seq_len, batch, num_splits, BLOCK_N)
    else:
        split_len = seq_len
        used_splits = 1
    if split < used_splits:
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        rows = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_DIM)
        row_mask = rows < group
        heads = kv_head * group + rows
        q = tl.load(
            query_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        q = _matmul_dtype(q, k_cache_ptr)
        qk_scale = scale_log2 * _load_scale(k_scale_ptr, K_SCALED)
        acc, m_i, l_i = _decode_range(
            q,
            k_cache_ptr + kv_head * stride_kch,
            v_cache_ptr + kv_head * stride_vch,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            start,
            end,
            qk_scale,
            stride_kcb,
            stride_kcs,
            stride_vcb,
            stride_vcs,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_G,
            BLOCK_N,
        )
        # Empty ranges (seq_len 0, or a split past the end) give l_i == 0: output 0, lse -inf.
        has_keys = l_i > 0.0
        acc = acc * (_load_scale(v_scale_ptr, V_SCALED) / tl.where(has_keys, l_i, 1.0))[:, None]
        if MODE == _MODE_MERGE_KERNEL:
            _store_partial(
                partial_out_ptr, partial_lse_ptr, acc, m_i, l_i, seq, heads, row_mask, split, group,
                num_splits, HEAD_DIM,
            )  # fmt: skip
        elif used_splits == 1:
            out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            _store_partial(
                partial_out_ptr, partial_lse_ptr, acc, m_i, l_i, seq, heads, row_mask, split, group,
                num_splits, HEAD_DIM,
            )  # fmt: skip
            # Balanced mode leaves the merge to the second kernel.
            if MODE == _MODE_FUSED:
                # Every thread's partial stores come before the counter's release; the last split to
                # arrive (acquire) merges them all and resets the counter for the next launch.
                tl.debug_barrier()
                counter = counters_ptr + seq * tl.num_programs(1) + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == used_splits - 1:
                    num_heads = tl.num_programs(1) * group
                    splits = tl.arange(0, BLOCK_S)
                    split_mask = splits < used_splits
                    for g in range(group):
                        head = kv_head * group + g
                        part_rows = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
                        merged = _merge_partials(
                            partial_out_ptr, partial_lse_ptr, part_rows, split_mask, HEAD_DIM, True
                        )
                        out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims
                        tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty))
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BALANCED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program = one (sequence, query head): log-sum-exp weighted sum of the split outputs (in
    balanced mode, of the splits the sequence used; one split has written the output itself)."""
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    used_splits = num_splits
    if BALANCED:
        seq_len = tl.load(seq_lens_ptr + seq)
        _, used_splits = _balanced_splits(seq_lens_ptr, seq_len, tl.num_programs(0), num_splits, BLOCK_N)
    if used_splits > 1:
        splits = tl.arange(0, BLOCK_S)
        part_rows = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
        merged = _merge_partials(
            partial_out_ptr, partial_lse_ptr, part_rows, splits < used_splits, HEAD_DIM, False
        )
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + tl.arange(0, HEAD_DIM)
        tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_decode_config(
    batch: int, cache_dtype: torch.dtype, device: torch.device | None = None
) -> DecodeConfig:
    """The configuration ``paged_decode_attention`` uses when it is given none: against an FP8 cache,
    from ``FP8_CUDA_MIN_ROWS`` rows, ``FP8_CUDA_DECODE`` (on a CUDA ``device``, as tuned for its GPU
    model: ``tuned_fp8_decode_config``); otherwise splits (where the grid has fewer than
    3 programs per SM) merged by a second kernel (H200, Qwen3-0.6B shape, 4096-wide tables, PDL: 7.9
    against 9.8 us per layer for the fused merge at batch 1 x 600, 11.2 against 15.0 at batch 8). bf16's
    64-key four-warp tiles, unsplit from 3 programs per SM, run at 3.8-4.0 TB/s on the bench workload's
    mixed lengths, which no balanced variant beat."""
    if cache_dtype == FP8_DTYPE and batch >= FP8_CUDA_MIN_ROWS:
        if device is not None and device.type == "cuda":
            return _device_fp8_decode_config(device)
        return FP8_CUDA_DECODE
    return MERGE_KERNEL_DECODE


@functools.cache
def _device_fp8_decode_config(device: torch.device) -> DecodeConfig:
    """``tuned_fp8_decode_config`` of the device's GPU model, its name read once per device: eager
    decode calls this every layer."""
    return tuned_fp8_decode_config(torch.cuda.get_device_name(device))


def decode_num_splits(
    batch: int, num_kv_heads: int, max_context: int, num_sms: int, config: DecodeConfig = MERGE_KERNEL_DECODE
) -> int:
    """Static split count of a decode launch's grid (it depends on shapes only, never on seq_lens):
    enough (sequence, kv head, split) programs to keep every multiprocessor busy, never more splits
    than the context has (minimum-size) splits."""
    programs = max(1, batch * num_kv_heads)
    min_tiles = config.min_split_tiles if config.mode == "fused" else 1
    usable = max(1, triton.cdiv(max_context, config.block_n * min_tiles))
    balanced = config.mode == "balanced"
    # Balanced mode splits however full the grid is: its short sequences add no programs.
    if programs >= _DECODE_NO_SPLIT_PROGRAMS_PER_SM * num_sms and not balanced:
        return 1
    wanted = triton.cdiv(config.target_programs_per_sm * num_sms, programs)
    splits = min(wanted, usable, config.max_splits)
    if balanced:
        splits = max(splits, min(config.min_splits, usable))
    if config.mode != "fused":
        return 1 << (splits.bit_length() - 1)  # round down to a power of two
    return splits


@dataclass
class DecodeWorkspace:
    """Preallocated scratch for split-KV decode; allocate once (e.g. before CUDA-graph capture) with
    :meth:`allocate` for the largest batch and pass it to every call (every layer may share one: the
    counters are back to zero after each call)."""

    partial_out: torch.Tensor  # float32, flat, >= batch * num_heads * splits * head_dim
    partial_lse: torch.Tensor  # float32, flat, >= batch * num_heads * splits
    counters: torch.Tensor  # int32 zeros, >= batch * num_kv_heads (fused mode)

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_context: int,
        device: torch.device | str,
        config: DecodeConfig | None = None,
        cache_dtype: torch.dtype = torch.bfloat16,
    ) -> DecodeWorkspace:
        """For calls with ``config``, or (None) with each batch's default for ``cache_dtype``."""
        device = torch.device(device)
        num_sms = _num_sms(device)
        rows = max(
            b
            * decode_num_splits(
                b,
                num_kv_heads,
                max_context,
                num_sms,
                config or default_decode_config(b, cache_dtype, device),
            )
            for b in range(1, max_batch + 1)
        )
        return cls(
            partial_out=torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(rows * num_heads, dtype=torch.float32, device=device),
            counters=torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device),
        )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One new query per sequence: ``query`` [batch, num_heads, head_dim] attends over the first
    ``seq_lens[b]`` cached tokens of its sequence. Rows with seq_len 0 give zeros. An FP8 cache is
    dequantized with ``k_scale`` / ``v_scale`` (1-element float32 tensors, None = 1)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    group = _check_heads(query, num_kv_heads, head_dim)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    batch, num_heads, _ = query.shape
    if seq_lens.shape != (batch,) or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"seq_lens must be [{batch}] and block_tables [{batch}, max_blocks]; got "
            f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with stride(-1) == 1, got {tuple(out.shape)}")
    if batch == 0:
        return out
    num_sms = _num_sms(query.device)
    config = config or default_decode_config(batch, k_cache.dtype, query.device)
    query = _last_dim_contiguous(query)
    block_tables = _last_dim_contiguous(block_tables)
    max_context = block_tables.shape[1] * block_size
    num_splits = decode_num_splits(batch, num_kv_heads, max_context, num_sms, config)
    _launch_decode(
        query, k_cache, v_cache, block_tables, seq_lens, scale, out, workspace, num_splits, group, config,
        k_scale, v_scale, pdl,
    )  # fmt: skip
    return out


def _decode_workspace(workspace, batch, num_heads, num_kv_heads, head_dim, num_splits, device):
    rows = batch * num_heads * num_splits
    if workspace is None:
        return DecodeWorkspace(
            partial_out=torch.empty(rows * head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(rows, dtype=torch.float32, device=device),
            counters=torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device),
        )
    if (
        workspace.partial_out.numel() < rows * head_dim
        or workspace.partial_lse.numel() < rows
        or workspace.counters.numel() < batch * num_kv_heads
    ):
        raise ValueError(
            f"workspace too small for batch={batch}, num_heads={num_heads}, splits={num_splits}, "
            f"head_dim={head_dim}: allocate it with DecodeWorkspace.allocate for the largest batch"
        )
    return workspace


def _launch_decode(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    out,
    workspace,
    num_splits,
    group,
    config=MERGE_KERNEL_DECODE,
    k_scale=None,
    v_scale=None,
    pdl=False,
):
    """Launches decode with an explicit grid split count (the GPU script sweeps it)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = num_heads // group
    if num_splits == 1:
        mode = _MODE_SINGLE.value
        partial_out = partial_lse = out  # unused by the kernel
        counters = seq_lens
    else:
        mode = _MODES[config.mode].value
        workspace = _decode_workspace(
            workspace, batch, num_heads, num_kv_heads, head_dim, num_splits, query.device
        )
        partial_out, partial_lse, counters = workspace.partial_out, workspace.partial_lse, workspace.counters
    # One compiled variant for every split count (the merge masks the unused splits): a count derived
    # from the batch would otherwise compile a new variant the first time a batch size is met.
    block_s = triton.next_power_of_2(config.max_splits)
    options = launch_options(pdl, query.device)
    register_cap = {"maxnreg": config.max_registers} if config.max_registers else {}
    cuda_kernel = None
    if config.kernel == "cuda":
        cuda_kernel = cuda_decode.kernel_for(
            query, k_cache, v_cache, out, block_tables, seq_lens, config.cuda_tiling
        )
    merged = False
    if cuda_kernel is not None:
        merged = cuda_decode.launch(
            cuda_kernel, query, k_cache, v_cache, block_tables, seq_lens, scale, out, partial_out,
            partial_lse, counters, num_splits, k_scale, v_scale, pdl,
        )  # fmt: skip
    else:
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            partial_out,
            partial_lse,
            counters,
            scale_log2=scale * _LOG2E,
            group=group,
            num_splits=num_splits,
            stride_qb=query.stride(0),
            stride_qh=query.stride(1),
            **_cache_strides(k_cache, v_cache),
            stride_bt=block_tables.stride(0),
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_dim,
            BLOCK_G=_group_block(group),
            BLOCK_N=config.block_n,
            BLOCK_S=block_s,
            MODE=mode,
            MIN_SPLIT_TILES=config.min_split_tiles,
            USE_PDL=pdl,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **_scale_args(k_scale, v_scale, out),
            **options,
            **register_cap,
        )
    if mode in (_MODE_MERGE_KERNEL.value, _MODE_BALANCED.value) and not merged:
        _decode_merge_kernel[(batch, num_heads)](
            partial_out,
            partial_lse,
            out,
            seq_lens,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_N=config.block_n,
            BLOCK_S=block_s,
            BALANCED=mode == _MODE_BALANCED.value,
            USE_PDL=pdl,
            num_warps=4,
            **options,
        )


# ----------------------------------------------------------------------------------------------------
# Prefill (with a cached prefix / chunked prefill)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(
    q,
    acc,
    m_i,
    l_i,
    k_head,
    v_head,
    table_row,
    tile_start,
    query_pos,
    seq_len,
    qk_scale,
    dims,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    tokens = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        token_mask = tokens < seq_len
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE).to(tl.int64)
    offsets = tokens % BLOCK_SIZE
    k_ptrs = k_head + (block_ids * stride_kcb + offsets * stride_kcs)[:, None] + dims[None, :]
    v_ptrs = v_head + (block_ids * stride_vcb + offsets * stride_vcs)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=token_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=token_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    scores = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
    if MASKED:
        visible = (tokens[None, :] <= query_pos[:, None]) & token_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    group,
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACK: tl.constexpr,
    K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr,
):
    """One program = one (head slot, sequence, query tile). Without packing (PACK == 1) the head slot
    is a query head and the tile's BLOCK_M rows are tokens; with packing it is a KV head and row r is
    token r // PACK, query head kv_head * group + r % PACK (rows past the group masked), so each K/V
    tile is loaded once for the whole group. The extra sequence index ``num_seqs`` zero-fills query
    rows past query_start_loc[-1] (padding), as the reference does."""
    slot = tl.program_id(0)
    seq = tl.program_id(1)
    # Causal work grows with the tile index: the slowest grid axis runs the last (heaviest) tiles first
    # so the light ones fill the tail; the heads of one tile run side by side and share K/V in L2.
    num_q_tiles = tl.num_programs(2)
    q_tile = num_q_tiles - 1 - tl.program_id(2)
    tile_tokens: tl.constexpr = BLOCK_M // PACK
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_M)
    row_token = rows // PACK
    if PACK == 1:
        kv_head = slot // group
        heads = slot + rows * 0
        head_mask = rows >= 0
    else:
        kv_head = slot
        heads = slot * group + rows % PACK
        head_mask = (rows % PACK) < group
    if seq == num_seqs:
        tail_start = tl.load(query_start_loc_ptr + num_seqs)
        zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
        for tile_token_start in range(
            tail_start + q_tile * tile_tokens, num_tokens, num_q_tiles * tile_tokens
        ):
            token = tile_token_start + row_token
            out_ptrs = (
                out_ptr + token.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            )
            tl.store(out_ptrs, zeros, mask=((token < num_tokens) & head_mask)[:, None])
    else:
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_tile * tile_tokens < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            prefix_len = seq_len - q_len
            q_idx = q_tile * tile_tokens + row_token
            row_mask = (q_idx < q_len) & head_mask
            token = (q_start + q_idx).to(tl.int64)
            q = tl.load(
                query_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None],
                other=0.0,
            )
            q = _matmul_dtype(q, k_cache_ptr)
            query_pos = prefix_len + q_idx
            qk_scale = scale_log2 * _load_scale(k_scale_ptr, K_SCALED)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            k_head = k_cache_ptr + kv_head * stride_kch
            v_head = v_cache_ptr + kv_head * stride_vch
            # Keys before the tile's first query position are visible to every row: no mask there.
            first_pos = prefix_len + q_tile * tile_tokens
            unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
            for tile_start in range(0, unmasked_end, BLOCK_N):
                acc, m_i, l_i = _prefill_tile(
                    q, acc, m_i, l_i, k_head, v_head, table_row, tile_start, query_pos, seq_len, qk_scale,
                    dims, stride_kcb, stride_kcs, stride_vcb, stride_vcs, BLOCK_SIZE, BLOCK_N, False,
                )  # fmt: skip
            # The diagonal tiles, up to the tile's last query position (keys past it are masked for
            # every row). The first one holds key `unmasked_end` <= every row's position, so m_i is
            # finite after it and fully masked rows later never give exp2(-inf + inf).
            kv_end = tl.minimum(seq_len, first_pos + tile_tokens)
            for tile_start in range(unmasked_end, kv_end, BLOCK_N):
                acc, m_i, l_i = _prefill_tile(
                    q, acc, m_i, l_i, k_head, v_head, table_row, tile_start, query_pos, seq_len, qk_scale,
                    dims, stride_kcb, stride_kcs, stride_vcb, stride_vcs, BLOCK_SIZE, BLOCK_N, True,
                )  # fmt: skip
            acc = acc * (_load_scale(v_scale_ptr, V_SCALED) / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
            out_ptrs = out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _prefill_config(max_query_len: int, group: int, fp8_cache: bool) -> PrefillConfig:
    if max_query_len <= 16:
        return SHORT_QUERY_PREFILL
    config = FP8_PREFILL if fp8_cache else DEFAULT_PREFILL
    # A GQA group wider than the tile's rows cannot be packed into it.
    if triton.next_power_of_2(group) > config.block_m:
        return replace(config, pack_gqa=False)
    return config


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (its last ``q_len`` positions) over its whole
    paged context; same semantics as ``paged_attention_ref``. ``max_query_len`` must be >= every
    sequence's query length (it sizes the grid). An FP8 cache is dequantized with ``k_scale`` /
    ``v_scale``. ``config`` picks the tiling (default: by ``max_query_len`` and the cache's dtype)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    group = _check_heads(query, num_kv_heads, head_dim)
    check_kv_scales(k_cache.dtype, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    if (
        seq_lens.dim() != 1
        or query_start_loc.shape != (num_seqs + 1,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"need query_start_loc [batch + 1], seq_lens [batch], block_tables [batch, max_blocks]; got "
            f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, {tuple(block_tables.shape)}"
        )
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    num_tokens, num_heads, _ = query.shape
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with stride(-1) == 1, got {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    config = config or _prefill_config(max_query_len, group, k_cache.dtype == FP8_DTYPE)
    pack = triton.next_power_of_2(group) if config.pack_gqa else 1
    if pack > config.block_m:
        raise ValueError(
            f"PrefillConfig.block_m ({config.block_m}) must hold at least one token of the packed GQA "
            f"group ({pack} rows)"
        )
    query = _last_dim_contiguous(query)
    block_tables = _last_dim_contiguous(block_tables)
    _launch_prefill(
        query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, scale, out, group,
        config, k_scale, v_scale,
    )  # fmt: skip
    return out


def _launch_prefill(
    query,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    max_query_len,
    scale,
    out,
    group,
    config,
    k_scale=None,
    v_scale=None,
):
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    pack = triton.next_power_of_2(group) if config.pack_gqa else 1
    tile_tokens = config.block_m // pack
    num_q_tiles = max(1, triton.cdiv(max_query_len, tile_tokens))
    head_slots = num_heads // group if config.pack_gqa else num_heads
    _prefill_kernel[(head_slots, num_seqs + 1, num_q_tiles)](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale_log2=scale * _LOG2E,
        group=group,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        **_cache_strides(k_cache, v_cache),
        stride_bt=block_tables.stride(0),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        PACK=pack,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **_scale_args(k_scale, v_scale, out),
    )
