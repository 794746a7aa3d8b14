"""One scheduling loop under one token budget (vLLM V1's shape), with preemption by recomputation.

Every request is driven by one number, ``num_computed_tokens``: a step computes the next tokens after it
(a prompt chunk, or the one token sampled last), and the step that reaches the end of the sequence
samples the next token. Prefill, chunked prefill, prefix hits, decode and recomputation after a
preemption are all that one path. Each step schedules the running requests first (each needs its
remaining tokens, normally 1), then admits waiting ones while the budget, ``max_num_seqs`` and the KV
pool allow; any number of prompts may be chunked. When a running request needs a block and none is
free, the latest arrival is preempted.

With async scheduling a step is scheduled before the previous one's tokens are known: the previous
step's sampled token is still on the device (``num_pending``) and becomes the next input there.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nanoinfer.engine.kv_cache_manager import KVCacheManager
from nanoinfer.engine.request import EngineRequest, Request, RequestStatus
from nanoinfer.engine.structured_outputs import GrammarFeed, GrammarResult
from nanoinfer.sample.logprobs import TokenLogprobs
from nanoinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoinfer.engine.grammar_process import RemoteGrammar
    from nanoinfer.structured.backend import Grammar

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NewRequestData:
    """A request taking a row of the model runner's persistent batch: on admission, and again when it
    resumes after a preemption."""

    request_id: str
    params: SamplingParams
    seed: int
    block_ids: list[int]
    # EOS and stop_token_ids: what min_tokens masks until it is reached.
    min_tokens_banned_ids: list[int]
    # Distinct prompt token ids, for the repetition penalty (None: the request has none).
    distinct_prompt_ids: np.ndarray | None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in a step (one row of the batch)."""

    request_id: str
    start_pos: int  # position of the first token computed == tokens already in the cache
    num_tokens: int
    # The ids of the tokens to compute that the host knows: all of them, or all but the last when that
    # one is the token the previous step sampled (``last_token_pending``), still on the device.
    token_ids: list[int]
    last_token_pending: bool
    new_block_ids: list[int]  # appended to its block table since its previous step
    samples: bool  # the step reaches the end of the sequence: a token is sampled from its last position
    num_output_tokens: int  # generated before this step's sample (its noise offset; min_tokens)
    # Penalties: the generated tokens the host knows (the pending one is added on the device).
    output_token_ids: np.ndarray | None = None
    # Prompt logprobs: the prompt token following each position from prompt_logprob_start on.
    prompt_logprob_targets: list[int] | None = None
    prompt_logprob_start: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: dict[str, NewRequestData] = field(default_factory=dict)
    # Requests that left the batch since the previous step (finished, aborted, preempted).
    finished_request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    # Rows (indices into ``scheduled``) that sample under a structured-outputs constraint: their
    # sampling waits for a grammar bitmask (see engine/structured_outputs.py).
    structured_rows: list[int] = field(default_factory=list)
    # Set by the core before update_from_output: what feeding each constrained row's sampled token to
    # its grammar gave (see grammar_feeds).
    grammar_results: dict[int, GrammarResult] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one core request: new token ids (normally one), and how it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: int | None = None  # the stop_token_ids entry that stopped it
    # The last new token is the EOS or stop token that ended it (its text is not shown); False when a
    # complete structured output ended it ("stop" too).
    stopped_by_token: bool = False
    new_logprobs: TokenLogprobs | None = None  # one position per new token
    prompt_logprobs: TokenLogprobs | None = None  # a chunk of positions, from prompt_logprobs_start
    prompt_logprobs_start: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # The error is the request's input's: its constraint hit a limit of the grammar library, or its
    # restrictions excluded every token. The server answers 400 rather than 500.
    invalid_input: bool = False


@dataclass
class RunnerOutput:
    """The model runner's answer for one SchedulerOutput, row for row."""

    token_ids: list[int]  # per scheduled row; -1 for rows that do not sample
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> its sampled token's logprobs
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # row -> its chunk
    failed_rows: dict[int, str] = field(default_factory=dict)  # rows whose sampling raised


