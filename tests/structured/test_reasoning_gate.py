"""A constraint after the reasoning (``ReasoningSpan``, ``backend.ReasoningGate``): the first token may
open the reasoning or answer at once, the reasoning is unconstrained and never fed to the constraint,
and the answer after the end token is matched from the constraint's start. The gate works on token ids:
two ids of the tiny tokenizer stand for ``<think>`` and ``</think>`` here (Qwen3 has them as tokens)."""

import pytest
import torch

from nanoinfer.structured import ReasoningSpan, StructuredOutputsParams, allocate_token_bitmask
from nanoinfer.structured.backend import ANSWER, REASONING, UNDECIDED, ReasoningGate
from nanoinfer.structured.bitmask_ref import unpack_bitmask
from tests.structured.conftest import TINY_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
ANSWER_TEXT = '{"name":"ab","n":7}'


@pytest.fixture
def span(tiny):
    tokenizer, _ = tiny
    start, end = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("<", ">"))
    return ReasoningSpan(start, end)


def _allowed(grammar, vocab_size=TINY_VOCAB) -> list[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    bitmask.zero_()
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar"])
def test_the_reasoning_is_free_and_the_answer_is_constrained(tiny_compilers, span, backend_name):
    tokenizer, compilers = tiny_compilers
    compiler = compilers[backend_name]
    plain = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    gate = compiler.compile(StructuredOutputsParams(json=SCHEMA, reasoning=span))
    assert isinstance(gate, ReasoningGate) and gate.state == UNDECIDED and gate.backend == plain.backend
    first = _allowed(plain)
    assert _allowed(gate) == sorted([*first, span.start_token_id])
    assert gate.accept_token(span.start_token_id) and gate.state == REASONING
    reasoning = _tokens(tokenizer, "hmm, 1 < 2; so") + [span.start_token_id, tokenizer.eos_token_id]
    for token in reasoning:
        assert _allowed(gate) == list(range(TINY_VOCAB))  # EOS too: the output may end in its reasoning
        assert not gate.is_terminated() and gate.is_accepting()
        assert gate.accept_token(token) and gate.state == REASONING
    assert gate.accept_token(span.end_token_id) and gate.state == ANSWER
    assert _allowed(gate) == first  # the constraint starts here, as if nothing came before
    assert not gate.accept_token(_tokens(tokenizer, "x")[0])  # refused: the state is unchanged
    for token in _tokens(tokenizer, ANSWER_TEXT):
        assert gate.accept_token(token)
    assert gate.is_terminated() and _allowed(gate) == [tokenizer.eos_token_id]
    assert gate.num_accepted == 2 + len(reasoning) + len(_tokens(tokenizer, ANSWER_TEXT))


def test_an_answer_at_once_is_constrained_from_its_first_token(tiny, span):
    tokenizer, compiler = tiny
    gate = compiler.compile(StructuredOutputsParams(json=SCHEMA, reasoning=span))
    tokens = _tokens(tokenizer, ANSWER_TEXT)
    assert gate.accept_token(tokens[0]) and gate.state == ANSWER
    assert span.start_token_id not in _allowed(gate)  # no reasoning once the answer began
    assert not gate.accept_token(span.start_token_id)
    for token in tokens[1:]:
        assert gate.accept_token(token)
    assert gate.is_terminated()
    # A token that neither opens the reasoning nor starts the answer is refused.
    other = compiler.compile(StructuredOutputsParams(json=SCHEMA, reasoning=span))
    assert not other.accept_token(_tokens(tokenizer, "x")[0]) and other.state == UNDECIDED


def test_a_prompt_that_opened_the_reasoning_starts_inside_it(tiny, span):
    tokenizer, compiler = tiny
    opened = ReasoningSpan(span.start_token_id, span.end_token_id, opened=True)
    gate = compiler.compile(StructuredOutputsParams(regex="[0-9]{2}", reasoning=opened))
    assert gate.state == REASONING and len(_allowed(gate)) == TINY_VOCAB
    assert gate.accept_token(span.end_token_id) and gate.state == ANSWER
    assert all(tokenizer.decode([t]).isdigit() for t in _allowed(gate))


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar"])
def test_fill_bitmasks_fills_gates_in_every_state_as_one_by_one(tiny_compilers, span, backend_name):
    tokenizer, compilers = tiny_compilers
    compiler = compilers[backend_name]
    grammars = [compiler.compile(StructuredOutputsParams(json=SCHEMA, reasoning=span)) for _ in range(4)]
    grammars[1].accept_token(span.start_token_id)  # in the reasoning
    for token in [span.start_token_id, span.end_token_id, *_tokens(tokenizer, ANSWER_TEXT[:6])]:
        assert grammars[2].accept_token(token)  # in the answer
    grammars.append(compiler.compile(StructuredOutputsParams(json=SCHEMA)))  # no gate
    rows = [4, 0, 3, 1, 2]
    together = allocate_token_bitmask(6, TINY_VOCAB)
    together.zero_()
    compiler.fill_bitmasks(list(zip(grammars, rows, strict=True)), together)
    one_by_one = allocate_token_bitmask(6, TINY_VOCAB)
    one_by_one.zero_()
    for grammar, row in zip(grammars, rows, strict=True):
        grammar.fill_bitmask(one_by_one, row)
    assert torch.equal(together, one_by_one)
    assert (together[0] == -1).all() and (together[5] == 0).all()
    assert [g.state for g in grammars[:4]] == [UNDECIDED, REASONING, ANSWER, UNDECIDED]


def test_the_span_is_checked(tiny, span):
    _, compiler = tiny
    with pytest.raises(ValueError, match="structured_outputs.reasoning.end_token_id must be a token id"):
        ReasoningSpan(1, -1)
    with pytest.raises(ValueError, match="must differ"):
        ReasoningSpan(3, 3)
    with pytest.raises(ValueError, match="structured_outputs.reasoning must be None or a ReasoningSpan"):
        StructuredOutputsParams(regex="a", reasoning={"start_token_id": 1, "end_token_id": 2})
    with pytest.raises(ValueError, match=rf"reasoning's token ids must be in \[0, {TINY_VOCAB}\)"):
        compiler.compile(StructuredOutputsParams(regex="a", reasoning=ReasoningSpan(1, TINY_VOCAB)))
