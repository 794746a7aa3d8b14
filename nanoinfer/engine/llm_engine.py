"""The engine loop: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from nanoinfer.config import EngineConfig
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.executor.batch import ModelInput, ScheduledRow, TokenLogprobs
from nanoinfer.models.checkpoint import load_tokenizer
from nanoinfer.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams, derive_seed

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


def _completion_seed(seed: int | None, index: int) -> int | None:
    """Completion 0 uses the request's seed as is (so n=1 and n>1 agree on it); the others derive theirs."""
    if seed is None or index == 0:
        return seed
    # Negative indices: distinct from the per-step seeds the sampler derives (index >= 0).
    return derive_seed(seed, -index)


class _Completion:
    """The output state of one of a request's n sequences: its text, stop-string search and logprobs."""

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, params: SamplingParams):
        self.seq = seq
        self.detokenizer = detokenizer
        self.stop_reason: int | str | None = None
        self.text_end: int | None = None  # where a stop string cut the text
        self.num_searched_chars = 0  # text already searched for stop strings (or before min_tokens)
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # While running, the text's tail that could be the start of a stop string is held back, so a
        # later cut never removes text that was already returned (vLLM does the same).
        self.holdback = (
            max(map(len, params.stop)) - 1 if params.stop and not params.include_stop_str_in_output else 0
        )

    def text(self) -> str:
        text = self.detokenizer.text
        if self.text_end is not None:
            return text[: self.text_end]
        if self.holdback and self.seq.finish_reason is None:
            return text[: max(len(text) - self.holdback, 0)]
        return text

    def output(self) -> CompletionOutput:
        seq = self.seq
        return CompletionOutput(
            index=seq.index,
            text=self.text(),
            token_ids=seq.completion_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    # Siblings (n > 1) that join the scheduler once the first sequence's prompt blocks are computed, so
    # that they find them in the prefix cache instead of computing the prompt again.
    pending: list[Sequence]
    # EOS and stop_token_ids: what min_tokens holds back.
    min_tokens_banned_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    num_unfinished: int
    arrival_time: float = field(default_factory=time.monotonic)
    error: str | None = None

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.output() for c in self.completions],
            finished=self.num_unfinished == 0,
            num_cached_tokens=max(self.completions[0].seq.num_cached_prompt_tokens, 0),
            # Complete (and never changed again) by the time a request produces its first output.
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from nanoinfer.executor.model_runner import ModelRunner  # imports torch model code

        self.config = config
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, _Request] = {}
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self._token_texts: dict[int, str] = {}  # decoded_token of logprobs, per token id

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        gen_eos = getattr(self.config.hf_config, "eos_token_id", None)
        for value in (self.tokenizer.eos_token_id, gen_eos):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    # -- requests --------------------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validates and queues a request; on error nothing is queued or allocated."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        # A validated snapshot: the caller may reuse or change its object while this request runs.
        params = dataclasses.replace(params)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, more than max_model_len={max_len} "
                "(the maximum context length)"
            )
        vocab = self.config.hf_config.vocab_size
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stops[:5]}")
        # Every token that ever needs K/V (all but the last sampled one) must fit in the whole pool.
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len
        kv_tokens = min(len(token_ids) + max_tokens - 1, max_len)
        needed = self.block_manager.blocks_needed(kv_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({kv_tokens} tokens) but the KV cache holds only "
                f"{self.block_manager.num_blocks} blocks of {self.config.kvcache_block_size} tokens; "
                "shorten the prompt or max_tokens"
            )
        block_size = self.config.kvcache_block_size
        seqs = [
            Sequence(
                token_ids, params, block_size, request_id, index=i, seed=_completion_seed(params.seed, i)
            )
            for i in range(params.n)
        ]
        # The first sequence computes the prompt logprobs, so it must compute every prompt position.
        seqs[0].skip_prefix_cache = params.prompt_logprobs is not None
        completions = [
            _Completion(
                seq, IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens), params
            )
            for seq in seqs
        ]
        # Siblings wait for the first sequence's prompt blocks only if there are full blocks to share.
        shareable = self.config.enable_prefix_caching and (len(token_ids) - 1) // block_size > 0
        admitted = seqs if not shareable else seqs[:1]
        banned = [] if params.ignore_eos else sorted(self.eos_token_ids)
        self.requests[request_id] = _Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            completions=completions,
            pending=seqs[len(admitted) :],
            min_tokens_banned_ids=sorted(set(banned) | set(params.stop_token_ids)),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            num_unfinished=params.n,
        )
        for seq in admitted:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for completion in request.completions:
            seq = completion.seq
            if seq.finish_reason is None and seq not in request.pending:
                self.scheduler.abort(seq)
        return True

    def _fail_request(self, request_id: str, error: Exception | str) -> _Request:
        """Ends a request whose own processing raised: its sequences stop and free their blocks, its output
        carries the error, and every other request goes on."""
        request = self.requests[request_id]
        if isinstance(error, Exception):
            logger.error("request %s failed", request_id, exc_info=error)
            error = f"{type(error).__name__}: {error}"
        else:
            logger.error("request %s failed: %s", request_id, error)
        pending = set(map(id, request.pending))
        for completion in request.completions:
            seq = completion.seq
            if seq.finish_reason is None and id(seq) not in pending:
                self.scheduler.abort(seq)
            seq.finish_reason = "error"
        request.pending.clear()
        request.num_unfinished = 0
        request.error = error
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one batch; returns the outputs of requests that advanced (one per request,
        with all its n completions)."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        rows = [self._row(seq) for seq in scheduled.seqs]
        result = self.model_runner.execute(ModelInput(scheduled.is_prefill, rows))
        if scheduled.is_prefill:
            self.num_prompt_tokens_computed += scheduled.num_tokens
        advanced: dict[str, _Request] = {}
        for row_index, chunk in result.prompt_logprobs.items():
            seq = scheduled.seqs[row_index]
            try:
                self._add_prompt_logprobs(seq, rows[row_index].start_pos, chunk)
            except Exception as e:
                advanced[seq.request_id] = self._fail_request(seq.request_id, e)
        ready = self.scheduler.postprocess(scheduled.seqs)
        logprob_position = {row: j for j, row in enumerate(result.logprob_rows)}
        for i, (seq, token_id) in enumerate(zip(ready, result.token_ids, strict=True)):
            request = self.requests.get(seq.request_id)
            if request is None or seq.finish_reason is not None:  # its request failed in this step
                continue
            advanced[seq.request_id] = request
            if i in result.failed_rows:
                self._fail_request(seq.request_id, result.failed_rows[i])
                continue
            try:
                if seq.num_completion_tokens == 0 and seq.index == 0:
                    # The prompt is computed and its full blocks are now in the prefix cache.
                    seq.skip_prefix_cache = False
                    for sibling in request.pending:
                        self.scheduler.add(sibling)
                    request.pending.clear()
                position = logprob_position.get(i) if logprob_position else None
                completion = request.completions[seq.index]
                self._append_token(request, completion, token_id, result.logprobs, position)
            except Exception as e:
                self._fail_request(seq.request_id, e)
        outputs = []
        for request in advanced.values():
            finished = request.num_unfinished == 0
            if finished or request.params.output_kind == RequestOutputKind.CUMULATIVE:
                outputs.append(request.output())
            if finished:
                del self.requests[request.request_id]
        return outputs

    def _row(self, seq: Sequence) -> ScheduledRow:
        start = seq.num_computed_tokens
        end = start + seq.num_scheduled_tokens
        params = seq.params
        row = ScheduledRow(
            token_ids=seq.token_ids[start:end],
            start_pos=start,
            block_table=seq.block_table,  # read-only until the step is over: no copy
            sample=end == seq.num_tokens,
            params=params,
        )
        if params.temperature_only and params.prompt_logprobs is None:
            return row
        num_output = seq.num_completion_tokens
        if row.sample:
            row.seed = seq.seed
            row.num_output_tokens = num_output
            if num_output < params.min_tokens:
                row.banned_token_ids = self.requests[seq.request_id].min_tokens_banned_ids
            if seq.output_token_array is not None:
                row.penalty_output_ids = seq.output_token_array.view()
                row.penalty_prompt_ids = seq.distinct_prompt_ids
        if params.prompt_logprobs is not None and seq.index == 0 and num_output == 0:
            # Position p's logits give the logprobs of prompt token p + 1.
            targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
            row.prompt_logprob_targets = targets or None
        return row

    def _add_prompt_logprobs(self, seq: Sequence, start_pos: int, chunk: TokenLogprobs) -> None:
        entries = self.requests[seq.request_id].prompt_logprobs
        # Positions served by the prefix cache were not computed, so their logprobs are unknown.
        entries.extend([None] * (start_pos + 1 - len(entries)))
        entries.extend(self._position_logprobs(chunk, i) for i in range(len(chunk.token_ids)))

    def _position_logprobs(self, chunk: TokenLogprobs, i: int) -> PositionLogprobs:
        """The token's own logprob first, then the top-N (the token's entry is replaced if it is one)."""
        token_text = self._token_text
        token_id = chunk.token_ids[i]
        entry = {token_id: Logprob(chunk.logprobs[i], chunk.ranks[i], token_text(token_id))}
        for rank, (top_id, top_logprob) in enumerate(
            zip(chunk.top_token_ids[i], chunk.top_logprobs[i], strict=True), 1
        ):
            entry[top_id] = Logprob(top_logprob, rank, token_text(top_id))
        return entry

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            # None: an id of the model's vocabulary that the tokenizer lacks (padding rows of the
            # embedding, as in Qwen's checkpoints); it decodes to nothing.
            text = "" if token is None else self.tokenizer.convert_tokens_to_string([token])
            self._token_texts[token_id] = text
        return text

    def _append_token(
        self,
        request: _Request,
        completion: _Completion,
        token_id: int,
        logprobs: TokenLogprobs | None,
        position: int | None,
    ) -> None:
        """Adds a sampled token (with its logprobs at ``position`` of ``logprobs``, if it has any) and
        decides whether the sequence is finished."""
        seq = completion.seq
        params = request.params
        seq.append_token(token_id)
        self.num_generated_tokens += 1
        if position is not None:
            completion.logprobs.append(self._position_logprobs(logprobs, position))
            completion.cumulative_logprob += logprobs.logprobs[position]
        num_output = seq.num_completion_tokens
        # Nothing stops a sequence before min_tokens (the sampler also masks EOS and stop tokens).
        can_stop = num_output > params.min_tokens
        reason: str | None = None
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
        elif can_stop and token_id in params.stop_token_ids:
            reason, completion.stop_reason = "stop", token_id
        # A stop token's own text is left out unless include_stop_str_in_output (as in vLLM).
        if reason is None or params.include_stop_str_in_output:
            if params.stop or params.output_kind == RequestOutputKind.CUMULATIVE:
                completion.detokenizer.add_token(token_id)
            else:  # nobody reads the text before the end: decode it in one go then
                completion.detokenizer.defer_token(token_id)
        if reason is None and params.stop:
            text = completion.detokenizer.text
            if can_stop:
                reason = self._match_stop_string(completion, text, params)
            completion.num_searched_chars = len(text)
        if reason is None and (
            (params.max_tokens is not None and num_output >= params.max_tokens)
            or seq.num_tokens >= self.config.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if params.output_kind == RequestOutputKind.FINAL_ONLY:
                completion.detokenizer.flush(final=True)
            self.scheduler.finish(seq, reason)
            request.num_unfinished -= 1

    @staticmethod
    def _match_stop_string(completion: _Completion, text: str, params: SamplingParams) -> str | None:
        """Finds the earliest stop string that ends in the text added since the last search (it may start
        before it: stop strings span tokens) and cuts the text there."""
        found_at, found = -1, None
        for stop in params.stop:
            at = text.find(stop, max(completion.num_searched_chars - len(stop) + 1, 0))
            if at != -1 and (found is None or at < found_at):
                found_at, found = at, stop
        if found is None:
            return None
        completion.stop_reason = found
        completion.text_end = found_at + len(found) if params.include_stop_str_in_output else found_at
        return "stop"

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_kv_blocks_total": bm.num_blocks,
            "num_kv_blocks_free": bm.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queried_tokens": bm.queried_tokens,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
        }

    def close(self) -> None:
        """Stops the model runner (and its tensor-parallel workers); the engine is unusable afterwards."""
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = None
