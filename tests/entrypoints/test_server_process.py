"""`nanoinfer serve` with its engine core in a process of its own (serve's default), live (a subprocess,
CPU, tiny model), through its faults and its shutdown: a killed engine process ends every stream with an
error event, and a whole response with 503, within a second, and the server exits non-zero; a killed
server takes its engine process with it; SIGTERM during six streams lets those that can finish in time
finish, ends the others with an error event, and exits 0. After each, none of the server's processes,
socket directories or /dev/shm entries is left. Plus the streaming cost (one event per engine step,
carrying all of the step's new text, and vLLM's continuous usage stats; through HTTP in test_server.py)
and the flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import httpx
import pytest

from nanoinfer.entrypoints import cli_serve, server
from nanoinfer.entrypoints.server import _Reply
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams
from tests.entrypoints.engine_delays import LAUNCHER, STEP_DELAY_ENV
from tests.entrypoints.test_server_hardening import LiveServer

MAX_MODEL_LEN = 256
# Each engine step of the live servers sleeps this long, so that streams last long enough to be cut.
STEP_DELAY_S = 0.02


# -- processes and what they leave ------------------------------------------------------------------------


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (the engine process, multiprocessing's resource tracker)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _state_and_parent(int(entry))) is not None:
            parents[int(entry)] = info[1]
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _exited(pid: int) -> bool:
    info = _state_and_parent(pid)
    return info is None or info[0] in ("Z", "X")


def _wait_all_exited(pids: set[int], timeout: float) -> set[int]:
    """The pids still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(map(_exited, pids)):
        time.sleep(0.05)
    return {pid for pid in pids if not _exited(pid)}


