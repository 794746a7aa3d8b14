"""EngineCoreProcess (the API side of an engine core in its own process) on the tiny model, CPU: the same
tokens and logprobs as an in-process EngineCore, aborts free blocks, a rejected request fails alone,
utility calls from many threads, and every way the engine process ends: shut down (no on_dead), killed
(on_dead within 2 s), a fatal step error under tensor parallelism (on_dead with its traceback), a failed
or slow start (an exception, nothing left running), and the API process killed (the engine process exits
within 5 s) or exiting without shutdown() (its exit hook stops the engine). No socket directory (nor the
tensor-parallel channel's /dev/shm segment) is left behind."""

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCore
from nanoinfer.frontend.core_client import EngineCoreDeadError, EngineCoreProcess
from nanoinfer.frontend.input_processor import InputProcessor
from nanoinfer.models.checkpoint import load_tokenizer
from tests.engine.core_factories import no_core, slow_core, step_fails_core
from tests.fixtures import engine_requests

KWARGS = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 64}
REPO_ROOT = Path(__file__).resolve().parents[2]


class _Collector:
    """on_outputs / on_dead for a test: what arrived, per core request id."""

    def __init__(self):
        self.cond = threading.Condition()
        self.tokens = defaultdict(list)
        self.logprobs = defaultdict(list)
        self.prompt_logprobs = defaultdict(list)
        self.finished: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.num_batches = 0
        self.dead: list[tuple[float, str]] = []
        self.threads = set()

    def on_outputs(self, batch):
        with self.cond:
            self.threads.add(threading.current_thread().name)
            self.num_batches += 1
            for out in batch.outputs:
                if out.error is not None:
                    self.errors[out.request_id] = out.error
                    continue
                self.tokens[out.request_id] += out.new_token_ids
                if out.new_logprobs is not None:
                    self.logprobs[out.request_id].append(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[out.request_id].append(
                        (out.prompt_logprobs_start, out.prompt_logprobs)
                    )
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out.finish_reason
            self.cond.notify_all()

    def on_dead(self, text):
        with self.cond:
            self.threads.add(threading.current_thread().name)
            self.dead.append((time.monotonic(), text))
            self.cond.notify_all()

    def wait(self, predicate, timeout=30.0):
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "timed out"

    def wait_finished(self, ids, timeout=30.0):
        self.wait(lambda: set(ids) <= set(self.finished) | set(self.errors), timeout)


def _shm_entries_of(pid):
    """/dev/shm entries named after ``pid``: the tensor-parallel channel of an engine process. (Other
    entries, such as multiprocessing's semaphores, cannot be told apart from those of other processes
    on the machine.)"""
    return [e for e in os.listdir("/dev/shm") if f"_{pid}_" in e] if os.path.isdir("/dev/shm") else []


def _socket_dirs():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nanoinfer-*")))


@pytest.fixture(scope="module")
def config(tiny_qwen3):
    return EngineConfig(tiny_qwen3, **KWARGS)


@pytest.fixture(scope="module")
def processor(config):
    return InputProcessor(config, load_tokenizer(config.model), config.num_kvcache_blocks)


@pytest.fixture
def no_leftovers():
    dirs = _socket_dirs()
    yield
    assert _socket_dirs() <= dirs


@pytest.fixture(scope="module")
def served(config):
    """A shared engine process (each test uses request ids of its own) and its collector."""
    dirs = _socket_dirs()
    collector = _Collector()
    client = EngineCoreProcess(config, collector.on_outputs, collector.on_dead, ready_timeout=60)
    assert client.num_kv_blocks == 64 and client.is_alive and client.error is None
    yield client, collector
    client.shutdown()
    assert not collector.dead and client._process.exitcode == 0
    assert not client.is_alive and client.error == "the engine process was shut down"
    with pytest.raises(EngineCoreDeadError):
        client.abort_requests(["same0"])
    assert not os.path.exists(client.directory)
    assert _socket_dirs() <= dirs


def _in_process(config, requests):
    core = EngineCore(config)
    tokens, logprobs, prompt_logprobs = defaultdict(list), defaultdict(list), defaultdict(list)
    try:
        for request in requests:
            core.add_request(request)
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.new_logprobs is not None:
                    logprobs[out.request_id].append(out.new_logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id].append((out.prompt_logprobs_start, out.prompt_logprobs))
    finally:
        core.close()
    return tokens, logprobs, prompt_logprobs


def test_same_outputs_as_an_in_process_core(served, config, processor):
    client, collector = served
    requests = engine_requests(processor, "same") + engine_requests(
        processor, "sampled", count=1, temperature=0.9, seed=11, n=2, logprobs=3, prompt_logprobs=2
    )
    client.add_requests(requests)
    ids = [r.request_id for r in requests]
    collector.wait_finished(ids)
    tokens, logprobs, prompt_logprobs = _in_process(config, requests)
    assert {i: collector.tokens[i] for i in ids} == tokens
    assert {i: collector.logprobs[i] for i in ids if i in logprobs} == logprobs
    assert {i: collector.prompt_logprobs[i] for i in ids if i in prompt_logprobs} == prompt_logprobs
    assert len(logprobs) == 2 and len(prompt_logprobs) == 1  # prompt logprobs: the first completion only
    assert all(collector.finished[i] == "length" for i in ids) and not collector.errors
    assert collector.threads == {"nanoinfer-core-client"}


def test_abort_frees_blocks(served, processor):
    client, collector = served
    requests = engine_requests(processor, "abort", max_tokens=200)
    ids = [r.request_id for r in requests]
    client.add_requests(requests)
    collector.wait(lambda: all(collector.tokens[i] for i in ids))
    client.abort_requests(ids)
    stats = client.call("stats", timeout=10)  # answered after the abort was applied
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] == 64
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert client.call("has_unfinished_requests", timeout=10) is False
    seen = {i: len(collector.tokens[i]) for i in ids}
    time.sleep(0.2)
    assert {i: len(collector.tokens[i]) for i in ids} == seen  # nothing after the abort's answer
    assert not set(ids) & set(collector.finished)


