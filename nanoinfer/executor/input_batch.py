"""The model runner's persistent batch: one row (slot) per request in the batch, kept across steps and
updated by diffs, and each step's inputs as host arrays.

Rank 0 turns a SchedulerOutput into :class:`StepInputs` (a few numpy arrays; under tensor parallelism
also what the workers receive) and :class:`SamplingMetadata`. Block tables live on the device in a
[max_num_seqs, max_blocks] table that only receives the block ids scheduled since the previous step;
sampling parameters live in per-slot arrays written once, when a request takes its slot.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanoinfer.engine.scheduler import NewRequestData, SchedulerOutput
from nanoinfer.executor.pinned import PinnedRing
from nanoinfer.sample.metadata import LogitControls, RowLogitControls, SamplingMetadata


class StepInputs(NamedTuple):
    """One step's model inputs as host arrays. Rows are ordered decode rows (one query token) first."""

    input_ids: np.ndarray  # int64 [tokens]; 0 where the token is the previous step's (pending)
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]; -1: write no K/V
    query_start_loc: np.ndarray  # int32 [rows + 1]
    seq_lens: np.ndarray  # int32 [rows], context length including this step's tokens
    row_slots: np.ndarray  # int64 [rows]: each row's persistent slot (its block-table row)
    # Block-table entries scheduled since the previous step, grouped by row in row order: row r's are
    # [table_row_starts[r], table_row_starts[r + 1]), table[row_slots[r], cols] = block ids.
    table_cols: np.ndarray  # int64
    table_block_ids: np.ndarray  # int32
    table_row_starts: np.ndarray  # int64 [rows + 1]
    num_decode_rows: int
    max_query_len: int
    max_seq_len: int
    logits_index: np.ndarray  # int64: the last token of each row that samples, rows in order
    # Tokens the previous step sampled that are inputs of this one: input_ids[pending_index] =
    # previous_sampled[pending_source] (resolved on rank 0's device, then broadcast to the workers).
    pending_index: np.ndarray  # int64
    pending_source: np.ndarray  # int64
    # Tokens whose logits give prompt logprobs (computing logits is a collective: every rank joins).
    prompt_logprob_index: np.ndarray | None = None


class StepPlan(NamedTuple):
    """Rank 0's bookkeeping of a step beside its StepInputs: which scheduled request each row is."""

    row_order: list[int]  # batch row -> index into SchedulerOutput.scheduled
    sample_rows: list[int]  # logits row -> index into SchedulerOutput.scheduled
    prompt_logprob_rows: list[tuple[int, int]]  # (scheduled index, number of positions), in order
    sample_slots: np.ndarray  # int64, per logits row: its request's persistent slot
    sample_offsets: np.ndarray  # int64, per logits row: tokens its request has generated (noise key)


class SamplingBuffers(NamedTuple):
    """Fixed device buffers [max_num_seqs] of the step's sampling rows, in logits-row order."""

    temperature: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    offsets: torch.Tensor  # int64


