"""`AsyncLLM`: the engine behind an asyncio server.

One background thread owns an LLMEngine (it is not thread-safe) and runs its loop: it applies queued
commands (add, abort, inspect), runs one ``step()`` while any request is unfinished, and hands every
step's outputs to the asyncio side in one batch per event loop. Requests added while the engine runs
join the batch at the next step. When there is nothing to do the thread blocks on its command queue.

Outputs come in each request's own output kind: a server streams DELTA outputs (only the new text and
token ids) and asks FINAL_ONLY for whole responses, so per-step work is proportional to the new tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from nanoinfer.frontend.output_processor import RequestStatsListener
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from nanoinfer.frontend.input_processor import PromptType
    from nanoinfer.frontend.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed or was shut down); no request can make progress."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its own fault); the engine goes on serving the others."""


class _Aborted:
    """Marks the end of an aborted request's stream."""


_ABORTED = _Aborted()


# -- commands from any thread to the engine thread -------------------------------------------------------


@dataclass
class _AddCommand:
    request_id: str
    prompt: Any
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future
    arrival_time: float


@dataclass
class _AbortCommand:
    request_id: str
    # When set, only this stream's request is aborted: a later request may reuse the id.
    stream: RequestStream | None


@dataclass
class _CallCommand:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future


class _StopCommand:
    pass


