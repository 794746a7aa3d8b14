"""EngineCoreOutputs in (new token ids per core request); RequestOutputs out: incremental
detokenization, stop strings, logprob dicts, and the three output kinds (CUMULATIVE, DELTA,
FINAL_ONLY). The n completions of a request are gathered into one RequestOutput.

Stop strings are found here, in text: the core learns of them as a finished request (``ended``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from nanoinfer.engine.scheduler import EngineCoreOutput
from nanoinfer.frontend.detokenizer import IncrementalDetokenizer
from nanoinfer.frontend.input_processor import ProcessedRequest
from nanoinfer.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from nanoinfer.sample.logprobs import TokenLogprobs
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class _Completion:
    """The output state of one of a request's completions."""

    def __init__(self, index: int, core_id: str, detokenizer: IncrementalDetokenizer, params: SamplingParams):
        self.index = index
        self.core_id = core_id
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
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
        # DELTA: what earlier outputs already carried.
        self.sent_chars = 0
        self.sent_tokens = 0
        # Nothing reads a quiet completion before it ends (one final output, no stop strings to search,
        # no logprobs): until then a step only appends its tokens.
        self.quiet = (
            params.output_kind == RequestOutputKind.FINAL_ONLY
            and not params.stop
            and params.logprobs is None
            and params.prompt_logprobs is None
        )

    def text(self) -> str:
        text = self.detokenizer.text
        if self.text_end is not None:
            return text[: self.text_end]
        if self.holdback and self.finish_reason is None:
            return text[: max(len(text) - self.holdback, 0)]
        return text

    def cumulative(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text(),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )

    def delta(self) -> CompletionOutput:
        text = self.text()
        new_text = text[self.sent_chars :]
        new_tokens = self.token_ids[self.sent_tokens :]
        new_logprobs = self.logprobs[self.sent_tokens :] if self.logprobs is not None else None
        self.sent_chars, self.sent_tokens = len(text), len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=new_text,
            token_ids=new_tokens,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=new_logprobs,
        )


class _RequestState:
    def __init__(self, request: ProcessedRequest, tokenizer: Any):
        params = request.params
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        self.completions = [
            _Completion(
                i,
                child.request_id,
                IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens),
                params,
            )
            for i, child in enumerate(request.children)
        ]
        self.num_unfinished = len(self.completions)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.error: str | None = None
        self.invalid_input = False
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    def output(self, kind: RequestOutputKind, advanced: set[int]) -> RequestOutput:
        if kind == RequestOutputKind.DELTA:
            outputs = [c.delta() for c in self.completions if c.index in advanced]
        else:
            outputs = [c.cumulative() for c in self.completions]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.num_unfinished == 0,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
            invalid_input=self.invalid_input,
            metrics=self.metrics,
        )


class RequestStatsListener(Protocol):
    """Receives per-request timings as outputs are processed (e.g. to feed Prometheus metrics).

    The methods must be quick and must not raise: an exception there stops the engine loop.
    """

    def on_prompt(self, num_prompt_tokens: int) -> None: ...

    def on_new_tokens(self, num_tokens: int, ttft_s: float | None, itl_s: float | None) -> None: ...

    def on_finished(self, finish_reason: str, e2e_s: float) -> None: ...


