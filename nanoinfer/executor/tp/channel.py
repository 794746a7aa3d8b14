"""A one-writer, many-reader message channel through shared memory, for rank 0 to hand each batch to the
tensor-parallel workers.

One message at a time lives in a shared-memory segment: 8 bytes of length, then a pickle. Each reader
has two semaphores: ``ready`` (the writer published a message) and ``ack`` (the reader has finished
reading it). The writer waits for every reader's ack before it writes the next message, so it never
overwrites one that a reader is still unpickling. While it waits it keeps checking that the readers are
alive; a reader in turn checks that its writer is alive, so neither side can hang on a dead peer.
Semaphores rather than multiprocessing's events: an event's ``set`` waits until each process sleeping in
its ``wait`` has woken, forever if one was killed there (a worker killed mid-run hung rank 0 that way).

The segment's name is unique (pid and a random token) and is unlinked as soon as every reader has
attached: from then on it exists only as mappings, and nothing is left in /dev/shm whatever happens to
the processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore
from typing import Any

_LENGTH = struct.Struct("<Q")
# How often a waiting side checks that its peer is still alive.
POLL_INTERVAL_S = 0.2
NAME_PREFIX = "nanoinfer_tp"


@dataclass
class ChannelReaderHandle:
    """What a reader process needs (picklable when passed to a spawned process's arguments)."""

    name: str
    capacity: int
    ready: Semaphore
    ack: Semaphore


class ChannelWriter:
    def __init__(self, capacity: int, num_readers: int, ctx: Any = None):
        if capacity < 1 or num_readers < 1:
            raise ValueError(f"capacity ({capacity}) and num_readers ({num_readers}) must be >= 1")
        ctx = ctx or mp.get_context("spawn")
        self.capacity = capacity
        self.name = f"{NAME_PREFIX}_{os.getpid()}_{secrets.token_hex(6)}"
        self.shm = SharedMemory(name=self.name, create=True, size=_LENGTH.size + capacity)
        self.linked = True
        self.ready = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.ack = [ctx.Semaphore(0) for _ in range(num_readers)]
        # Readers acknowledge attaching like a message: the first wait is for that.
        self.awaiting_acks = True

    def reader_handle(self, index: int) -> ChannelReaderHandle:
        return ChannelReaderHandle(self.name, self.capacity, self.ready[index], self.ack[index])

    def wait_acks(self, check_alive: Callable[[], None], timeout_s: float) -> None:
        """Waits until every reader has read the last message (or attached, before the first)."""
        if not self.awaiting_acks:
            return
        deadline = time.monotonic() + timeout_s
        for i, ack in enumerate(self.ack):
            while not ack.acquire(timeout=POLL_INTERVAL_S):
                check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"channel reader {i} did not acknowledge a message within {timeout_s} s"
                    )
        self.awaiting_acks = False
        if self.linked:
            self._unlink()

    def send(self, message: Any, check_alive: Callable[[], None], timeout_s: float) -> None:
        """Publishes ``message`` to every reader once they have all read the previous one.
        ``check_alive`` raises when a reader process is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.capacity:
            raise RuntimeError(
                f"message of {len(data)} bytes does not fit the {self.capacity}-byte shared-memory "
                f"channel {self.name}"
            )
        self.wait_acks(check_alive, timeout_s)
        buf = self.shm.buf
        buf[_LENGTH.size : _LENGTH.size + len(data)] = data
        _LENGTH.pack_into(buf, 0, len(data))
        self.awaiting_acks = True
        for ready in self.ready:
            ready.release()

    def _unlink(self) -> None:
        self.linked = False
        with contextlib.suppress(FileNotFoundError):  # already gone: nothing to release
            self.shm.unlink()

    def close(self) -> None:
        if self.shm is None:
            return
        if self.linked:
            self._unlink()
        self.shm.close()
        self.shm = None


class ChannelReader:
    def __init__(self, handle: ChannelReaderHandle):
        self.handle = handle
        self.shm = SharedMemory(name=handle.name)
        handle.ack.release()  # attached: the writer may unlink the name

    def recv(self, writer_alive: Callable[[], bool]) -> tuple[bool, Any]:
        """Blocks for the next message: (True, message), or (False, None) once ``writer_alive()`` is
        false."""
        ready, ack = self.handle.ready, self.handle.ack
        while not ready.acquire(timeout=POLL_INTERVAL_S):
            if not writer_alive():
                return False, None
        buf = self.shm.buf
        (length,) = _LENGTH.unpack_from(buf, 0)
        with buf[_LENGTH.size : _LENGTH.size + length] as payload:
            message = pickle.loads(payload)
        ack.release()
        return True, message

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