def _engine_pid(server_pid: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in _descendants(server_pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        time.sleep(0.05)
    raise AssertionError("no engine process below the server")


def _shm_entries_of(pids: set[int]) -> list[str]:
    """/dev/shm entries named after one of ``pids`` (as a tensor-parallel channel is)."""
    if not os.path.isdir("/dev/shm"):
        return []
    return [e for e in os.listdir("/dev/shm") if any(f"_{pid}_" in e for pid in pids)]


class Served:
    """A live server whose engine steps are STEP_DELAY_S slower, with a temporary directory of its own
    (where its engine process's sockets live), and everything it started."""

    def __init__(self, tiny_qwen3: str, log_path, *extra_args: str):
        # Short: an ipc socket path must fit in 108 bytes.
        self.tmpdir = tempfile.mkdtemp(prefix="nist-", dir="/tmp")
        args = [tiny_qwen3, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), *extra_args]
        env = {"TMPDIR": self.tmpdir, STEP_DELAY_ENV: str(STEP_DELAY_S)}
        try:
            self.live = LiveServer(args, log_path, launcher=LAUNCHER, env=env)
        except BaseException:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        self.pid = self.live.process.pid
        self.pids = {self.pid}
        try:
            self.engine_pid = _engine_pid(self.pid)
            self.pids |= _descendants(self.pid)
            assert self.engine_pid in self.pids and os.listdir(self.tmpdir), "no socket directory"
        except BaseException:
            self.close()
            raise

    def assert_nothing_left(self) -> None:
        assert not _wait_all_exited(self.pids, 10.0), "processes left behind"
        assert os.listdir(self.tmpdir) == [], "socket files or directories left behind"
        assert not _shm_entries_of(self.pids)

    def close(self) -> None:
        if self.live.process.poll() is None:
            self.live.process.kill()
            self.live.process.wait()
        self.live.log.close()
        for pid in self.pids:
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class StreamReader(threading.Thread):
    """Streams one completion in the background: its SSE data lines, when each arrived, and an event
    set once the first text arrived."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url = url
        self.body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        self.body["stream"] = True
        self.lines: list[tuple[float, str]] = []
        self.started = threading.Event()
        self.failure: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=30) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append((time.monotonic(), line[len("data: ") :]))
                        self.started.set()
        except BaseException as e:  # the test reports it
            self.failure = e
            self.started.set()

    def events(self) -> list[dict]:
        """The JSON events before [DONE] (which must end the stream, the only one)."""
        data = [line for _, line in self.lines]
        assert self.failure is None, self.failure
        assert data and data[-1] == "[DONE]" and data.count("[DONE]") == 1, data[-3:]
        return [json.loads(line) for line in data[:-1]]

    def error_time(self) -> float:
        """When the error event arrived."""
        (when,) = [when for when, line in self.lines if line.startswith('{"error"')]
        return when


@pytest.fixture
def served(tiny_qwen3, tmp_path):
    servers = []

    def start(*extra_args: str) -> Served:
        srv = Served(tiny_qwen3, tmp_path / f"server{len(servers)}.log", *extra_args)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.close()


def test_killed_engine_process_ends_every_stream_and_the_server_exits_non_zero(served):
    srv = served()
    readers = [StreamReader(srv.live.url, 200) for _ in range(4)]
    assert all(r.started.wait(30) for r in readers)
    whole = {}  # a request answered as a whole, in flight as well

    def post_whole() -> None:
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        response = httpx.post(srv.live.url + "/v1/completions", json=body, timeout=30)
        whole.update(status=response.status_code, body=response.json(), at=time.monotonic())

    poster = threading.Thread(target=post_whole, daemon=True)
    poster.start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(srv.engine_pid, signal.SIGKILL)
    poster.join(10)
    assert whole["status"] == 503 and "SIGKILL" in whole["body"]["error"]["message"]
    assert whole["at"] - killed_at < 1.0
    for reader in readers:
        reader.join(10)
        events = reader.events()
        assert "SIGKILL" in events[-1]["error"]["message"] and events[-1]["error"]["type"] == "server_error"
        assert all("choices" in e and e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert reader.error_time() - killed_at < 1.0
    assert srv.live.process.wait(10) == 1
    assert time.monotonic() - killed_at < 5.0
    srv.assert_nothing_left()
    assert "SIGKILL" in srv.live.log_path.read_text()


def test_killed_server_takes_its_engine_process_with_it(served):
    srv = served()
    reader = StreamReader(srv.live.url, 200)
    assert reader.started.wait(30)
    killed_at = time.monotonic()
    srv.live.process.kill()  # SIGKILL: nothing of the server runs any more
    srv.live.process.wait()
    assert not _wait_all_exited({srv.engine_pid}, 5.0)
    assert time.monotonic() - killed_at < 5.0
    srv.assert_nothing_left()  # the engine process removed the dead server's socket files


def test_sigterm_during_six_streams_drains_and_exits_zero(served):
    # Short streams (40 steps: 0.8 s) finish within the 2 s allowed; long ones (200: 4 s) are cut then.
    srv = served("--shutdown-timeout", "2")
    short = [StreamReader(srv.live.url, 40) for _ in range(3)]
    long = [StreamReader(srv.live.url, 200) for _ in range(3)]
    assert all(r.started.wait(30) for r in short + long)
    signalled_at = time.monotonic()
    srv.live.process.send_signal(signal.SIGTERM)
    for reader in short + long:
        reader.join(15)
    for reader in short:
        events = reader.events()
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    for reader in long:
        events = reader.events()
        assert "shut down" in events[-1]["error"]["message"]
        assert 2.0 <= reader.error_time() - signalled_at < 3.5
    assert srv.live.process.wait(10) == 0
    srv.assert_nothing_left()
    log = srv.live.log_path.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log  # uvicorn never had to cancel a response


# -- streaming cost ----------------------------------------------------------------------------------------


class _Stream:
    """Stands in for a RequestStream: yields the given DELTA outputs."""

    def __init__(self, outputs: list[RequestOutput]):
        self.outputs = outputs
        self.aborted = False

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        for output in self.outputs:
            yield output

    def abort(self) -> None:
        self.aborted = True


def _steps(num_steps: int, tokens_per_step: int) -> list[RequestOutput]:
    """One DELTA output per step, each with several new tokens (as speculative decoding makes them)."""
    outputs = []
    for step in range(num_steps):
        last = step == num_steps - 1
        ids = list(range(step * tokens_per_step, (step + 1) * tokens_per_step))
        completion = CompletionOutput(0, f"<{step}>", ids, finish_reason="length" if last else None)
        outputs.append(RequestOutput("r", None, [1, 2, 3], [completion], finished=last))
    return outputs


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_one_event_per_step_with_all_its_text_and_continuous_usage(chat):
    params = SamplingParams(max_tokens=12)
    reply = _Reply("id-1", "m", chat, [3], params, lambda token_id, logprob: "")

    async def events(include_usage, continuous):
        stream = _Stream(_steps(4, 3))
        lines = [line async for line in reply.stream_events([stream], include_usage, continuous)]
        assert stream.aborted and lines[-1] == b"data: [DONE]\n\n"
        return [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]

    plain, continuous = asyncio.run(events(False, False)), asyncio.run(events(True, True))
    first = 1 if chat else 0  # chat opens with the assistant's role
    assert len(plain) == first + 4 and len(continuous) == first + 4 + 1  # and a last usage chunk
    texts = [(c["delta"].get("content") if chat else c["text"]) for e in plain[first:] for c in e["choices"]]
    assert texts == ["<0>", "<1>", "<2>", "<3>"]
    assert all(e["usage"] is None for e in plain)
    usage = [e["usage"] for e in continuous]
    assert [u["completion_tokens"] for u in usage] == [0] * first + [3, 6, 9, 12, 12]
    assert all(u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"] for u in usage)
    assert continuous[-1]["choices"] == []


# -- flags -------------------------------------------------------------------------------------------------


def test_flags():
    parser = argparse.ArgumentParser()
    cli_serve.register(parser.add_subparsers())
    defaults = parser.parse_args(["serve", "/m"])
    assert defaults.engine_process is True and defaults.shutdown_timeout == server.GRACEFUL_SHUTDOWN_TIMEOUT_S
    chosen = parser.parse_args(["serve", "/m", "--no-engine-process", "--shutdown-timeout", "0.5"])
    assert chosen.engine_process is False and chosen.shutdown_timeout == 0.5
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "/m", "--shutdown-timeout", bad])
