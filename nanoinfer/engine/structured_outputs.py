"""The engine core's side of structured outputs: a grammar matcher per constrained request, and each
step's token bitmask of its constrained rows.

The bitmask of step n+1 depends on the token step n samples, so step n+1's forward pass is launched
with its sampling deferred. With async scheduling one call of the core (``EngineCore.step``) schedules
and prepares step n+1, takes step n's bitmask and launches step n's sampling, and waits for step n's
tokens; then step n's tokens are fed to the grammars (``Scheduler.advance_grammars``) and step n+1's
bitmask is filled, while the core launches step n+1's forward pass and makes step n's outputs. On CUDA
both run on a worker thread (:meth:`StructuredOutputManager.start_bitmask`): the feeding beside the
forward launch (whose graph replay releases the GIL), the fill beside the rest of that launch, step
n's outputs (and, in-process, the frontend's processing of them) and the next call's schedule and
prepare, until the next call takes the bitmask for step n+1's sampling. Step n's outputs wait only
for the feeding (:meth:`PendingBitmask.wait_advanced`), and the engine thread asks the grammars
nothing while the worker runs.

The grammar libraries fill without the GIL; the worker needs it to start, to feed the tokens and to
finish, and a busy engine thread hands it over once per switch interval (5 ms by default, longer than
a step: benchmarks/structured_backends.py --fill-threads measured a 0.6 ms fill taking 11 ms beside a
busy thread, 1.0 ms at a 0.1 ms interval), so the interval is lowered while the worker runs. On the
CPU (``fill_on_worker`` off) and without async scheduling both run on the engine's thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.request import engine_eos_token_ids
from nanoinfer.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    # The grammar libraries are imported by the first constrained request only.
    from nanoinfer.structured.backend import Grammar, GrammarCompiler

# The GIL switch interval while the worker runs: it waits at most this long for the GIL whenever it needs
# it back (see the module docstring).
FILL_SWITCH_INTERVAL_S = 1e-4


@dataclass
class GrammarBitmask:
    """The allowed next tokens of a step's constrained rows."""

    rows: list[int]  # indices into SchedulerOutput.scheduled, of rows that sample
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)] on the CPU (see structured/backend.py)
    # The buffer's event (CUDA; one for all its bitmasks: creating one costs more than the copy's launch),
    # recorded after the copy to the GPU, which reads the (pinned) buffer until then.
    upload_event: torch.cuda.Event | None = None
    uploaded: bool = False

    def upload(self, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bitmask on ``device`` (in the first rows of ``out`` when given), without waiting for the
        device: the buffer is pinned on CUDA, and is refilled only after the upload event (see
        :meth:`StructuredOutputManager._take_buffer`)."""
        on_cuda = device.type == "cuda"
        if out is None:
            if not on_cuda:
                return self.bitmask
            masks = self.bitmask.to(device, non_blocking=True)
        else:
            masks = out[: self.bitmask.shape[0]]
            masks.copy_(self.bitmask, non_blocking=on_cuda)
        if on_cuda:
            self.upload_event.record()
            self.uploaded = True
        return masks


class StructuredOutputManager:
    """Compiles constraints into matchers and fills bitmasks. The grammar compiler (llguidance's token
    trie, and for JSON xgrammar's tokenizer info: together about a second and a half for a 150k
    vocabulary) is built by the first constrained request, so that engines that never see one never
    pay for it."""

    def __init__(self, config: EngineConfig, tokenizer: Callable[[], Any]):
        self._config = config
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._buffer: torch.Tensor | None = None
        self._last: GrammarBitmask | None = None  # the latest bitmask made in the buffer
        self._upload_event: torch.cuda.Event | None = None
        # The worker pays where the forward pass leaves the host's cores free (CUDA); on the CPU the
        # fill would compete with the forward pass for them, and a 16-row fill takes well under 0.1 ms
        # (benchmarks/structured_outputs.py --device cpu: ratio 0.75-0.77 with it, 0.78-0.85 without).
        self.fill_on_worker = config.device == "cuda"
        self._worker: ThreadPoolExecutor | None = None
        self._pending: PendingBitmask | None = None
        self._switch_interval = sys.getswitchinterval()  # restored when the pending fill is taken
        # For the structured-outputs benchmark: time spent filling bitmasks, and waiting for a fill that
        # ran on the worker.
        self.num_mask_steps = 0
        self.mask_seconds = 0.0
        self.mask_wait_seconds = 0.0

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from nanoinfer.structured.backend import GrammarCompiler

            tokenizer = self._tokenizer()
            config = self._config
            self._compiler = GrammarCompiler(
                tokenizer, config.hf_config.vocab_size, engine_eos_token_ids(config, tokenizer)
            )
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher; ValueError naming the field when the constraint is invalid."""
        return self.compiler.compile(params)

    def bitmask(self, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        """The bitmask of (scheduled row, matcher) pairs, filled now on the grammar libraries' threads."""
        self.finish_pending()
        return self._fill(self._take_buffer(grammars), grammars)

    def start_bitmask(
        self, grammars: list[tuple[int, Grammar]], advance: Callable[[], None] | None = None
    ) -> PendingBitmask:
        """Starts filling the bitmask of (scheduled row, matcher) pairs on the worker thread, after
        ``advance`` (which feeds the matchers their latest tokens), and returns at once; with
        ``fill_on_worker`` off, runs both first. Until :meth:`PendingBitmask.result`, the caller must
        not ask these matchers anything, nor read what ``advance`` writes before
        :meth:`PendingBitmask.wait_advanced`."""
        self.finish_pending()
        result = self._take_buffer(grammars)
        if not self.fill_on_worker:
            done = PendingBitmask(self, None)
            done._future.set_result(self._advance_and_fill(result, grammars, advance, None))
            return done
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoinfer-bitmask")
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, FILL_SWITCH_INTERVAL_S))
        pending = PendingBitmask(self, threading.Event())
        pending._future = self._worker.submit(self._advance_and_fill, result, grammars, advance, pending)
        self._pending = pending
        return pending

    def _advance_and_fill(
        self,
        result: GrammarBitmask,
        grammars: list[tuple[int, Grammar]],
        advance: Callable[[], None] | None,
        pending: PendingBitmask | None,
    ) -> GrammarBitmask:
        try:
            if advance is not None:
                advance()
        except BaseException as e:
            if pending is not None:
                pending.advance_error = e
            raise
        finally:
            if pending is not None:
                pending.advanced.set()
        return self._fill(result, grammars)

    def finish_pending(self) -> None:
        """Waits for the fill in flight, if any (its buffer is about to be reused, or the engine stops)."""
        if self._pending is not None:
            self._pending.result()

    def _finished(self, pending: PendingBitmask, waited_s: float) -> None:
        if pending is self._pending:
            self._pending = None
            sys.setswitchinterval(self._switch_interval)
            self.mask_wait_seconds += waited_s

    def _fill(self, result: GrammarBitmask, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        started = time.perf_counter()
        self.compiler.fill_bitmasks([(grammar, i) for i, (_, grammar) in enumerate(grammars)], result.bitmask)
        self.num_mask_steps += 1
        self.mask_seconds += time.perf_counter() - started
        return result

    def close(self) -> None:
        self.finish_pending()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _take_buffer(self, grammars: list[tuple[int, Grammar]]) -> GrammarBitmask:
        """The next bitmask, in the one buffer. Its previous bitmask's copy to the GPU came before the
        sampling whose tokens advanced these matchers, so the wait is for a finished copy."""
        from nanoinfer.structured.backend import allocate_token_bitmask

        previous = self._last
        if previous is not None and previous.uploaded:
            previous.upload_event.synchronize()
        num_rows = len(grammars)
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            self._buffer = allocate_token_bitmask(
                max(num_rows, self._config.max_num_seqs),
                self.compiler.vocab_size,
                pin_memory=self._config.device == "cuda",
            )
        if self._upload_event is None and self._config.device == "cuda":
            self._upload_event = torch.cuda.Event()
        self._last = GrammarBitmask([row for row, _ in grammars], self._buffer[:num_rows], self._upload_event)
        return self._last


class PendingBitmask:
    """A bitmask being filled on the manager's worker thread (``StructuredOutputManager.start_bitmask``)."""

    def __init__(self, manager: StructuredOutputManager, advanced: threading.Event | None):
        self._manager = manager
        self._future: Future[GrammarBitmask] = Future()  # the worker's, once submitted
        self.advanced = advanced  # set once the matchers have been fed (None: fed before it was made)
        self.advance_error: BaseException | None = None

    def wait_advanced(self) -> None:
        """Waits until the ``advance`` given to ``start_bitmask`` has run; re-raises what it raised."""
        if self.advanced is None:
            return
        started = time.perf_counter()
        self.advanced.wait()
        self._manager.mask_wait_seconds += time.perf_counter() - started
        if self.advance_error is not None:
            raise self.advance_error

    def result(self) -> GrammarBitmask:
        """The filled bitmask, after waiting for the worker; re-raises what the fill raised."""
        started = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._manager._finished(self, time.perf_counter() - started)
