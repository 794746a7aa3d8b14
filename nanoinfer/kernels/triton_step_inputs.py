"""A step's inputs from one packed device array into the forward pass's persistent buffers, in one launch
(what ``step_inputs_ref.unpack_step_inputs_ref`` does in about eight torch ops; the arguments are the
same, see there).

Why a kernel: the engine's thread copies every step's inputs, and on a host whose cores the grammar
processes share each torch op cost it 30-40 us (py-spy over the structured-outputs benchmark on the H100's
host, docs/benchmarks.md): the eight took about a fifth of a constrained step, which the host bounds.

The grid: first the token programs (``BLOCK`` tokens each: the three token buffers), then one program per
padded row (its ``query_start_loc`` and ``seq_lens`` entries; for a real row its block-table row, copied
from its slot's, then the row's new entries written over it and into the persistent table; a barrier
orders the two writes of the program). Every entry of a row comes from its own program, so no program
waits for another's writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from nanoinfer.kernels.step_inputs_ref import ROW_BUFFERS, TOKEN_BUFFERS

_BLOCK = 1024
_MAX_BLOCK_W = 1024
_BLOCK_U = 16
# Each buffer's dtype, in the kernel's argument order.
_BUFFER_DTYPES = {name: torch.int64 for name in TOKEN_BUFFERS} | {
    name: torch.int32 for name in (*ROW_BUFFERS, "block_tables")
}


@triton.jit(
    do_not_specialize=[
        "input_ids_at",
        "positions_at",
        "slot_mapping_at",
        "query_start_loc_at",
        "seq_lens_at",
        "row_slots_at",
        "table_cols_at",
        "table_block_ids_at",
        "table_row_starts_at",
        "num_tokens",
        "num_rows",
        "padded_rows",
        "num_token_programs",
    ]
)
def _unpack_step_inputs_kernel(
    packed_ptr,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    block_tables_ptr,
    input_ids_at,
    positions_at,
    slot_mapping_at,
    query_start_loc_at,
    seq_lens_at,
    row_slots_at,
    table_cols_at,
    table_block_ids_at,
    table_row_starts_at,
    num_tokens,
    num_rows,
    padded_rows,
    width,
    stride_table,
    stride_tables,
    num_token_programs,
    BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_token_programs:
        tokens = pid * BLOCK + tl.arange(0, BLOCK)
        mask = tokens < num_tokens
        tl.store(input_ids_ptr + tokens, tl.load(packed_ptr + input_ids_at + tokens, mask=mask), mask=mask)
        tl.store(positions_ptr + tokens, tl.load(packed_ptr + positions_at + tokens, mask=mask), mask=mask)
        slots = tl.load(packed_ptr + slot_mapping_at + tokens, mask=mask)
        tl.store(slot_mapping_ptr + tokens, slots, mask=mask)
    else:
        row = pid - num_token_programs
        tl.store(seq_lens_ptr + row, tl.load(packed_ptr + seq_lens_at + row).to(tl.int32))
        tl.store(query_start_loc_ptr + row, tl.load(packed_ptr + query_start_loc_at + row).to(tl.int32))
        if row == padded_rows - 1:
            last = tl.load(packed_ptr + query_start_loc_at + padded_rows).to(tl.int32)
            tl.store(query_start_loc_ptr + padded_rows, last)
        if row < num_rows:
            slot = tl.load(packed_ptr + row_slots_at + row)
            source = block_table_ptr + slot * stride_table
            target = block_tables_ptr + row.to(tl.int64) * stride_tables
            for start in range(0, width, BLOCK_W):
                cols = start + tl.arange(0, BLOCK_W)
                in_row = cols < width
                tl.store(target + cols, tl.load(source + cols, mask=in_row), mask=in_row)
            first = tl.load(packed_ptr + table_row_starts_at + row)
            end = tl.load(packed_ptr + table_row_starts_at + row + 1)
            if end > first:
                # The row's copy above is written before its new entries overwrite part of it.
                tl.debug_barrier()
                for at in range(first, end, BLOCK_U):
                    entries = at + tl.arange(0, BLOCK_U)
                    valid = entries < end
                    cols = tl.load(packed_ptr + table_cols_at + entries, mask=valid, other=0)
                    ids = tl.load(packed_ptr + table_block_ids_at + entries, mask=valid, other=0).to(tl.int32)
                    tl.store(target + cols, ids, mask=valid)
                    tl.store(source + cols, ids, mask=valid)


def unpack_step_inputs(
    packed: torch.Tensor,
    parts: Mapping[str, tuple[int, int]],
    num_rows: int,
    buffers: Any,
    block_table: torch.Tensor,
) -> None:
    """Same as ``unpack_step_inputs_ref`` (see step_inputs_ref), on CUDA, in one launch."""
    tensors = {name: getattr(buffers, name) for name in _BUFFER_DTYPES}
    if packed.dtype != torch.int64 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous int64 tensor, got {packed.dtype}")
    for name, tensor in tensors.items():
        if tensor.dtype != _BUFFER_DTYPES[name] or tensor.stride(-1) != 1:
            raise ValueError(
                f"buffers.{name} must be {_BUFFER_DTYPES[name]} with unit last stride, got {tensor.dtype}"
            )
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 with unit last stride, got {block_table.dtype}")
    width = block_table.shape[1]
    if tensors["block_tables"].shape[1] != width:
        got = tensors["block_tables"].shape[1]
        raise ValueError(f"buffers.block_tables must be as wide as block_table ({width}), got {got}")
    num_tokens, padded_rows = parts["input_ids"][1], parts["seq_lens"][1]
    if not 0 <= num_rows <= padded_rows:
        raise ValueError(f"num_rows must be in [0, {padded_rows}], got {num_rows}")
    num_token_programs = triton.cdiv(num_tokens, _BLOCK)
    _unpack_step_inputs_kernel[(num_token_programs + padded_rows,)](
        packed,
        *(tensors[name] for name in (*TOKEN_BUFFERS, *ROW_BUFFERS)),
        block_table,
        tensors["block_tables"],
        *(parts[name][0] for name in (*TOKEN_BUFFERS, *ROW_BUFFERS, "row_slots")),
        parts["table_cols"][0],
        parts["table_block_ids"][0],
        parts["table_row_starts"][0],
        num_tokens,
        num_rows,
        padded_rows,
        width,
        block_table.stride(0),
        tensors["block_tables"].stride(0),
        num_token_programs,
        BLOCK=_BLOCK,
        BLOCK_W=min(_MAX_BLOCK_W, triton.next_power_of_2(width)),
        BLOCK_U=_BLOCK_U,
    )
