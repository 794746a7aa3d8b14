"""The engine-core process on its own (run_engine_core behind two raw ZeroMQ sockets, the tiny model on
the CPU): ready, each step's outputs, rejected requests and failing utility
calls answered without a crash, SIGINT ignored, and every way it ends: Shutdown and SIGTERM (status 0),
a core that fails to start or fails in a step (a FatalError with the traceback, status 1), a parent
that is gone (it exits by itself and removes the parent's socket files)."""

import multiprocessing
import os
import signal
import time

import pytest
import zmq

from nanoinfer.config import EngineConfig
from nanoinfer.engine import wire
from nanoinfer.engine.core_process import _UTILITIES, run_engine_core
from nanoinfer.frontend.input_processor import InputProcessor
from nanoinfer.models.checkpoint import load_tokenizer
from tests.engine.core_factories import no_core, slow_core, step_fails_core
from tests.fixtures import engine_requests

KWARGS = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 64}


class _Engine:
    """An engine process and the two sockets a parent binds for it."""

    def __init__(self, config, directory, core_factory=None, parent_pid=None):
        self.context = zmq.Context()
        self.input_path, self.output_path = f"{directory}/in", f"{directory}/out"
        self.input = self.context.socket(zmq.PUSH)
        self.input.bind(f"ipc://{self.input_path}")
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(f"ipc://{self.output_path}")
        extra = (core_factory,) if core_factory is not None else ()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(
                config,
                f"ipc://{self.input_path}",
                f"ipc://{self.output_path}",
                parent_pid or os.getpid(),
                *extra,
            ),
        )
        self.process.start()

    def send(self, message):
        self.input.send(wire.encode(message))

    def recv(self, timeout=30.0):
        if not self.output.poll(timeout * 1000):
            raise TimeoutError("no message from the engine process")
        return wire.decode_output(self.output.recv())

    def call(self, method, *args, call_id=0):
        self.send(wire.UtilityCall(call_id, method, list(args)))
        while True:
            message = self.recv()
            if isinstance(message, wire.UtilityResult):
                assert message.call_id == call_id
                return message

    def close(self):
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def config(tiny_qwen3):
    return EngineConfig(tiny_qwen3, **KWARGS)


@pytest.fixture(scope="module")
def engine(config, tmp_path_factory):
    engine = _Engine(config, tmp_path_factory.mktemp("ipc"))
    ready = engine.recv()
    assert isinstance(ready, wire.Ready)
    assert ready.num_kv_blocks == 64 and ready.pid == engine.process.pid
    assert ready.stats["num_kv_blocks_free"] == 64
    yield engine
    try:
        engine.send(wire.AddRequests(_requests(config, "last", count=2, max_tokens=200)))
        assert isinstance(engine.recv(), wire.Outputs)
        engine.send(wire.Shutdown())  # mid-run
        engine.process.join(10)
        assert engine.process.exitcode == 0
    finally:
        engine.close()


def _requests(config, prefix, count=3, **params):
    processor = InputProcessor(config, load_tokenizer(config.model), config.num_kvcache_blocks)
    return engine_requests(processor, prefix, count, **params)


def _collect(engine, ids):
    """Token ids and finish reasons per request id until all of ``ids`` finished, and the batches."""
    tokens = {i: [] for i in ids}
    finished: dict[str, str] = {}
    errors: dict[str, str] = {}
    batches = []
    while not set(ids) <= set(finished):
        message = engine.recv()
        assert isinstance(message, wire.Outputs), message
        batches.append(message)
        for out in message.outputs:
            if out.error is not None:
                errors[out.request_id] = out.error
                continue
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    return tokens, finished, errors, batches


def test_utilities_match_the_allow_list():
    assert set(_UTILITIES) == set(wire.UTILITY_METHODS)


