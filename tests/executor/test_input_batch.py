"""The persistent batch: slots, block-table diffs, decode rows first, pending inputs, sampling arrays."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from nanoinfer.engine.scheduler import NewRequestData, ScheduledRequest, SchedulerOutput
from nanoinfer.executor.input_batch import InputBatch
from nanoinfer.sampling_params import SamplingParams

BS = 16


def new_request(request_id: str, block_ids: list[int], params: SamplingParams | None = None, seed=0):
    return NewRequestData(request_id, params or SamplingParams(), seed, block_ids, [], None)


def row(request_id, start, tokens, new_blocks, samples=True, pending=False, **extra):
    return ScheduledRequest(
        request_id=request_id,
        start_pos=start,
        num_tokens=len(tokens) + int(pending),
        token_ids=list(tokens),
        last_token_pending=pending,
        new_block_ids=list(new_blocks),
        samples=samples,
        num_output_tokens=extra.pop("num_output_tokens", 0),
        **extra,
    )


def _entry_slots(step) -> np.ndarray:
    """The slot of each new block-table entry: its row's (entries are grouped by row in row order)."""
    return np.repeat(step.row_slots, np.diff(step.table_row_starts))


def test_rows_come_decode_first_with_positions_slots_and_table_diffs():
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=8, block_size=BS, device=torch.device("cpu"))
    prompt = SamplingParams(prompt_logprobs=1)
    first = SchedulerOutput(
        scheduled=[
            row("p", 0, [5, 6, 7], [3], samples=False, prompt_logprob_targets=[6, 7, 8]),
            row("d", 39, [9], [3, 4, 8]),
        ],
        new_requests={"p": new_request("p", [3], prompt), "d": new_request("d", [3, 4, 8])},
    )
    step, plan = batch.prepare(first)
    assert plan.row_order == [1, 0]  # the one-token row first
    np.testing.assert_array_equal(step.input_ids, [9, 5, 6, 7])
    np.testing.assert_array_equal(step.positions, [39, 0, 1, 2])
    np.testing.assert_array_equal(step.slot_mapping, [8 * BS + 7, 3 * BS, 3 * BS + 1, 3 * BS + 2])
    np.testing.assert_array_equal(step.query_start_loc, [0, 1, 4])
    np.testing.assert_array_equal(step.seq_lens, [40, 3])
    assert step.num_decode_rows == 1 and (step.max_query_len, step.max_seq_len) == (3, 40)
    np.testing.assert_array_equal(step.logits_index, [0])
    np.testing.assert_array_equal(step.prompt_logprob_index, [1, 2, 3])
    assert plan.sample_rows == [1] and plan.prompt_logprob_rows == [(0, 3)]
    # Only the new block ids travel, into the rows' slots.
    slot_d, slot_p = batch.slot_of["d"], batch.slot_of["p"]
    assert sorted(zip(_entry_slots(step), step.table_cols, step.table_block_ids, strict=True)) == sorted(
        [(slot_p, 0, 3), (slot_d, 0, 3), (slot_d, 1, 4), (slot_d, 2, 8)]
    )
    assert b"SamplingParams" not in pickle.dumps(step)

    # Next step: d decodes on its pending token (the previous step's sample), p starts a new block.
    batch.previous_sample_row = {"d": 0}
    second = SchedulerOutput(
        scheduled=[row("p", 3, list(range(20)), [11], samples=False), row("d", 40, [], [], pending=True)],
        finished_request_ids=[],
    )
    step, plan = batch.prepare(second)
    assert step.num_decode_rows == 1 and plan.row_order == [1, 0]
    np.testing.assert_array_equal(step.pending_index, [0])
    np.testing.assert_array_equal(step.pending_source, [0])
    assert list(zip(_entry_slots(step), step.table_cols, step.table_block_ids, strict=True)) == [
        (slot_p, 1, 11)
    ]
    np.testing.assert_array_equal(step.slot_mapping[[0, 1, -1]], [8 * BS + 8, 3 * BS + 3, 11 * BS + 6])

    # A finished request frees its slot for the next one.
    third = SchedulerOutput(
        scheduled=[row("n", 0, [1, 2], [5])],
        new_requests={"n": new_request("n", [5])},
        finished_request_ids=["d"],
    )
    batch.prepare(third)
    assert "d" not in batch.slot_of and batch.slot_of["n"] == slot_d


def test_sampling_arrays_follow_the_slots():
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=4, block_size=BS, device=torch.device("cpu"))
    params = {
        "g": SamplingParams(temperature=0.0),
        "t": SamplingParams(temperature=0.7),
        "k": SamplingParams(temperature=1.0, top_k=5, min_tokens=3, logprobs=2),
    }
    out = SchedulerOutput(
        scheduled=[row(name, 0, [1, 2], [i], num_output_tokens=i) for i, name in enumerate(params)],
        new_requests={
            name: new_request(name, [i], p, seed=100 + i) for i, (name, p) in enumerate(params.items())
        },
    )
    out.new_requests["k"].min_tokens_banned_ids = [7]
    step, plan = batch.prepare(out)
    metadata = batch.sampling_metadata(
        out, plan, None, batch.to_device(plan.sample_slots), batch.to_device(plan.sample_offsets)
    )
    assert metadata.temperature.tolist() == [0.0, 0.699999988079071, 1.0]
    assert metadata.greedy.tolist() == [True, False, False]
    assert metadata.seeds.tolist() == [100, 101, 102] and metadata.offsets.tolist() == [0, 1, 2]
    # The decode graphs that sample read these three from the batch's fixed buffers.
    for name in ("temperature", "seeds", "offsets"):
        assert getattr(metadata, name).data_ptr() == getattr(batch.step_sampling, name).data_ptr()
    assert not metadata.temperature_only  # top_k and logprobs
    assert metadata.top_k.tolist() == [0, 0, 5] and metadata.top_p is None and metadata.min_p is None
    assert metadata.banned == [(2, [7])]  # 2 tokens generated, min_tokens 3
    assert metadata.num_logprobs.tolist() == [-1, -1, 2] and metadata.penalties is None


