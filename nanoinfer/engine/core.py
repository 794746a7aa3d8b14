"""The engine core: tokenized requests in, each step's new token ids per request out. No text, no
tensors: the scheduler decides, the executor runs the step on the device.

With async scheduling (on by default on CUDA) one step is always in flight: :meth:`EngineCore.step`
schedules and launches step n+1, then waits for step n and turns its result into outputs, so that the
host's work for one step overlaps the device's for the other. Step n+1's input for a decoding request is
step n's sampled token, which stays on the device. A request that step n finished has a row in step
n+1 that is wasted: its token is dropped. A step with structured-outputs rows is launched with its
sampling deferred; once step n's tokens are on the host (taken just after that launch), the grammar
processes feed them to the grammars and fill step n+1's bitmask while the device runs step n+1's forward
pass. The next call schedules step n+2 and copies its inputs to the device meanwhile, then takes the
bitmask and launches step n+1's sampling and, right after it, step n+2 (see
engine/structured_outputs.py). Step n's outputs take its constrained tokens as accepted; the grammars'
answers are checked at the next call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.kv_cache_manager import KVCacheManager
from nanoinfer.engine.request import EngineRequest
from nanoinfer.engine.scheduler import EngineCoreOutput, RunnerOutput, Scheduler, SchedulerOutput
from nanoinfer.engine.structured_outputs import (
    ACCEPTED,
    GrammarBitmask,
    GrammarFeed,
    PendingBitmask,
    StructuredOutputManager,
)
from nanoinfer.executor.model_runner import StepHandle
from nanoinfer.models.checkpoint import load_tokenizer

if TYPE_CHECKING:
    from nanoinfer.engine.grammar_process import RemoteGrammar
    from nanoinfer.structured.backend import Grammar

logger = logging.getLogger(__name__)

# How long a step waits for a compile after a step that had nothing to run (every unfinished request
# waits for its constraint): it returns as soon as one is done; the bound is how soon the caller sees its
# new commands (aborts, requests).
IDLE_COMPILE_WAIT_S = 0.005


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Tokens the finished step computed: prompt tokens (prefill) and sampled tokens.
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Any = None, *, start_grammar_processes: bool = False):
        """``tokenizer``: the frontend's, when it runs in the same process (structured outputs need
        one; otherwise the core loads its own when the first constrained request arrives).
        ``start_grammar_processes``: start the config's grammar processes now, beside the model's load,
        instead of at the first constrained request (a server's engine: each process takes seconds to
        start, which its first constrained requests would otherwise wait for). The processes import the
        caller's main module, as every spawned process does."""
        from nanoinfer.executor.executor import create_executor  # imports the model code

        self.config = config
        if config.cpu_num_threads is not None:
            # Here rather than in the frontend: the core may run in a process of its own.
            torch.set_num_threads(config.cpu_num_threads)
        started = time.perf_counter()
        self.structured_outputs = StructuredOutputManager(
            config,
            lambda: tokenizer if tokenizer is not None else load_tokenizer(config.model, config.tokenizer),
        )
        if start_grammar_processes:
            self.structured_outputs.start_grammar_processes()
        try:
            self.executor = create_executor(config)
        except BaseException:
            self.structured_outputs.close()
            raise
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
        )
        self.async_scheduling = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # The bitmask of the in-flight step's constrained rows, filling in the grammar processes.
        self._pending_bitmask: tuple[SchedulerOutput, PendingBitmask] | None = None
        # A step whose constrained rows' tokens were applied before their grammars answered (the feeding
        # of that pending exchange, with its feeds), checked at the next call.
        self._unchecked: tuple[SchedulerOutput, PendingBitmask, list[GrammarFeed]] | None = None
        self._compiling: dict[int, str] = {}  # the request of each constraint compiling, by compile key
        self._ran_nothing = False  # the last step had nothing to launch and none in flight
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        logger.info(
            "engine core ready in %.1f s: %d KV blocks of %d tokens, async scheduling %s",
            time.perf_counter() - started,
            self.num_kv_blocks,
            config.kvcache_block_size,
            "on" if self.async_scheduling else "off",
        )

    # -- requests --------------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request the frontend's input processor validated (its KV need fits the pool); raises
        ValueError if its id is in use. A structured-outputs constraint compiles while the request waits
        and the others run; one that does not compile fails its request with an output."""
        constraint = request.params.structured_outputs
        self.scheduler.add_request(request, waits_for_grammar=constraint is not None)
        if constraint is not None:
            try:
                key = self.structured_outputs.start_compile(constraint)
            except BaseException:
                self.scheduler.abort_requests([request.request_id])
                raise
            self._compiling[key] = request.request_id

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drops requests (aborted, or ended by the frontend: a stop string) and frees their blocks."""
        self.scheduler.abort_requests(request_ids)
        if self._compiling:
            # Their compiles' outcomes are dropped when they come (a matcher's handle releases it).
            gone = set(request_ids)
            for key in [key for key, request_id in self._compiling.items() if request_id in gone]:
                del self._compiling[key]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # -- the loop --------------------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Runs one step. Without async scheduling: schedule, run, return its outputs. With it: launch
        the next step, then return the outputs of the one launched by the previous call. Requests whose
        constraints failed to compile end in the outputs too."""
        failed = self._take_compiled()
        outputs = self._step()
        if failed:
            outputs.outputs[:0] = failed
        return outputs

    def _check_fed(self) -> list[EngineCoreOutput]:
        """The outputs of the requests that the previous call's grammar answers end: those answers came
        after their tokens were applied, which is how a constrained step's outputs leave the engine
        without waiting for the grammars. Checked just before the next bitmask is taken (the grammar
        processes feed before they fill), so that the engine waits for them once, after this call's
        schedule and inputs; a request they end has a row in the step scheduled meanwhile, which is
        wasted (its token is dropped), as when a step ends a request while the next is in flight."""
        if self._unchecked is None:
            return []
        out, pending, feeds = self._unchecked
        self._unchecked = None
        results = pending.wait_advanced()
        ended = []
        for feed in feeds:
            result = results[feed.row]
            if result is ACCEPTED:  # nearly every row: nothing to apply
                continue
            request_id = out.scheduled[feed.row].request_id
            output = self.scheduler.apply_late_grammar_result(request_id, feed.grammar, result)
            if output is not None:
                ended.append(output)
        return ended

    def _take_compiled(self) -> list[EngineCoreOutput]:
        """Hands the compiled constraints to their requests; the outputs of those that failed. After a
        step that had nothing to run, waits a little for a compile (instead of spinning)."""
        if not self.structured_outputs.has_compiling():  # every key in self._compiling is there too
            return []
        # (Compiles of aborted requests are taken too: their matchers are released then.)
        timeout = IDLE_COMPILE_WAIT_S if self._ran_nothing else 0.0
        failed = []
        for compiled in self.structured_outputs.poll_compiled(timeout):
            request_id = self._compiling.pop(compiled.key, None)
            if request_id is None:
                continue
            if compiled.error is None:
                self.scheduler.set_grammar(request_id, compiled.grammar)
                continue
            output = self.scheduler.fail_request(request_id, compiled.error, compiled.invalid_input)
            if output is not None:
                failed.append(output)
        return failed

    def _step(self) -> EngineCoreOutputs:
        out = self.scheduler.schedule()
        self._ran_nothing = out.is_empty and self._in_flight is None
        prepared = self.executor.prepare(out) if not out.is_empty else None
        constrained = prepared is not None and bool(out.structured_rows)
        if not self.async_scheduling:
            if prepared is None:
                return EngineCoreOutputs()
            handle = self.executor.launch(out, prepared, defer_sampling=constrained)
            if constrained:
                self._sample_structured(out, handle)
            return self._finish_step(out, handle)
        previous, self._in_flight = self._in_flight, None
        deferred = previous is not None and previous[1].deferred is not None
        staged_inputs = None
        if deferred and prepared is not None:
            # While the grammar processes finish the previous step's bitmask: this step's inputs go to the
            # device now (that deferred sampling reads none of their buffers), so that only the gather of
            # its pending tokens and its launch are left after that sampling.
            staged_inputs = self.executor.stage(prepared)
        ended = self._check_fed()
        if deferred:
            # The previous step's sampling waited for its bitmask; its tokens are this step's inputs.
            self._sample_structured(*previous)
        if prepared is not None:
            # Launched right after the sampling it follows, so that the device goes from one to the other.
            self._in_flight = (out, self.executor.launch(out, prepared, constrained, staged_inputs))
        previous_result = None
        fed = False  # the previous step's tokens are being fed with this step's fill
        if constrained:
            feeds = []
            if deferred:
                # The previous step's tokens also advance the grammars that this step's bitmask is made
                # from: taken as soon as this step is launched, so that the grammars advance and the bitmask
                # fills in the grammar processes while the device runs its forward pass and the previous
                # step's outputs are made.
                previous_result = previous[1].result()
                feeds = self.scheduler.grammar_feeds(previous[0], previous_result)
            grammars = self._grammars(out)
            if grammars:
                self._pending_bitmask = (out, self.structured_outputs.start_bitmask(grammars, feeds))
                fed = previous_result is not None
            elif previous_result is not None:
                previous[0].grammar_results = self.structured_outputs.feed(feeds)
        if previous is None:
            return EngineCoreOutputs(ended)
        if fed:
            # The previous step's outputs are made now, its constrained tokens taken as accepted: the
            # grammars accept nearly every token (their masks allowed it), so the outputs do not wait for
            # the feeding; the next call checks its answers (_check_fed) and ends the requests of the rare
            # refusal (a token that the request's other restrictions forced on it, a grammar library's
            # failure) or of a grammar that allows only an EOS the request cannot sample.
            previous[0].grammar_results = dict.fromkeys((feed.row for feed in feeds), ACCEPTED)
            self._unchecked = (previous[0], self._pending_bitmask[1], feeds)
        outputs = self._finish_step(*previous, previous_result)
        if ended:
            outputs.outputs[:0] = ended
        return outputs

    def _grammars(self, out: SchedulerOutput) -> list[tuple[int, Grammar | RemoteGrammar]]:
        """The (row, grammar) pairs of a step's constrained rows whose requests are still running."""
        requests = self.scheduler.requests
        grammars = []
        for row in out.structured_rows:
            # A request that the previous step finished has no grammar to ask; its token is dropped.
            request = requests.get(out.scheduled[row].request_id)
            if request is not None:
                grammars.append((row, request.grammar))
        return grammars

    def _sample_structured(self, out: SchedulerOutput, handle: StepHandle) -> None:
        """Takes the bitmask of a step whose constrained rows waited for it (filled in the grammar processes
        since the previous call, or now) and launches its sampling. A request aborted since its fill started
        keeps its row's mask; its token is dropped."""
        pending, self._pending_bitmask = self._pending_bitmask, None
        bitmask: GrammarBitmask | None
        if pending is not None and pending[0] is out:
            bitmask = pending[1].result()
        else:
            grammars = self._grammars(out)
            bitmask = self.structured_outputs.bitmask(grammars) if grammars else None
        self.executor.sample(handle, bitmask)

    def _finish_step(
        self, out: SchedulerOutput, handle: StepHandle, result: RunnerOutput | None = None
    ) -> EngineCoreOutputs:
        """The outputs of a launched step (``result``: its tokens, when already taken)."""
        if result is None:
            result = handle.result()
        if out.structured_rows and out.grammar_results is None:
            out.grammar_results = self.structured_outputs.feed(self.scheduler.grammar_feeds(out, result))
        outputs = self.scheduler.update_from_output(out, result)
        num_sampled = sum(1 for t in result.token_ids if t >= 0)
        num_prompt = sum(r.num_tokens for r in out.scheduled if not r.samples or r.num_tokens > 1)
        self.num_prompt_tokens_computed += num_prompt
        self.num_generated_tokens += num_sampled
        return EngineCoreOutputs(outputs, num_prompt, num_sampled)

    def stats(self) -> dict[str, int]:
        stats = self.scheduler.stats()
        stats["num_prompt_tokens_computed"] = self.num_prompt_tokens_computed
        stats["num_generated_tokens"] = self.num_generated_tokens
        stats["structured_mask_steps"] = self.structured_outputs.num_mask_steps
        stats["structured_mask_us"] = round(self.structured_outputs.mask_seconds * 1e6)
        stats["structured_mask_wait_us"] = round(self.structured_outputs.mask_wait_seconds * 1e6)
        return stats

    def close(self) -> None:
        """Stops the executor (and its tensor-parallel workers); the core is unusable afterwards."""
        self._in_flight = None
        self._pending_bitmask = None
        self._unchecked = None
        self.structured_outputs.close()
        if self.executor is not None:
            self.executor.close()
            self.executor = None
