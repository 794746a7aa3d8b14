"""Applying token bitmasks to logits: the pure-PyTorch reference (and the CPU path).

``logits[row_indices[i], j] = -inf`` wherever bit ``j % 32`` of ``bitmask[i, j // 32]`` is 0. Bits past
the logits' vocabulary are ignored; logits columns past the bitmask's ``32 * words`` are disallowed.
``row_indices`` (None: bitmask row i is logits row i) lets a batch where only some rows are
constrained carry a bitmask of those rows only; the other logits rows are untouched. A logits row
listed twice gets both masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BITS_PER_WORD = 32


def check_logits_and_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a 2-D floating-point tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask must be on the logits' device ({logits.device}), got {bitmask.device}")


def check_row_indices(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | Sequence[int] | None
) -> torch.Tensor | None:
    """row_indices as an int64 tensor on the logits' device (None stays None), checked on the host."""
    if row_indices is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(
                f"without row_indices the bitmask needs one row per logits row ({logits.shape[0]}), "
                f"got {bitmask.shape[0]}"
            )
        return None
    rows = torch.as_tensor(row_indices, dtype=torch.int64)
    if rows.dim() != 1 or rows.numel() != bitmask.shape[0]:
        raise ValueError(
            f"row_indices must list one logits row per bitmask row ({bitmask.shape[0]}), "
            f"got shape {tuple(rows.shape)}"
        )
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"row_indices must be in [0, {logits.shape[0]}), got {rows.tolist()}")
    return rows.to(logits.device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed (False past the bitmask's words)."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    padding = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, padding], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | Sequence[int] | None = None
) -> None:
    """In place: the disallowed tokens of each listed logits row get -inf."""
    check_logits_and_bitmask(logits, bitmask)
    rows = check_row_indices(logits, bitmask, row_indices)
    if bitmask.shape[0] == 0:
        return
    disallowed = ~unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    # Each distinct logits row once, disallowed wherever any of its masks disallows.
    targets, position = rows.unique(return_inverse=True)
    combined = torch.zeros(len(targets), logits.shape[1], dtype=torch.int32, device=logits.device)
    combined.index_add_(0, position, disallowed.to(torch.int32))
    masked = logits[targets]
    masked.masked_fill_(combined > 0, float("-inf"))
    logits[targets] = masked