NO_TOKEN_ALLOWED = (
    "no token is allowed at this step: the request's allowed_token_ids, bad_words, min_tokens and "
    "structured_outputs together exclude every token"
)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # new or preempted, in arrival order
        self.running: list[Request] = []  # admitted: prefilling or decoding, in admission order
        # Requests waiting for their leader's prompt to be in the prefix cache, by leader id.
        self.followers: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self._num_arrivals = 0
        self._left_batch: list[str] = []
        # Block ids each request in the batch has already been sent to the model runner.
        self._num_blocks_sent: dict[str, int] = {}
        # Prompt positions whose logprobs were already returned (a preempted request recomputes them).
        self._prompt_logprobs_done: dict[str, int] = {}

    # -- requests --------------------------------------------------------------------------------------

    def add_request(
        self,
        engine_request: EngineRequest,
        grammar: Grammar | RemoteGrammar | None = None,
        waits_for_grammar: bool = False,
    ) -> Request:
        """Queues a request; ``waits_for_grammar``: its constraint is compiling, and it is not admitted
        until :meth:`set_grammar` (the requests behind it are)."""
        if engine_request.request_id in self.requests:
            raise ValueError(f"request_id {engine_request.request_id!r} is already in use")
        request = Request(engine_request, self._num_arrivals, grammar, waits_for_grammar)
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        leader = self.requests.get(request.leader_id) if request.leader_id else None
        if leader is not None and not leader.is_finished and leader.num_output_tokens == 0:
            self.followers.setdefault(leader.request_id, []).append(request)
        else:
            self.waiting.append(request)
        return request

    def set_grammar(self, request_id: str, grammar: Grammar | RemoteGrammar) -> None:
        """A compiled constraint's matcher: its request may be admitted (an unknown id is ignored: the
        request is gone)."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            request.grammar = grammar
            request.status = RequestStatus.WAITING

    def fail_request(
        self, request_id: str, error: str, invalid_input: bool = False
    ) -> EngineCoreOutput | None:
        """Ends a request with ``error`` (its constraint did not compile); None if it is gone."""
        request = self.requests.get(request_id)
        return self._fail(request, error, invalid_input) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Removes the requests wherever they are and frees their blocks; unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, "abort")

    def _finish(self, request: Request, reason: str) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            for group in self.followers.values():
                if request in group:
                    group.remove(request)
        self._leave_batch(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._prompt_logprobs_done.pop(request.request_id, None)
        self._release_followers(request)

    def _leave_batch(self, request: Request) -> None:
        if self._num_blocks_sent.pop(request.request_id, None) is not None:
            self._left_batch.append(request.request_id)

    def _release_followers(self, leader: Request) -> None:
        """Followers join the queue once their leader's prompt blocks are cached (or it is gone)."""
        for follower in self.followers.pop(leader.request_id, ()):
            self.waiting.append(follower)

    def _preempt(self, request: Request) -> None:
        self._leave_batch(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # -- scheduling ------------------------------------------------------------------------------------

    def _at_length_limit(self, request: Request) -> bool:
        """Whether the tokens already sampled (some perhaps still on the device) end the request."""
        max_tokens = request.params.max_tokens
        return (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens + request.num_pending >= self.max_model_len
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            # With async scheduling a request whose pending token ends it is left out (it finishes when
            # that token arrives); an EOS it sampled is only seen then, costing one wasted row.
            if request.num_pending and self._at_length_limit(request):
                i += 1
                continue
            num_new = min(request.num_tokens_to_compute, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # the latest admission yields first
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._schedule(out, request, num_new)
                budget -= num_new
                i += 1
        # Admissions wait while requests are being preempted: they would only take blocks back.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting.popleft()
            # Preempted with a sampled token still on its way to the host, or its constraint compiling.
            if request.num_pending or request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(request)
                continue
            cached = self.kv.find_cached_prefix(request)
            num_new = min(request.num_tokens - len(cached) * self.block_size, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                self.waiting.appendleft(request)
                break
            self.kv.record_prefix_query(request)
            if request.num_cached_prompt_tokens < 0:
                request.num_cached_prompt_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests[request.request_id] = NewRequestData(
                request.request_id,
                request.params,
                request.seed,
                request.block_ids,  # the runner reads it during this step only
                request.min_tokens_banned_ids,
                request.distinct_prompt_ids,
            )
            self._num_blocks_sent[request.request_id] = 0
            self._schedule(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        # Reported with the next step that runs (an empty output never reaches the model runner).
        if out.scheduled:
            out.finished_request_ids, self._left_batch = self._left_batch, []
        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        num_known = request.num_tokens
        sent = self._num_blocks_sent[request.request_id]
        samples = end == num_known + request.num_pending
        row = ScheduledRequest(
            request_id=request.request_id,
            start_pos=start,
            num_tokens=num_new,
            token_ids=request.token_ids[start:end]
            if end <= num_known
            else request.token_ids[start:num_known],
            last_token_pending=end > num_known,
            new_block_ids=request.block_ids[sent:],
            samples=samples,
            num_output_tokens=request.num_output_tokens,
        )
        self._num_blocks_sent[request.request_id] = len(request.block_ids)
        if samples and request.output_token_array is not None:
            row.output_token_ids = request.output_token_array.view()
        if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens:
            done = self._prompt_logprobs_done.get(request.request_id, 0)
            first = max(start, done)
            targets = request.token_ids[first + 1 : min(end + 1, request.num_prompt_tokens)]
            if targets:
                row.prompt_logprob_targets = targets
                row.prompt_logprob_start = first - start
                self._prompt_logprobs_done[request.request_id] = first + len(targets)
        request.num_computed_tokens = end
        if samples:
            request.num_pending += 1
            if request.grammar is not None:
                out.structured_rows.append(len(out.scheduled))
        out.scheduled.append(row)

    # -- results ---------------------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Applies a finished step: appends the sampled tokens, ends requests that stop, publishes newly
        full blocks to the prefix cache. Returns the step's outputs; rows of requests that finished or
        were aborted meanwhile are dropped (with async scheduling, their extra token)."""
        outputs: list[EngineCoreOutput] = []
        grammar_results = out.grammar_results
        for row_index, row in enumerate(out.scheduled):
            request = self.requests.get(row.request_id)
            if request is None:
                continue
            try:
                grammar_result = grammar_results.get(row_index) if grammar_results is not None else None
                output = self._apply_row(request, row, row_index, result, grammar_result)
            except Exception as e:  # this request's own fault: it fails alone
                logger.exception("request %s failed", row.request_id)
                output = self._fail(request, f"{type(e).__name__}: {e}")
            if output is not None:
                outputs.append(output)
        return outputs

    def grammar_feeds(self, out: SchedulerOutput, result: RunnerOutput) -> list[GrammarFeed]:
        """The sampled tokens of a finished step's constrained rows, to feed to their grammars before
        :meth:`update_from_output` (which reads the results from ``out.grammar_results``): the next
        step's bitmask, made from the advanced grammars, can then start filling elsewhere while this
        step's outputs are made, and the scheduler never asks a grammar anything."""
        feeds = []
        for row_index in out.structured_rows:
            request = self.requests.get(out.scheduled[row_index].request_id)
            if request is None or row_index in result.failed_rows:
                continue
            num_output = request.num_tokens + 1 - request.num_prompt_tokens
            eos_blocked = not request.eos_token_ids or num_output < request.params.min_tokens
            feeds.append(GrammarFeed(row_index, request.grammar, result.token_ids[row_index], eos_blocked))
        return feeds

    def _apply_row(
        self,
        request: Request,
        row: ScheduledRequest,
        row_index: int,
        result: RunnerOutput,
        grammar_result: GrammarResult | None = None,
    ) -> EngineCoreOutput | None:
        output = None
        prompt_chunk = result.prompt_logprobs.get(row_index)
        if prompt_chunk is not None:
            output = EngineCoreOutput(request.request_id, [])
            output.prompt_logprobs = prompt_chunk
            output.prompt_logprobs_start = row.start_pos + row.prompt_logprob_start
        if not row.samples:
            if request.block_ids:
                self.kv.cache_full_blocks(request)
            return output
        request.num_pending -= 1
        error = result.failed_rows.get(row_index)
        if error is not None:
            return self._fail(request, error)
        token_id = result.token_ids[row_index]
        if request.grammar is not None and grammar_result is None:
            raise RuntimeError("a constrained row's token was not fed to its grammar")
        # Where a request's restrictions together exclude every token, the sampler takes one all the
        # same (the argmax of a row of -inf): a token its allowed_token_ids or its grammar refuses.
        if request.allowed_token_set is not None and token_id not in request.allowed_token_set:
            return self._fail(request, NO_TOKEN_ALLOWED, invalid_input=True)
        if grammar_result is not None and grammar_result.error is not None:
            return self._refused(request, grammar_result)
        request.append_token(token_id)
        if output is None:
            output = EngineCoreOutput(request.request_id, [token_id])
        else:
            output.new_token_ids = [token_id]
        output.new_logprobs = result.logprobs.get(row_index)
        if request.num_output_tokens - request.num_pending == 1:
            output.num_cached_tokens = max(request.num_cached_prompt_tokens, 0)
            self._release_followers(request)
        if request.block_ids:
            self.kv.cache_full_blocks(request)
        reason = self._stop_reason(request, token_id)
        output.stopped_by_token = reason == "stop"
        if reason is None and grammar_result is not None and grammar_result.blocks_eos:
            reason = "stop"
        if reason is not None:
            output.finish_reason = reason
            output.stop_reason = request.stop_reason
            self._finish(request, reason)
        return output

    def apply_late_grammar_result(
        self, request_id: str, grammar: Grammar | RemoteGrammar, result: GrammarResult
    ) -> EngineCoreOutput | None:
        """What feeding a token to ``grammar`` gave, after the token was applied to its request as
        accepted (see ``EngineCore._check_fed``): a refusal fails the request, a grammar that allows only
        the EOS the request cannot sample ends it (an output with no new token). None: nothing to do,
        or the request has ended meanwhile (its id may name another request by now)."""
        request = self.requests.get(request_id)
        if request is None or request.grammar is not grammar:
            return None
        if result.error is not None:
            return self._refused(request, result)
        if result.blocks_eos:
            self._finish(request, "stop")
            return EngineCoreOutput(request.request_id, [], finish_reason="stop")
        return None

    def _refused(self, request: Request, result: GrammarResult) -> EngineCoreOutput:
        """Fails a request whose grammar refused its token (see GrammarResult)."""
        if not result.invalid_input and request.params.bad_words:
            return self._fail(request, NO_TOKEN_ALLOWED, invalid_input=True)
        return self._fail(request, result.error, result.invalid_input)

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.params
        num_output = request.num_tokens - request.num_prompt_tokens
        # Nothing stops a request before min_tokens (the sampler also masks EOS and stop tokens).
        if num_output > params.min_tokens:
            if token_id in request.eos_token_ids:
                return "stop"
            if token_id in request.stop_token_ids:
                request.stop_reason = token_id
                return "stop"
        if (params.max_tokens is not None and num_output >= params.max_tokens) or (
            request.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    def _fail(self, request: Request, error: str, invalid_input: bool = False) -> EngineCoreOutput:
        logger.error("request %s failed: %s", request.request_id, error)
        self._finish(request, "error")
        return EngineCoreOutput(
            request.request_id, [], finish_reason="error", error=error, invalid_input=invalid_input
        )

    def stats(self) -> dict[str, int]:
        kv = self.kv
        return {
            "num_kv_blocks_total": kv.num_blocks,
            "num_kv_blocks_free": kv.num_free_blocks,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + sum(map(len, self.followers.values())),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queried_tokens": kv.queried_tokens,
            "prefix_cache_hit_tokens": kv.hit_tokens,
        }