def test_outputs_of_each_step(engine, config):
    """(The tokens equal an in-process core's: tests/frontend/test_core_client.py.)"""
    requests = _requests(config, "same") + _requests(config, "fan", count=1, temperature=0.8, seed=3, n=2)
    engine.send(wire.AddRequests(requests))
    tokens, finished, errors, batches = _collect(engine, [r.request_id for r in requests])
    assert not errors and set(finished.values()) == {"length"}
    assert all(len(t) == 8 for t in tokens.values())
    assert sum(b.num_generated_tokens for b in batches) == sum(len(t) for t in tokens.values())
    assert sum(b.num_prompt_tokens for b in batches) >= sum(len(r.prompt_token_ids) for r in requests[:3])
    assert all(b.timestamp <= time.time() for b in batches)
    stats = engine.call("stats").value
    assert stats["num_kv_blocks_free"] == 64 and stats["num_running"] == 0


def test_rejected_request_fails_alone(engine, config):
    first = _requests(config, "dup", count=1, max_tokens=20)
    engine.send(wire.AddRequests(first))
    again = _requests(config, "dup", count=1) + _requests(config, "ok", count=1)
    engine.send(wire.AddRequests(again))
    tokens, finished, errors, _ = _collect(engine, ["dup0", "ok0"])
    assert "already in use" in errors["dup0"]
    assert finished == {"dup0": "length", "ok0": "length"}
    assert len(tokens["dup0"]) == 20 and len(tokens["ok0"]) == 8


def test_utility_errors_and_sigint(engine):
    assert engine.call("ping", 1, "a", call_id=7).value == [1, "a"]
    unknown = engine.call("reset_everything", call_id=8)
    assert unknown.value is None and "unknown utility method" in unknown.error
    bad_args = engine.call("stats", 1, 2, call_id=9)
    assert "TypeError" in bad_args.error
    os.kill(engine.process.pid, signal.SIGINT)
    time.sleep(0.3)
    assert engine.process.is_alive() and engine.call("ping", call_id=10).value == []


def test_sigterm_exits_zero_mid_run(config, tmp_path):
    engine = _Engine(config, tmp_path)
    try:
        assert isinstance(engine.recv(), wire.Ready)
        engine.send(wire.AddRequests(_requests(config, "t", count=2, max_tokens=200)))
        assert isinstance(engine.recv(), wire.Outputs)
        engine.process.terminate()
        engine.process.join(10)
        assert engine.process.exitcode == 0
    finally:
        engine.close()


def test_start_failure_is_reported(config, tmp_path):
    engine = _Engine(config, tmp_path, core_factory=no_core)
    try:
        message = engine.recv()
        assert isinstance(message, wire.FatalError)
        assert "failed to start" in message.text and "injected start failure" in message.text
        assert "Traceback" in message.text
        engine.process.join(10)
        assert engine.process.exitcode == 1
    finally:
        engine.close()


def test_step_failure_is_fatal(config, tmp_path):
    engine = _Engine(config, tmp_path, core_factory=step_fails_core("injected step failure"))
    try:
        assert isinstance(engine.recv(), wire.Ready)
        engine.send(wire.AddRequests(_requests(config, "f", count=2, max_tokens=50)))
        messages = [engine.recv()]
        while not isinstance(messages[-1], wire.FatalError):
            messages.append(engine.recv())
        assert all(isinstance(m, wire.Outputs) for m in messages[:-1])
        assert "injected step failure" in messages[-1].text and "Traceback" in messages[-1].text
        engine.process.join(10)
        assert engine.process.exitcode == 1
    finally:
        engine.close()


def test_exits_when_its_parent_is_gone(config, tmp_path):
    """A parent pid that is not its parent's (-1: no process has it) is a parent that died: it exits
    within about a second, even while its core is still being built, and removes the parent's socket
    files."""
    engine = _Engine(config, tmp_path, core_factory=slow_core(30), parent_pid=-1)
    try:
        engine.process.join(10)
        assert engine.process.exitcode == 1
        assert not os.path.exists(engine.input_path) and not os.path.exists(engine.output_path)
        assert not tmp_path.exists()
    finally:
        engine.close()
