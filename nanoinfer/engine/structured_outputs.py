"""The engine core's side of structured outputs: a grammar matcher per constrained request, and each
step's token bitmask of its constrained rows.

The bitmask of step n+1 depends on the token step n samples, so step n+1's forward pass is launched
with its sampling deferred. With async scheduling one call of the core (``EngineCore.step``) schedules
and prepares step n+1, takes step n's bitmask and launches step n's sampling, and waits for step n's
tokens; then step n's tokens are fed to the grammars (``Scheduler.grammar_feeds`` says what to feed,
``feed_grammar`` feeds one) and step n+1's bitmask is filled, while the core launches step n+1's
forward pass and makes step n's outputs. Those take step n's constrained tokens as accepted, without
waiting for the feeding: the core's next call checks its answers (:meth:`PendingBitmask.wait_advanced`)
and ends the requests that one ends; the bitmask is taken when step n+1 samples.

Where the grammars run: on CUDA in processes of their own (``EngineConfig.num_grammar_processes``, see
engine/grammar_process.py), beside the engine's thread and without sharing its GIL; on the CPU on the
engine's thread (a process there would take the cores the forward pass uses).

Compiles never hold up the engine's steps: a constraint compiles on a thread (of the grammar process
that will hold it, or of the engine's process) while its request waits
(``RequestStatus.WAITING_FOR_GRAMMAR``) and the other requests run; the core takes the compiles that are
done at each step (:meth:`StructuredOutputManager.poll_compiled`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.grammar_process import CompiledGrammar, compile_outcome
from nanoinfer.engine.request import engine_eos_token_ids
from nanoinfer.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    # The grammar libraries are imported by the first constrained request only.
    from nanoinfer.engine.grammar_process import GrammarProcesses, RemoteGrammar
    from nanoinfer.executor.model_runner import StepHandle
    from nanoinfer.structured.backend import Grammar, GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GrammarResult:
    """A constrained row's sampled token fed to its grammar: ``error`` says why it was not accepted
    (``invalid_input``: the constraint itself could not be matched, a limit of the grammar library:
    the request's fault, not the engine's); ``blocks_eos``: the grammar now allows only EOS, which the
    request cannot sample (see ``GrammarFeed.eos_blocked``)."""

    error: str | None = None
    blocks_eos: bool = False
    invalid_input: bool = False


# The result of nearly every row (shared: nothing changes a result once made).
ACCEPTED = GrammarResult()


@dataclass(slots=True)
class GrammarFeed:
    """A constrained row's sampled token, to feed to its grammar (``Scheduler.grammar_feeds``)."""

    row: int  # index into SchedulerOutput.scheduled
    grammar: Grammar | RemoteGrammar
    token_id: int
    # The request cannot sample EOS next (it ignores EOS, or min_tokens still bans it): if the grammar
    # then allows only EOS, the request ends here instead.
    eos_blocked: bool


def feed_grammar(grammar: Grammar, token_id: int, eos_blocked: bool) -> GrammarResult:
    """``token_id`` fed to ``grammar``; a failure of the grammar library is that row's error alone."""
    try:
        if not grammar.accept_token(token_id):
            if grammar.error is not None:
                return GrammarResult(
                    f"structured_outputs could not be matched: {grammar.error}", invalid_input=True
                )
            return GrammarResult(f"sampled token {token_id} is not allowed by structured_outputs")
        if eos_blocked and grammar.is_terminated():
            return GrammarResult(blocks_eos=True)
        return ACCEPTED
    except Exception as e:
        logger.exception("a grammar failed on token %d", token_id)
        return GrammarResult(f"{type(e).__name__}: {e}")


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows."""

    rows: list[int]  # indices into SchedulerOutput.scheduled, of rows that sample
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)] on the CPU (see structured/backend.py)
    # The step whose sampling the bitmask was uploaded for (set by ModelRunner.sample): on CUDA the copy
    # reads the pinned buffer until the device gets to it, which is before that sampling, so the buffer
    # is refilled only once the step's tokens are on the host (StepHandle.wait; see
    # StructuredOutputManager._take_buffer). An event recorded after the copy would say the same at the
    # cost of two CUDA calls per step (its record and its wait: 20-30 us each on the H100's host).
    read_by: StepHandle | None = None

    def upload(self, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bitmask on ``device`` (in the first rows of ``out`` when given), without waiting for the
        device: the buffer is pinned on CUDA (see ``read_by``)."""
        on_cuda = device.type == "cuda"
        if out is None:
            if not on_cuda:
                return self.bitmask
            masks = self.bitmask.to(device, non_blocking=True)
        else:
            masks = out[: self.bitmask.shape[0]]
            masks.copy_(self.bitmask, non_blocking=on_cuda)
        return masks


