"""The OpenAI-compatible server, end to end through the official `openai` client and raw HTTP: streaming
equals non-streaming, concurrent streams, disconnects abort, bad input gets OpenAI-shaped errors with the
right status and leaves no KV block behind, /metrics moves. Each with the engine on a thread of the
server's process and with the engine core in a process of its own. Plus the protocol's pure pieces."""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from nanoinfer import SamplingParams
from nanoinfer.config import EngineConfig
from nanoinfer.entrypoints import cli_serve
from nanoinfer.entrypoints import openai_protocol as protocol
from nanoinfer.entrypoints.engine_args import engine_kwargs_from_args
from nanoinfer.entrypoints.http_limits import ServerLimits
from nanoinfer.entrypoints.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from nanoinfer.entrypoints.server import OpenAIServer
from nanoinfer.frontend.async_llm import AsyncLLM
from nanoinfer.frontend.llm_engine import LLMEngine
from nanoinfer.metrics import ServingMetrics
from nanoinfer.outputs import Logprob
from tests.entrypoints.engine_delays import FlagFile, delayed_core

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_BODY = 64 * 1024
ENGINE_KWARGS = {"device": "cpu", "max_model_len": MAX_MODEL_LEN, "num_kvcache_blocks": 256}


@dataclass
class RunningServer:
    url: str
    server: OpenAIServer
    llm: AsyncLLM
    # While set, every engine step takes 10 ms longer: long requests stay in flight long enough for a
    # client to leave while they run.
    slow_steps: FlagFile


@contextlib.contextmanager
def serve_in_thread(model_path: str, engine_process: bool = False, **server_kwargs):
    """A real uvicorn server on a free 127.0.0.1 port, in a background thread of this process; its engine
    runs on a thread of this process, or (``engine_process``) its engine core in a process of its own."""
    with tempfile.TemporaryDirectory() as flag_directory:
        slow_steps = FlagFile(os.path.join(flag_directory, "slow-steps"))
        if engine_process:
            config = EngineConfig.from_kwargs(model_path, **ENGINE_KWARGS)
            core_factory = delayed_core(0.01, slow_steps.path)
            llm = AsyncLLM.with_engine_process(config, ready_timeout=60, core_factory=core_factory)
        else:
            llm = AsyncLLM(lambda: _engine_with_slow_steps(model_path, slow_steps))
        try:
            with _uvicorn_in_thread(llm, slow_steps, **server_kwargs) as srv:
                yield srv
        finally:
            llm.shutdown()


def _engine_with_slow_steps(model_path: str, slow_steps: FlagFile) -> LLMEngine:
    engine = LLMEngine.from_kwargs(model_path, **ENGINE_KWARGS)
    step = engine.step

    def maybe_slow_step():
        if slow_steps.is_set():
            time.sleep(0.01)
        return step()

    engine.step = maybe_slow_step
    return engine


@contextlib.contextmanager
def uvicorn_in_thread(app, **config_kwargs):
    """A uvicorn server for the ASGI ``app`` on a free 127.0.0.1 port, in a thread of this process;
    yields its URL once it accepts connections. ``config_kwargs`` go to uvicorn.Config."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config_kwargs))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def _uvicorn_in_thread(llm: AsyncLLM, slow_steps: FlagFile, **server_kwargs):
    server = OpenAIServer(llm, [MODEL, "alias"], **server_kwargs)
    with uvicorn_in_thread(server.app) as url:
        yield RunningServer(url, server, llm, slow_steps)


@pytest.fixture(scope="module", params=["engine_thread", "engine_process"])
def running(tiny_qwen3, request):
    with serve_in_thread(
        tiny_qwen3,
        engine_process=request.param == "engine_process",
        api_key=API_KEY,
        limits=ServerLimits(max_request_body_bytes=MAX_BODY),
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(running):
    with openai.OpenAI(base_url=running.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(running):
    return running.server.tokenizer


@pytest.fixture(scope="module")
def http(running):
    with httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def all_free(llm: AsyncLLM) -> bool:
    stats = llm.stats(timeout=10)
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0
    )


def wait_all_free(llm: AsyncLLM, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all_free(llm):
            return True
        time.sleep(0.02)
    return False


def scrape(http: httpx.Client) -> dict[str, float]:
    """/metrics as {'name{label=value,...}': value}, parsed with Prometheus' own parser."""
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