def test_rejected_request_fails_alone(served, processor):
    client, collector = served
    client.add_requests(engine_requests(processor, "dup", count=1, max_tokens=20))
    again = engine_requests(processor, "dup", count=1) + engine_requests(processor, "fine", count=1)
    client.add_requests(again)
    collector.wait(lambda: {"dup0", "fine0"} <= set(collector.finished))
    assert "already in use" in collector.errors["dup0"]
    assert len(collector.tokens["dup0"]) == 20 and len(collector.tokens["fine0"]) == 8
    assert client.is_alive


def test_calls_from_many_threads(served):
    client, _ = served
    answers = {}

    def ask(thread_index):
        answers[thread_index] = [client.call("ping", thread_index, i, timeout=10) for i in range(25)]

    threads = [threading.Thread(target=ask, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {t: [[t, i] for i in range(25)] for t in range(4)}
    with pytest.raises(ValueError, match="name must be one of"):
        client.call("reset_everything")
    with pytest.raises(RuntimeError, match="TypeError"):
        client.call("stats", 1, timeout=10)
    assert client.call_future("ping", "x").result(10) == ["x"]

    async def cancel_one_then_call():
        """An awaiter cancelled while its call is in flight cancels the future; its answer is dropped."""
        waiting = asyncio.ensure_future(asyncio.wrap_future(client.call_future("ping", "cancelled")))
        await asyncio.sleep(0)
        waiting.cancel()
        return [await asyncio.wrap_future(client.call_future("ping", i)) for i in range(3)]

    for _ in range(5):
        assert asyncio.run(cancel_one_then_call()) == [[0], [1], [2]]
    assert client.is_alive and not client._calls


def test_killed_engine_calls_on_dead(config, processor, no_leftovers):
    collector = _Collector()
    client = EngineCoreProcess(config, collector.on_outputs, collector.on_dead, ready_timeout=60)
    try:
        requests = engine_requests(processor, "kill", max_tokens=200)
        client.add_requests(requests)
        collector.wait(lambda: collector.tokens[requests[0].request_id])
        killed_at = time.monotonic()
        os.kill(client.pid, signal.SIGKILL)
        collector.wait(lambda: collector.dead, timeout=5)
        (dead_at, text), *more = collector.dead
        assert dead_at - killed_at < 2.0 and not more
        assert "SIGKILL" in text and client.error == text and not client.is_alive
        with pytest.raises(EngineCoreDeadError, match="SIGKILL"):
            client.add_requests(requests)
        with pytest.raises(EngineCoreDeadError):
            client.call("ping", timeout=5)
    finally:
        client.shutdown()
    assert len(collector.dead) == 1 and not os.path.exists(client.directory)


def test_fatal_step_error_calls_on_dead(tiny_qwen3, processor, no_leftovers):
    """Under tensor parallelism too: the engine process starts its worker (it is no daemon), and a step
    failure on rank 0 stops the worker and the process, leaving nothing behind."""
    config = EngineConfig(tiny_qwen3, tensor_parallel_size=2, **KWARGS)
    collector = _Collector()
    client = EngineCoreProcess(
        config,
        collector.on_outputs,
        collector.on_dead,
        ready_timeout=60,
        core_factory=step_fails_core("injected step failure"),
    )
    try:
        client.add_requests(engine_requests(processor, "fatal", max_tokens=50))
        collector.wait(lambda: collector.dead, timeout=20)
        [(_, text)] = collector.dead
        assert "injected step failure" in text and "Traceback" in text and not client.is_alive
        assert collector.num_batches >= 1  # the steps before the failure
        client._receiver.join(20)
        assert client._process.exitcode == 1
    finally:
        client.shutdown()
    assert len(collector.dead) == 1 and collector.threads == {"nanoinfer-core-client"}
    assert not _shm_entries_of(client.pid)


def test_failed_start_raises_with_the_engine_error(config, no_leftovers):
    collector = _Collector()
    with pytest.raises(RuntimeError, match="failed to start(.|\n)*injected start failure"):
        EngineCoreProcess(
            config, collector.on_outputs, collector.on_dead, ready_timeout=60, core_factory=no_core
        )
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not ready within 1"):
        EngineCoreProcess(
            config, collector.on_outputs, collector.on_dead, ready_timeout=1, core_factory=slow_core(60)
        )
    assert time.monotonic() - started < 5  # SIGTERM stops a core that is still being built at once
    assert not collector.dead


_API_PROCESS = """
import sys
import time

from nanoinfer.config import EngineConfig
from nanoinfer.engine.request import EngineRequest
from nanoinfer.frontend.core_client import EngineCoreProcess
from nanoinfer.sampling_params import SamplingParams

config = EngineConfig(sys.argv[1], device="cpu", max_model_len=256, num_kvcache_blocks=64)
client = EngineCoreProcess(config, lambda batch: None, lambda text: print("on_dead"), ready_timeout=60)
params = SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True)
client.add_requests([EngineRequest(f"r{i}", [5, 6, 7], params, seed=i) for i in range(4)])
print(client.pid, client.directory, flush=True)
if sys.argv[2] == "sleep":
    time.sleep(120)
"""


def _exited(pid):
    """True once ``pid`` is gone or a zombie (its new parent may not reap it at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_exited(pid, timeout):
    deadline = time.monotonic() + timeout
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _exited(pid)


def test_engine_process_ends_with_the_api_process(tiny_qwen3, no_leftovers):
    """Killed (SIGKILL) mid-run, the API process leaves an engine process that exits by itself within 5 s
    and removes the sockets' directory; an API process that just returns from its script (no shutdown())
    stops its engine at exit instead of waiting for it forever."""
    api = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _API_PROCESS, tiny_qwen3, mode],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for mode in ("sleep", "exit")
    }
    engines = {}
    try:
        for mode, process in api.items():
            pid, directory = process.stdout.readline().split()
            engines[mode] = (int(pid), directory)
        killed_pid, killed_directory = engines["sleep"]
        time.sleep(0.3)  # mid-run
        assert not _exited(killed_pid) and os.path.isdir(killed_directory)
        api["sleep"].kill()
        api["sleep"].wait()
        assert _wait_exited(killed_pid, 5.0)
        assert not os.path.exists(killed_directory)  # the engine removed its dead parent's sockets
        assert api["exit"].wait(30) == 0
        assert api["exit"].stdout.read() == ""  # on_dead was not called
        exited_pid, exited_directory = engines["exit"]
        assert _exited(exited_pid) and not os.path.exists(exited_directory)
    finally:
        for process in api.values():
            process.kill()
            process.wait()
        for pid, _ in engines.values():
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)
