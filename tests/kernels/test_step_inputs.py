"""``unpack_step_inputs`` (one Triton launch) against its torch reference, on random packed steps: decode
steps padded to a graph's rows, mixed steps with many new block-table entries, rows without any."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanoinfer.kernels.step_inputs_ref import unpack_step_inputs_ref
from tests.kernels.helpers import DEVICE, triton_module

MAX_TOKENS, MAX_ROWS, NUM_SLOTS = 2100, 40, 48


def _buffers(width: int, gen: torch.Generator) -> SimpleNamespace:
    """Persistent buffers holding earlier steps' values (random), as the engine's do."""

    def ints(shape, dtype):
        return torch.randint(0, 1000, shape, generator=gen, dtype=torch.int64).to(dtype).to(DEVICE)

    return SimpleNamespace(
        input_ids=ints((MAX_TOKENS,), torch.int64),
        positions=ints((MAX_TOKENS,), torch.int64),
        slot_mapping=ints((MAX_TOKENS,), torch.int64),
        query_start_loc=ints((MAX_ROWS + 1,), torch.int32),
        seq_lens=ints((MAX_ROWS,), torch.int32),
        block_tables=ints((MAX_ROWS, width), torch.int32),
    )


def _packed_step(rng: np.random.Generator, num_rows: int, padded_rows: int, num_tokens: int, width: int):
    """A packed step as ``ModelRunner._pack`` lays it out: rows on distinct slots, each with 0-3 new
    block-table entries (up to ``width`` for one row), grouped by row in row order, and parts the kernel
    does not read between them; and each entry's slot."""
    slots = rng.permutation(NUM_SLOTS)[:num_rows]
    table_slots, table_cols, table_ids, row_starts = [], [], [], [0]
    for row, slot in enumerate(slots):
        count = width if row == 1 else int(rng.integers(0, 4))
        first = int(rng.integers(0, width - count + 1))
        table_slots += [slot] * count
        table_cols += range(first, first + count)
        table_ids += rng.integers(0, 10_000, count).tolist()
        row_starts.append(len(table_slots))
    parts = {
        "input_ids": rng.integers(0, 150_000, num_tokens),
        "logits_index": rng.integers(0, 100, 7),
        "positions": rng.integers(0, 4096, num_tokens),
        "slot_mapping": rng.integers(-1, 100_000, num_tokens),
        "query_start_loc": np.sort(rng.integers(0, num_tokens, padded_rows + 1)),
        "seq_lens": rng.integers(0, 4096, padded_rows),
        "row_slots": np.concatenate([slots, np.zeros(padded_rows - num_rows, dtype=np.int64)]),
        "table_cols": np.array(table_cols, dtype=np.int64),
        "table_block_ids": np.array(table_ids, dtype=np.int64),
        "table_row_starts": np.array(row_starts, dtype=np.int64),
        "pending_index": rng.integers(0, 100, 5),
    }
    places, offset = {}, 0
    for name, array in parts.items():
        places[name] = (offset, len(array))
        offset += len(array)
    packed = torch.from_numpy(np.concatenate([a.astype(np.int64) for a in parts.values()])).to(DEVICE)
    return packed, places, table_slots


@pytest.mark.parametrize(
    "num_rows, padded_rows, num_tokens, width",
    [(1, 1, 1, 9), (29, 32, 32, 257), (13, 16, 16, 2049), (5, 5, 2000, 129), (17, 17, 1030, 64)],
)
def test_unpack_step_inputs_matches_reference(num_rows, padded_rows, num_tokens, width):
    kernel = triton_module("triton_step_inputs")
    gen = torch.Generator().manual_seed(num_rows * 1000 + width)
    packed, parts, entry_slots = _packed_step(
        np.random.default_rng(num_rows + width), num_rows, padded_rows, num_tokens, width
    )
    table = torch.randint(0, 10_000, (NUM_SLOTS, width), generator=gen, dtype=torch.int32).to(DEVICE)
    expected_buffers, expected_table = _buffers(width, torch.Generator().manual_seed(7)), table.clone()
    buffers, got_table = _buffers(width, torch.Generator().manual_seed(7)), table.clone()
    unpack_step_inputs_ref(packed, parts, num_rows, expected_buffers, expected_table)
    kernel.unpack_step_inputs(packed, parts, num_rows, buffers, got_table)
    assert torch.equal(got_table, expected_table)
    for name, tensor in vars(buffers).items():
        assert torch.equal(tensor, getattr(expected_buffers, name)), name
    # The reference, checked apart: the rows' new entries are in the persistent table and the step's rows.
    for k, slot in enumerate(entry_slots):
        col = packed[parts["table_cols"][0] + k].item()
        assert expected_table[slot, col].item() == packed[parts["table_block_ids"][0] + k].item()
    row_slots = packed[parts["row_slots"][0] : parts["row_slots"][0] + num_rows].cpu()
    assert torch.equal(expected_buffers.block_tables[:num_rows].cpu(), expected_table.cpu()[row_slots])


def test_unpack_step_inputs_rejects_mismatched_buffers():
    kernel = triton_module("triton_step_inputs")
    packed, parts, _ = _packed_step(np.random.default_rng(0), 2, 2, 2, 9)
    buffers = _buffers(9, torch.Generator().manual_seed(0))
    table = torch.zeros(NUM_SLOTS, 9, dtype=torch.int32, device=DEVICE)
    buffers.seq_lens = buffers.seq_lens.long()
    with pytest.raises(ValueError, match="buffers.seq_lens must be torch.int32"):
        kernel.unpack_step_inputs(packed, parts, 2, buffers, table)
    buffers = _buffers(8, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="block_tables must be as wide as block_table"):
        kernel.unpack_step_inputs(packed, parts, 2, buffers, table)
    with pytest.raises(ValueError, match="num_rows must be in"):
        kernel.unpack_step_inputs(packed, parts, 3, _buffers(9, torch.Generator()), table)