class OutputProcessor:
    def __init__(self, tokenizer: Any, stats_listener: RequestStatsListener | None = None):
        self.tokenizer = tokenizer
        self.stats_listener = stats_listener
        self.requests: dict[str, _RequestState] = {}
        self._by_core_id: dict[str, tuple[_RequestState, _Completion]] = {}
        self._token_texts: dict[int, str] = {}  # decoded_token of logprobs, per token id

    def add_request(self, request: ProcessedRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        state = _RequestState(request, self.tokenizer)
        self.requests[request.request_id] = state
        for completion in state.completions:
            self._by_core_id[completion.core_id] = (state, completion)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets the request; returns its unfinished completions' core ids (to abort in the core)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for completion in state.completions:
            self._by_core_id.pop(completion.core_id, None)
        if self.stats_listener is not None:
            self.stats_listener.on_finished("abort", time.time() - state.metrics.arrival_time)
        return [c.core_id for c in state.completions if c.finish_reason is None]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs due after these core outputs (per each request's output kind), and
        the core ids of completions that ended here (a stop string, a failure): the core must drop them.
        A failure while processing one request's output fails that request alone."""
        now = time.time()
        advanced: dict[str, set[int]] = {}
        ended: list[str] = []
        for output in outputs:
            entry = self._by_core_id.get(output.request_id)
            if entry is None:  # aborted, or ended by a stop string, after this step was launched
                continue
            state, completion = entry
            if completion.finish_reason is not None:
                # Ended here by a stop string while its siblings go on: an engine core in another
                # process may have sent outputs of it before it learned of that.
                continue
            if completion.quiet and output.finish_reason is None and output.error is None:
                # The common step of an offline request, kept short: it runs once per row per step.
                new_token_ids = output.new_token_ids
                if new_token_ids:
                    if completion.index == 0 and not completion.token_ids:
                        state.num_cached_tokens = output.num_cached_tokens
                    self._record_timing(state, len(new_token_ids), now)
                    completion.token_ids += new_token_ids
                    completion.detokenizer.defer_tokens(new_token_ids)
                continue
            if output.error is not None:
                ended += self._fail(state, output.error, output.invalid_input)
                advanced.setdefault(state.request_id, set()).update(c.index for c in state.completions)
                continue
            if output.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, output.prompt_logprobs_start, output.prompt_logprobs)
            if not output.new_token_ids and output.finish_reason is None:
                continue
            if completion.index == 0 and not completion.token_ids:
                state.num_cached_tokens = output.num_cached_tokens
            self._record_timing(state, len(output.new_token_ids), now)
            try:
                if self._append(state, completion, output):
                    ended.append(completion.core_id)
            except Exception as e:
                logger.exception("request %s failed", state.request_id)
                ended += self._fail(state, f"{type(e).__name__}: {e}")
                advanced.setdefault(state.request_id, set()).update(c.index for c in state.completions)
                continue
            advanced.setdefault(state.request_id, set()).add(completion.index)
        results = []
        for request_id, indices in advanced.items():
            state = self.requests[request_id]
            finished = state.num_unfinished == 0
            kind = state.params.output_kind
            if finished:
                state.metrics.finished_time = now
                if self.stats_listener is not None:
                    reason = next((c.finish_reason for c in state.completions if c.finish_reason), "stop")
                    self.stats_listener.on_finished(reason, now - state.metrics.arrival_time)
                del self.requests[request_id]
                for completion in state.completions:
                    self._by_core_id.pop(completion.core_id, None)
            if finished or kind != RequestOutputKind.FINAL_ONLY:
                results.append(state.output(kind, indices))
        return results, ended

    def _record_timing(self, state: _RequestState, num_tokens: int, now: float) -> None:
        metrics, listener = state.metrics, self.stats_listener
        if listener is not None and num_tokens:
            if metrics.first_token_time is None:
                listener.on_prompt(len(state.prompt_token_ids))
                listener.on_new_tokens(num_tokens, now - metrics.arrival_time, None)
            else:
                listener.on_new_tokens(num_tokens, None, now - metrics.last_token_time)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now

    def _fail(self, state: _RequestState, error: str, invalid_input: bool = False) -> list[str]:
        """A completion failed in the core: the whole request fails; returns its other live completions."""
        state.error = error
        state.invalid_input = invalid_input
        others = []
        for completion in state.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "error"
                others.append(completion.core_id)
        state.num_unfinished = 0
        return others

    def _append(self, state: _RequestState, completion: _Completion, output: EngineCoreOutput) -> bool:
        """Adds a core output's tokens to a completion; True when a stop string ended it here."""
        params = state.params
        kind = params.output_kind
        for position, token_id in enumerate(output.new_token_ids):
            completion.token_ids.append(token_id)
            if output.new_logprobs is not None and completion.logprobs is not None:
                completion.logprobs.append(self._position_logprobs(output.new_logprobs, position))
                completion.cumulative_logprob += output.new_logprobs.logprobs[position]
        # A stop token's (or EOS's) own text is left out unless include_stop_str_in_output (vLLM).
        text_tokens = output.new_token_ids
        if output.stopped_by_token and not params.include_stop_str_in_output:
            text_tokens = text_tokens[:-1]
        detokenizer = completion.detokenizer
        if params.stop or kind != RequestOutputKind.FINAL_ONLY:
            for token_id in text_tokens:
                detokenizer.add_token(token_id)
        else:  # nobody reads the text before the end: decode it in one go then
            detokenizer.defer_tokens(text_tokens)
        stopped = False
        if params.stop and output.finish_reason != "stop":
            text = detokenizer.text
            # Nothing stops a completion before min_tokens.
            if len(completion.token_ids) > params.min_tokens and self._match_stop_string(
                completion, text, params
            ):
                stopped = True
            completion.num_searched_chars = len(text)
        if stopped:
            self._finish(state, completion, "stop", completion.stop_reason)
        elif output.finish_reason is not None:
            self._finish(state, completion, output.finish_reason, output.stop_reason)
        return stopped

    @staticmethod
    def _finish(state: _RequestState, completion: _Completion, reason: str, stop_reason) -> None:
        completion.finish_reason = reason
        completion.stop_reason = stop_reason
        if state.params.output_kind == RequestOutputKind.FINAL_ONLY:
            completion.detokenizer.flush(final=True)
        state.num_unfinished -= 1

    @staticmethod
    def _match_stop_string(completion: _Completion, text: str, params: SamplingParams) -> bool:
        """Finds the earliest stop string that ends in the text added since the last search (it may start
        before it: stop strings span tokens) and cuts the text there."""
        found_at, found = -1, None
        for stop in params.stop:
            at = text.find(stop, max(completion.num_searched_chars - len(stop) + 1, 0))
            if at != -1 and (found is None or at < found_at):
                found_at, found = at, stop
        if found is None:
            return False
        completion.stop_reason = found
        completion.text_end = found_at + len(found) if params.include_stop_str_in_output else found_at
        return True

    # -- logprobs --------------------------------------------------------------------------------------

    def _add_prompt_logprobs(self, state: _RequestState, start: int, chunk: TokenLogprobs) -> None:
        entries = state.prompt_logprobs
        if entries is None:
            return
        # Positions served by the prefix cache were not computed, so their logprobs are unknown.
        entries.extend([None] * (start + 1 - len(entries)))
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
