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

A step's exchange goes through shared memory, not the pipes: the engine writes the step's feeds and
fills into one shared board (:class:`StepBoard`, read by every process) and wakes the processes that
hold any of them with a semaphore each; every woken process feeds its grammars their tokens (see
``structured_outputs.feed_grammar``), writes how many results were not a plain acceptance into its reply
slot and posts its "fed" semaphore, then fills its bitmask rows and posts "filled" (with the fill's
nanoseconds in its slot). On the H100's host a pipe's send or receive cost the engine's thread 10-20 us
each, three per process and step (run 81: about 430 us of a 2.2 ms step with eight processes); a
semaphore costs about a microsecond. Feeds' results that are not a plain acceptance, rare, follow on
the pipe as {feed index: (error, blocks_eos, invalid_input)} before "fed" is posted.

The pipe carries the rest, pickled; the engine's thread alone sends ``("compile", released, key,
params)``: compile ``params`` as grammar ``key``; answered, whenever it is done, by ``("compiled", key,
error, invalid_input)`` (error None: compiled; ``invalid_input``: the constraint's fault, as the
ValueErrors of ``GrammarCompiler.compile``). A thread of the process reads the pipe, so that the loop
that feeds and fills waits on its semaphore alone.

The process sends ``("ready", eos_token_ids)`` or ``("failed", message)`` first; compile answers may
come between a step's replies. ``released`` (in a compile message, and in the board's slot of the
process at each step): the keys of the process's grammars whose requests are gone (their handles were
collected). If a process dies, the requests whose grammars it held or was compiling fail with an
error, and the next constrained request starts another in its place.
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

import numpy as np
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
# How often the engine's wait for a process's semaphore checks that the process is alive (a dead one
# never posts).
LIVENESS_CHECK_S = 0.05


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


class StepBoard:
    """One step's feeds and fills in shared memory: written by the engine's thread, read by the processes
    it wakes (see the module docstring). One int64 tensor, shared with every process, in five parts:

    - ``counts``: the step's number of feeds and of fills;
    - ``feeds`` [3, rows]: each feed's grammar key, token id and eos_blocked;
    - ``fills`` [2, rows]: each fill's grammar key and bitmask row;
    - ``released`` [processes, 1 + rows]: per process, a count, then keys of its grammars to drop;
    - ``replies`` [processes, 3]: per process, the count of its feeds' results that are not a plain
      acceptance (sent on the pipe), its latest fill's nanoseconds, and how many grammars it holds
      (those of requests that are gone included, until their keys reach it)."""

    def __init__(self, tensor: torch.Tensor, rows: int, num_processes: int):
        self.tensor, self.rows, self.num_processes = tensor, rows, num_processes
        words = tensor.numpy()
        released_end = 2 + 5 * rows + num_processes * (1 + rows)
        self.counts = words[:2]
        self.feeds = words[2 : 2 + 3 * rows].reshape(3, rows)
        self.fills = words[2 + 3 * rows : 2 + 5 * rows].reshape(2, rows)
        self.released = words[2 + 5 * rows : released_end].reshape(num_processes, 1 + rows)
        self.replies = words[released_end:].reshape(num_processes, 3)

    @classmethod
    def allocate(cls, rows: int, num_processes: int) -> StepBoard:
        size = 2 + 5 * rows + num_processes * (1 + rows) + 3 * num_processes
        return cls(torch.zeros(size, dtype=torch.int64).share_memory_(), rows, num_processes)


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
        self.board = StepBoard.allocate(num_rows, num_processes)
        self.processes = [self._start(i) for i in range(num_processes)]
        # The compiles that processes which have since exited were running, answered as failed.
        self._orphaned: list[CompiledGrammar] = []

    def restart_exited(self) -> None:
        """Replaces each process that has exited (its grammars are lost: their requests fail); the new
        one starts in the background."""
        for i, process in enumerate(self.processes):
            if not process.alive:
                process.close()
                self._orphaned.extend(process.take_compiled())
                self.processes[i] = self._start(i)

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

    def _start(self, index: int) -> _GrammarProcess:
        return _GrammarProcess(self._config, self.bitmask, self.board, index, self._num_threads)

    def send_step(
        self, feeds: Sequence[GrammarFeed], fills: Sequence[tuple[int, RemoteGrammar]]
    ) -> GrammarExchange:
        """Writes a step's feeds and its fills ((bitmask row, grammar) pairs) into the board and wakes
        the processes that hold their grammars; the exchange takes the replies. A dead process answers
        each of its feeds with an error, and its rows allow EOS alone."""
        board, n = self.board, len(self.processes)
        num_feeds, num_fills = len(feeds), len(fills)
        if max(num_feeds, num_fills) > board.rows:
            raise RuntimeError(f"{num_feeds} feeds and {num_fills} fills for a board of {board.rows} rows")
        board.counts[:] = (num_feeds, num_fills)
        woken = np.zeros(n, dtype=bool)
        if num_feeds:
            keys = board.feeds[0, :num_feeds]
            keys[:] = [feed.grammar.key for feed in feeds]
            board.feeds[1, :num_feeds] = [feed.token_id for feed in feeds]
            board.feeds[2, :num_feeds] = [feed.eos_blocked for feed in feeds]
            woken[keys % n] = True
        filling = np.zeros(n, dtype=bool)
        if num_fills:
            keys = board.fills[0, :num_fills]
            keys[:] = [grammar.key for _, grammar in fills]
            board.fills[1, :num_fills] = [row for row, _ in fills]
            filling[keys % n] = True
        sent = []
        for process, wake, fill in zip(self.processes, woken | filling, filling, strict=True):
            if wake:
                process.post_step()
                sent.append((process, bool(fill)))
        return GrammarExchange(sent, feeds, fills, self.bitmask)

    def grammars_held(self) -> list[int]:
        """How many grammars each process held when it last answered a step (the keys of requests that
        are gone reach a process with its next step or compile)."""
        return self.board.replies[:, 2].tolist()

    def close(self) -> None:
        for process in self.processes:
            process.close()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bitmask.data_ptr())
            self._pinned = False


