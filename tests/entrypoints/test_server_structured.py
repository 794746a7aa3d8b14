"""Structured outputs, tool calling and reasoning through the server and the official `openai` client:
response_format (json_schema, json_object), vLLM's structured_outputs and guided_* fields, tool_choice
"required" / named / "auto" (streamed calls assembled by the client), a tool round trip, Qwen3-style
reasoning split, and every bad input a 400 in OpenAI's shape that leaves the server serving.

The tiny model is random: only the constraint can make its output valid. "auto" and the reasoning split
parse what the model writes; a regex constraint makes it write a call or a <think> block."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pydantic
import pytest

from nanoinfer.config import EngineConfig
from nanoinfer.entrypoints import cli_serve, structured_requests
from nanoinfer.entrypoints.structured_requests import ChatOutputParser, ToolOptions
from nanoinfer.frontend.async_llm import AsyncLLM
from nanoinfer.frontend.llm_engine import LLMEngine
from tests.entrypoints.engine_delays import FlagFile
from tests.entrypoints.test_server import _uvicorn_in_thread

# A Qwen-style template that renders tools, assistant tool calls and tool results (Hermes format).
TOOL_TEMPLATE = (
    # Tool names only: the tiny tokenizer spends many tokens on JSON, and the context is 512 tokens.
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ENGINE_KWARGS = {
    "device": "cpu",
    "max_model_len": 512,
    "num_kvcache_blocks": 256,
    "chat_template": TOOL_TEMPLATE,
}
MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: pydantic.constr(max_length=10)
    age: pydantic.conint(ge=0, le=120)
    role: str = pydantic.Field(json_schema_extra={"enum": ["admin", "user"]})


@pytest.fixture(scope="module", params=["engine_thread", "engine_process"])
def running(tiny_qwen3, request, tmp_path_factory):
    if request.param == "engine_process":
        llm = AsyncLLM.with_engine_process(
            EngineConfig.from_kwargs(tiny_qwen3, **ENGINE_KWARGS), ready_timeout=60
        )
    else:
        llm = AsyncLLM(lambda: LLMEngine.from_kwargs(tiny_qwen3, **ENGINE_KWARGS))
    slow_steps = FlagFile(str(tmp_path_factory.mktemp("flags") / "unused"))
    options = ToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    try:
        with _uvicorn_in_thread(llm, slow_steps, tool_options=options) as srv:
            yield srv
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def client(running):
    return openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


def _no_leak(running) -> None:
    deadline = time.monotonic() + 5
    while True:
        stats = running.llm.stats(timeout=10)
        if stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


def _check_weather_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"} and value["unit"] in ("celsius", "fahrenheit")
    assert isinstance(value["city"], str) and len(value["city"]) <= 12


def test_json_schema_response_format_parsed_by_the_openai_client(client, running):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=USER, response_format=Person, temperature=1.0, seed=seed, max_tokens=120
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        person = choice.message.parsed
        assert isinstance(person, Person) and person.role in ("admin", "user")
        assert choice.message.reasoning_content is None  # the parser finds no <think> block
    _no_leak(running)


def test_json_object_and_extra_body_constraints(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"}, max_tokens=60, seed=1
    )
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    regex = r"[a-z]{3,6}-[0-9]{2}"
    for body in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        text = (
            client.completions.create(
                model=MODEL, prompt="code:", max_tokens=20, temperature=1.0, extra_body=body
            )
            .choices[0]
            .text
        )
        assert re.fullmatch(regex, text), text
    choices = ["alpha", "beta gamma"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10, extra_body=body)
        assert reply.choices[0].message.content in choices


def test_streamed_json_schema_equals_the_whole_response(client):
    schema = Person.model_json_schema()
    kwargs = dict(
        model=MODEL, messages=USER, max_tokens=120, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    Person.model_validate_json(whole)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_required_gives_valid_calls(client, running, stream):
    # The random model chains a geometric number of calls (65-80 tokens each): these seeds end after one
    # to three, well inside max_tokens (the most the 512-token context leaves after the prompt).
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=440)
    for seed in range(3):
        if stream:
            with client.chat.completions.stream(**kwargs, seed=seed, temperature=1.0) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.create(**kwargs, seed=seed, temperature=1.0)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls
        assert calls and not choice.message.content
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                _check_weather_arguments(call.function.arguments)
            else:
                assert -12 <= json.loads(call.function.arguments)["zone"] <= 14
    _no_leak(running)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_tool_choice_calls_that_function(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, max_tokens=200, seed=4)
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kwargs)
    calls = completion.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    _check_weather_arguments(calls[0].function.arguments)


def test_tool_round_trip_in_one_conversation(client, running):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason in ("stop", "length")
    # The template saw the call (its arguments as an object) and the tool's answer.
    rendered = httpx.post(
        running.url + "/tokenize",
        json={"model": MODEL, "messages": conversation, "tools": TOOLS, "return_token_strs": False},
    ).json()
    prompt = running.server.tokenizer.decode(rendered["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt


AUTO_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_tool_choice_parses_calls_the_model_writes(client, stream):
    # tool_choice "auto" (the default with tools) constrains nothing; the regex makes the model write a call.
    kwargs = dict(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=200,
        extra_body={"structured_outputs": {"regex": "Sure\\.\\n" + re.escape(AUTO_CALL)}},
    )  # fmt: skip
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kwargs)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_time", {"zone": 3})
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_reasoning_is_split_into_reasoning_content(client, stream):
    body = {"structured_outputs": {"regex": "<think>\\nLet me see\\.\\n</think>\\n\\nIt is [a-z]{2,5}\\."}}
    kwargs = dict(model=MODEL, messages=USER, max_tokens=150, extra_body=body)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == "Let me see."
    assert re.fullmatch(r"It is [a-z]{2,5}\.", content), content


def test_a_pathological_schema_is_rejected_quickly(running):
    # 300 nested objects (900 JSON levels), written as text: the client's JSON encoder would recurse.
    depth = 300
    schema = (
        '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth
    )
    body = f'{{"model": "{MODEL}", "messages": {json.dumps(USER)}, "max_tokens": 8, "guided_json": {schema}}}'
    started = time.monotonic()
    response = httpx.post(
        running.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert time.monotonic() - started < 10
    # Refused by the body's JSON parser (its nesting limit) before any compiler sees it.
    assert "recursion limit" in response.json()["error"]["message"]
    _no_leak(running)


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": '{"type": '}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", BAD_REQUESTS)
def test_bad_constraints_are_400s_and_the_server_keeps_serving(running, fields, param):
    started = time.monotonic()
    response = httpx.post(
        running.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 8, **fields},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert time.monotonic() - started < 10
    ok = httpx.post(
        running.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 4, "guided_choice": ["yes", "no"]},
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
    _no_leak(running)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_constraint_that_cannot_be_matched_midway_is_a_400(running, stream):
    """Valid when validated (its first mask fits the grammar library's limits on this vocabulary), this
    regex exceeds them at its second token: the request fails alone, for its input."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "guided_regex": "((a{100}){100}){100}"}
    response = httpx.post(running.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
    if stream:
        assert response.status_code == 200
        error = json.loads(response.text.split("data: ")[-2])["error"]
        assert error["type"] == "invalid_request_error"
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "guided_regex"
    assert "structured_outputs could not be matched: lexer error" in error["message"]
    _no_leak(running)


def test_auto_tool_choice_needs_the_server_flag():
    class Request:
        tools = TOOLS
        tool_choice = None

    with pytest.raises(structured_requests.APIError, match="--enable-auto-tool-choice"):
        ChatOutputParser(Request(), ToolOptions(), "")
    parser = ChatOutputParser(Request(), ToolOptions(True, "hermes"), "")
    message, finish = parser.message("Hi " + AUTO_CALL, "stop")
    assert finish == "tool_calls" and message["content"] == "Hi"
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": 3}'}
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ToolOptions(enable_auto_tool_choice=True)


def test_cli_parser_choices_match_the_server():
    assert cli_serve.TOOL_CALL_PARSERS == structured_requests.TOOL_CALL_PARSERS
    assert cli_serve.REASONING_PARSERS == structured_requests.REASONING_PARSERS


def test_server_startup_rejects_auto_tool_choice_without_a_parser(tiny_qwen3, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    cli_serve.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", tiny_qwen3, "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit, match="needs --tool-call-parser"):
        args.func(args)


# A template that turns the reasoning on (the prompt ends inside <think>) or off (an empty block), as
# Qwen3's enable_thinking does; left out, the model may open the reasoning itself.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if thinking is defined %}{% if thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}{% endif %}"
)
THINK, END_THINK = "384", "385"  # tiny_thinker's <think> and </think>, as logit_bias keys


@pytest.fixture(scope="module")
def thinking_client(tiny_thinker, tmp_path_factory):
    kwargs = dict(ENGINE_KWARGS, chat_template=THINKING_TEMPLATE)
    llm = AsyncLLM(lambda: LLMEngine.from_kwargs(tiny_thinker, **kwargs))
    slow_steps = FlagFile(str(tmp_path_factory.mktemp("flags") / "unused"))
    try:
        with _uvicorn_in_thread(llm, slow_steps, tool_options=ToolOptions(reasoning_parser="qwen3")) as srv:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), srv
    finally:
        llm.shutdown()


