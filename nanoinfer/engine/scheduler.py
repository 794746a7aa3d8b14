"""FCFS scheduling with chunked prefill, decode batching and preemption by recomputation.

Every sequence is driven by one number, ``num_computed_tokens``: a step computes the next chunk of its
uncomputed tokens, and once none remain the model's output for the last one is sampled. Prefix hits,
chunked prefill and recomputation after preemption are all the same path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # new, preempted, or mid chunked prefill (at the head)
        self.running: deque[Sequence] = deque()  # prompt computed; decoding
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """Prefill has priority; when no prefill can run, every running sequence decodes one token."""
        prefill = self._schedule_prefill()
        if prefill:
            return SchedulerOutput(prefill, is_prefill=True)
        decode = self._schedule_decode()
        if decode:
            return SchedulerOutput(decode, is_prefill=False)
        # Decode preempted everything it held, which puts those sequences back into waiting.
        prefill = self._schedule_prefill()
        return SchedulerOutput(prefill, is_prefill=True) if prefill else None

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        # Admitted sequences join `running` as they are scheduled, so its length is the batch so far.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached: list[int] = []
            if not seq.block_table:
                cached = self.block_manager.match_prefix(seq)
                if not self.block_manager.can_allocate(seq, cached):
                    break
                num_new = seq.num_tokens - len(cached) * self.block_manager.block_size
            else:  # the rest of a chunked prefill
                num_new = seq.num_uncomputed_tokens
            # Only the first sequence of a batch may be split; later ones go whole or wait.
            if num_new > budget and scheduled:
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, cached)
                if seq.num_cached_prompt_tokens < 0:
                    seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.num_scheduled_tokens = min(num_new, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_new:
                break  # the chunked sequence stays at the head of waiting
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.try_append(seq):
                if self.running:
                    self._preempt(self.running.pop())  # the latest arrival yields first
                else:
                    self._preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence]) -> list[Sequence]:
        """Advances each scheduled sequence past the tokens computed this step and publishes newly full
        blocks to the prefix cache. Returns the sequences that now need a sampled token (their last
        token is computed), in batch order."""
        ready = []
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.register_computed_blocks(seq)
            if seq.num_uncomputed_tokens == 0:
                ready.append(seq)
        return ready

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Removes ``seq`` wherever it is (waiting, mid chunked prefill, running) and frees its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
