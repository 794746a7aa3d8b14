"""HermesToolParser: whole-output parsing, and streaming that the openai client assembles into the
same calls for every way of splitting the output."""

import json
import random
import re

import pytest

from nanoinfer.entrypoints.tool_parsers import HermesToolParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", "{}")

# (output, expected content, expected [(name, arguments)])
WELL_FORMED = [
    ("Just an answer, no tools.", "Just an answer, no tools.", []),
    ("  spaces around  \n", "  spaces around  \n", []),
    ("", None, []),
    (CALL, None, [WEATHER]),
    ("Let me check.\n" + CALL, "Let me check.", [WEATHER]),
    ("Let me check.\n" + CALL + " \n", "Let me check.", [WEATHER]),
    (CALL + "A" + CALL2 + "B", "AB", [WEATHER, TIME]),
    (CALL + "\n" + CALL2, None, [WEATHER, TIME]),
    ("First " + CALL + " then\n" + CALL2 + "\nDone.", "First then\nDone.", [WEATHER, TIME]),
    # No closing tag at the end of the output (the model stopped right after the JSON).
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [TIME]),
    # Compact JSON, other whitespace, nested arguments with braces and tags inside strings.
    ('<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}"}],"c":"</tool_call>"}}</tool_call>', None,
     [("f", '{"a":[1,{"b":"}"}],"c":"</tool_call>"}')]),
    ('<tool_call>\n{ "name" : "ünï\\u00e7ode" ,\n "arguments" :\t{"q": "\\"quoted\\" \\\\ 你好 🚀"} }\n'
     '</tool_call>', None, [("ünïçode", '{"q": "\\"quoted\\" \\\\ 你好 🚀"}')]),
    ("a <tool_ca b", "a <tool_ca b", []),  # a partial tag that is not one
    ("ends with a partial tag <tool_c", "ends with a partial tag <tool_c", []),
]  # fmt: skip

# Malformed before a call could be committed: content as written, streaming included.
MALFORMED = [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',  # name must come first
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',  # arguments must be an object
    '<tool_call>\n{"name": "f", "parameters": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": ',  # cut off before the arguments
    'text <tool_call>{"name": "f\n"}</tool_call> more',
]

# Malformed only after the call was committed: the whole-output parse keeps it as content.
MALFORMED_LATE = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # missing the outer brace
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "extra": 2}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": "cut off',
]


BESIDE = CALL + '\n<tool_call>{"name": 1}</tool_call>\n' + CALL2


def parse(text):
    content, calls = HermesToolParser().extract_tool_calls(text)
    return content, [(c.function.name, c.function.arguments) for c in calls]


def stream(pieces):
    """Feeds ``pieces`` to a streaming parser; returns the deltas, with finish()'s."""
    parser = HermesToolParser().streaming()
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish(), parser


def assemble(deltas):
    """What a client rebuilds from the deltas, checking the shape OpenAI's stream uses."""
    content = ""
    calls = []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert delta["content"]
            content += delta["content"]
            continue
        (entry,) = delta["tool_calls"]
        if entry["index"] == len(calls):
            assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
            assert re.fullmatch("call_[0-9a-f]{24}", entry["id"])
            calls.append([entry["function"]["name"], entry["function"]["arguments"]])
        else:
            assert entry["index"] == len(calls) - 1 and set(entry) == {"index", "function"}
            assert set(entry["function"]) == {"arguments"}
            calls[-1][1] += entry["function"]["arguments"]
    return content or None, [tuple(c) for c in calls]


def splits(text):
    """Every way of cutting ``text`` once, every way of cutting it twice (short texts), one character
    at a time, and random cuts."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    if len(text) <= 80:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("text, content, calls", WELL_FORMED)
def test_whole_output(text, content, calls):
    assert parse(text) == (content, calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("text", MALFORMED + MALFORMED_LATE)
def test_malformed_calls_stay_content(text):
    assert parse(text) == (text, [])
    assert parse("Before. " + text + " After.") == ("Before. " + text + " After.", [])


def test_a_malformed_call_beside_good_ones():
    assert parse(BESIDE) == ('\n<tool_call>{"name": 1}</tool_call>', [WEATHER, TIME])


@pytest.mark.parametrize("text", [t for t, _, _ in WELL_FORMED] + MALFORMED + [BESIDE])
def test_streaming_equals_the_whole_output_for_every_split(text):
    expected = parse(text)
    for pieces in splits(text):
        deltas, parser = stream(pieces)
        assert assemble(deltas) == expected, pieces
        assert [(c.function.name, c.function.arguments) for c in parser.tool_calls] == expected[1]


@pytest.mark.parametrize("text", MALFORMED_LATE)
def test_streaming_a_call_that_breaks_after_its_name_keeps_what_was_sent(text):
    deltas, parser = stream(list(text))
    content, calls = assemble(deltas)
    assert [name for name, _ in calls] == ["f"] and len(parser.tool_calls) == 1


def test_nothing_is_sent_before_it_is_decided():
    parser = HermesToolParser().streaming()
    assert parser.feed("Hello \n") == [{"content": "Hello"}]
    assert parser.feed("<tool") == []  # the whitespace and a possible tag are held back
    assert parser.feed('_call>\n{"name": "get_') == []
    first, fragment = parser.feed('time", "arguments": {')
    entry = first["tool_calls"][0]
    assert entry["index"] == 0 and entry["function"] == {"name": "get_time", "arguments": ""}
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert parser.feed("}") == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert parser.feed("}\n</tool_call>\n") == []
    assert parser.feed("Bye") == [{"content": "\nBye"}]
    assert parser.finish() == []


def test_the_openai_client_assembles_the_stream():
    pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    text = "I will call two tools.\n" + CALL + "\n" + CALL2
    state = ChatCompletionStreamState()
    parser = HermesToolParser().streaming()
    deltas = [d for piece in re.findall(".{1,7}", text, re.S) for d in parser.feed(piece)] + parser.finish()
    chunks = [{"role": "assistant"}, *deltas]
    for i, delta in enumerate(chunks):
        last = i == len(chunks) - 1
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": "tool_calls" if last else None}],
        }
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    message = state.get_final_completion().choices[0].message
    whole_content, whole_calls = HermesToolParser().extract_tool_calls(text)
    assert message.content == whole_content == "I will call two tools."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [WEATHER, TIME]
    assert [c.id for c in message.tool_calls] == [c.id for c in parser.tool_calls]
    assert len({c.id for c in whole_calls + parser.tool_calls}) == 4


def test_tool_call_to_dict():
    _, (call,) = HermesToolParser().extract_tool_calls(CALL)
    assert call.to_dict() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": WEATHER[1]},
    }
