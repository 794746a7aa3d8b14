"""The rank 0 -> workers shared-memory channel: ordering, acknowledgement, liveness, cleanup, sizing."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.executor.input_batch import InputBatch
from nanoinfer.executor.tp.channel import ChannelReader, ChannelWriter
from nanoinfer.executor.tp.workers import max_message_bytes
from nanoinfer.sampling_params import SamplingParams
from tests.executor.test_input_batch import new_request, row


def _always_alive() -> None:
    return None


def _segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def _read_all(handle, received: list, delay_s: float = 0.0) -> None:
    reader = ChannelReader(handle)
    try:
        while True:
            ok, message = reader.recv(lambda: True)
            if message is None:
                return
            received.append(message)
            time.sleep(delay_s)
    finally:
        reader.close()


def _message(i: int) -> dict:
    # Sizes vary so that a longer older message would show through a shorter newer one if overwritten.
    return {"index": i, "payload": list(range(i * 37 % 500))}


def test_every_reader_gets_every_message_in_order():
    writer = ChannelWriter(64 * 1024, 2)
    received = [[], []]
    # One fast reader and one slow one: the writer must wait for the slow one before each write.
    threads = [
        threading.Thread(target=_read_all, args=(writer.reader_handle(i), received[i], delay))
        for i, delay in enumerate((0.0, 0.002))
    ]
    for t in threads:
        t.start()
    try:
        writer.wait_acks(_always_alive, 10)
        assert not _segment_exists(writer.name)  # unlinked once every reader has attached
        messages = [_message(i) for i in range(60)]
        for m in messages:
            writer.send(m, _always_alive, 10)
        writer.send(None, _always_alive, 10)
        for t in threads:
            t.join(10)
        assert received == [messages, messages]
    finally:
        writer.close()
    assert not _segment_exists(writer.name)


def test_writer_waits_for_the_acknowledgement():
    writer = ChannelWriter(1024, 1)
    reader = ChannelReader(writer.reader_handle(0))
    try:
        writer.wait_acks(_always_alive, 5)
        writer.send("first", _always_alive, 5)
        # Nobody has read "first": a second send must not overwrite it, and times out instead.
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="did not acknowledge"):
            writer.send("second", _always_alive, 0.5)
        assert time.monotonic() - start >= 0.4
        assert reader.recv(lambda: True) == (True, "first")
        writer.send("third", _always_alive, 5)
        assert reader.recv(lambda: True) == (True, "third")
    finally:
        reader.close()
        writer.close()


def test_dead_reader_is_reported_not_waited_for():
    writer = ChannelWriter(1024, 1)
    reader = ChannelReader(writer.reader_handle(0))
    dead = False

    def check_alive():
        if dead:
            raise RuntimeError("reader 0 exited")

    try:
        writer.send("one", check_alive, 5)
        dead = True  # the reader never acknowledges "one"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reader 0 exited"):
            writer.send("two", check_alive, 60)
        assert time.monotonic() - start < 2
    finally:
        reader.close()
        writer.close()


def test_reader_returns_when_the_writer_is_gone():
    writer = ChannelWriter(1024, 1)
    reader = ChannelReader(writer.reader_handle(0))
    try:
        start = time.monotonic()
        assert reader.recv(lambda: False) == (False, None)
        assert time.monotonic() - start < 2
    finally:
        reader.close()
        writer.close()


def test_oversized_message_names_the_sizes():
    writer = ChannelWriter(100, 1)
    try:
        with pytest.raises(RuntimeError, match=r"message of \d+ bytes does not fit the 100-byte"):
            writer.send(list(range(1000)), _always_alive, 1)
    finally:
        writer.close()


def test_segment_names_are_unique_and_removed_on_close():
    a, b = ChannelWriter(64, 1), ChannelWriter(64, 1)
    try:
        assert a.name != b.name and str(os.getpid()) in a.name
        assert _segment_exists(a.name) and _segment_exists(b.name)
    finally:
        a.close()
        b.close()
    assert not _segment_exists(a.name) and not _segment_exists(b.name)


def _process_reader(handle, results) -> None:
    reader = ChannelReader(handle)
    parent = mp.parent_process()
    total = 0
    while True:
        ok, batch = reader.recv(parent.is_alive)
        if not ok or batch is None:
            break
        total += int(batch.input_ids.sum() + batch.table_block_ids.sum())
    reader.close()
    results.put(total)


def test_across_processes_with_step_inputs():
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(1 << 16, 1, ctx)
    results = ctx.SimpleQueue()
    process = ctx.Process(target=_process_reader, args=(writer.reader_handle(0), results), daemon=True)
    process.start()

    def check_alive():
        if process.exitcode is not None:
            raise RuntimeError("reader exited")

    batch = InputBatch(max_num_seqs=4, max_blocks_per_seq=64, block_size=16, device=torch.device("cpu"))
    try:
        expected = 0
        for step in range(50):
            request_id = f"r{step}"
            out = SchedulerOutput(
                scheduled=[row(request_id, 16 * step, [step, 1], [step])],
                new_requests={request_id: new_request(request_id, [step])},
                finished_request_ids=[f"r{step - 1}"] if step else [],
            )
            inputs, _ = batch.prepare(out)
            writer.send(inputs, check_alive, 30)
            expected += int(inputs.input_ids.sum()) + int(inputs.table_block_ids.sum())
        writer.send(None, check_alive, 30)
        process.join(30)
        assert process.exitcode == 0 and results.get() == expected
    finally:
        if process.is_alive():
            process.kill()
        writer.close()
    assert not _segment_exists(writer.name)


def _wait_for_a_message(handle) -> None:
    ChannelReader(handle).recv(lambda: True)


def test_a_reader_killed_while_it_waits_does_not_block_the_writer():
    """A reader process killed inside its wait for the next message (as a worker killed between steps):
    the writer's publish returns at once and its next send reports the dead reader. (Multiprocessing's
    events hang here: their set() waits for every process that sleeps in their wait() to wake.)"""
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(1024, 1, ctx)
    process = ctx.Process(target=_wait_for_a_message, args=(writer.reader_handle(0),), daemon=True)
    process.start()

    def check_alive():
        if process.exitcode is not None:
            raise RuntimeError("reader exited")

    outcome: list = []

    def send_twice():
        try:
            writer.send("one", check_alive, 30)
            outcome.append("published")
            writer.send("two", check_alive, 30)
        except RuntimeError as e:
            outcome.append(str(e))

    try:
        writer.wait_acks(check_alive, 30)  # attached; now (or soon) waiting for "one"
        time.sleep(0.5)
        process.kill()
        process.join(10)
        sender = threading.Thread(target=send_twice, daemon=True)
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "the writer hangs on the dead reader"
        assert outcome == ["published", "reader exited"]
    finally:
        if process.is_alive():
            process.kill()
        writer.close()


@pytest.mark.parametrize(
    "seqs, budget, max_model_len, block_size",
    [(1, 16, 16, 16), (4, 64, 300, 16), (256, 16384, 4096, 16), (64, 8192, 40960, 256), (512, 512, 2048, 16)],
)
def test_size_bound_covers_the_largest_batch(seqs, budget, max_model_len, block_size):
    cfg = SimpleNamespace(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_blocks_per_seq=(max_model_len + block_size - 1) // block_size,
    )
    width = cfg.max_blocks_per_seq + 1
    tokens = max(budget, seqs)
    per_row = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    params = SamplingParams(prompt_logprobs=1)
    batch = InputBatch(seqs, cfg.max_blocks_per_seq, block_size, torch.device("cpu"))
    ids = [f"r{i}" for i in range(seqs)]
    # Every row new, with a full-width block table sent whole, and prompt logprobs at every token.
    out = SchedulerOutput(
        scheduled=[
            row(rid, 0, [7] * n, list(range(width)), prompt_logprob_targets=[7] * n)
            for rid, n in zip(ids, per_row, strict=True)
        ],
        new_requests={rid: new_request(rid, list(range(width)), params) for rid in ids},
    )
    step, _ = batch.prepare(out)
    size = len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert size <= max_message_bytes(cfg)
