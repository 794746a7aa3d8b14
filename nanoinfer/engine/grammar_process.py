"""Constrained requests' grammars in processes of their own (``EngineConfig.num_grammar_processes``).

Feeding a step's tokens to 64 grammars and filling their next bitmask takes about a millisecond of host
time per step (H200 host, benchmarks/structured_outputs.py). On a thread of the engine's process, every
part of it that holds the GIL (each accepted token is a call into the grammar library that holds it, and
so is the fill's Python around xgrammar's threads) waits for the engine thread's Python or makes it
wait: on a worker thread (run 39) the engine thread's constrained step took 2.7 ms against 1.5 for the
same batch unconstrained. Here the grammars have interpreters of their own: the engine sends each step
the tokens to feed and the rows to fill, and the masks arrive in one shared-memory bitmask (pinned on
CUDA, so that its copy to the device is asynchronous). With several processes, grammar ``key`` lives in
process ``key % n``, and the processes feed and fill their grammars at once.

Nothing here makes the engine wait for a compile: a process starts (seconds: imports, the tokenizer
and the grammar compiler; see benchmarks/grammar_process_start.py) while the engine keeps stepping, or,
for a server, while the engine builds itself, and compiles on a thread of its own (5-80 ms for a new JSON
schema at a 150k vocabulary; the grammar libraries release the GIL for most of it), so that the steps it
serves meanwhile go on. The engine takes what has compiled with :meth:`GrammarProcesses.poll`.

One pipe per process carries pickled messages. The engine's thread alone sends:

- ``("compile", released, key, params)``: compile ``params`` as grammar ``key``; answered, whenever it
  is done, by ``("compiled", key, error, invalid_input)`` (error None: compiled; ``invalid_input``: the
  constraint's fault, as the ValueErrors of ``GrammarCompiler.compile``).
- ``("step", released, keys, token_ids, eos_blocked, start, fills)``: feed grammar ``keys[i]`` its
  token (see ``structured_outputs.feed_grammar``), reply with the results that are not a plain
  acceptance, as {i: (error, blocks_eos, invalid_input)} (pickling one object per row would cost the
  engine's thread more than the feeding); then, when ``fills`` (keys) is not empty, fill bitmask row
  ``start + i`` for grammar ``fills[i]`` and reply with the fill's seconds.

The process sends ``("ready", eos_token_ids)`` or ``("failed", message)`` first; compile answers may
come between a step's replies, which come in order. ``released``: the keys of the process's grammars
whose requests are gone (their handles were collected). If a process dies, the requests whose grammars
it held or was compiling fail with an error, and the next constrained request starts another in its
place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_connections
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from nanoinfer.config import EngineConfig

if TYPE_CHECKING:
    from nanoinfer.engine.structured_outputs import GrammarFeed, GrammarResult
    from nanoinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# How long a process may take to import its modules, load the tokenizer and build the grammar compiler
# (6 s alone on a 2-core box at a 150k vocabulary, 20 s for four at once on the H200's host) before the
# engine gives up on it.
START_TIMEOUT_S = 120.0
# The process's GIL switch interval: its loop (feeding, filling) waits at most this long for the GIL
# while the compile thread runs Python (the default, 5 ms, would add up to that to a step's fill).
SWITCH_INTERVAL_S = 0.0002


class RemoteGrammar:
    """The engine's handle of a grammar that lives in a grammar process: its key. When the handle is
    collected (its request is gone), the key is queued for its process to drop."""

    __slots__ = ("key", "_released")

    def __init__(self, key: int, released: list[int]):
        self.key = key
        self._released = released

    def __del__(self) -> None:
        self._released.append(self.key)


@dataclass(slots=True)
class CompiledGrammar:
    """A compile's outcome: the matcher (or its handle), or why there is none (``invalid_input``: the
    constraint's fault, not the engine's)."""

    key: int
    grammar: Any = None
    error: str | None = None
    invalid_input: bool = False


def compile_outcome(key: int, compile_grammar: Callable[[], Any]) -> CompiledGrammar:
    """What ``compile_grammar()`` gave for compile ``key``: its matcher, or its error (a ValueError is
    the constraint's fault; anything else is logged)."""
    try:
        return CompiledGrammar(key, compile_grammar())
    except ValueError as e:
        return CompiledGrammar(key, error=str(e), invalid_input=True)
    except Exception as e:  # noqa: BLE001 (the request fails alone; the engine goes on)
        logger.exception("a constraint failed to compile")
        return CompiledGrammar(key, error=f"{type(e).__name__}: {e}")


class GrammarProcessExited(RuntimeError):
    pass


class GrammarProcesses:
    """The engine's side of the grammar processes, started by the first constrained request: grammar
    ``key`` lives in process ``key % len(processes)``, and each step's feeds and fills go to the
    processes of their grammars, which work at once (their rows of one shared bitmask)."""

    def __init__(self, config: EngineConfig, num_rows: int, num_processes: int):
        # Not xgrammar's module: importing it takes half a second of the engine's thread.
        from nanoinfer.structured.backend import allocate_token_bitmask, default_num_threads

        self._config = config
        self.bitmask = allocate_token_bitmask(num_rows, config.hf_config.vocab_size).share_memory_()
        self._pinned = False
        if config.device == "cuda":
            status = torch.cuda.cudart().cudaHostRegister(
                self.bitmask.data_ptr(), self.bitmask.numel() * self.bitmask.element_size(), 0
            )
            self._pinned = int(status) == 0
            if not self._pinned:
                logger.warning("the grammar bitmask could not be pinned (%s): its copies will wait", status)
        # The batched fill's threads of each process: the processes fill at once, so they share the
        # host's cores instead of each taking most of them. A compile, rare and not at once in every
        # process, takes all of them (with one thread each, eight processes on the H100's 16-core host
        # took about 2 s to compile the engine benchmark's schema; run 73).
        self._num_threads = max(1, default_num_threads() // num_processes)
        self.processes = [self._start() for _ in range(num_processes)]
        # The compiles that processes which have since exited were running, answered as failed.
        self._orphaned: list[CompiledGrammar] = []

    def restart_exited(self) -> None:
        """Replaces each process that has exited (its grammars are lost: their requests fail); the new
        one starts in the background."""
        for i, process in enumerate(self.processes):
            if not process.alive:
                process.close()
                self._orphaned.extend(process.take_compiled())
                self.processes[i] = self._start()

    def compile(self, key: int, params: StructuredOutputsParams) -> None:
        """Starts compiling ``params`` as grammar ``key``; :meth:`poll` gives the outcome."""
        self.processes[key % len(self.processes)].compile(key, params)

    def has_compiling(self) -> bool:
        """Whether a compile has not been taken by :meth:`poll` yet."""
        return bool(self._orphaned) or any(p.compiling or p.has_compiled for p in self.processes)

    def poll(self, timeout: float = 0.0) -> list[CompiledGrammar]:
        """The compiles that are done (waiting up to ``timeout`` seconds for one when none is). Raises
        RuntimeError when a process could not start (the engine cannot serve constraints)."""
        done = self._orphaned
        self._orphaned = []
        waiting = [p for p in self.processes if p.alive and (p.compiling or not p.ready)]
        if timeout > 0 and not done and waiting and not any(p.has_compiled for p in waiting):
            wait_for_connections([p.connection for p in waiting], timeout)
        for process in self.processes:
            process.read_available()
            done.extend(process.take_compiled())
        return done

    def _start(self) -> _GrammarProcess:
        return _GrammarProcess(self._config, self.bitmask, self._num_threads)

    def in_fill_order(self, grammars: list[tuple[int, RemoteGrammar]]) -> list[tuple[int, RemoteGrammar]]:
        """(scheduled row, grammar) pairs ordered by process, so that each process fills one run of
        consecutive bitmask rows (xgrammar's batched fill takes a bitmask and fills its first rows)."""
        n = len(self.processes)
        return sorted(grammars, key=lambda pair: pair[1].key % n)

    def send_step(self, feeds: Sequence[GrammarFeed], fills: Sequence[RemoteGrammar]) -> GrammarExchange:
        """Sends a step's feeds, and its fills (bitmask row i for ``fills[i]``, in :meth:`in_fill_order`),
        to their processes; the exchange takes the replies. A dead process answers each of its feeds with
        an error, and its rows allow EOS alone."""
        n = len(self.processes)
        parts: list[tuple[list[GrammarFeed], int, list[int]]] = [([], 0, []) for _ in range(n)]
        for feed in feeds:
            parts[feed.grammar.key % n][0].append(feed)
        previous = -1
        for row, grammar in enumerate(fills):
            p = grammar.key % n
            if p != previous:
                if parts[p][2]:
                    raise RuntimeError("the fills are not in fill order (see in_fill_order)")
                parts[p] = (parts[p][0], row, parts[p][2])
                previous = p
            parts[p][2].append(grammar.key)
        sent = []
        for process, (process_feeds, start, keys) in zip(self.processes, parts, strict=True):
            if process_feeds or keys:
                process.send_step(process_feeds, start, keys)
                sent.append((process, process_feeds, range(start, start + len(keys))))
        return GrammarExchange(sent, self.bitmask)

    def close(self) -> None:
        for process in self.processes:
            process.close()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bitmask.data_ptr())
            self._pinned = False


class GrammarExchange:
    """One step's replies from the processes it was sent to: the feeds' results first, then the fill."""

    def __init__(self, sent: list[tuple[_GrammarProcess, list[GrammarFeed], range]], bitmask: torch.Tensor):
        self._sent = sent
        self._bitmask = bitmask

    def results(self) -> dict[int, GrammarResult]:
        """Each feed's result by row."""
        results: dict[int, GrammarResult] = {}
        for process, feeds, _ in self._sent:
            results.update(process.receive_results(feeds))
        return results

    def fill(self) -> float:
        """Waits until every row is filled; returns the longest fill's seconds in its process."""
        from nanoinfer.structured.backend import set_only

        seconds = 0.0
        for process, _, rows in self._sent:
            if not rows:
                continue
            try:
                seconds = max(seconds, process.receive_fill())
            except GrammarProcessExited:
                for row in rows:
                    set_only(self._bitmask, row, process.eos_token_ids)
        return seconds


class _GrammarProcess:
    """One grammar process, started here; it is ready once its first message has been read."""

    def __init__(self, config: EngineConfig, bitmask: torch.Tensor, num_threads: int):
        from nanoinfer.engine.request import engine_eos_token_ids

        context = mp.get_context("spawn")
        self.connection, child_connection = context.Pipe()
        self._process = context.Process(
            target=serve,
            args=(child_connection, config, bitmask, num_threads),
            name="nanoinfer-grammars",
            daemon=True,
        )
        self._process.start()
        child_connection.close()
        self._started = time.monotonic()
        # Keys of this process's grammars whose handles were collected, sent with the next message.
        self.released: list[int] = []
        self.alive = True
        self.ready = False
        # Until the process says (it loads the tokenizer), the model config's EOS ids: the rows of a
        # process that dies allow EOS alone.
        self.eos_token_ids: tuple[int, ...] = engine_eos_token_ids(config, None)
        self.compiling: set[int] = set()  # keys sent to compile and not answered yet
        self._compiled: list[CompiledGrammar] = []  # answers read, not taken yet
        self._replies: deque[Any] = deque()  # the steps' replies read, in order
        self._unsent: list[tuple] = []  # compiles that wait for the process to be ready

    @property
    def has_compiled(self) -> bool:
        return bool(self._compiled)

    def compile(self, key: int, params: StructuredOutputsParams) -> None:
        self.compiling.add(key)
        if not self.alive:
            self._fail_compiling("the grammar process has exited")
        elif self.ready:
            self._send(("compile", self._take_released(), key, params))
        else:
            # Sent once the process reads its pipe: a burst of schemas could fill the pipe's buffer
            # meanwhile and block the engine's thread.
            self._unsent.append((key, params))

    def take_compiled(self) -> list[CompiledGrammar]:
        done, self._compiled = self._compiled, []
        return done

    def read_available(self) -> None:
        """Reads what the process has sent, without waiting (a process that has exited fails its
        compiles); raises RuntimeError when it could not start."""
        if not self.alive:
            return
        with contextlib.suppress(GrammarProcessExited):
            while self.alive and self.connection.poll(0):
                self._read()
        # After the read: a process started with the engine may have been ready long before this poll.
        if self.alive and not self.ready and time.monotonic() - self._started > START_TIMEOUT_S:
            self.close()
            raise RuntimeError(f"the grammar process did not start within {START_TIMEOUT_S:.0f} s")

    def send_step(self, feeds: list[GrammarFeed], start: int, keys: list[int]) -> None:
        message = (
            "step",
            self._take_released(),
            [feed.grammar.key for feed in feeds],
            [feed.token_id for feed in feeds],
            [feed.eos_blocked for feed in feeds],
            start,
            keys,
        )
        with contextlib.suppress(GrammarProcessExited):
            self._send(message)

    def receive_results(self, feeds: list[GrammarFeed]) -> dict[int, GrammarResult]:
        from nanoinfer.engine.structured_outputs import ACCEPTED, GrammarResult

        try:
            unusual = self._receive()
        except GrammarProcessExited as e:
            return {feed.row: GrammarResult(str(e)) for feed in feeds}
        results = {feed.row: ACCEPTED for feed in feeds}
        for i, (error, blocks_eos, invalid_input) in unusual.items():
            results[feeds[i].row] = GrammarResult(error, blocks_eos, invalid_input)
        return results

    def receive_fill(self) -> float:
        return self._receive()

    def close(self) -> None:
        self.connection.close()  # the process exits at the end of its pipe
        if not self.ready:
            self._process.kill()  # still starting (it reads the pipe only once ready); it holds nothing
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self.alive = False
        self._fail_compiling("the grammar process was closed")

    def _take_released(self) -> list[int]:
        # RemoteGrammar.__del__ may append from any thread: take what is there, atomically per item.
        released = []
        while self.released:
            released.append(self.released.pop())
        return released

    def _receive(self) -> Any:
        """The next reply of a step (compile answers read on the way are kept)."""
        while not self._replies:
            self._read()
        return self._replies.popleft()

    def _read(self) -> None:
        """Reads one message and puts it where it belongs."""
        if not self.alive:
            raise GrammarProcessExited("the grammar process has exited")
        try:
            message = self.connection.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            self._exited()
            if not self.ready and (self._process.exitcode or 0) > 0:  # not killed: it cannot start
                raise RuntimeError(
                    f"the grammar process exited as it started (exit code {self._process.exitcode}); a "
                    'script that runs the engine must do so under `if __name__ == "__main__":` '
                    "(processes start by importing it), or set num_grammar_processes=0"
                ) from e
            raise GrammarProcessExited(f"the grammar process has exited ({type(e).__name__})") from e
        kind = message[0] if isinstance(message, tuple) else None
        if kind == "compiled":
            _, key, error, invalid_input = message
            self.compiling.discard(key)
            grammar = RemoteGrammar(key, self.released) if error is None else None
            self._compiled.append(CompiledGrammar(key, grammar, error, invalid_input))
        elif kind == "ready":
            self.ready = True
            self.eos_token_ids = message[1]
            unsent, self._unsent = self._unsent, []
            for key, params in unsent:
                self._send(("compile", self._take_released(), key, params))
        elif kind == "failed":
            self.close()
            raise RuntimeError(f"the grammar process failed to start: {message[1]}")
        else:
            self._replies.append(message)

    def _send(self, message: tuple) -> None:
        if not self.alive:
            raise GrammarProcessExited("the grammar process has exited")
        try:
            self.connection.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            self._exited()
            raise GrammarProcessExited(f"the grammar process has exited ({type(e).__name__})") from e

    def _exited(self) -> None:
        self.alive = False
        self._process.join(timeout=5)
        logger.error("a grammar process exited (exit code %s)", self._process.exitcode)
        self._fail_compiling(f"the grammar process exited (exit code {self._process.exitcode})")

    def _fail_compiling(self, error: str) -> None:
        self._unsent.clear()
        for key in sorted(self.compiling):
            self._compiled.append(CompiledGrammar(key, error=f"structured_outputs: {error} while compiling"))
        self.compiling.clear()


def serve(conn: Any, config: EngineConfig, bitmask: torch.Tensor, num_threads: int) -> None:
    """The grammar process's loop (see the module docstring)."""
    from nanoinfer.engine.request import engine_eos_token_ids
    from nanoinfer.engine.structured_outputs import ACCEPTED, GrammarResult, feed_grammar
    from nanoinfer.models.checkpoint import load_tokenizer
    from nanoinfer.structured.backend import GrammarCompiler, set_only

    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        tokenizer = load_tokenizer(config.model, config.tokenizer)
        eos_token_ids = engine_eos_token_ids(config, tokenizer)
        compiler = GrammarCompiler(
            tokenizer, config.hf_config.vocab_size, eos_token_ids, num_threads=num_threads
        )
    except Exception as e:  # noqa: BLE001 (reported to the engine, which raises it)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", eos_token_ids))
    grammars: dict[int, Any] = {}
    send_lock = threading.Lock()  # the loop and the compile thread both answer on the pipe
    compile_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-grammar-compile")

    def send(message: Any) -> None:
        with send_lock:
            conn.send(message)

    def compile_and_answer(key: int, params: StructuredOutputsParams) -> None:
        outcome = compile_outcome(key, lambda: compiler.compile(params))
        if outcome.error is None:
            grammars[key] = outcome.grammar
        with contextlib.suppress(OSError):  # the engine has gone: the loop returns
            send(("compiled", key, outcome.error, outcome.invalid_input))

    lost = GrammarResult("structured_outputs: the request's grammar was lost (the grammar process restarted)")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the engine has closed the pipe, or exited
        for key in message[1]:
            grammars.pop(key, None)
        if message[0] == "compile":
            _, _, key, params = message
            if compiler.is_kept(params):
                # A repeated constraint (a pipeline's, a served tool's) needs a matcher only: here at
                # once, rather than behind a new schema's compile.
                compile_and_answer(key, params)
            else:
                compile_thread.submit(compile_and_answer, key, params)
            continue
        _, _, keys, token_ids, eos_blocked, start, fills = message
        unusual = {}
        for i, key in enumerate(keys):
            grammar = grammars.get(key)
            result = lost if grammar is None else feed_grammar(grammar, token_ids[i], eos_blocked[i])
            if result is not ACCEPTED:
                unusual[i] = (result.error, result.blocks_eos, result.invalid_input)
        send(unusual)
        if fills:
            started = time.perf_counter()
            rows = bitmask[start : start + len(fills)]
            compiler.fill_bitmasks(
                [(grammars[key], i) for i, key in enumerate(fills) if key in grammars], rows
            )
            for i, key in enumerate(fills):
                if key not in grammars:
                    set_only(rows, i, eos_token_ids)
            send(time.perf_counter() - started)