# -- happy paths -------------------------------------------------------------------------------------------


def test_models_and_health(client, http, running):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert http.get("/health").status_code == 200
    # /health and /metrics need no key; /v1 does.
    assert httpx.get(running.url + "/health").status_code == 200
    assert httpx.get(running.url + "/v1/models").status_code == 401


def test_completion_stream_equals_non_stream(client, tokenizer):
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == MODEL
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # Token ids in, the same tokens out; a batch of prompts gives one choice each, in order.
    by_ids = client.completions.create(**{**kwargs, "prompt": tokenizer.encode("The quick brown fox")})
    assert by_ids.choices[0].text == full.choices[0].text
    batch = client.completions.create(**{**kwargs, "prompt": ["Paged attention", "The quick brown fox"]})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == full.choices[0].text


def test_chat_stream_equals_non_stream(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    kwargs = {"model": "alias", "messages": messages, "max_completion_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.model == "alias"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # The prompt is the chat template's rendering, ending with the assistant header.
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer.encode(template))
    # Without max_tokens, chat may use the rest of the context.
    rest = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert rest.usage.total_tokens == MAX_MODEL_LEN and rest.choices[0].finish_reason == "length"


def test_concurrent_streams(client, running):
    prompts = [f"Request {i}: the quick brown fox" for i in range(32)]
    # The same prompts as one non-streamed batch request.
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
    expected = [choice.text for choice in batch.choices]

    async def stream_one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=running.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30
        ) as aclient:
            return await asyncio.gather(*(stream_one(aclient, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert wait_all_free(running.llm)


def test_client_closing_stream_aborts(client, http, running):
    aborted = "nanoinfer:request_success_total{finished_reason=abort}"
    before = scrape(http).get(aborted, 0.0)
    running.slow_steps.set()
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert not all_free(running.llm)
        stream.close()
        assert wait_all_free(running.llm)
        # A non-streaming request whose client gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Paged attention", "max_tokens": 200, "ignore_eos": True},
                timeout=0.3,
            )
        assert wait_all_free(running.llm)
    finally:
        running.slow_steps.clear()
    assert scrape(http).get(aborted, 0.0) == before + 2


def test_sampling_options_logprobs_and_n(client):
    kwargs = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "top_p": 0.95,
        "n": 2,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True, "top_k": 50},
    }
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1] and full.usage.completion_tokens == 24
    for choice in full.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
        assert logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # top 2 plus the sampled token
    # Streamed with the same seed: the same text and the same logprobs, chunk by chunk.
    texts, tokens, token_logprobs, offsets = ({0: [], 1: []} for _ in range(4))
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                token_logprobs[choice.index] += choice.logprobs.token_logprobs
                offsets[choice.index] += choice.logprobs.text_offset
    for choice in full.choices:
        assert "".join(texts[choice.index]) == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
        assert token_logprobs[choice.index] == pytest.approx(choice.logprobs.token_logprobs)
        assert offsets[choice.index] == choice.logprobs.text_offset

    chat_kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "max_completion_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": {"ignore_eos": True},
    }
    chat = client.chat.completions.create(**chat_kwargs)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 3 for entry in content)
    # Greedy: the chosen token is the most likely one.
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob) for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    streamed = [
        entry
        for chunk in client.chat.completions.create(**chat_kwargs, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_stream_usage_options(http):
    """vLLM's continuous_usage_stats: with include_usage, every chunk carries the usage so far (without
    it, no chunk does); and a stream has at most one event per engine step."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "stream": True}

    def chunks(stream_options):
        response = http.post("/v1/completions", json={**body, "stream_options": stream_options})
        assert response.status_code == 200, response.text
        lines = [line for line in response.text.splitlines() if line.startswith("data: {")]
        return [json.loads(line[len("data: ") :]) for line in lines]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in every) and every[-1]["usage"]["completion_tokens"] == 6
    generated = [c["usage"]["completion_tokens"] for c in every]
    assert generated == sorted(generated) and 1 <= len(every) - 1 <= 6
    assert every[-1]["choices"] == [] and generated[-2] == 6
    assert all(c["usage"] is None for c in chunks({"continuous_usage_stats": True}))


def test_stop_strings(client):
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = text[: text.index(stop)]
    full = client.completions.create(**kwargs, stop=[stop])
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- errors ------------------------------------------------------------------------------------------------

_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
_HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    # (endpoint, body (dict or raw bytes), headers, status, param, text in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', None, 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, 400, None, "JSON object"),
    ("/v1/completions", {**_OK, "max_tokens": "3"}, None, 400, "max_tokens", "integer"),
    ("/v1/completions", {**_OK, "max_tokens": 0}, None, 400, "max_tokens", None),
    ("/v1/completions", {**_OK, "temperature": -1}, None, 400, "temperature", None),
    ("/v1/completions", {**_OK, "stream": "yes"}, None, 400, "stream", None),
    ("/v1/completions", {**_OK, "frobnicate": 1}, None, 400, "frobnicate", "unrecognized"),
    ("/v1/completions", {"model": MODEL}, None, 400, "prompt", "missing"),
    ("/v1/completions", {**_OK, "prompt": ""}, None, 400, "prompt", "empty"),
    ("/v1/completions", {**_OK, "prompt": []}, None, 400, "prompt", "empty"),
    ("/v1/completions", {**_OK, "prompt": [5, 100000]}, None, 400, "prompt", "token ids"),
    ("/v1/completions", {**_OK, "prompt": list(range(3, 303))}, None, 400, "prompt", str(MAX_MODEL_LEN)),
    ("/v1/completions", {**_OK, "max_tokens": MAX_MODEL_LEN}, None, 400, "max_tokens", str(MAX_MODEL_LEN)),
    ("/v1/completions", {**_OK, "n": 2}, None, 400, "n", None),
    ("/v1/completions", {**_OK, "top_p": 0.5}, None, 400, "top_p", "not supported"),
    ("/v1/completions", {**_OK, "top_k": 5}, None, 400, "top_k", None),
    ("/v1/completions", {**_OK, "stop": ["\n"]}, None, 400, "stop", None),
    ("/v1/completions", {**_OK, "seed": 1}, None, 400, "seed", None),
    ("/v1/completions", {**_OK, "logprobs": 21}, None, 400, "logprobs", "20"),
    ("/v1/completions", {**_OK, "logit_bias": {"5": 1.0}}, None, 400, "logit_bias", "not supported"),
    ("/v1/completions", {**_OK, "top_p": 1.5}, None, 400, "top_p", None),
    ("/v1/completions", {**_OK, "stop": ""}, None, 400, "stop", None),
    ("/v1/completions", {**_OK, "min_tokens": 5}, None, 400, "min_tokens", "max_tokens"),
    ("/v1/completions", {**_OK, "n": 0}, None, 400, "n", None),
    ("/v1/completions", {**_OK, "suffix": "x"}, None, 400, "suffix", None),
    ("/v1/completions", {**_OK, "service_tier": "flex"}, None, 400, "service_tier", "not supported"),
    ("/v1/completions", {**_OK, "stream_options": {}}, None, 400, "stream_options", None),
    ("/v1/completions", {**_OK, "model": "gpt-4"}, None, 404, "model", "gpt-4"),
    ("/v1/completions", _OK, {"Authorization": ""}, 401, None, "API key"),
    ("/v1/completions", _OK, {"Authorization": "Bearer wrong"}, 401, None, "API key"),
    ("/v1/completions", {**_OK, "prompt": "x" * (MAX_BODY + 1)}, None, 413, None, str(MAX_BODY)),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, None, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, None, 400,
     "messages", "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "x": 1}]}, None,
     400, "messages", "unrecognized"),
    ("/v1/chat/completions", {**_HI, "tools": [{}]}, None, 400, "tools", None),
    ("/v1/chat/completions", {**_HI, "top_logprobs": 2}, None, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {**_HI, "logprobs": True, "top_logprobs": 21}, None, 400, "top_logprobs", "20"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}]}, None,
     400, "messages", str(MAX_MODEL_LEN)),
]  # fmt: skip


def test_bad_requests_get_openai_errors_and_leave_nothing_allocated(http, running):
    for endpoint, body, headers, status, param, text in BAD_REQUESTS:
        if param in protocol.SAMPLING_FIELDS and engine_supports(param):
            continue  # the engine learned it since this list was written
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.post(
            endpoint, content=content, headers={"Content-Type": "application/json", **(headers or {})}
        )
        case = f"{endpoint} {content[:80]!r} {headers}"
        assert response.status_code == status, (case, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, case
        assert error["param"] == param, (case, error)
        if text is not None:
            assert text in error["message"], (case, error)
        assert all_free(running.llm), case
    # Neutral values of the not-yet-supported fields are fine, and the server still serves.
    neutral = {"top_p": 1, "top_k": -1, "min_p": 0, "stop": [], "seed": None, "presence_penalty": 0, "n": 1}
    response = http.post("/v1/completions", json={**_OK, **neutral, "user": "me"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert all_free(running.llm)
    # Unknown routes and methods answer in the same error shape.
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and "message" in response.json()["error"]
    assert http.get("/v1/completions").status_code == 405


def test_metrics_move(client, http):
    before = scrape(http)
    result = client.completions.create(
        model=MODEL,
        prompt="Prefix caching reuses",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape(http)

    def moved(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("nanoinfer:prompt_tokens_total{}") == result.usage.prompt_tokens
    assert moved("nanoinfer:generation_tokens_total{}") == 5
    assert moved("nanoinfer:request_success_total{finished_reason=length}") == 1
    assert moved("nanoinfer:time_to_first_token_seconds_count{}") == 1
    assert moved("nanoinfer:inter_token_latency_seconds_count{}") == 4
    assert moved("nanoinfer:e2e_request_latency_seconds_count{}") == 1
    assert after["nanoinfer:num_requests_running{}"] == 0 and after["nanoinfer:num_requests_waiting{}"] == 0
    assert after["nanoinfer:kv_cache_usage_perc{}"] == 0.0
    assert 0.0 <= after["nanoinfer:prefix_cache_hit_rate{}"] <= 1.0
    assert "nanoinfer:num_preemptions_total{}" in after
    assert after["nanoinfer:prefix_cache_queries_total{}"] >= result.usage.prompt_tokens


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine_thread", "engine_process"])
def test_unhealthy_after_engine_crash(tiny_qwen3, engine_process):
    with serve_in_thread(tiny_qwen3, engine_process=engine_process) as srv:
        if engine_process:
            os.kill(srv.llm.engine_pid, signal.SIGKILL)
            deadline = time.monotonic() + 1.0
            while srv.llm.is_healthy and time.monotonic() < deadline:
                time.sleep(0.01)
            cause = "SIGKILL"
        else:

            def crash(engine):
                raise RuntimeError("simulated crash")

            # Make the next step fail, then send a request into it.
            break_step = srv.llm._driver.submit_call(lambda e: setattr(e, "step", lambda: crash(e)))
            break_step.result(10)
            cause = "simulated crash"
        response = httpx.post(srv.url + "/v1/completions", json=_OK, timeout=10)
        assert response.status_code == 503 and cause in response.json()["error"]["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and cause in health.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json=_OK, timeout=10).status_code == 503


# -- protocol pieces ---------------------------------------------------------------------------------------


# One value per SAMPLING_FIELDS row that turns its feature on.
NON_NEUTRAL = {
    "n": 2,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "seed": 1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "stop": "x",
    "stop_token_ids": [7],
    "min_tokens": 2,
    "logit_bias": {"5": 1.0},
    "allowed_token_ids": [5],
    "bad_words": ["x"],
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "include_stop_str_in_output": True,
    "suffix": "x",
    "best_of": 2,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "service_tier": "flex",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"},
    "reasoning_effort": "high",
    "web_search_options": {},
    "priority": 1,
    "truncate_prompt_tokens": 8,
    "use_beam_search": True,
    "length_penalty": 0.5,
}


def engine_supports(field: str) -> bool:
    """Whether SamplingParams implements the field, so that the server passes it through."""
    sampling_param = protocol.SAMPLING_FIELDS[field].sampling_param
    return sampling_param in {f.name for f in dataclasses.fields(SamplingParams)}


def test_every_neutral_value_is_accepted_and_others_are_named():
    assert set(NON_NEUTRAL) == set(protocol.SAMPLING_FIELDS)
    for name, spec in protocol.SAMPLING_FIELDS.items():
        for model, base in (
            (CompletionRequest, {"prompt": "x"}),
            (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        ):
            if name not in model.model_fields:
                continue
            for value in spec.neutral:
                protocol.parse_request(model, json.dumps({**base, name: value}).encode())
            value = NON_NEUTRAL[name]
            body = json.dumps({**base, name: value}).encode()
            if engine_supports(name):
                params = protocol.parse_request(model, body).sampling_params(4)
                assert getattr(params, spec.sampling_param) is not None
                continue
            with pytest.raises(APIError) as info:
                protocol.parse_request(model, body)
            assert info.value.param == name and info.value.status_code == 400, (name, value)
            assert "not supported" in info.value.message


def test_request_parsing_details():
    request = protocol.parse_request(CompletionRequest, b'{"prompt": [[1, 2], [3]], "max_tokens": 3}')
    assert request.prompts() == [[1, 2], [3]]
    assert request.sampling_params(3).max_tokens == 3 and request.sampling_params(3).temperature == 1.0
    chat = protocol.parse_request(
        ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", '
        b'"text": "b"}]}], "max_tokens": 9, "max_completion_tokens": 4, "temperature": 0}',
    )
    assert chat.messages[0].template_input() == {"role": "user", "content": "a\nb"}
    assert chat.requested_max_tokens() == 4 and chat.sampling_params(4).greedy
    with pytest.raises(APIError, match="finite"):
        protocol.parse_request(CompletionRequest, b'{"prompt": "x", "temperature": NaN}')
    with pytest.raises(APIError) as info:
        protocol.parse_request(CompletionRequest, b'{"prompt": "x", "ignore_eos": 1}')
    assert info.value.param == "ignore_eos"


def test_sse_and_response_shapes():
    event = protocol.sse_event({"a": "é"})
    assert event == 'data: {"a":"é"}\n\n'.encode() and protocol.SSE_DONE == b"data: [DONE]\n\n"
    # -inf (a masked token among the top logprobs) has no JSON number: clamped as vLLM does.
    masked = {7: Logprob(float("-inf"), 2), 3: Logprob(-0.5, 1)}
    body = protocol.completion_logprobs([3], [masked], lambda t, lp: f"t{t}", 0)
    assert body["top_logprobs"] == [{"t7": protocol.MIN_JSON_LOGPROB, "t3": -0.5}]
    chat = protocol.chat_logprobs([7], [masked], lambda t, lp: f"t{t}", 2)
    assert chat["content"][0]["logprob"] == protocol.MIN_JSON_LOGPROB
    body = protocol.response_body("text_completion", "cmpl-1", 5, "m", [], protocol.usage(3, 4))
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert APIError("nope", 404, param="model").body() == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "model", "code": None}
    }
    assert APIError("down", 503).body()["error"]["type"] == "server_error"


def test_metrics_registries_are_independent():
    first, second = ServingMetrics("a"), ServingMetrics("b")
    first.on_prompt(10)
    first.on_new_tokens(1, 0.5, None)
    first.on_new_tokens(2, None, 0.02)
    first.on_finished("stop", 1.0)
    stats = {
        "num_kv_blocks_total": 10,
        "num_kv_blocks_free": 4,
        "num_running": 2,
        "num_waiting": 1,
        "num_preemptions": 3,
        "prefix_cache_queried_tokens": 100,
        "prefix_cache_hit_tokens": 25,
    }
    first.update_engine_stats(stats)
    first.update_engine_stats({**stats, "num_preemptions": 5})
    samples = {
        s.name: s.value for f in text_string_to_metric_families(first.render().decode()) for s in f.samples
    }
    assert samples["nanoinfer:kv_cache_usage_perc"] == pytest.approx(0.6)
    assert samples["nanoinfer:prefix_cache_hit_rate"] == 0.25
    assert samples["nanoinfer:num_preemptions_total"] == 5
    assert samples["nanoinfer:generation_tokens_total"] == 3
    assert samples["nanoinfer:inter_token_latency_seconds_count"] == 2
    assert samples["nanoinfer:request_success_total"] == 1
    second_text = second.render().decode()
    assert "nanoinfer:generation_tokens_total" in second_text and 'model_name="a"' not in second_text


def test_cli_registers_serve_subcommand():
    parser = argparse.ArgumentParser()
    cli_serve.register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "/models/x", "--port", "9000", "--max-model-len", "64", "--api-key", "k"]
    )
    assert (args.model, args.host, args.port, args.api_key) == ("/models/x", "127.0.0.1", 9000, "k")
    assert engine_kwargs_from_args(args) == {"max_model_len": 64}