class GrammarExchange:
    """One step's replies from the processes it woke: the feeds' results first, then the fill."""

    def __init__(
        self,
        sent: list[tuple[_GrammarProcess, bool]],
        feeds: Sequence[GrammarFeed],
        fills: Sequence[tuple[int, RemoteGrammar]],
        bitmask: torch.Tensor,
    ):
        self._sent = sent  # (process, whether it fills rows)
        self._feeds = feeds
        self._fills = fills
        self._bitmask = bitmask

    def results(self) -> dict[int, GrammarResult]:
        """Each feed's result by row."""
        from nanoinfer.engine.structured_outputs import ACCEPTED, GrammarResult

        feeds = self._feeds
        results = dict.fromkeys((feed.row for feed in feeds), ACCEPTED)
        for process, _ in self._sent:
            try:
                unusual = process.wait_fed()
            except GrammarProcessExited as e:
                for feed in feeds:
                    if process.holds(feed.grammar.key):
                        results[feed.row] = GrammarResult(str(e))
                continue
            for i, (error, blocks_eos, invalid_input) in unusual.items():
                results[feeds[i].row] = GrammarResult(error, blocks_eos, invalid_input)
        return results

    def fill(self) -> float:
        """Waits until every row is filled; returns the longest fill's seconds in its process."""
        from nanoinfer.structured.backend import set_only

        seconds = 0.0
        for process, fills in self._sent:
            if not fills:
                continue
            try:
                seconds = max(seconds, process.wait_filled())
            except GrammarProcessExited:
                for row, grammar in self._fills:
                    if process.holds(grammar.key):
                        set_only(self._bitmask, row, process.eos_token_ids)
        return seconds


