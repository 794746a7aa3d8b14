"""Triton kernels for the paged KV cache on CUDA: cache writes, split-KV decode, paged prefill.

Every kernel matches `attention_ref` (the tests check it). The cache layout is
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is ``block * block_size + offset``.

CUDA-graph safety: no function here reads a device value on the host. Launch grids depend only on
tensor shapes; per-sequence lengths are read inside the kernels, and work past a sequence's end is
skipped on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Split-count heuristic, from H200 timings (bf16, head_dim 128) of (sequence, kv head, split) programs:
# with at least 3 programs per SM already, splitting only adds merge work (batch 64 x 4096 context:
# 4.2 TB/s unsplit, 4.0 with 4 splits); below that, about 4 programs per SM with a power-of-two split
# count did best (batch 32 x 4096: 2 splits 3.8 TB/s vs 3, 5 or 20 splits 3.4-3.5; batch 8 x 8192:
# 8 splits 3.3 vs 4, 9, 17 or 64 splits 3.0-3.2; batch 1 x 32768: 64 splits 2.6 vs 32 or 128: 2.5).
_DECODE_NO_SPLIT_PROGRAMS_PER_SM = 3
_DECODE_TARGET_PROGRAMS_PER_SM = 4
_DECODE_MAX_SPLITS = 64
_DECODE_BLOCK_N = 64


# ----------------------------------------------------------------------------------------------------
# Input checks (host metadata only: shapes, dtypes, strides; never device values)
# ----------------------------------------------------------------------------------------------------


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"k_cache/v_cache dtype must be one of {_SUPPORTED_DTYPES}, got {k_cache.dtype}")
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
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _group_block(group: int) -> int:
    # tl.dot needs at least 16 rows, so small GQA groups are padded with masked query rows.
    return max(16, triton.next_power_of_2(group))


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
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    v_dst = (
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    )
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ([tokens, num_kv_heads, head_dim], any token/head strides) into the
    cache at ``slot_mapping`` ([tokens] int32/int64); slot -1 rows are skipped."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
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
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------------------
# Decode: split-KV flash decoding
# ----------------------------------------------------------------------------------------------------


# Triton compiles a separate variant of a kernel for each class of value of its integer arguments (1,
# a multiple of 16, other). The arguments that change from batch to batch (sequence and token counts,
# the block-table width, the split count) are left out of that, so that a new combination met in the
# middle of a run does not cost a compilation (about a second when Triton's disk cache lacks it).
# None of them is a stride of vectorized loads, so no variant would be faster.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
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
    SINGLE_SPLIT: tl.constexpr,
):
    """One program = one (sequence, kv head, split): the query heads sharing that kv head are the rows
    of one tl.dot tile. With SINGLE_SPLIT the normalised output is written directly; otherwise the
    split's normalised partial output and its log2-sum-exp go to the workspace for the merge."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are sized on the device from this sequence's length (rounded to whole key tiles), so the
    # grid only depends on static shapes; splits past the end have an empty range.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
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

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kch
    v_head = v_cache_ptr + kv_head * stride_vch
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
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Empty ranges (seq_len 0, or a split past the end) give l_i == 0: output 0, lse -inf.
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        num_heads = tl.num_programs(1) * group
        part_row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(partial_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + part_row, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program = one (sequence, query head): log-sum-exp weighted sum of the split outputs."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    split_mask = splits < num_splits
    part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    lse = tl.load(partial_lse_ptr + part_row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty (seq_len 0, a CUDA-graph padding row): every weight is 0 and the output is 0.
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weights, axis=0)
    parts = tl.load(partial_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], mask=split_mask[:, None])
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Static split count for a decode launch (it depends on shapes only, never on seq_lens): enough
    (sequence, kv head, split) programs to keep every multiprocessor busy, never more splits than the
    context has key tiles."""
    programs = max(1, batch * num_kv_heads)
    if programs >= _DECODE_NO_SPLIT_PROGRAMS_PER_SM * num_sms:
        return 1
    wanted = triton.cdiv(_DECODE_TARGET_PROGRAMS_PER_SM * num_sms, programs)
    usable = max(1, triton.cdiv(max_context, _DECODE_BLOCK_N))
    splits = min(wanted, usable, _DECODE_MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@dataclass
class DecodeWorkspace:
    """Preallocated fp32 scratch for split-KV decode; allocate once (e.g. before CUDA-graph capture)
    with :meth:`allocate` for the largest batch and pass it to every call."""

    partial_out: torch.Tensor  # flat, >= batch * num_heads * splits * head_dim
    partial_lse: torch.Tensor  # flat, >= batch * num_heads * splits

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_context: int,
        device: torch.device | str,
    ) -> DecodeWorkspace:
        device = torch.device(device)
        num_sms = _num_sms(device)
        rows = max(
            b * decode_num_splits(b, num_kv_heads, max_context, num_sms) for b in range(1, max_batch + 1)
        )
        return cls(
            partial_out=torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(rows * num_heads, dtype=torch.float32, device=device),
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
) -> torch.Tensor:
    """One new query per sequence: ``query`` [batch, num_heads, head_dim] attends over the first
    ``seq_lens[b]`` cached tokens of its sequence. Rows with seq_len 0 give zeros."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    group = _check_heads(query, num_kv_heads, head_dim)
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
    query = _last_dim_contiguous(query)
    block_tables = _last_dim_contiguous(block_tables)
    max_context = block_tables.shape[1] * block_size
    num_splits = decode_num_splits(batch, num_kv_heads, max_context, _num_sms(query.device))
    _launch_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, out, workspace, num_splits, group)
    return out


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
    block_n=_DECODE_BLOCK_N,
    num_warps=4,
    num_stages=3,
):
    batch, num_heads, head_dim = query.shape
    num_kv_heads = num_heads // group
    block_size = k_cache.shape[1]
    single = num_splits == 1
    if single:
        partial_out = partial_lse = out  # unused by the kernel
    else:
        rows = batch * num_heads * num_splits
        if workspace is None:
            workspace = DecodeWorkspace(
                partial_out=torch.empty(rows * head_dim, dtype=torch.float32, device=query.device),
                partial_lse=torch.empty(rows, dtype=torch.float32, device=query.device),
            )
        elif workspace.partial_out.numel() < rows * head_dim or workspace.partial_lse.numel() < rows:
            raise ValueError(
                f"workspace too small for batch={batch}, num_heads={num_heads}, splits={num_splits}, "
                f"head_dim={head_dim}: allocate it with DecodeWorkspace.allocate for the largest batch"
            )
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * _LOG2E,
        group,
        num_splits,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_G=_group_block(group),
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not single:
        _decode_merge_kernel[(batch, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
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
    scale_log2,
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
    scores = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        visible = (tokens[None, :] <= query_pos[:, None]) & token_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
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
):
    """One program = one (query head, sequence, query tile). The extra sequence index ``num_seqs``
    zero-fills query rows past query_start_loc[-1] (padding), as the reference does."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # Causal work grows with the tile index: the slowest grid axis runs the last (heaviest) tiles first
    # so the light ones fill the tail; the heads of one tile run side by side and share K/V in L2.
    num_q_tiles = tl.num_programs(2)
    q_tile = num_q_tiles - 1 - tl.program_id(2)
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_M)
    if seq == num_seqs:
        tail_start = tl.load(query_start_loc_ptr + num_seqs)
        zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
        for row_start in range(tail_start + q_tile * BLOCK_M, num_tokens, num_q_tiles * BLOCK_M):
            token = row_start + rows
            out_ptrs = out_ptr + token.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
            tl.store(out_ptrs, zeros, mask=(token < num_tokens)[:, None])
    else:
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_tile * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            prefix_len = seq_len - q_len
            q_idx = q_tile * BLOCK_M + rows
            row_mask = q_idx < q_len
            token = (q_start + q_idx).to(tl.int64)
            q = tl.load(
                query_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None],
                other=0.0,
            )
            query_pos = prefix_len + q_idx
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            kv_head = head // group
            table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            k_head = k_cache_ptr + kv_head * stride_kch
            v_head = v_cache_ptr + kv_head * stride_vch
            # Keys before the tile's first query position are visible to every row: no mask there.
            first_pos = prefix_len + q_tile * BLOCK_M
            unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
            for tile_start in range(0, unmasked_end, BLOCK_N):
                acc, m_i, l_i = _prefill_tile(
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
                    scale_log2,
                    dims,
                    stride_kcb,
                    stride_kcs,
                    stride_vcb,
                    stride_vcs,
                    BLOCK_SIZE,
                    BLOCK_N,
                    False,
                )
            # The diagonal tiles. The first one holds key `unmasked_end` <= every row's position,
            # so m_i is finite after it and fully masked rows later never give exp2(-inf + inf).
            kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
            for tile_start in range(unmasked_end, kv_end, BLOCK_N):
                acc, m_i, l_i = _prefill_tile(
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
                    scale_log2,
                    dims,
                    stride_kcb,
                    stride_kcs,
                    stride_vcb,
                    stride_vcs,
                    BLOCK_SIZE,
                    BLOCK_N,
                    True,
                )
            acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            out_ptrs = out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _prefill_config(max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the prefill kernel."""
    # Measured on an H200 (head_dim 128, bf16): 64 x 64 tiles with 4 warps beat 128-row tiles by 5-10%.
    if max_query_len <= 16:
        return 16, 64, 4, 3
    return 64, 64, 4, 3


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
) -> torch.Tensor:
    """Causal attention of each sequence's new queries (its last ``q_len`` positions) over its whole
    paged context; same semantics as ``paged_attention_ref``. ``max_query_len`` must be >= every
    sequence's query length (it sizes the grid)."""
    block_size, num_kv_heads, head_dim = _check_cache(k_cache, v_cache)
    group = _check_heads(query, num_kv_heads, head_dim)
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
    query = _last_dim_contiguous(query)
    block_tables = _last_dim_contiguous(block_tables)
    _launch_prefill(
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
        _prefill_config(max_query_len),
    )
    return out


def _launch_prefill(
    query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_query_len, scale, out, group, config
):
    block_m, block_n, num_warps, num_stages = config
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_q_tiles = max(1, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[(num_heads, num_seqs + 1, num_q_tiles)](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        group,
        num_seqs,
        num_tokens,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