# (chat_template_kwargs, logit_bias, whether some reasoning must come back over the seeds, the first
# token of every output)
THINKING_CASES = {
    "model_opens_and_closes_its_reasoning": (None, {THINK: 30, END_THINK: 40}, False, "<think>"),
    "prompt_opened_the_reasoning": ({"thinking": True}, {END_THINK: 5}, True, None),
    # The reasoning is off: <think> is not allowed, however likely.
    "prompt_closed_the_reasoning": ({"thinking": False}, {THINK: 30}, False, "{"),
}


@pytest.mark.parametrize("case", list(THINKING_CASES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_with_a_reasoning_parser_the_constraint_applies_after_the_reasoning(thinking_client, case, stream):
    client, running = thinking_client
    template_kwargs, bias, must_reason, first_token = THINKING_CASES[case]
    extra_body = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
    reasoned = 0
    for seed in range(4):
        kwargs = dict(
            model=MODEL, messages=USER, temperature=1.0, seed=seed, max_tokens=200, logit_bias=bias,
            extra_body=extra_body,
        )  # fmt: skip
        if stream:
            schema = {
                "name": "person",
                "schema": {**Person.model_json_schema(), "additionalProperties": False},
            }
            chunks = list(
                client.chat.completions.create(
                    **kwargs, stream=True, response_format={"type": "json_schema", "json_schema": schema}
                )
            )
            reasoning = "".join(
                getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
            )
            person = Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))
        else:
            choice = client.chat.completions.parse(**kwargs, response_format=Person, logprobs=True).choices[0]
            reasoning, person = choice.message.reasoning_content or "", choice.message.parsed
            assert first_token is None or choice.logprobs.content[0].token == first_token
        assert isinstance(person, Person)
        assert "think>" not in reasoning
        reasoned += bool(reasoning)
    assert reasoned > 0 if must_reason else reasoned == 0
    _no_leak(running)


