"""Qwen3ReasoningParser: <think>...</think> split off the answer, whole and streamed (every split)."""

import random

import pytest

from nanoinfer.entrypoints.reasoning_parsers import (
    Qwen3ReasoningParser,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
)

# (output, in_reasoning, expected reasoning, expected content)
CASES = [
    (
        "<think>\nThe user wants a greeting.\n</think>\n\nHello!",
        False,
        "The user wants a greeting.",
        "Hello!",
    ),
    ("\n<think>a</think>b", False, "a", "b"),
    ("<think></think>\n\nJust the answer.", False, None, "Just the answer."),
    ("<think>\nstill thinking when the output ended", False, "still thinking when the output ended", None),
    ("<think>thinking ends in a partial tag </thi", False, "thinking ends in a partial tag </thi", None),
    ("No tags at all.", False, None, "No tags at all."),
    ("  spaces kept when there are no tags \n", False, None, "  spaces kept when there are no tags \n"),
    ("An answer mentioning <think> later.", False, None, "An answer mentioning <think> later."),
    ("<thinking>is not the tag</thinking>", False, None, "<thinking>is not the tag</thinking>"),
    ("", False, None, None),
    ("<thi", False, None, "<thi"),
    # The template opened the reasoning in the prompt: the output starts inside it.
    ("The user asks about X.\n</think>\n\nX is Y.", True, "The user asks about X.", "X is Y."),
    ("only reasoning, never closed", True, "only reasoning, never closed", None),
    ("</think>answer", True, None, "answer"),
    ("a </think> b </think> c", True, "a", "b </think> c"),
    ("<think>a</think>\n", False, "a", None),
    ("", True, None, None),
    ("r\u00e9flexion 🤔 </think> r\u00e9ponse 你好", True, "r\u00e9flexion 🤔", "r\u00e9ponse 你好"),
]


def splits(text):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 10))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(parser, pieces):
    reasoning, content = [], []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        assert delta[0] != "" and delta[1] != ""  # empty parts are None
        reasoning.append(delta[0] or "")
        content.append(delta[1] or "")
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", CASES)
def test_whole_output(text, in_reasoning, reasoning, content):
    assert Qwen3ReasoningParser(in_reasoning).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", CASES)
def test_streaming_equals_the_whole_output_for_every_split(text, in_reasoning, reasoning, content):
    parser = Qwen3ReasoningParser(in_reasoning)
    for pieces in splits(text):
        assert stream(parser.streaming(), pieces) == (reasoning, content), pieces


def test_deltas_come_as_soon_as_they_are_decided():
    parser = Qwen3ReasoningParser().streaming()
    assert parser.feed("<thi") == (None, None)
    assert parser.feed("nk>\nLet me") == ("Let me", None)
    assert parser.feed(" think. \n</th") == (" think.", None)  # trailing whitespace and a partial tag held
    assert parser.feed("ink>\n\n") == (None, None)
    assert parser.feed("Answer") == (None, "Answer")
    assert parser.feed(" done.\n") == (None, " done.\n")
    assert parser.finish() == (None, None)


def test_content_without_tags_is_streamed_at_once():
    parser = Qwen3ReasoningParser().streaming()
    assert parser.feed("Hi") == (None, "Hi")
    assert parser.feed(" <think> is just text here") == (None, " <think> is just text here")


@pytest.mark.parametrize(
    "prompt, opens, closes",
    [
        ("<|im_start|>assistant\n<think>\n", True, False),
        ("<|im_start|>assistant\n", False, False),
        # enable_thinking=False: the template closes an empty reasoning block.
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, True),
        ("earlier turn <think>x</think> answer <|im_start|>assistant\n<think>", True, False),
        ("earlier turn <think>x</think> answer <|im_start|>assistant\n", False, False),
    ],
)
def test_prompt_opens_or_closes_reasoning(prompt, opens, closes):
    assert prompt_opens_reasoning(prompt) is opens
    assert prompt_closes_reasoning(prompt) is closes
