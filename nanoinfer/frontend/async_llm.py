"""`AsyncLLM`: the engine behind an asyncio server, run in one of two ways.

**On a thread of this process** (``AsyncLLM(engine_factory)``, ``from_kwargs(model)``): one background
thread owns an LLMEngine (it is not thread-safe) and runs its loop: it applies queued commands (add,
abort, inspect), runs one ``step()`` while any request is unfinished, and hands every step's outputs to
the asyncio side in one batch per event loop. Requests added while the engine runs join the batch at the
next step; text to tokenize and structured-outputs constraints to validate are processed on input
threads first, beside the engine's steps. When there is nothing to do the thread blocks on its command
queue.

**With the engine core in a process of its own** (``AsyncLLM.with_engine_process(config)``,
``from_kwargs(model, engine_process=True)``): this process keeps the frontend and the core's process
only runs the model, so the core's step loop never shares an interpreter (and its GIL) with HTTP, JSON
and text work. Requests are validated and tokenized here (token ids: on the caller's event loop; text
and structured-outputs constraints: on input threads, see _InputThreads) and sent to the core as
EngineRequests; aborts go as core request ids. Each core step's new token ids arrive in one batch on the
EngineCoreProcess's receiver thread, which turns them into RequestOutputs (detokenization, stop strings:
the output processor) and posts them to their streams, one hop per event loop. A stop string found here
aborts the core request. Nothing here waits for the engine: sends never block, and a slow consumer only
lets its own stream's outputs pile up (they are merged, see RequestStream). One lock guards the output
processor and the table of streams, which the event loops (add, abort) and the receiver thread (outputs)
share. Every add gets a core id of its own (the user's id and a counter), so that outputs of an aborted
request still on their way can never be credited to a later request that reuses its id. If the engine
process dies, every unfinished request fails at once with EngineDeadError and the death callbacks run.

Outputs come in each request's own output kind: a server streams DELTA outputs (only the new text and
token ids) and asks FINAL_ONLY for whole responses, so per-step work is proportional to the new tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from nanoinfer.frontend.core_client import EngineCoreDeadError, EngineCoreProcess
from nanoinfer.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType, completion_seed
from nanoinfer.frontend.output_processor import OutputProcessor, RequestStatsListener
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine import wire
    from nanoinfer.engine.core import EngineCore
    from nanoinfer.frontend.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it crashed or was shut down); no request can make progress."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its own fault); the engine goes on serving the others."""