def test_a_named_tool_call_comes_after_the_reasoning(thinking_client):
    client, running = thinking_client
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, max_tokens=200, seed=seed,
            temperature=1.0, logit_bias={THINK: 30, END_THINK: 40}, logprobs=True,
        ).choices[0]  # fmt: skip
        assert [t.token for t in choice.logprobs.content[:2]] == ["<think>", "</think>"]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_weather_arguments(call.function.arguments)
    _no_leak(running)


def test_the_gate_needs_think_tags_that_are_single_tokens(tiny_qwen3, tiny_thinker):
    from transformers import AutoTokenizer

    assert structured_requests.reasoning_token_ids(AutoTokenizer.from_pretrained(tiny_thinker)) == (384, 385)
    # The tiny tokenizer spells the tags in several tokens: no gate, the constraint starts at once.
    assert structured_requests.reasoning_token_ids(AutoTokenizer.from_pretrained(tiny_qwen3)) is None
    constraint = structured_requests.StructuredOutputsParams(json_object=True)
    assert structured_requests.constrain_after_reasoning(constraint, None, "<think>\n") is constraint
    gated = structured_requests.constrain_after_reasoning(constraint, (384, 385), "assistant\n<think>\n")
    assert gated.reasoning == structured_requests.ReasoningSpan(384, 385, opened=True)
    closed = "assistant\n<think>\n\n</think>\n\n"
    assert structured_requests.constrain_after_reasoning(constraint, (384, 385), closed) is constraint