def merge_delta_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Several DELTA outputs of one request as one: per completion, the texts, token ids and logprobs
    concatenated; the latest of everything else."""
    merged: dict[int, CompletionOutput] = {}
    for output in outputs:
        for c in output.outputs:
            previous = merged.get(c.index)
            if previous is None:
                merged[c.index] = replace(c, token_ids=list(c.token_ids))
                continue
            logprobs = previous.logprobs
            if c.logprobs is not None:
                logprobs = (logprobs or []) + c.logprobs
            merged[c.index] = replace(
                c, text=previous.text + c.text, token_ids=previous.token_ids + c.token_ids, logprobs=logprobs
            )
    return replace(outputs[-1], outputs=[merged[i] for i in sorted(merged)])


class RequestStream:
    """The outputs of one request as an async iterator of RequestOutputs (in the request's output kind).

    DELTA outputs that pile up while the consumer is busy are merged into one (CUMULATIVE ones: the
    latest is kept). The iterator ends after the finished output; it raises the error if the request
    failed. Call :meth:`abort` when abandoning it.
    """

    def __init__(self, async_llm: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._async_llm = async_llm
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._kind = RequestOutputKind.CUMULATIVE
        self._last: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outputs: list[RequestOutput] = []
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item is _ABORTED:
                self.finished = True
                return self._aborted_output(outputs)
            if item.error is not None:
                self.finished = True
                raise RequestFailedError(f"request {self.request_id} failed: {item.error}")
            outputs.append(item)
        output = merge_delta_outputs(outputs) if self._kind == RequestOutputKind.DELTA else outputs[-1]
        self.finished = output.finished
        self._last = output
        return output

    def _aborted_output(self, outputs: list[RequestOutput]) -> RequestOutput:
        """The end of an aborted stream: what was queued before, with finish_reason "abort"."""
        if outputs:
            base = merge_delta_outputs(outputs) if self._kind == RequestOutputKind.DELTA else outputs[-1]
        elif self._last is not None:
            empty = [replace(c, text="", token_ids=[], logprobs=None) for c in self._last.outputs]
            base = replace(
                self._last, outputs=empty if self._kind == RequestOutputKind.DELTA else self._last.outputs
            )
        else:
            base = RequestOutput(self.request_id, None, [], [CompletionOutput(0, "", [])])
        completions = [replace(c, finish_reason=c.finish_reason or "abort") for c in base.outputs]
        return replace(base, outputs=completions, finished=True)

    def abort(self) -> None:
        """Stops the request and frees its KV blocks (soon, on the engine thread); no-op once finished."""
        if not self.finished:
            self.finished = True
            self._async_llm._abort(self.request_id, self)


class AsyncLLM:
    """An LLMEngine driven by one background thread, with an asyncio API.

    ``engine_factory`` is called on the engine thread, so thread-local torch state (grad mode, current
    CUDA device) set while building the engine holds while it runs. The constructor blocks until the
    engine is ready and re-raises the factory's exception if it fails.
    """

    def __init__(
        self, engine_factory: Callable[[], LLMEngine], stats_listener: RequestStatsListener | None = None
    ):
        self._stats_listener = stats_listener
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Guards _dead so that no command is queued after the engine thread drained the queue for good.
        self._lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._crashed = False
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._engine: LLMEngine | None = None
        self._last_stats: dict[str, int] = {}
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine_factory, ready), name="nanoinfer-engine", daemon=True
        )
        self._thread.start()
        ready.result()

    @classmethod
    def from_kwargs(
        cls, model: str, stats_listener: RequestStatsListener | None = None, **engine_kwargs: Any
    ) -> AsyncLLM:
        from nanoinfer.frontend.llm_engine import LLMEngine

        return cls(lambda: LLMEngine.from_kwargs(model, **engine_kwargs), stats_listener)

    @property
    def stats_listener(self) -> RequestStatsListener | None:
        return self._stats_listener

    @stats_listener.setter
    def stats_listener(self, listener: RequestStatsListener | None) -> None:
        """Timings of every request from now on (the engine's output processor reports them)."""
        self._stats_listener = listener
        self._engine.output_processor.stats_listener = listener

    @property
    def config(self):
        """The engine's EngineConfig (read-only after construction)."""
        return self._engine.config

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine loop stopped, or None while it runs."""
        return self._dead

    @property
    def crashed(self) -> bool:
        """The engine loop stopped by itself (an error no single request caused), not by shutdown()."""
        return self._crashed

    def on_engine_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` runs once, on the engine thread, when the loop crashes (not on shutdown)."""
        with self._lock:
            if self._dead is None:
                self._death_callbacks.append(callback)
                return
        if self._crashed:
            callback(self._dead)

    # -- public API ------------------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> RequestStream:
        """Queues a request and waits until the engine accepted it.

        Raises the engine's ValueError (bad prompt, duplicate id, prompt too long) with nothing
        allocated, or EngineDeadError. The caller must iterate the stream to its end or abort it.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        params = params if params is not None else SamplingParams()
        stream._kind = params.output_kind
        accepted = loop.create_future()
        self._submit(_AddCommand(request_id, prompt, params, stream, accepted, time.time()))
        try:
            await accepted
        except asyncio.CancelledError:
            # The add may still succeed on the engine thread; the abort queued behind it undoes it.
            stream.abort()
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    async def generate(
        self, prompt: PromptType, params: SamplingParams | None, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (in its output kind) after each step that advanced it.

        Closing the generator early aborts the request. A cancellation while it waits for output does
        that at once; after a ``break`` (or an exception in the loop body) it happens when asyncio
        finalizes the abandoned generator, unless the loop runs under ``contextlib.aclosing(...)``.
        """
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Removes the request wherever it is (waiting, running, mid-prefill) and frees its KV blocks.

        Thread-safe and non-blocking: the abort runs on the engine thread before its next step. The
        request's stream, if someone iterates it, ends with finish_reason "abort".
        """
        self._abort(request_id, None)

    async def get_stats(self) -> dict[str, int]:
        """``LLMEngine.stats()`` taken on the engine thread after every command queued before this call.

        After the engine stopped, returns the last stats it reported.
        """
        try:
            return await asyncio.wrap_future(self._submit_call(self._take_stats))
        except EngineDeadError:
            return dict(self._last_stats)

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """Blocking version of :meth:`get_stats` for other threads (never the engine thread itself)."""
        try:
            return self._submit_call(self._take_stats).result(timeout)
        except EngineDeadError:
            return dict(self._last_stats)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine thread: unfinished requests fail with EngineDeadError; the engine is closed."""
        with self._lock:
            if self._dead is None:
                self._commands.put(_StopCommand())
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- submitting commands ---------------------------------------------------------------------------

    def _submit(self, command: Any) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._commands.put(command)

    def _submit_call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_CallCommand(fn, future))
        return future

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine holds no requests
            self._submit(_AbortCommand(request_id, stream))

    # -- the engine thread -----------------------------------------------------------------------------

    def _take_stats(self, engine: LLMEngine) -> dict[str, int]:
        self._last_stats = engine.stats()  # what get_stats answers once the engine has stopped
        return dict(self._last_stats)

    def _run(self, engine_factory: Callable[[], LLMEngine], ready: concurrent.futures.Future) -> None:
        try:
            self._engine = engine_factory()
            self._engine.output_processor.stats_listener = self._stats_listener
            self._take_stats(self._engine)
        except BaseException as e:
            with self._lock:
                self._dead = EngineDeadError(f"the engine failed to start: {e!r}")
            ready.set_exception(e)
            return
        ready.set_result(None)
        engine = self._engine
        try:
            while self._apply_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
            error = EngineDeadError("the engine was shut down")
        except BaseException as e:
            logger.exception("the engine loop crashed")
            error = EngineDeadError(f"the engine loop crashed: {e!r}")
            error.__cause__ = e
            self._crashed = True
        self._stop(engine, error)
        if self._crashed:
            for callback in self._death_callbacks:
                try:
                    callback(error)
                except Exception:
                    logger.exception("an engine-death callback failed")

    def _apply_commands(self, block: bool) -> bool:
        """Runs every queued command (waiting for one if ``block``); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _StopCommand):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> None:
        engine = self._engine
        if isinstance(command, _AddCommand):
            try:
                engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
            except Exception as e:  # a bad request fails alone; the engine allocated nothing for it
                _resolve(command.accepted, error=e)
                return
            self._streams[command.request_id] = command.stream
            _resolve(command.accepted, value=None)
        elif isinstance(command, _AbortCommand):
            stream = self._streams.get(command.request_id)
            if stream is None or (command.stream is not None and stream is not command.stream):
                return
            del self._streams[command.request_id]
            engine.abort_request(command.request_id)
            _post(stream._loop, [(stream, _ABORTED)])
        elif isinstance(command, _CallCommand):
            try:
                result = command.fn(engine)
            except Exception as e:
                command.result.set_exception(e)
                return
            command.result.set_result(result)
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Sends each output to its stream: one hop to each event loop per step."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # not added through this AsyncLLM
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream._loop, []).append((stream, output))
        for loop, items in batches.items():
            _post(loop, items)

    def _stop(self, engine: LLMEngine, error: EngineDeadError) -> None:
        """Fails every unfinished request and every queued command with ``error``; closes the engine."""
        with self._lock:
            self._dead = error
        try:
            self._take_stats(engine)
        except Exception:
            logger.exception("engine.stats() failed while stopping")
        for stream in self._streams.values():
            _post(stream._loop, [(stream, error)])
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _AddCommand):
                _resolve(command.accepted, error=error)
            elif isinstance(command, _CallCommand):
                command.result.set_exception(error)
        try:
            engine.close()
        except Exception:
            logger.exception("engine.close() failed")


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Puts (stream, item) pairs into their streams' queues on ``loop``."""

    def put_all() -> None:
        for stream, item in items:
            stream._queue.put_nowait(item)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read these outputs
        loop.call_soon_threadsafe(put_all)


def _resolve(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if future.done():  # cancelled by a caller that stopped waiting
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
        future.get_loop().call_soon_threadsafe(settle)