class InvalidRequestError(RequestFailedError):
    """One request failed inside the engine because of its input (``RequestOutput.invalid_input``)."""


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
    # Already tokenized and validated on the input thread (then ``prompt`` and ``params`` are not read).
    processed: ProcessedRequest | None = None


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
        # What arrived and was not yet taken, and the future the consumer waits on while it is empty: a
        # deque and one future, cheaper than an asyncio.Queue at one put and one get per step.
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._kind = RequestOutputKind.CUMULATIVE
        self._last: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    def _put(self, item: Any) -> None:
        """Queues an output, an error or the abort marker; runs on the stream's event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
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
                error = InvalidRequestError if item.invalid_input else RequestFailedError
                raise error(f"request {self.request_id} failed: {item.error}")
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
        """Stops the request and frees its KV blocks (soon, in the engine); no-op once finished."""
        if not self.finished:
            self.finished = True
            self._async_llm._abort(self.request_id, self)


class AsyncLLM:
    """An engine with an asyncio API: an LLMEngine on a background thread of this process, or (see
    :meth:`with_engine_process`) an engine core in a process of its own. Both behave the same to callers.

    ``engine_factory`` is called on the engine thread, so thread-local torch state (grad mode, current
    CUDA device) set while building the engine holds while it runs. The constructor blocks until the
    engine is ready and re-raises the factory's exception if it fails.
    """

    def __init__(
        self, engine_factory: Callable[[], LLMEngine], stats_listener: RequestStatsListener | None = None
    ):
        self._driver: _EngineThread | _EngineProcess = _EngineThread(engine_factory, stats_listener)

    @classmethod
    def with_engine_process(
        cls,
        config: EngineConfig,
        stats_listener: RequestStatsListener | None = None,
        *,
        ready_timeout: float = 600.0,
        core_factory: Callable[[EngineConfig], EngineCore] | None = None,
    ) -> AsyncLLM:
        """An AsyncLLM whose engine core runs in a spawned process (see the module's docstring); this
        process loads the tokenizer and keeps the input and output processing. Blocks until the core is
        ready; raises RuntimeError (with the engine process's traceback) if it fails to start, or
        TimeoutError after ``ready_timeout`` seconds. ``core_factory`` builds the core in the engine
        process (a picklable callable; tests only)."""
        llm = cls.__new__(cls)
        llm._driver = _EngineProcess(config, stats_listener, ready_timeout, core_factory)
        return llm

    @classmethod
    def from_kwargs(
        cls,
        model: str,
        stats_listener: RequestStatsListener | None = None,
        *,
        engine_process: bool = False,
        **engine_kwargs: Any,
    ) -> AsyncLLM:
        """``engine_process``: run the engine core in a process of its own (:meth:`with_engine_process`)
        rather than on a thread of this one."""
        from nanoinfer.config import EngineConfig

        if engine_process:
            return cls.with_engine_process(EngineConfig.from_kwargs(model, **engine_kwargs), stats_listener)
        from nanoinfer.frontend.llm_engine import LLMEngine

        def engine() -> LLMEngine:
            config = EngineConfig.from_kwargs(model, **engine_kwargs)
            return LLMEngine(config, start_grammar_processes=True)

        return cls(engine, stats_listener)

    @property
    def stats_listener(self) -> RequestStatsListener | None:
        return self._driver.stats_listener

    @stats_listener.setter
    def stats_listener(self, listener: RequestStatsListener | None) -> None:
        """Timings of every request from now on (the output processor reports them)."""
        self._driver.set_stats_listener(listener)

    @property
    def config(self) -> EngineConfig:
        """The engine's EngineConfig (read-only after construction)."""
        return self._driver.config

    @property
    def engine_pid(self) -> int | None:
        """The engine core's process id, or None when the engine runs on a thread of this process."""
        return self._driver.engine_pid

    @property
    def is_healthy(self) -> bool:
        return self._driver.dead is None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine stopped, or None while it runs."""
        return self._driver.dead

    @property
    def crashed(self) -> bool:
        """The engine stopped by itself (an error no single request caused, or its process died), not by
        shutdown()."""
        return self._driver.crashed

    def on_engine_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` runs once when the engine crashes (not on shutdown): on the engine thread,
        or on the engine process's receiver thread. Registered after a crash, it runs at once."""
        self._driver.on_dead(callback)

    # -- public API ------------------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> RequestStream:
        """Validates and queues a request: once this returns, the engine has it (on a thread: it accepted
        it; in a process: it was sent, and the core takes it before its next step).

        Raises ValueError (bad prompt, duplicate id, prompt too long) with nothing allocated, or
        EngineDeadError. The caller must iterate the stream to its end or abort it.
        """
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        params = params if params is not None else SamplingParams()
        stream._kind = params.output_kind
        await self._driver.add(request_id, prompt, params, stream)
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

        Thread-safe and non-blocking: the engine drops it before its next step. The request's stream, if
        someone iterates it, ends with finish_reason "abort".
        """
        self._abort(request_id, None)

    async def get_stats(self) -> dict[str, int]:
        """``EngineCore.stats()`` taken by the engine after everything queued before this call.

        After the engine stopped, returns the last stats it reported.
        """
        try:
            return await asyncio.wrap_future(self._driver.stats_future())
        except EngineDeadError:
            return dict(self._driver.last_stats)

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        """Blocking version of :meth:`get_stats` for other threads (never the engine's own threads)."""
        try:
            return self._driver.stats_future().result(timeout)
        except EngineDeadError:
            return dict(self._driver.last_stats)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the engine (its thread, or its process): unfinished requests fail with EngineDeadError
        and the engine is closed. Waits up to ``timeout`` seconds (then an engine process is killed).
        Idempotent."""
        self._driver.shutdown(timeout)

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        self._driver.abort(request_id, stream)


class _Driver:
    """What both ways of running the engine share: whether it stopped and why, and the crash callbacks."""

    def __init__(self, stats_listener: RequestStatsListener | None):
        self.stats_listener = stats_listener
        self.lock = threading.Lock()
        self.dead: EngineDeadError | None = None
        self.crashed = False
        self.last_stats: dict[str, int] = {}  # what get_stats answers once the engine has stopped
        self._death_callbacks: list[Callable[[EngineDeadError], None]] = []
        self.input_threads = _InputThreads()

    async def _process_on(
        self, input_thread: concurrent.futures.Executor, stream: RequestStream, process: Callable, *args: Any
    ) -> ProcessedRequest:
        """``process(*args)`` on ``input_thread``, awaited on the stream's event loop; the engine's death
        where it has died (its input threads are shut down then)."""
        if self.dead is not None:
            raise self.dead
        try:
            return await stream._loop.run_in_executor(input_thread, process, *args)
        except RuntimeError:  # the input thread is gone: shut down since the check above
            if self.dead is not None:
                raise self.dead from None
            raise

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        with self.lock:
            if self.dead is None:
                self._death_callbacks.append(callback)
                return
        if self.crashed:
            callback(self.dead)

    def _run_death_callbacks(self, error: EngineDeadError) -> None:
        for callback in self._death_callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("an engine-death callback failed")


class _EngineThread(_Driver):
    """An LLMEngine owned by one background thread, driven by commands from any thread."""

    engine_pid = None

    def __init__(self, engine_factory: Callable[[], LLMEngine], stats_listener: RequestStatsListener | None):
        super().__init__(stats_listener)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # self.lock also guards self.dead so that no command is queued after the engine thread drained
        # the queue for good.
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._engine: LLMEngine | None = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = threading.Thread(
            target=self._run, args=(engine_factory, ready), name="nanoinfer-engine", daemon=True
        )
        self.thread.start()
        ready.result()

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    def set_stats_listener(self, listener: RequestStatsListener | None) -> None:
        self.stats_listener = listener
        self._engine.output_processor.stats_listener = listener

    async def add(self, request_id: str, prompt: Any, params: SamplingParams, stream: RequestStream) -> None:
        arrival_time = time.time()
        processed = None
        input_thread = self.input_threads.for_request(prompt, params)
        if input_thread is not None:
            # Beside the engine's steps rather than between them.
            process = self._engine.input_processor.process
            try:
                processed = await self._process_on(
                    input_thread, stream, process, request_id, prompt, params, arrival_time
                )
            except BaseException:
                stream.finished = True
                raise
        accepted = stream._loop.create_future()
        self._submit(_AddCommand(request_id, prompt, params, stream, accepted, arrival_time, processed))
        try:
            await accepted
        except asyncio.CancelledError:
            # The add may still succeed on the engine thread; the abort queued behind it undoes it.
            stream.abort()
            raise
        except BaseException:
            stream.finished = True
            raise

    def abort(self, request_id: str, stream: RequestStream | None) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine holds no requests
            self._submit(_AbortCommand(request_id, stream))

    def stats_future(self) -> concurrent.futures.Future:
        """Raises EngineDeadError once the engine stopped; the future fails with it if it stops first."""
        return self.submit_call(self._take_stats)

    def shutdown(self, timeout: float | None) -> None:
        with self.lock:
            if self.dead is None:
                self._commands.put(_StopCommand())
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    # -- submitting commands ---------------------------------------------------------------------------

    def _submit(self, command: Any) -> None:
        with self.lock:
            if self.dead is not None:
                raise self.dead
            self._commands.put(command)

    def submit_call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Runs ``fn(engine)`` on the engine thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_CallCommand(fn, future))
        return future

    # -- the engine thread -----------------------------------------------------------------------------

    def _take_stats(self, engine: LLMEngine) -> dict[str, int]:
        self.last_stats = engine.stats()
        return dict(self.last_stats)

    def _run(self, engine_factory: Callable[[], LLMEngine], ready: concurrent.futures.Future) -> None:
        try:
            self._engine = engine_factory()
            self._engine.output_processor.stats_listener = self.stats_listener
            self._take_stats(self._engine)
        except BaseException as e:
            with self.lock:
                self.dead = EngineDeadError(f"the engine failed to start: {e!r}")
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
            self.crashed = True
        self._stop(engine, error)

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
                if command.processed is not None:
                    engine.add_processed_request(command.processed)
                else:
                    engine.add_request(
                        command.request_id, command.prompt, command.params, command.arrival_time
                    )
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
        _deliver_outputs(self._streams, outputs)

    def _stop(self, engine: LLMEngine, error: EngineDeadError) -> None:
        """Fails every unfinished request and every queued command with ``error``; closes the engine.
        After a crash the death callbacks run first: whoever sees the error has them behind it."""
        with self.lock:
            self.dead = error
        if self.crashed:
            self._run_death_callbacks(error)
        try:
            self._take_stats(engine)
        except Exception:
            logger.exception("engine.stats() failed while stopping")
        _fail_streams(list(self._streams.values()), error)
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
        self.input_threads.shutdown()
        try:
            engine.close()
        except Exception:
            logger.exception("engine.close() failed")


class _EngineProcess(_Driver):
    """An engine core in a process of its own (EngineCoreProcess), with the input and output processing
    in this one."""

    def __init__(
        self,
        config: EngineConfig,
        stats_listener: RequestStatsListener | None,
        ready_timeout: float,
        core_factory: Callable[[EngineConfig], EngineCore] | None,
    ):
        from nanoinfer.models.checkpoint import load_tokenizer

        super().__init__(stats_listener)
        self.config = config
        # A tokenizer each for tokenizing (event loops, the input thread) and detokenizing (the receiver
        # thread): a fast tokenizer object is not safe for concurrent calls.
        input_tokenizer = load_tokenizer(config.model, config.tokenizer, config.chat_template_text)
        output_tokenizer = load_tokenizer(config.model, config.tokenizer)
        # self.lock guards the output processor, self._streams and the sending of adds and aborts (so that
        # an abort never overtakes its add), as well as self.dead.
        self._output_processor = OutputProcessor(output_tokenizer, stats_listener)
        self._streams: dict[str, RequestStream] = {}  # by the user's request id
        self._core_ids = itertools.count()
        self._client = EngineCoreProcess(
            config, self._on_outputs, self._on_dead, ready_timeout=ready_timeout, core_factory=core_factory
        )
        self.engine_pid = self._client.pid
        self.last_stats = dict(self._client.ready.stats)
        self._input_processor = InputProcessor(config, input_tokenizer, self._client.num_kv_blocks)
        logger.info("the engine core runs in process %d", self.engine_pid)

    def set_stats_listener(self, listener: RequestStatsListener | None) -> None:
        with self.lock:
            self.stats_listener = listener
            self._output_processor.stats_listener = listener

    async def add(self, request_id: str, prompt: Any, params: SamplingParams, stream: RequestStream) -> None:
        try:
            await self._add(request_id, prompt, params, stream)
        except BaseException:
            stream.finished = True
            raise

    async def _add(self, request_id: str, prompt: Any, params: SamplingParams, stream: RequestStream) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.dead is not None:
            raise self.dead
        process = self._input_processor.process
        args = (f"{request_id}@{next(self._core_ids)}", prompt, params, time.time())
        input_thread = self.input_threads.for_request(prompt, params)
        if input_thread is not None:
            request = await self._process_on(input_thread, stream, process, *args)
        else:
            request = process(*args)
        # The user's id for the outputs; the children (the core's requests) keep the unique one.
        request.request_id = request_id
        for child in request.children:
            child.params = _sendable(child.params)
        with self.lock:
            if self.dead is not None:
                raise self.dead
            self._output_processor.add_request(request)  # raises ValueError for an id in use
            try:
                self._client.add_requests(request.children)
            except BaseException as e:
                self._output_processor.abort_request(request_id)
                if isinstance(e, EngineCoreDeadError):
                    raise EngineDeadError(f"the engine process stopped: {_summary(str(e))}") from e
                raise
            self._streams[request_id] = stream

    def abort(self, request_id: str, stream: RequestStream | None) -> None:
        with self.lock:
            current = self._streams.get(request_id)
            if current is None or (stream is not None and current is not stream):
                return
            del self._streams[request_id]
            core_ids = self._output_processor.abort_request(request_id)
            with contextlib.suppress(EngineCoreDeadError):  # a dead engine holds no requests
                self._client.abort_requests(core_ids)
            _post(current._loop, [(current, _ABORTED)])

    def stats_future(self) -> concurrent.futures.Future:
        """Raises EngineDeadError once the engine stopped; the future fails with it if it stops first."""
        if self.dead is not None:
            raise self.dead
        try:
            call = self._client.call_future("stats")
        except EngineCoreDeadError as e:
            raise EngineDeadError(str(e)) from None
        stats: concurrent.futures.Future = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future) -> None:
            error = done.exception()
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its caller
                if error is None:
                    self.last_stats = done.result()
                    stats.set_result(dict(self.last_stats))
                elif isinstance(error, EngineCoreDeadError):
                    stats.set_exception(EngineDeadError(str(error)))
                else:
                    stats.set_exception(error)

        call.add_done_callback(settle)
        return stats

    def shutdown(self, timeout: float | None) -> None:
        error = EngineDeadError("the engine was shut down")
        with self.lock:
            first = self.dead is None
            if first:
                self.dead = error
                streams, self._streams = list(self._streams.values()), {}
        if first:
            _fail_streams(streams, error)
            # A prompt being tokenized meanwhile finishes; its add then fails with the error.
            self.input_threads.shutdown()
        self._client.shutdown(timeout)

    # -- the receiver thread ---------------------------------------------------------------------------

    def _on_outputs(self, batch: wire.Outputs) -> None:
        with self.lock:
            outputs, ended = self._output_processor.process_outputs(batch.outputs)
            if ended:  # stop strings (or failures) the output processor found: the core drops them
                with contextlib.suppress(EngineCoreDeadError):
                    self._client.abort_requests(ended)
            # Posted under the lock, so that an abort's end marker never overtakes these outputs.
            _deliver_outputs(self._streams, outputs)

    def _on_dead(self, text: str) -> None:
        error = EngineDeadError(f"the engine process stopped: {_summary(text)}")
        with self.lock:
            if self.dead is not None:
                return
            self.dead = error
            self.crashed = True
            streams, self._streams = list(self._streams.values()), {}
        logger.error("%s", error)
        # The callbacks first: whoever sees the error has them behind it.
        self._run_death_callbacks(error)
        _fail_streams(streams, error)


class _InputThreads:
    """Where requests are processed off the callers' event loops (and, with the engine on a thread,
    beside its steps): text to tokenize on one thread, structured-outputs constraints to validate (a
    compile: milliseconds, and seconds for the first, which builds the grammar compiler) on another, so
    that a constraint never holds up another request's tokenization."""

    def __init__(self) -> None:
        self._text = concurrent.futures.ThreadPoolExecutor(1, "nanoinfer-input")
        self._constraints = concurrent.futures.ThreadPoolExecutor(1, "nanoinfer-constraints")

    def for_request(self, prompt: Any, params: Any) -> concurrent.futures.Executor | None:
        """The thread that processes this request; None for one that needs neither (token ids)."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            return self._constraints
        return self._text if _needs_tokenizing(prompt) else None

    def shutdown(self) -> None:
        self._text.shutdown(wait=False)
        self._constraints.shutdown(wait=False)


def _needs_tokenizing(prompt: Any) -> bool:
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str)
    return isinstance(prompt, str)


def _sendable(params: SamplingParams) -> SamplingParams:
    """The params with a seed that msgpack can carry (64 bits). A seed may be any integer, but the core
    only asks whether there is one: each EngineRequest carries its completion's own seed, which the input
    processor derived from the seed's 64 bits, the ones kept here."""
    if params.seed is None or -(1 << 63) <= params.seed < 1 << 63:
        return params
    return replace(params, seed=completion_seed(params.seed, 0))


def _summary(text: str) -> str:
    """A one-line account of the engine process's end: its first and last lines (for a traceback, what
    failed and the exception), the whole of which the log already has."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return text.strip()
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


def _deliver_outputs(streams: dict[str, RequestStream], outputs: list[RequestOutput]) -> None:
    """Sends each output to its request's stream (dropping the stream once it is finished): one hop to
    each event loop per step. Outputs of requests not in ``streams`` (not added through this AsyncLLM, or
    already ended) are dropped."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    for output in outputs:
        stream = streams.get(output.request_id)
        if stream is None:
            continue
        if output.finished:
            del streams[output.request_id]
        batches.setdefault(stream._loop, []).append((stream, output))
    for loop, items in batches.items():
        _post(loop, items)


def _fail_streams(streams: list[RequestStream], error: BaseException) -> None:
    """Ends each stream with ``error``: one hop to each event loop."""
    batches: dict[asyncio.AbstractEventLoop, list] = {}
    for stream in streams:
        batches.setdefault(stream._loop, []).append((stream, error))
    for loop, items in batches.items():
        _post(loop, items)


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Puts (stream, item) pairs into their streams' queues on ``loop``."""

    def put_all() -> None:
        for stream, item in items:
            stream._put(item)

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
