"""The API process's side of an engine core that runs in a process of its own.

:class:`EngineCoreProcess` spawns :func:`nanoinfer.engine.core_process.run_engine_core`, binds the two
ZeroMQ sockets (ipc:// files in a temporary directory of its own) and waits until the core is ready.
Requests, aborts and utility calls go out on a PUSH socket: a send never waits for the engine, which
drains the socket between steps. One background thread (the receiver) reads the engine's messages: it
hands each step's outputs to ``on_outputs``, answers utility calls, and notices the process's end at
once (it waits on the process's sentinel as well as the socket), after which ``on_dead`` runs once.

Threads: every public method may be called from any thread. ``on_outputs`` and ``on_dead`` run on the
receiver thread, one at a time, in the order the engine sent its messages; a callback must not block for
long (every later output waits for it) and must not join the receiver (``shutdown()`` from a callback is
fine: it does not wait for the thread it runs on).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from nanoinfer.config import EngineConfig
from nanoinfer.engine import wire
from nanoinfer.engine.core import EngineCore
from nanoinfer.engine.core_process import run_engine_core
from nanoinfer.engine.request import EngineRequest

logger = logging.getLogger(__name__)

# After a FatalError the engine process exits by itself; if it has not after this long, it is killed.
FATAL_EXIT_TIMEOUT_S = 10.0
# After the process ended: how long the receiver waits for its last messages once none is arriving.
FINAL_MESSAGES_QUIET_S = 0.1
# sockaddr_un holds 108 bytes: longer ipc:// paths cannot be bound.
_MAX_SOCKET_PATH = 100


class EngineCoreDeadError(RuntimeError):
    """The engine process has stopped (crashed, was killed, or was shut down): nothing more can be sent."""


class EngineCoreProcess:
    """An engine core in a spawned process, and the sockets to it.

    Blocks until the core is ready: raises RuntimeError with the engine's traceback if it failed to
    start (or with its exit status if it died without one), TimeoutError after ``ready_timeout``
    seconds; either way nothing is left behind. ``on_outputs(batch)`` receives every
    :class:`~nanoinfer.engine.wire.Outputs` batch; ``on_dead(text)`` is called once if the process ends
    without :meth:`shutdown` (a fatal error: its traceback; otherwise its exit status).
    ``core_factory`` builds the core in the engine process (a picklable callable; tests only).
    """

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[wire.Outputs], None],
        on_dead: Callable[[str], None],
        *,
        ready_timeout: float = 600.0,
        core_factory: Callable[[EngineConfig], EngineCore] | None = None,
    ):
        self.config = config
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._send_lock = threading.Lock()  # the input socket (ZeroMQ sockets are not thread-safe)
        self._state_lock = threading.Lock()  # _error, _calls, _shutdown_requested
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._error: str | None = None
        self._fatal_text: str | None = None
        self._shutdown_requested = False
        self.directory = _make_socket_directory()
        input_address = f"ipc://{self.directory}/input"
        output_address = f"ipc://{self.directory}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._output = self._context.socket(zmq.PULL)
        self._process = None
        self._receiver: threading.Thread | None = None
        try:
            # No high-water marks on this side: the engine drains its input every loop, and this
            # process's ZeroMQ I/O thread takes the engine's outputs even while Python threads are busy.
            self._input.setsockopt(zmq.SNDHWM, 0)
            self._input.setsockopt(zmq.LINGER, 0)
            self._input.bind(input_address)
            self._output.setsockopt(zmq.RCVHWM, 0)
            self._output.bind(output_address)
            extra = (core_factory,) if core_factory is not None else ()
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core,
                args=(config, input_address, output_address, os.getpid(), *extra),
                name="nanoinfer-engine-core",
                # Not a daemon: the engine process starts processes of its own (tensor-parallel workers),
                # which multiprocessing forbids daemons. An exit hook stops it instead.
                daemon=False,
            )
            self._process.start()
            # Registered after multiprocessing's exit hook (imported by start()), so it runs first: that
            # hook would wait forever for a non-daemon process that is still serving.
            atexit.register(self._stop_at_exit)
            self.ready = self._wait_ready(ready_timeout)
        except BaseException:
            self._release()
            raise
        self.num_kv_blocks = self.ready.num_kv_blocks
        self._receiver = threading.Thread(target=self._receive, name="nanoinfer-core-client", daemon=True)
        self._receiver.start()

    # -- state -----------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def is_alive(self) -> bool:
        """False once the process has ended (or sent a fatal error), or shutdown() was called."""
        return self._error is None and not self._shutdown_requested

    @property
    def error(self) -> str | None:
        """Why the engine process stopped, or None while it runs."""
        return self._error

    # -- requests --------------------------------------------------------------------------------------

    def add_requests(self, requests: list[EngineRequest]) -> None:
        """Sends requests to the core (in order, after everything sent before). A request the core rejects
        comes back as an error output (finish_reason "error") in a later batch. Raises
        EngineCoreDeadError once the process has stopped."""
        if requests:
            self._send(wire.AddRequests(list(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drops the core requests; outputs of theirs already sent may still arrive. Raises
        EngineCoreDeadError once the process has stopped."""
        if request_ids:
            self._send(wire.AbortRequests(list(request_ids)))

    def call_future(self, name: str, *args: Any) -> concurrent.futures.Future:
        """Runs utility ``name`` (one of wire.UTILITY_METHODS) in the engine process, after everything sent
        before. The future fails with RuntimeError if the call raised there, and with EngineCoreDeadError
        if the process stops first."""
        if name not in wire.UTILITY_METHODS:
            raise ValueError(f"name must be one of {wire.UTILITY_METHODS}, got {name!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._state_lock:
            if self._error is not None:
                raise EngineCoreDeadError(self._error)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        future.call_id = call_id
        try:
            self._send(wire.UtilityCall(call_id, name, list(args)))
        except BaseException:
            with self._state_lock:
                self._calls.pop(call_id, None)
            raise
        return future

    def call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """:meth:`call_future`, waited for: raises TimeoutError after ``timeout`` seconds."""
        future = self.call_future(name, *args)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            with self._state_lock:
                self._calls.pop(future.call_id, None)
            raise TimeoutError(f"the engine did not answer {name!r} within {timeout} s") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the engine process to stop (it closes the core and exits), waits up to ``timeout`` seconds,
        then sends SIGTERM, then SIGKILL. Pending calls fail with EngineCoreDeadError; on_dead is not
        called. Removes the sockets' directory. Idempotent."""
        with self._state_lock:
            first = not self._shutdown_requested
            self._shutdown_requested = True
        if first:
            with contextlib.suppress(EngineCoreDeadError):  # already gone
                self._send(wire.Shutdown())
        # Only the receiver thread reaps the process (two threads waiting on one pid race); this waits
        # on its sentinel.
        sentinel = self._process.sentinel
        for stop in (None, self._process.terminate, self._process.kill):
            if stop is not None:
                logger.warning("the engine process did not stop in time: %s", stop.__name__)
                stop()
            if multiprocessing.connection.wait([sentinel], timeout if stop is None else 5.0):
                break
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)

    # -- sending ---------------------------------------------------------------------------------------

    def _send(self, message: wire.EngineInput) -> None:
        data = wire.encode(message)
        with self._send_lock:
            if self._error is not None:
                raise EngineCoreDeadError(self._error)
            try:
                self._input.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no engine connected: it is gone, and the receiver will report it
                raise EngineCoreDeadError("the engine process is not connected") from None

    # -- starting --------------------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> wire.Ready:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._process.sentinel, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the engine process was not ready within {timeout} s")
            events = dict(poller.poll(remaining * 1000))
            if self._output in events:
                message = wire.decode_output(self._output.recv())
                if isinstance(message, wire.Ready):
                    return message
                if isinstance(message, wire.FatalError):
                    self._process.join(FATAL_EXIT_TIMEOUT_S)
                    raise RuntimeError(f"the engine process failed to start: {message.text}")
                raise RuntimeError(f"the engine process sent {type(message).__name__} before it was ready")
            if self._process.sentinel in events and not self._output.poll(1000):
                # It ended, and no last message (a FatalError) is on its way.
                self._process.join(1.0)
                raise RuntimeError(f"the engine process failed to start: {self._exit_text()}")

    # -- the receiver thread ---------------------------------------------------------------------------

    def _receive(self) -> None:
        sentinel = self._process.sentinel
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(sentinel, zmq.POLLIN)
        kill_at = None  # after a FatalError: when to kill a process that has not exited
        try:
            while True:
                timeout_ms = None if kill_at is None else max(kill_at - time.monotonic(), 0) * 1000
                events = dict(poller.poll(timeout_ms))
                if self._output in events and self._drain() and kill_at is None:
                    kill_at = time.monotonic() + FATAL_EXIT_TIMEOUT_S
                if sentinel in events:
                    while self._output.poll(FINAL_MESSAGES_QUIET_S * 1000):
                        self._drain()
                    break
                if kill_at is not None and time.monotonic() >= kill_at:
                    logger.error("the engine process did not exit after its fatal error: killing it")
                    self._process.kill()
                    kill_at = None
        except Exception:
            logger.exception("reading the engine process's messages failed: stopping it")
            self._fatal_text = self._fatal_text or "the engine process's messages could not be read"
            self._process.kill()
        self._process.join()
        self._report_dead(self._exit_text())
        self._release()

    def _drain(self) -> bool:
        """Handles every message waiting; True if one was a FatalError."""
        fatal = False
        while True:
            try:
                data = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return fatal
            message = wire.decode_output(data.buffer)
            if isinstance(message, wire.Outputs):
                try:
                    self._on_outputs(message)
                except Exception:
                    logger.exception("on_outputs failed")
            elif isinstance(message, wire.UtilityResult):
                self._resolve(message)
            elif isinstance(message, wire.FatalError):
                logger.error("the engine process failed:\n%s", message.text)
                self._fatal_text = message.text
                self._report_dead(message.text)
                fatal = True
            else:
                logger.warning("ignoring an unexpected %s from the engine process", type(message).__name__)

    def _resolve(self, result: wire.UtilityResult) -> None:
        with self._state_lock:
            future = self._calls.pop(result.call_id, None)
        if future is None:  # its caller stopped waiting
            return
        # A caller may have cancelled the future (asyncio.wrap_future does when its awaiter is cancelled).
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if result.error is not None:
                future.set_exception(RuntimeError(f"the engine's utility call failed: {result.error}"))
            else:
                future.set_result(result.value)

    def _report_dead(self, text: str) -> None:
        """Once: marks the engine dead, fails the pending calls, and (unless shut down) calls on_dead."""
        with self._state_lock:
            if self._error is not None:
                return
            self._error = text
            calls, self._calls = list(self._calls.values()), {}
            crashed = not self._shutdown_requested
        for future in calls:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled by its caller
                future.set_exception(EngineCoreDeadError(text))
        if crashed:
            try:
                self._on_dead(text)
            except Exception:
                logger.exception("on_dead failed")

    def _exit_text(self) -> str:
        if self._fatal_text is not None:
            return self._fatal_text
        code = self._process.exitcode
        if self._shutdown_requested and code == 0:
            return "the engine process was shut down"
        if code is None:
            return f"the engine process (pid {self._process.pid}) is not responding"
        if code < 0:
            return f"the engine process (pid {self._process.pid}) was killed by {signal.Signals(-code).name}"
        return f"the engine process (pid {self._process.pid}) exited with status {code}"

    def _stop_at_exit(self) -> None:
        if self._receiver is not None:
            self.shutdown(timeout=5.0)

    def _release(self) -> None:
        """Closes the sockets, stops the process if it still runs (a failed start: SIGTERM, which ends a
        core still being built at once, then SIGKILL) and removes the sockets' directory."""
        atexit.unregister(self._stop_at_exit)
        with self._send_lock:
            self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        process = self._process
        if process is not None and process.pid is not None and process.exitcode is None:
            process.terminate()
            process.join(5.0)
            if process.exitcode is None:
                process.kill()
                process.join()
        shutil.rmtree(self.directory, ignore_errors=True)


def _make_socket_directory() -> str:
    directory = tempfile.mkdtemp(prefix="nanoinfer-")
    if len(directory) + len("/output") > _MAX_SOCKET_PATH:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="nanoinfer-", dir="/tmp")
    return directory
