"""A live `nanoinfer serve` (a subprocess, CPU, tiny model) against a hostile client: every request gets a
200 or an OpenAI-shaped 4xx naming the field, /health keeps answering quickly while expensive requests
are in flight, normal requests succeed right after, slow and vanishing clients cost nothing and log no
traceback, and an engine that dies makes the server exit non-zero. The server runs its engine core in a
process of its own (serve's default), but for the engine failure, which is injected into the server's
process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "clé-ü-ключ"  # non-ASCII: the header carries its UTF-8 bytes
MAX_MODEL_LEN = 256
OK = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(
        self, args: list[str], log_path: Path, launcher: str | None = None, env: dict[str, str] | None = None
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable]
        command += ["-c", launcher] if launcher else ["-m", "nanoinfer.entrypoints.cli"]
        command += ["serve", *args, "--port", str(self.port)]
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
            time.sleep(0.2)

    def headers(self) -> dict[bytes, bytes]:
        return {b"authorization": b"Bearer " + API_KEY.encode(), b"content-type": b"application/json"}

    def post(self, path: str, body, timeout: float = 60, **kwargs) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = kwargs.pop("headers", self.headers())
        return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout, **kwargs)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(2)  # SIGINT: uvicorn's graceful shutdown
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    args = [tiny_qwen3, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY]
    args += ["--header-timeout", "1", "--body-timeout", "1", "--allowed-hosts", "127.0.0.1"]
    args += ["--served-model-name", "tiny"]
    srv = LiveServer(args, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    assert srv.stop() == 0


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


def _assert_ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"] and body["usage"]["completion_tokens"] >= 1
    return body


def _health_latency_while(server: LiveServer, work) -> tuple[float, object]:
    """Runs ``work()`` in a thread and polls /health meanwhile; returns the slowest /health answer."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        slowest = 0.0
        while True:
            started = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            if future.done():
                break
            time.sleep(0.02)
        return slowest, future.result()


# Each sampling field at its float extremes: (field, value, allowed). allowed=True: 200; else 400 naming it.
SAMPLING_EXTREMES = [
    ("temperature", 0.0, True),
    ("temperature", 1e-45, True),
    ("temperature", 1e6, True),
    ("temperature", 1e308, False),
    ("top_p", 1e-300, False),
    ("top_p", 7e-46, False),
    ("top_p", 1.2e-38, True),
    ("top_p", 1.0, True),
    ("min_p", 1e-300, False),
    ("min_p", 1.2e-38, True),
    ("min_p", 1.0, True),
    ("top_k", 1, True),
    ("top_k", 2**31 - 1, True),
    ("top_k", 2**63, False),
    ("presence_penalty", 2.0, True),
    ("presence_penalty", -2.5, False),
    ("frequency_penalty", -2.0, True),
    ("frequency_penalty", 1e308, False),
    ("repetition_penalty", 1e-6, True),
    ("repetition_penalty", 1e6, True),
    ("repetition_penalty", 1e-300, False),
    ("repetition_penalty", 1e300, False),
    ("seed", -(2**63), True),
    ("seed", 10**30, True),
    ("n", 128, True),
    ("n", 129, False),
    ("n", 10_000, False),
    ("max_tokens", 10**30, False),
    ("min_tokens", 10**30, False),
    ("logprobs", 20, True),
    ("logprobs", 21, False),
]


@pytest.mark.parametrize("field, value, allowed", SAMPLING_EXTREMES)
def test_sampling_fields_at_their_extremes(server, field, value, allowed):
    body = {**OK, "temperature": 0.7, field: value}
    if field == "n":
        body["max_tokens"] = 1
    response = server.post("/v1/completions", body)
    if allowed:
        _assert_ok(response)
    else:
        _assert_openai_error(response, 400, field)
    _assert_ok(server.post("/v1/completions", OK))


def test_tiny_top_p_no_longer_kills_the_engine(server):
    body = {"prompt": "hi", "max_tokens": 4, "top_p": 1e-300}
    _assert_openai_error(server.post("/v1/completions", body), 400, "top_p")
    body["top_p"] = 1.2e-38  # the smallest allowed: the sampler keeps the most likely token
    _assert_ok(server.post("/v1/completions", body))
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_template_from_the_request_is_refused(server):
    for template in (
        "{{ 'ab ' * 3000000 }}",
        "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}",
    ):
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": template},
        }
        slowest, response = _health_latency_while(
            server, lambda b=body: server.post("/v1/chat/completions", b)
        )
        _assert_openai_error(response, 400, "chat_template_kwargs")
        assert slowest < 1.0
    # Keys that are apply_chat_template's own arguments are not template variables.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = {**body, "chat_template_kwargs": {"tokenize": True}}
    _assert_openai_error(server.post("/v1/chat/completions", bad), 400, "chat_template_kwargs")
    _assert_ok(server.post("/v1/chat/completions", body))