class _GrammarProcess:
    """One grammar process, started here; it is ready once its first message has been read."""

    def __init__(
        self, config: EngineConfig, bitmask: torch.Tensor, board: StepBoard, index: int, num_threads: int
    ):
        from nanoinfer.engine.request import engine_eos_token_ids

        context = mp.get_context("spawn")
        self.connection, child_connection = context.Pipe()
        self.index = index  # the process holds grammar key k where k % board.num_processes == index
        self._board = board
        # Posted by the engine (a step for the process), and by the process (fed; filled).
        self._work, self._fed, self._filled = (context.Semaphore(0) for _ in range(3))
        self._process = context.Process(
            target=serve,
            args=(
                child_connection,
                config,
                bitmask,
                (board.tensor, board.rows, board.num_processes, index),
                (self._work, self._fed, self._filled),
                num_threads,
            ),
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

    def holds(self, key: int) -> bool:
        """Whether grammar ``key`` lives in this process."""
        return key % self._board.num_processes == self.index

    def post_step(self) -> None:
        """Wakes the process for the step in the board (with the keys of its grammars to drop)."""
        if not self.alive:
            return  # its waits raise GrammarProcessExited
        board = self._board
        released = self._take_released(board.rows)
        slot = board.released[self.index]
        slot[0] = len(released)
        slot[1 : 1 + len(released)] = released
        self._work.release()

    def wait_fed(self) -> dict[int, tuple[str | None, bool, bool]]:
        """Waits until the process has fed its grammars the step's tokens; the results that are not a
        plain acceptance, by feed index."""
        self._wait(self._fed)
        return self._receive() if self._board.replies[self.index, 0] else {}

    def wait_filled(self) -> float:
        """Waits until the process has filled its bitmask rows; the fill's seconds."""
        self._wait(self._filled)
        return float(self._board.replies[self.index, 1]) / 1e9

    def _wait(self, semaphore: Any) -> None:
        if not self.alive:
            raise GrammarProcessExited("the grammar process has exited")
        while not semaphore.acquire(timeout=LIVENESS_CHECK_S):
            if not self._process.is_alive():
                self._exited()
                raise GrammarProcessExited("the grammar process has exited")

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

    def _take_released(self, limit: int | None = None) -> list[int]:
        # RemoteGrammar.__del__ may append from any thread: take what is there, atomically per item (at
        # most ``limit``; the rest go with the next message).
        released = []
        while self.released and (limit is None or len(released) < limit):
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


def serve(
    conn: Any,
    config: EngineConfig,
    bitmask: torch.Tensor,
    board_spec: tuple[torch.Tensor, int, int, int],
    semaphores: tuple[Any, Any, Any],
    num_threads: int,
) -> None:
    """The grammar process's loop (see the module docstring). ``board_spec``: the step board's tensor,
    rows and processes, and this process's index; ``semaphores``: work, fed, filled."""
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
    tensor, rows, num_processes, index = board_spec
    board = StepBoard(tensor, rows, num_processes)
    work, fed, filled = semaphores
    # Grammars by key; the pipe's thread and the compile thread change it while the loop reads it (each
    # dict operation is atomic).
    grammars: dict[int, Any] = {}
    send_lock = threading.Lock()  # the loop, the pipe's thread and the compile thread all answer on the pipe
    compile_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-grammar-compile")
    closed = threading.Event()

    def send(message: Any) -> None:
        with send_lock:
            conn.send(message)

    def compile_and_answer(key: int, params: StructuredOutputsParams) -> None:
        outcome = compile_outcome(key, lambda: compiler.compile(params))
        if outcome.error is None:
            grammars[key] = outcome.grammar
        with contextlib.suppress(OSError):  # the engine has gone: the loop returns
            send(("compiled", key, outcome.error, outcome.invalid_input))

    def read_pipe() -> None:
        while True:
            try:
                _, released, key, params = conn.recv()
            except (EOFError, OSError):
                break  # the engine has closed the pipe, or exited
            for gone in released:
                grammars.pop(gone, None)
            if compiler.is_kept(params):
                # A repeated constraint (a pipeline's, a served tool's) needs a matcher only: here at
                # once, rather than behind a new schema's compile.
                compile_and_answer(key, params)
            else:
                compile_thread.submit(compile_and_answer, key, params)
        closed.set()
        work.release()

    threading.Thread(target=read_pipe, name="nanoinfer-grammar-pipe", daemon=True).start()
    lost = GrammarResult("structured_outputs: the request's grammar was lost (the grammar process restarted)")
    while True:
        work.acquire()
        if closed.is_set():
            return
        # Everything this process needs from the board is read before "fed" is posted: after the engine
        # has its replies it may write the next step there.
        released = board.released[index]
        for key in released[1 : 1 + released[0]].tolist():
            grammars.pop(key, None)
        num_feeds, num_fills = board.counts.tolist()
        feeds = board.feeds[:, :num_feeds]
        mine = np.flatnonzero(feeds[0] % num_processes == index)
        my_feeds = feeds[:, mine].T.tolist()
        fills = board.fills[:, :num_fills]
        my_fills = fills[:, fills[0] % num_processes == index].T.tolist()
        unusual = {}
        for i, (key, token_id, eos_blocked) in zip(mine.tolist(), my_feeds, strict=True):
            grammar = grammars.get(key)
            result = lost if grammar is None else feed_grammar(grammar, token_id, bool(eos_blocked))
            if result is not ACCEPTED:
                unusual[i] = (result.error, result.blocks_eos, result.invalid_input)
        board.replies[index, 0] = len(unusual)
        board.replies[index, 2] = len(grammars)
        if unusual:
            with contextlib.suppress(OSError):
                send(unusual)
        fed.release()
        if not my_fills:
            continue
        started = time.perf_counter_ns()
        matched = [(grammars.get(key), row) for key, row in my_fills]
        compiler.fill_bitmasks([(grammar, row) for grammar, row in matched if grammar is not None], bitmask)
        for grammar, row in matched:
            if grammar is None:
                set_only(bitmask, row, eos_token_ids)
        board.replies[index, 1] = time.perf_counter_ns() - started
        filled.release()