class StructuredOutputManager:
    """Compiles constraints into matchers, feeds them and fills bitmasks. The grammar compiler
    (llguidance's token trie, and for JSON xgrammar's tokenizer info: together about a second and a
    half for a 150k vocabulary), or the grammar processes, are built by the first constrained request, so
    that engines that never see one never pay for it (on the compile thread, or in the processes). A
    server's engine starts its grammar processes with itself instead (:meth:`start_grammar_processes`)."""

    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any]):
        self._config = config
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # the frontend's validation and the compile thread
        self._processes: GrammarProcesses | None = None
        self._next_key = 0  # the last key given to a compile (keys are never reused)
        # Without grammar processes: the compile thread, and its compiles in flight by key.
        self._compile_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiling: dict[int, concurrent.futures.Future] = {}
        self._buffer: torch.Tensor | None = None
        self._last: GrammarBitmask | None = None  # the latest bitmask made in the buffer
        self._pending: PendingBitmask | None = None  # the grammar processes' exchange in flight
        # For the structured-outputs benchmark: time spent filling bitmasks, and waiting for the grammar
        # processes.
        self.num_mask_steps = 0
        self.mask_seconds = 0.0
        self.mask_wait_seconds = 0.0

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                from nanoinfer.structured.backend import GrammarCompiler

                tokenizer = self._tokenizer()
                config = self._config
                self._compiler = GrammarCompiler(
                    tokenizer, config.hf_config.vocab_size, engine_eos_token_ids(config, tokenizer)
                )
            return self._compiler

    def _grammar_processes(self) -> GrammarProcesses:
        """The grammar processes, started by the first call, and any that has exited started again."""
        if self._processes is None:
            from nanoinfer.engine.grammar_process import GrammarProcesses

            config = self._config
            self._processes = GrammarProcesses(config, config.max_num_seqs, config.num_grammar_processes)
            self._buffer, self._last = self._processes.bitmask, None
        else:
            self._processes.restart_exited()
        return self._processes

    def start_grammar_processes(self) -> None:
        """Starts the grammar processes now (if the config has any) rather than at the first constrained
        request; they start in the background."""
        if self._config.num_grammar_processes:
            self._grammar_processes()

    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the field when the constraint is invalid (compiled here, in this process,
        whichever process the requests' matchers live in; its first mask too, see
        ``GrammarCompiler.compile``)."""
        self.compiler.compile(params, validate=True)

    def start_compile(self, params: StructuredOutputsParams) -> int:
        """Starts compiling a fresh matcher of ``params`` and returns at once: the compile's key, which
        :meth:`poll_compiled` gives back with the matcher (in a grammar process: its handle), or with the
        error (ValueError's message naming the field when the constraint is invalid)."""
        self._next_key += 1
        key = self._next_key
        if self._config.num_grammar_processes:
            self._grammar_processes().compile(key, params)
        elif self._compiler is not None and self._compiler.is_kept(params):
            # A repeated constraint (the frontend's validation of this request compiled it, when the
            # frontend shares this manager) needs a matcher only: made here, taken by the next poll.
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(compile_outcome(key, lambda: self._compiler.compile(params)))
            self._compiling[key] = done
        else:
            if self._compile_thread is None:
                self._compile_thread = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="nanoinfer-grammar-compile"
                )
            self._compiling[key] = self._compile_thread.submit(
                compile_outcome, key, lambda: self.compiler.compile(params)
            )
        return key

    def has_compiling(self) -> bool:
        """Whether a compile has not been taken by :meth:`poll_compiled` yet."""
        if self._config.num_grammar_processes:
            return self._processes is not None and self._processes.has_compiling()
        return bool(self._compiling)

    def poll_compiled(self, timeout: float = 0.0) -> list[CompiledGrammar]:
        """The compiles that are done, each once (waiting up to ``timeout`` seconds for one when none
        is). Raises RuntimeError when the grammar processes cannot start."""
        if self._config.num_grammar_processes:
            return self._processes.poll(timeout) if self._processes is not None else []
        if not self._compiling:
            return []
        if timeout > 0 and not any(future.done() for future in self._compiling.values()):
            concurrent.futures.wait(self._compiling.values(), timeout, concurrent.futures.FIRST_COMPLETED)
        done = [key for key, future in self._compiling.items() if future.done()]
        return [self._compiling.pop(key).result() for key in done]

    def feed(self, feeds: list[GrammarFeed]) -> dict[int, GrammarResult]:
        """Each feed's result by row, fed now."""
        self.finish_pending()
        if not feeds:
            return {}
        if self._config.num_grammar_processes:
            return self._grammar_processes().send_step(feeds, []).results()
        return _feed_all(feeds)

    def bitmask(self, grammars: list[tuple[int, Grammar | RemoteGrammar]]) -> GrammarBitmask:
        """The bitmask of (scheduled row, matcher) pairs, filled now."""
        self.finish_pending()
        if self._config.num_grammar_processes:
            return self._start_in_processes(grammars, []).result()
        return self._fill(self._take_buffer(grammars), grammars)

    def start_bitmask(
        self, grammars: list[tuple[int, Grammar | RemoteGrammar]], feeds: list[GrammarFeed]
    ) -> PendingBitmask:
        """Starts feeding ``feeds`` (the matchers' latest tokens), then filling the bitmask of (scheduled
        row, matcher) pairs, in the grammar processes, and returns at once; without them, does both
        first."""
        self.finish_pending()
        if self._config.num_grammar_processes:
            return self._start_in_processes(grammars, feeds)
        results = _feed_all(feeds)
        return PendingBitmask.done(self, results, self._fill(self._take_buffer(grammars), grammars))

    def _start_in_processes(
        self, grammars: list[tuple[int, RemoteGrammar]], feeds: list[GrammarFeed]
    ) -> PendingBitmask:
        processes = self._grammar_processes()
        result = self._take_buffer(grammars)
        # Bitmask row i for the i-th pair (each process fills its rows wherever they are).
        exchange = processes.send_step(feeds, [(i, grammar) for i, (_, grammar) in enumerate(grammars)])

        def filled() -> GrammarBitmask:
            self.mask_seconds += exchange.fill()
            self.num_mask_steps += 1
            return result

        self._pending = PendingBitmask(self, exchange.results, filled)
        return self._pending

    def finish_pending(self) -> None:
        """Waits for the grammar processes' feeding and fill in flight, if any (the buffer or a pipe is
        about to be reused, or the engine stops)."""
        if self._pending is not None:
            self._pending.result()

    def _finished(self, pending: PendingBitmask, waited_s: float) -> None:
        if pending is self._pending:
            self._pending = None
        self.mask_wait_seconds += waited_s

    def _fill(self, result: GrammarBitmask, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        started = time.perf_counter()
        self.compiler.fill_bitmasks([(grammar, i) for i, (_, grammar) in enumerate(grammars)], result.bitmask)
        self.num_mask_steps += 1
        self.mask_seconds += time.perf_counter() - started
        return result

    def close(self) -> None:
        self.finish_pending()
        if self._compile_thread is not None:
            self._compile_thread.shutdown(wait=False, cancel_futures=True)
            self._compile_thread = None
            self._compiling.clear()
        if self._processes is not None:
            self._processes.close()
            self._processes = None

    def _take_buffer(self, grammars: list[tuple[int, Any]]) -> GrammarBitmask:
        """The next bitmask, in the one buffer, once the device has copied the previous one (see
        ``GrammarBitmask.read_by``)."""
        from nanoinfer.structured.backend import allocate_token_bitmask

        previous = self._last
        if previous is not None and previous.read_by is not None:
            # Nearly always done already: the step's result is read before the next bitmask is taken.
            previous.read_by.wait()
        num_rows = len(grammars)
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = allocate_token_bitmask(
                max(num_rows, self._config.max_num_seqs),
                self._config.hf_config.vocab_size,
                pin_memory=self._config.device == "cuda",
            )
        self._last = GrammarBitmask([row for row, _ in grammars], self._buffer[:num_rows])
        return self._last


def _feed_all(feeds: list[GrammarFeed]) -> dict[int, GrammarResult]:
    return {feed.row: feed_grammar(feed.grammar, feed.token_id, feed.eos_blocked) for feed in feeds}


class PendingBitmask:
    """A step's feeding and bitmask fill, running in the grammar processes
    (``StructuredOutputManager.start_bitmask``), or done."""

    def __init__(
        self,
        manager: StructuredOutputManager,
        wait_results: Callable[[], dict[int, GrammarResult]],
        wait_bitmask: Callable[[], GrammarBitmask],
    ):
        self._manager = manager
        self._wait_results = wait_results
        self._wait_bitmask = wait_bitmask
        self._results: dict[int, GrammarResult] | None = None
        self._bitmask: GrammarBitmask | None = None
        self._error: BaseException | None = None

    @classmethod
    def done(
        cls, manager: StructuredOutputManager, results: dict[int, GrammarResult], bitmask: GrammarBitmask
    ) -> PendingBitmask:
        pending = cls(manager, lambda: results, lambda: bitmask)
        pending._results, pending._bitmask = results, bitmask
        return pending

    def wait_advanced(self) -> dict[int, GrammarResult]:
        """The feeds' results by row, after waiting for them; re-raises what the feeding raised."""
        if self._results is None:
            started = time.perf_counter()
            try:
                self._results = self._wait_results()
            finally:
                self._manager.mask_wait_seconds += time.perf_counter() - started
        return self._results

    def result(self) -> GrammarBitmask:
        """The filled bitmask, after waiting for it; re-raises what the feeding or the fill raised."""
        if self._bitmask is not None:
            return self._bitmask
        if self._error is not None:
            raise self._error
        started = None
        try:
            self.wait_advanced()  # the process's replies come in order
            started = time.perf_counter()
            self._bitmask = self._wait_bitmask()
            return self._bitmask
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._manager._finished(self, time.perf_counter() - started if started is not None else 0.0)
