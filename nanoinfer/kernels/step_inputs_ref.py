"""A step's inputs from one packed device array into the forward pass's persistent buffers: the reference
(torch ops; the CPU path) of ``triton_step_inputs.unpack_step_inputs``.

The model runner copies a step's host arrays to the device as one int64 array; ``parts`` names where each
lies in it, as (start, size):

* ``input_ids``, ``positions``, ``slot_mapping``: the step's (padded) tokens;
* ``query_start_loc`` (padded rows + 1), ``seq_lens`` (padded rows), ``row_slots`` (padded rows: each row's
  block-table row);
* ``table_cols``, ``table_block_ids``: the block-table entries scheduled since the previous step,
  grouped by row in row order, and ``table_row_starts`` (rows + 1: row r's entries are
  ``[starts[r], starts[r + 1])``, in its slot's row).

``buffers`` has the device tensors ``input_ids``, ``positions``, ``slot_mapping`` (int64),
``query_start_loc``, ``seq_lens`` (int32) and ``block_tables`` (int32 [rows, width]); ``block_table`` is the
persistent int32 [slots, width] table. The first ``num_rows`` rows of ``block_tables`` become their slots'
rows; padding rows' are left as they are (they have no context: nothing reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

ROW_BUFFERS = ("query_start_loc", "seq_lens")
TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")


def unpack_step_inputs_ref(
    packed: torch.Tensor,
    parts: Mapping[str, tuple[int, int]],
    num_rows: int,
    buffers: Any,
    block_table: torch.Tensor,
) -> None:
    def part(name: str) -> torch.Tensor:
        start, size = parts[name]
        return packed[start : start + size]

    for name in (*TOKEN_BUFFERS, *ROW_BUFFERS):
        values = part(name)
        getattr(buffers, name)[: len(values)].copy_(values, non_blocking=True)
    row_slots = part("row_slots")[:num_rows]
    num_entries = parts["table_cols"][1]
    if num_entries:
        starts = part("table_row_starts")
        slots = row_slots.repeat_interleave(starts[1:] - starts[:-1], output_size=num_entries)
        block_table[slots, part("table_cols")] = part("table_block_ids").to(torch.int32)
    buffers.block_tables[:num_rows] = block_table[row_slots]
