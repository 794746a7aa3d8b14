"""Applying token bitmasks to logits on the GPU: one Triton launch for the whole batch.

Same semantics as ``apply_token_bitmask_ref`` (bitmask_ref.py, the reference it is tested against):
``logits[row_indices[i], j] = -inf`` wherever bit ``j % 32`` of ``bitmask[i, j // 32]`` is 0; bits past
the logits' vocabulary are ignored, logits columns past ``32 * words`` are disallowed, rows not listed
are untouched.

Each program handles BLOCK_SIZE columns of one bitmask row and only writes -inf where a token is
disallowed, so a logits row listed twice gets both masks and allowed logits are never read or written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from nanoinfer.structured.bitmask_ref import check_logits_and_bitmask, check_row_indices

BLOCK_SIZE = 2048


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    row_indices_ptr,
    vocab_size,
    num_words,
    logits_row_stride,
    logits_col_stride,
    bitmask_row_stride,
    HAS_ROW_INDICES: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    mask_row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if HAS_ROW_INDICES:
        logits_row = tl.load(row_indices_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    words = columns // 32
    # Columns past the bitmask read word 0: no bit set, so disallowed.
    word_values = tl.load(
        bitmask_ptr + mask_row * bitmask_row_stride + words, mask=words < num_words, other=0
    )
    allowed = ((word_values >> (columns % 32)) & 1) != 0
    in_vocab = columns < vocab_size
    offsets = logits_row * logits_row_stride + columns.to(tl.int64) * logits_col_stride
    tl.store(logits_ptr + offsets, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """In place: the disallowed tokens of each listed logits row get -inf (one kernel launch).

    ``bitmask`` must be on the logits' device (copy it there with ``non_blocking=True`` from pinned
    memory). ``row_indices`` given as a list are checked on the host; as a device tensor only its shape
    is checked, to avoid a synchronization.
    """
    check_logits_and_bitmask(logits, bitmask)
    if isinstance(row_indices, torch.Tensor) and row_indices.device.type != "cpu":
        if (
            row_indices.dim() != 1
            or row_indices.numel() != bitmask.shape[0]
            or row_indices.device != logits.device
        ):
            raise ValueError(
                f"row_indices must be a 1-D tensor on {logits.device} with one logits row per bitmask row "
                f"({bitmask.shape[0]}), got {tuple(row_indices.shape)} on {row_indices.device}"
            )
        rows = row_indices
    else:
        rows = check_row_indices(logits, bitmask, row_indices)
    num_rows = bitmask.shape[0]
    if num_rows == 0 or logits.shape[1] == 0:
        return
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    grid = (num_rows, triton.cdiv(logits.shape[1], BLOCK_SIZE))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        bitmask if rows is None else rows,  # not read without row indices
        logits.shape[1],
        bitmask.shape[1],
        logits.stride(0),
        logits.stride(1),
        bitmask.stride(0),
        HAS_ROW_INDICES=rows is not None,
        BLOCK_SIZE=BLOCK_SIZE,
    )
