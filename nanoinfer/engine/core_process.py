"""The engine-core process: an EngineCore driven by messages from the API-server process.

:func:`run_engine_core` is the target of the process that the API side
(:class:`nanoinfer.frontend.core_client.EngineCoreProcess`) spawns. It builds the core, reports
:class:`~nanoinfer.engine.wire.Ready`, and loops: it takes every message waiting on its input socket,
runs one step while any request is unfinished, and sends the step's outputs. With nothing to do it waits
for input at most IDLE_POLL_S, so that it notices when its parent is gone.

The loop never waits for the API process: outputs go out on a PUSH socket without blocking, and a batch
that cannot be sent at once is kept, in order, and sent on a later iteration.

How it ends: a Shutdown message or SIGTERM closes the core and exits with status 0 (SIGTERM while the
core is being built ends the process at once); the parent's death does the same within IDLE_POLL_S (or
one step) and also removes the parent's socket files; a failure of the core that no single request
caused sends a FatalError with the traceback and exits with status 1.
SIGINT is ignored: Ctrl-C reaches the whole process group, and the API process decides how to stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from nanoinfer.config import EngineConfig
from nanoinfer.engine import wire
from nanoinfer.engine.core import EngineCore
from nanoinfer.engine.scheduler import EngineCoreOutput
from nanoinfer.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1
# Messages ZeroMQ queues on the output socket before a send would block; past this, batches wait in
# the loop's own queue. The API process's ZeroMQ I/O thread drains the socket whatever its Python
# threads are doing, so this fills only if that process is stopped.
OUTPUT_HIGH_WATER_MARK = 10_000
# How long the last messages (the final outputs, a FatalError) may take to leave when the process ends.
FINAL_SEND_TIMEOUT_S = 2.0

# The implementations of wire.UTILITY_METHODS.
_UTILITIES: dict[str, Callable[..., Any]] = {
    "ping": lambda core, *args: list(args),
    "stats": lambda core: core.stats(),
    "has_unfinished_requests": lambda core: core.has_unfinished_requests(),
}


def serving_core(config: EngineConfig) -> EngineCore:
    """The engine process's core: it serves requests as they come, so its grammar processes start with it."""
    return EngineCore(config, start_grammar_processes=True)


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    core_factory: Callable[[EngineConfig], EngineCore] = serving_core,
) -> None:
    """Runs an engine core until shut down. ``input_address`` and ``output_address`` are the ZeroMQ
    endpoints the parent bound (PUSH to this process, PULL from it); ``parent_pid`` is the process whose
    death ends this one. ``core_factory`` builds the core (tests substitute a failing one).

    Raises SystemExit(1) after a fatal error (the core failed to start or a step failed); returns (exit
    status 0) otherwise."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    process = _EngineCoreProc(input_address, output_address, parent_pid)
    failed = False
    try:
        failed = not process.run(config, core_factory)
    finally:
        process.close()
    if failed:
        raise SystemExit(1)


class _EngineCoreProc:
    def __init__(self, input_address: str, output_address: str, parent_pid: int):
        self.parent_pid = parent_pid
        self.socket_paths = [
            a.removeprefix("ipc://") for a in (input_address, output_address) if a.startswith("ipc://")
        ]
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.connect(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, OUTPUT_HIGH_WATER_MARK)
        self.output.connect(output_address)
        self.backlog: deque[bytes] = deque()  # encoded messages a send would have blocked on, in order
        self.core: EngineCore | None = None
        self.terminated = False  # SIGTERM arrived

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminated = True

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    # -- life cycle ------------------------------------------------------------------------------------

    def run(self, config: EngineConfig, core_factory: Callable[[EngineConfig], EngineCore]) -> bool:
        """Builds the core and runs the loop; False after a fatal error (already reported)."""
        if not self._build_core(config, core_factory):
            return False
        # Until now SIGTERM ended the process at once (there was nothing to close); from now on it ends
        # the loop, which closes the core.
        signal.signal(signal.SIGTERM, self.on_sigterm)
        freeze_startup_heap()
        self.send(wire.Ready(self.core.num_kv_blocks, os.getpid(), self.core.stats()))
        try:
            self._loop()
        except Exception:
            logger.exception("the engine core failed")
            self.send(wire.FatalError(f"the engine core failed:\n{traceback.format_exc()}"))
            return False
        return True

    def _build_core(self, config: EngineConfig, core_factory: Callable[[EngineConfig], EngineCore]) -> bool:
        # Building the core (loading weights, capturing graphs) can take minutes; a watcher ends the
        # process meanwhile if its parent dies, as the loop does afterwards.
        built = threading.Event()
        watcher = threading.Thread(target=self._watch_parent, args=(built,), daemon=True)
        watcher.start()
        try:
            self.core = core_factory(config)
        except Exception:
            logger.exception("the engine core failed to start")
            self.send(wire.FatalError(f"the engine core failed to start:\n{traceback.format_exc()}"))
            return False
        finally:
            built.set()
            watcher.join()
        return True

    def _watch_parent(self, built: threading.Event) -> None:
        while not built.wait(IDLE_POLL_S):
            if not self.parent_alive():
                logger.warning("the API process is gone while the engine core starts: exiting")
                self._remove_socket_files()
                os._exit(1)

    def close(self) -> None:
        """Closes the core, lets the last messages leave (if anyone is left to read them) and closes the
        sockets. Without a parent, also removes the parent's socket files and their directory."""
        parent_alive = self.parent_alive()
        if parent_alive:
            self._flush(until=time.monotonic() + FINAL_SEND_TIMEOUT_S)
        if self.core is not None:
            try:
                self.core.close()
            except Exception:
                logger.exception("closing the engine core failed")
            self.core = None
        linger_ms = int(FINAL_SEND_TIMEOUT_S * 1000) if parent_alive else 0
        self.input.close(linger=0)
        self.output.close(linger=linger_ms)
        self.context.term()
        if not parent_alive:
            self._remove_socket_files()

    def _remove_socket_files(self) -> None:
        """The parent's ipc socket files and their directory, which the parent can no longer remove."""
        directories = set()
        for path in self.socket_paths:
            directories.add(os.path.dirname(path))
            with contextlib.suppress(OSError):
                os.unlink(path)
        for directory in directories:
            with contextlib.suppress(OSError):  # only if empty: nothing but the sockets is removed
                os.rmdir(directory)

    # -- the loop --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        core = self.core
        while not self.terminated:
            if not self.parent_alive():
                logger.warning("the API process (pid %d) is gone: exiting", self.parent_pid)
                return
            if self.backlog:
                self._flush()
            if core.has_unfinished_requests():
                timeout_ms = 0
            else:  # idle: wait for input, but retry a blocked send soon
                timeout_ms = 10 if self.backlog else int(IDLE_POLL_S * 1000)
            if not self._apply_inputs(timeout_ms):
                return
            if core.has_unfinished_requests():
                out = core.step()
                if out.outputs or out.num_prompt_tokens or out.num_generated_tokens:
                    now = time.time()
                    self.send(wire.Outputs(out.outputs, out.num_prompt_tokens, out.num_generated_tokens, now))

    def _apply_inputs(self, timeout_ms: int) -> bool:
        """Applies every message waiting (waiting up to ``timeout_ms`` for the first); False once told to
        shut down."""
        if not self.input.poll(timeout_ms):
            return True
        rejected: list[EngineCoreOutput] = []
        keep_going = True
        while keep_going:
            try:
                data = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            keep_going = self._apply(wire.decode_input(data.buffer), rejected)
        if rejected:
            self.send(wire.Outputs(rejected, 0, 0, time.time()))
        return keep_going

    def _apply(self, message: wire.EngineInput, rejected: list[EngineCoreOutput]) -> bool:
        core = self.core
        if isinstance(message, wire.AddRequests):
            for request in message.requests:
                try:
                    core.add_request(request)
                except ValueError as e:  # this request's fault: it fails alone
                    failed = EngineCoreOutput(request.request_id, [], finish_reason="error", error=str(e))
                    rejected.append(failed)
        elif isinstance(message, wire.AbortRequests):
            core.abort_requests(message.request_ids)
        elif isinstance(message, wire.UtilityCall):
            self.send(self._call(message))
        elif isinstance(message, wire.Shutdown):
            return False
        return True

    def _call(self, call: wire.UtilityCall) -> wire.UtilityResult:
        method = _UTILITIES.get(call.method)
        if method is None:
            return wire.UtilityResult(
                call.call_id, error=f"unknown utility method {call.method!r}; allowed: {wire.UTILITY_METHODS}"
            )
        try:
            return wire.UtilityResult(call.call_id, method(self.core, *call.args))
        except Exception as e:
            return wire.UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    # -- sending ---------------------------------------------------------------------------------------

    def send(self, message: wire.EngineOutput) -> None:
        """Sends without blocking; what cannot leave now waits in the backlog, behind earlier messages."""
        self.backlog.append(wire.encode(message))
        self._flush()

    def _flush(self, until: float | None = None) -> None:
        """Sends the backlog until a send would block; with ``until`` (a time.monotonic() deadline), keeps
        trying until then."""
        while self.backlog:
            try:
                self.output.send(self.backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if until is None or time.monotonic() >= until:
                    return
                time.sleep(0.01)
                continue
            self.backlog.popleft()