def test_plain_rows_skip_the_per_row_lists_and_a_penalized_row_brings_them_back():
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=4, block_size=BS, device=torch.device("cpu"))

    def metadata_of(params: dict[str, SamplingParams]):
        out = SchedulerOutput(
            scheduled=[row(name, 0, [1, 2], [i]) for i, name in enumerate(params)],
            new_requests={name: new_request(name, [i], p) for i, (name, p) in enumerate(params.items())},
            finished_request_ids=[name for name in batch.slot_of if name not in params],
        )
        _, plan = batch.prepare(out)
        return batch.sampling_metadata(
            out, plan, None, batch.to_device(plan.sample_slots), batch.to_device(plan.sample_offsets)
        )

    plain = metadata_of({"a": SamplingParams(temperature=0.7), "b": SamplingParams(temperature=0.0)})
    assert plain.temperature_only and plain.penalties is None and plain.banned is None
    assert plain.logit_controls is None
    # A new request in a freed slot: the slot's flag follows the request that holds it.
    mixed = metadata_of(
        {
            "c": SamplingParams(presence_penalty=0.5, repetition_penalty=1.2),
            "d": SamplingParams(logit_bias={3: 1.0}),
        }
    )
    assert len(mixed.penalties.output_token_ids) == len(mixed.penalties.prompt_token_ids) == 2
    assert mixed.logit_controls.rows == [1]
    again = metadata_of({"e": SamplingParams(temperature=0.5), "f": SamplingParams(temperature=0.5)})
    assert again.temperature_only and again.penalties is None and again.logit_controls is None


def test_a_batch_that_keeps_its_slots_skips_the_gathers_and_a_new_request_in_a_freed_slot_does_not(
    monkeypatch,
):
    """The step's temperature and seed rows are gathered from the slots again only when the sampling
    rows' slots change or a slot gets a new request (a freed slot taken at the same row)."""
    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=4, block_size=BS, device=torch.device("cpu"))
    gathers = []
    index_select = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: gathers.append(1) or index_select(*a, **k))

    def step(running: list[str], new: dict[str, tuple[SamplingParams, int]]):
        out = SchedulerOutput(
            scheduled=[row(name, 0, [1, 2], [i]) for i, name in enumerate(running)],
            new_requests={name: new_request(name, [0], p, seed) for name, (p, seed) in new.items()},
            finished_request_ids=[name for name in batch.slot_of if name not in running],
        )
        _, plan = batch.prepare(out)
        metadata = batch.sampling_metadata(
            out, plan, None, batch.to_device(plan.sample_slots), batch.to_device(plan.sample_offsets)
        )
        return metadata.temperature.tolist(), metadata.seeds.tolist(), len(gathers)

    a, b, c = (
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
    )
    assert step(["a", "b"], {"a": (a, 1), "b": (b, 2)}) == ([0.5, 1.0], [1, 2], 2)
    assert step(["a", "b"], {}) == ([0.5, 1.0], [1, 2], 2)  # the same slots: no gather
    # "b" ends and "c" takes its slot, at its row, in one step: the same slots, but c's values.
    assert step(["a", "c"], {"c": (c, 3)}) == ([0.5, 0.0], [1, 3], 4)
    assert batch.slot_of["c"] == 1
    assert step(["c"], {}) == ([0.0], [3], 6)  # "a" finished: other rows


def test_the_warm_up_runs_both_gather_kernels_and_leaves_the_first_step_its_own_gather(monkeypatch):
    """index_select switches kernels past 16 indices, so the warm-up gathers on both sides of it; the
    first step still gathers its rows' values (the warm-up's zeros are not taken for them)."""
    batch = InputBatch(max_num_seqs=20, max_blocks_per_seq=4, block_size=BS, device=torch.device("cpu"))
    index_sizes = []
    index_select = torch.index_select
    monkeypatch.setattr(
        torch,
        "index_select",
        lambda src, dim, index, **k: index_sizes.append(len(index)) or index_select(src, dim, index, **k),
    )
    batch.warm_up()
    assert min(index_sizes) <= 16 < max(index_sizes) == 20
    out = SchedulerOutput(
        scheduled=[row("a", 0, [1, 2], [0])],
        new_requests={"a": new_request("a", [0], SamplingParams(temperature=0.5), seed=7)},
        finished_request_ids=[],
    )
    _, plan = batch.prepare(out)
    metadata = batch.sampling_metadata(
        out, plan, None, batch.to_device(plan.sample_slots), batch.to_device(plan.sample_offsets)
    )
    assert (metadata.temperature.tolist(), metadata.seeds.tolist()) == ([0.5], [7])