_EMPTY_I64 = np.zeros(0, dtype=np.int64)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.pinned = PinnedRing(device)
        # One column beyond max_model_len's blocks: a sequence at full length can start one more block.
        width = max_blocks_per_seq + 1
        self.block_table_host = np.zeros((max_num_seqs, width), dtype=np.int32)
        self.block_table = torch.zeros(max_num_seqs, width, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        # Sampling parameters per slot.
        self.temperature_host = np.zeros(max_num_seqs, dtype=np.float32)
        self.temperature = torch.zeros(max_num_seqs, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # The step's sampling rows' temperature, seed and noise offset, gathered into fixed buffers (a
        # decode graph that samples reads them there).
        self.step_sampling = SamplingBuffers(
            temperature=torch.zeros(max_num_seqs, dtype=torch.float32, device=device),
            seeds=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
            offsets=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
        )
        # The slots whose temperature and seed step_sampling holds, in its row order (None: unknown). A
        # batch that keeps its requests keeps them, and skips the two gathers (tens of microseconds of
        # host time each on a slow host).
        self._gathered_slots: np.ndarray | None = None
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_p = np.ones(max_num_seqs, dtype=np.float64)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float64)
        self.presence = np.zeros(max_num_seqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition = np.ones(max_num_seqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.zeros(max_num_seqs, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.banned_ids: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.prompt_ids: list[np.ndarray | None] = [None] * max_num_seqs
        # logit_bias / allowed_token_ids / bad_words per slot (None: the request sets none), and the
        # slots that read the generated tokens (penalties, bad_words).
        self.logit_controls: list[RowLogitControls | None] = [None] * max_num_seqs
        self.needs_output_ids = np.zeros(max_num_seqs, dtype=bool)
        # Slots whose request uses min_tokens, a logit control, or reads its generated tokens: a batch of
        # none of them (plain temperature sampling) skips the per-row lists of sampling_metadata.
        self.needs_row_lists = np.zeros(max_num_seqs, dtype=bool)
        # The previous step's sampled tokens (on the device) and which request each row was.
        self.previous_sampled: torch.Tensor | None = None
        self.previous_sample_row: dict[str, int] = {}

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, without waiting for the device (see :class:`PinnedRing`)."""
        return self.pinned.to_device(array)

    # -- slots ---------------------------------------------------------------------------------------

    def _add(self, new: NewRequestData) -> int:
        slot = self._free_slots.pop()
        self.slot_of[new.request_id] = slot
        self._gathered_slots = None  # the slot's temperature and seed change
        p = new.params
        self.temperature_host[slot] = p.temperature
        self.top_k[slot] = p.top_k if p.top_k > 0 else 0
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[slot] = p.prompt_logprobs or 0
        self.min_tokens[slot] = min(p.min_tokens, 1 << 62)  # any count past max_model_len is the same
        self.banned_ids[slot] = new.min_tokens_banned_ids
        self.prompt_ids[slot] = new.distinct_prompt_ids
        self.logit_controls[slot] = RowLogitControls.from_params(p, self.device, self.to_device)
        self.needs_output_ids[slot] = p.needs_output_token_ids
        self.needs_row_lists[slot] = (
            p.needs_output_token_ids or self.logit_controls[slot] is not None or p.min_tokens > 0
        )
        self.num_blocks[slot] = 0
        return slot

    def _remove(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.prompt_ids[slot] = None
            self.logit_controls[slot] = None
            self._free_slots.append(slot)

    # -- one step --------------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> tuple[StepInputs, StepPlan]:
        """Applies the step's diffs to the persistent rows and builds its inputs."""
        for request_id in out.finished_request_ids:
            self._remove(request_id)
        new_slots = [self._add(new) for new in out.new_requests.values()]
        if new_slots:
            index = self.to_device(np.array(new_slots, dtype=np.int64))
            self.temperature[index] = self.to_device(self.temperature_host[new_slots])
            seeds = [new.seed for new in out.new_requests.values()]
            self.seeds[index] = self.to_device(np.array(seeds, dtype=np.int64))

        scheduled = out.scheduled
        # Decode rows (one query token) first: the attention backend sends them to the decode kernel.
        decode_rows = [i for i, r in enumerate(scheduled) if r.num_tokens == 1]
        row_order = decode_rows + [i for i, r in enumerate(scheduled) if r.num_tokens != 1]
        num_rows = len(row_order)
        slot_of = self.slot_of
        block_size = self.block_size
        table = self.block_table_host
        row_slots = np.empty(num_rows, dtype=np.int64)
        q_lens = np.empty(num_rows, dtype=np.int64)
        starts = np.empty(num_rows, dtype=np.int64)
        table_row_ends: list[int] = []
        table_cols: list[int] = []
        table_ids: list[int] = []
        tokens: list[int] = []
        pending_index: list[int] = []
        pending_source: list[int] = []
        sample_rows: list[int] = []
        sample_slots: list[int] = []
        sample_offsets: list[int] = []
        logits_index: list[int] = []
        prompt_logprob_rows: list[tuple[int, int]] = []
        prompt_logprob_index: list[np.ndarray] = []
        previous_row = self.previous_sample_row
        offset = 0
        for row, index in enumerate(row_order):
            r = scheduled[index]
            slot = slot_of[r.request_id]
            row_slots[row] = slot
            q_lens[row] = r.num_tokens
            starts[row] = r.start_pos
            if r.new_block_ids:
                first = int(self.num_blocks[slot])
                n = len(r.new_block_ids)
                table[slot, first : first + n] = r.new_block_ids
                self.num_blocks[slot] = first + n
                table_cols += range(first, first + n)
                table_ids += r.new_block_ids
            table_row_ends.append(len(table_cols))
            tokens += r.token_ids
            if r.last_token_pending:
                tokens.append(0)
                pending_index.append(offset + r.num_tokens - 1)
                pending_source.append(previous_row[r.request_id])
            if r.prompt_logprob_targets:
                count = len(r.prompt_logprob_targets)
                prompt_logprob_rows.append((index, count))
                begin = offset + r.prompt_logprob_start
                prompt_logprob_index.append(np.arange(begin, begin + count, dtype=np.int64))
            offset += r.num_tokens
            if r.samples:
                sample_rows.append(index)
                sample_slots.append(slot)
                sample_offsets.append(r.num_output_tokens)
                logits_index.append(offset - 1)

        positions = np.repeat(starts - np.concatenate([[0], np.cumsum(q_lens)[:-1]]), q_lens)
        positions += np.arange(offset, dtype=np.int64)
        token_slots = np.repeat(row_slots, q_lens)
        slot_mapping = table[token_slots, positions // block_size].astype(np.int64) * block_size
        slot_mapping += positions % block_size
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        seq_lens = (starts + q_lens).astype(np.int32)
        step = StepInputs(
            input_ids=np.array(tokens, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            row_slots=row_slots,
            table_cols=np.array(table_cols, dtype=np.int64),
            table_block_ids=np.array(table_ids, dtype=np.int32),
            table_row_starts=np.array([0, *table_row_ends], dtype=np.int64),
            num_decode_rows=len(decode_rows),
            max_query_len=int(q_lens.max()) if num_rows else 0,
            max_seq_len=int(seq_lens.max()) if num_rows else 0,
            logits_index=np.array(logits_index, dtype=np.int64),
            pending_index=np.array(pending_index, dtype=np.int64) if pending_index else _EMPTY_I64,
            pending_source=np.array(pending_source, dtype=np.int64) if pending_source else _EMPTY_I64,
            prompt_logprob_index=np.concatenate(prompt_logprob_index) if prompt_logprob_index else None,
        )
        plan = StepPlan(
            row_order,
            sample_rows,
            prompt_logprob_rows,
            np.array(sample_slots, dtype=np.int64),
            np.array(sample_offsets, dtype=np.int64),
        )
        return step, plan

    def sampling_metadata(
        self,
        out: SchedulerOutput,
        plan: StepPlan,
        pending_tokens: torch.Tensor | None,
        device_slots: torch.Tensor,
        device_offsets: torch.Tensor,
    ) -> SamplingMetadata:
        """The sampling inputs of the step's sampling rows (logits rows, in order). ``pending_tokens``:
        each sampling row's last input token on the device (the previous step's sample where the host
        does not know it yet), for penalties. ``device_slots`` / ``device_offsets``: the plan's
        sample_slots / sample_offsets already on the device (copied with the step's inputs)."""
        slots = plan.sample_slots
        temperature_host = self.temperature_host[slots]
        banned: list[list[int]] = []
        output_ids: list[np.ndarray] = []
        prompt_ids: list[np.ndarray | None] = []
        pending = controls = None
        if self.needs_row_lists[slots].any():
            rows = [out.scheduled[i] for i in plan.sample_rows]
            banned = [
                self.banned_ids[s] if r.num_output_tokens < self.min_tokens[s] else []
                for s, r in zip(slots, rows, strict=True)
            ]
            if self.needs_output_ids[slots].any() and pending_tokens is not None:
                is_pending = self.to_device(np.array([r.last_token_pending for r in rows]))
                pending = torch.where(is_pending, pending_tokens, torch.full_like(pending_tokens, -1))
            empty = np.zeros(0, dtype=np.int64)
            output_ids = [r.output_token_ids if r.output_token_ids is not None else empty for r in rows]
            prompt_ids = [self.prompt_ids[s] for s in slots]
            controls = self._logit_controls(rows, slots, output_ids, pending)
        n = len(slots)
        buffers = self.step_sampling
        temperature, seeds = buffers.temperature[:n], buffers.seeds[:n]
        if self._gathered_slots is None or not np.array_equal(self._gathered_slots, slots):
            self._gather_sampling_rows(device_slots)
            self._gathered_slots = slots
        offsets = buffers.offsets[:n].copy_(device_offsets)
        return SamplingMetadata.from_arrays(
            temperature=temperature,
            seeds=seeds,
            offsets=offsets,
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            presence=self.presence[slots],
            frequency=self.frequency[slots],
            repetition=self.repetition[slots],
            output_token_ids=output_ids,
            prompt_token_ids=prompt_ids,
            banned_token_ids=banned,
            num_logprobs=self.num_logprobs[slots],
            pending_token_ids=pending,
            greedy=temperature_host == 0.0,
            logit_controls=controls,
        )

    def _gather_sampling_rows(self, device_slots: torch.Tensor) -> None:
        """The temperature and seed of each slot in ``device_slots``, into step_sampling's first rows."""
        n = len(device_slots)
        torch.index_select(self.temperature, 0, device_slots, out=self.step_sampling.temperature[:n])
        torch.index_select(self.seeds, 0, device_slots, out=self.step_sampling.seeds[:n])

    def warm_up(self) -> None:
        """Runs the step's device-side gathers once before any request, at both of their kernels:
        index_select takes one kernel up to 16 indices and aten's gather past that. CUDA loads a kernel
        on its first launch; in nano-vLLM's workload that first launch came inside the first step (31
        sampling rows, after a one-row warm-up request) and held the host for 12 ms with the device
        idle (run 118). Leaves no gathered rows behind."""
        max_rows = len(self.seeds)
        for num_rows in sorted({1, min(17, max_rows), max_rows}):
            self._gather_sampling_rows(torch.zeros(num_rows, dtype=torch.int64, device=self.device))
        self._gathered_slots = None

    def _logit_controls(
        self, rows: list, slots: np.ndarray, output_ids: list[np.ndarray], pending: torch.Tensor | None
    ) -> LogitControls | None:
        with_controls = [i for i, s in enumerate(slots) if self.logit_controls[s] is not None]
        if not with_controls:
            return None
        return LogitControls(
            rows=with_controls,
            per_row=[self.logit_controls[slots[i]] for i in with_controls],
            output_token_ids=[output_ids[i] for i in with_controls],
            last_token_pending=[rows[i].last_token_pending and pending is not None for i in with_controls],
            pending_token_ids=pending,
        )