def test_huge_prompts_are_refused_before_tokenization_without_stalling(server):
    huge = "lorem ipsum dolor " * 58_000  # about 1 MiB of text, under the body limit
    slowest, response = _health_latency_while(
        server, lambda: server.post("/v1/completions", {"prompt": huge, "max_tokens": 2})
    )
    _assert_openai_error(response, 400, "prompt")
    assert slowest < 1.0
    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    _assert_openai_error(server.post("/v1/chat/completions", chat), 400, "messages")
    # Under the character limit but over the context: tokenized (off the event loop), then refused.
    long_text = "hello " * 4000
    slowest, response = _health_latency_while(
        server, lambda: server.post("/v1/completions", {"prompt": long_text, "max_tokens": 2})
    )
    _assert_openai_error(response, 400, "prompt")
    assert slowest < 1.0
    _assert_ok(server.post("/v1/completions", OK))


def test_unbounded_work_is_refused(server):
    _assert_openai_error(server.post("/v1/completions", {**OK, "stop": ["x"] * 50_000}), 400, "stop")
    _assert_openai_error(server.post("/v1/completions", {**OK, "stop": ["y" * 300]}), 400, "stop")
    _assert_ok(server.post("/v1/completions", {**OK, "stop": [f"s{i}" for i in range(16)]}))
    many = {**OK, "prompt": ["a", "b", "c"] * 30, "n": 3}  # 270 completions
    _assert_openai_error(server.post("/v1/completions", many), 400, "prompt")
    _assert_openai_error(server.post("/v1/completions", {**OK, "n": 200}), 400, "n")


def test_bad_stop_token_ids_name_their_field(server):
    _assert_openai_error(
        server.post("/v1/completions", {**OK, "stop_token_ids": [10**6]}), 400, "stop_token_ids"
    )


@pytest.mark.parametrize("echo", [False, True])
def test_prompt_token_ids_out_of_range_name_the_prompt(server, echo):
    # With echo they used to reach the tokenizer's decode first: a 500 (found by fuzzing the server).
    for ids in ([-1], [10**6], [[1, 2], [3, -5]]):
        body = {**OK, "prompt": ids, "echo": echo}
        _assert_openai_error(server.post("/v1/completions", body), 400, "prompt")


def test_only_json_bodies_and_allowed_hosts(server):
    plain = {**server.headers(), b"content-type": b"text/plain"}
    response = server.post("/v1/completions", OK, headers=plain)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    missing = {b"authorization": server.headers()[b"authorization"]}
    assert server.post("/v1/completions", OK, headers=missing).status_code == 415
    evil = {**server.headers(), b"host": b"evil.example"}
    assert server.post("/v1/completions", OK, headers=evil).status_code == 400
    wrong_key = {**server.headers(), b"authorization": b"Bearer cle-u"}
    assert server.post("/v1/completions", OK, headers=wrong_key).status_code == 401
    _assert_ok(server.post("/v1/completions", OK))  # the non-ASCII key itself works


def _raw_request(server: LiveServer, head: bytes, body: bytes = b"", wait: float = 0.0) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head)
        if body:
            sock.sendall(body)
        time.sleep(wait)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def _head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        + b"authorization: Bearer "
        + API_KEY.encode()
        + f"\r\ncontent-length: {length}\r\n\r\n".encode()
    )


def test_slow_and_vanishing_clients(server):
    log_before = server.log_path.read_text()
    # Headers that never finish: the connection is closed after --header-timeout (1 s).
    started = time.monotonic()
    assert _raw_request(server, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n") == b""
    assert time.monotonic() - started < 5
    # A body that never finishes: 408 after --body-timeout.
    answer = _raw_request(server, _head(1000), b'{"prompt": ')
    assert answer.startswith(b"HTTP/1.1 408")
    # Clients that leave while uploading their body.
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_head(100_000) + b'{"prompt": "')
    time.sleep(0.5)
    _assert_ok(server.post("/v1/completions", OK))
    new_log = server.log_path.read_text()[len(log_before) :]
    assert "Traceback" not in new_log and "Exception" not in new_log, new_log
    assert len(new_log.splitlines()) <= 30


_CRASHING_LAUNCHER = textwrap.dedent(
    """
    import sys
    from nanoinfer.executor.model_runner import ModelRunner
    from nanoinfer.entrypoints.cli import main

    real = ModelRunner.execute
    calls = []

    def execute(self, *args):
        calls.append(1)
        if len(calls) > 12:  # after a few steps: a fault no request caused (a device error, say)
            raise RuntimeError("simulated device failure")
        return real(self, *args)

    ModelRunner.execute = execute
    sys.exit(main(sys.argv[1:]))
    """
)


def test_server_exits_non_zero_when_the_engine_dies(tiny_qwen3, tmp_path):
    # The launcher breaks the engine in the server's own process: the engine must run there. (With the
    # engine core in a process of its own: tests/entrypoints/test_server_process.py.)
    args = [tiny_qwen3, "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--no-engine-process"]
    srv = LiveServer(args, tmp_path / "server.log", launcher=_CRASHING_LAUNCHER)
    try:
        body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "simulated device failure" in json.loads(events[-2][len("data: ") :])["error"]["message"]
        srv.process.wait(20)
        assert srv.process.returncode == 1
        assert "simulated device failure" in srv.log_path.read_text()
    finally:
        srv.stop()
