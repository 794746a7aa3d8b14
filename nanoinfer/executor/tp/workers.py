"""Tensor-parallel workers: ranks 1..N-1, each a spawned process owning a ModelRunner.

Rank 0's executor (:class:`nanoinfer.executor.tp.executor.TensorParallelExecutor`, in the engine's
process) starts them (:class:`TensorParallelWorkers`), sends each step's inputs through a shared-memory
channel before running its own shard, and stops them on close. A worker waits for a step, runs it (its
collectives pair up with rank 0's), and loops; it exits on the stop message, or by itself when rank 0's
process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
import traceback
import weakref
from collections.abc import Iterator

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.distributed import (
    ABORT_TIMEOUT_S,
    COLLECTIVE_TIMEOUT,
    connect_store,
    create_master_store,
    destroy_process_group,
    ensure_no_process_group,
    init_process_group,
    set_failure_check,
    start_abort,
)
from nanoinfer.executor.input_batch import StepInputs
from nanoinfer.executor.tp.channel import ChannelReader, ChannelReaderHandle, ChannelWriter

logger = logging.getLogger(__name__)

# A clean stop (stop message, model teardown) takes well under this; then the worker is killed.
STOP_TIMEOUT_S = 10.0
# How often rank 0 checks its workers while it waits for its GPU work under NCCL (wait_for_device).
WORKER_CHECK_S = 0.01


def max_message_bytes(config: EngineConfig) -> int:
    """An upper bound on a pickled StepInputs: T = max(max_num_batched_tokens, max_num_seqs) tokens (ids,
    positions and slots, and at most T prompt-logprob positions: 8 bytes each), at most max_num_seqs
    rows (4-byte query starts and lengths, 8-byte slots, logits indices and pending indices and sources),
    block-table entries sent whole for at most every row (8-byte slot and column, 4-byte id, for at most
    max_blocks_per_seq + 1 entries each), and under 400 bytes of pickle framing per array."""
    rows = config.max_num_seqs
    tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    return 8192 + 8 * 4 * tokens + rows * (8 + 32 + 20 * (config.max_blocks_per_seq + 1))


class TensorParallelWorkers:
    """Rank 0's side of tensor parallelism: starts ranks 1..N-1, owns rank 0's process group, sends each
    batch, watches the workers and stops them."""

    def __init__(self, config: EngineConfig):
        ensure_no_process_group()  # before any process starts
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.store = create_master_store(size)
        self.channel = ChannelWriter(max_message_bytes(config), size - 1, ctx)
        self.errors = ctx.SimpleQueue()
        self.processes: list = []
        self.failure: str | None = None
        # Shared with the finalizer and the NCCL watchdog. watchdog_quiet: the pipe end that tells the
        # watchdog to stand down; in_step: rank 0's thread is inside a step.
        self._state = {"graceful": True, "owns_group": False, "watchdog_quiet": None, "in_step": False}
        # The finalizer holds no reference to self: it runs from stop(), when the engine is
        # garbage-collected, or at interpreter exit (registered after multiprocessing's own exit hook, so
        # it runs first and the workers get a clean stop rather than a SIGTERM).
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.channel, self._state)
        atexit.register(self._finalizer)
        try:
            for rank in range(1, size):
                process = ctx.Process(
                    target=_worker_main,
                    args=(config, rank, self.store.port, self.channel.reader_handle(rank - 1), self.errors),
                    name=f"nanoinfer-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                self.processes.append(process)
        except BaseException:
            self.stop(graceful=False)
            raise
        set_failure_check(self.explain_failure)

    def init_process_group(self, device: torch.device) -> None:
        init_process_group(self.store, 0, len(self.processes) + 1, device)
        self._state["owns_group"] = True
        if device.type == "cuda":
            self._start_nccl_watchdog()

    def _start_nccl_watchdog(self) -> None:
        """NCCL, unlike gloo, does not notice a peer's death: a collective waiting for a dead worker
        waits at least until the process group's timeout. Rank 0 therefore waits for its GPU work without
        blocking in CUDA (:meth:`wait_for_device`) and raises the worker's error; this thread watches
        the workers and, when one dies, starts an abort of the communicator (which NCCL may never
        finish while a rank is dead).

        Should rank 0's thread still be inside its step ABORT_TIMEOUT_S later, it is blocked inside an
        NCCL call that nothing can interrupt (seen on 2 x H200 when a worker died early in a
        generation): the watchdog then logs the cause and exits the process with status 1 rather than
        leave it hanging. Stopping the workers silences the watchdog first."""
        quiet_reader, self._state["watchdog_quiet"] = mp.Pipe(duplex=False)
        sentinels = [p.sentinel for p in self.processes]
        state = self._state  # not self: the thread must not keep the engine alive

        def watch() -> None:
            ready = mp.connection.wait([*sentinels, quiet_reader])
            if quiet_reader in ready:
                return
            logger.error("a tensor-parallel worker exited; aborting the NCCL communicator")
            start_abort()
            deadline = time.monotonic() + ABORT_TIMEOUT_S
            while state["in_step"] and time.monotonic() < deadline:
                time.sleep(0.05)
            if state["in_step"]:
                logger.critical(
                    "a tensor-parallel worker died during a step and rank 0 is still blocked in NCCL "
                    "%s s later; nothing can end that wait: exiting the process",
                    ABORT_TIMEOUT_S,
                )
                os._exit(1)

        threading.Thread(target=watch, name="nanoinfer-tp-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def running_step(self) -> Iterator[None]:
        """Marks rank 0's thread as inside a step (for the NCCL watchdog)."""
        self._state["in_step"] = True
        try:
            yield
        finally:
            self._state["in_step"] = False

    def wait_for_device(self, event) -> None:
        """Waits until ``event`` (a CUDA event recorded after the step's collectives) has completed,
        checking the workers every WORKER_CHECK_S: a blocking synchronize would never return if a
        worker died mid-collective and the communicator's abort did not end the wait. Raises the
        worker's error when one has exited."""
        next_check = time.monotonic() + WORKER_CHECK_S
        while not event.query():
            if time.monotonic() >= next_check:
                self.raise_if_dead()
                next_check = time.monotonic() + WORKER_CHECK_S
            time.sleep(0)  # lets other threads (the server's event loop) run
        self.raise_if_dead()

    @property
    def healthy(self) -> bool:
        return self.failure is None and all(p.is_alive() for p in self.processes)

    def raise_if_dead(self) -> None:
        """Raises RuntimeError naming the worker that exited, with its traceback when it sent one."""
        if self.failure is None:
            dead = [(rank, p) for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
            if not dead:
                return
            errors = {}
            while not self.errors.empty():
                rank, text = self.errors.get()
                errors[rank] = text
            lines = [
                f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in dead
            ]
            lines += [f"rank {rank} failed with:\n{text}" for rank, text in sorted(errors.items())]
            self.failure = "\n".join(lines)
        raise RuntimeError(self.failure + "\nthe engine cannot continue; close it and start a new one")

    def explain_failure(self) -> None:
        """After a failed collective: a dying worker's connections close a moment before its exit status
        can be read, so wait a little for it to exit and reap it."""
        ended = mp.connection.wait([p.sentinel for p in self.processes], timeout=2.0)
        for p in self.processes:
            if p.sentinel in ended:
                p.join(2.0)
        self.raise_if_dead()

    def wait_ready(self) -> None:
        """Waits until every worker has attached to the channel (its name is then unlinked)."""
        self.channel.wait_acks(self.raise_if_dead, COLLECTIVE_TIMEOUT.total_seconds())

    def send(self, step: StepInputs) -> None:
        self.raise_if_dead()
        self.channel.send(step, self.raise_if_dead, COLLECTIVE_TIMEOUT.total_seconds())

    def stop(self, graceful: bool = True) -> None:
        """Stops the workers (a stop message when ``graceful``, else at once) and rank 0's process group."""
        self._state["graceful"] = graceful
        atexit.unregister(self._finalizer)
        self._finalizer()
        set_failure_check(None)


def _stop_workers(processes: list, channel: ChannelWriter, state: dict) -> None:
    quiet = state.pop("watchdog_quiet", None)
    if quiet is not None:
        # The workers exiting from now on is expected. A broken pipe: the watchdog has already fired.
        with contextlib.suppress(BrokenPipeError):
            quiet.send(None)
        quiet.close()

    def raise_if_any_dead() -> None:
        if any(p.exitcode is not None for p in processes):
            raise RuntimeError("a tensor-parallel worker exited")

    # A dead worker never acknowledges, and the others are then stuck in a collective or exiting: only
    # an intact group gets the stop message.
    graceful = state["graceful"] and all(p.is_alive() for p in processes)
    if graceful:
        try:
            channel.send(None, raise_if_any_dead, STOP_TIMEOUT_S)
        except RuntimeError:
            graceful = False
    # Before waiting for the workers: they leave the group at the same time.
    if state["owns_group"]:
        state["owns_group"] = False
        destroy_process_group()
    for p in processes:
        p.join(STOP_TIMEOUT_S if graceful else 0)
        if p.is_alive():
            if graceful:
                logger.warning(
                    "tensor-parallel worker %s did not stop in %s s; killing it", p.name, STOP_TIMEOUT_S
                )
            p.kill()
            p.join(STOP_TIMEOUT_S)
    channel.close()


def _worker_main(
    config: EngineConfig, rank: int, port: int, handle: ChannelReaderHandle, errors: mp.SimpleQueue
) -> None:
    from nanoinfer.executor.model_runner import ModelRunner

    reader = runner = None
    joined = False
    parent = mp.parent_process()
    try:
        if config.device == "cpu":
            # One thread per extra rank: N processes of all-core thread pools would oversubscribe the CPU.
            torch.set_num_threads(1)
        reader = ChannelReader(handle)
        device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group(
            connect_store(port, config.tensor_parallel_size), rank, config.tensor_parallel_size, device
        )
        joined = True
        runner = ModelRunner(config, rank=rank)
        while True:
            ok, step = reader.recv(parent.is_alive)
            if not ok:
                # Rank 0's process is gone, perhaps in the middle of a collective: under NCCL this rank's
                # queued GPU work would then never finish, and a teardown would wait for it. Exiting
                # hands everything back to the OS.
                logger.error("tensor-parallel worker rank %d: rank 0's process is gone; exiting", rank)
                os._exit(1)
            if step is None:  # the stop message
                break
            runner.execute_worker_step(step)
    except KeyboardInterrupt:
        # Ctrl-C reaches the whole process group; rank 0 reports the interruption, this rank just ends.
        raise SystemExit(1) from None
    except BaseException:
        text = traceback.format_exc()
        try:
            # Its tail only: a short message is one atomic pipe write, so rank 0 never reads half of one.
            errors.put((rank, text[-3000:]))
        finally:
            logger.error("tensor-parallel worker rank %d (pid %d) failed:\n%s", rank, os.getpid(), text)
        raise SystemExit(1) from None
    finally:
        if runner is not None:
            runner.close()
        if joined:
            destroy_process_group()
        if reader is not None:
            reader.close()
