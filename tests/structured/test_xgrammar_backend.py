"""The auto backend: which JSON schemas xgrammar compiles (quickly), and that its matchers behave as
llguidance's: the same masks along random walks (bounded strings aside: they take no escapes), the
same end of output, valid JSON strings only; fill_bitmasks over both kinds of matcher at once."""

import json
import logging
import random
import time

import pytest
import torch

import nanoinfer.structured.xgrammar_backend as xgrammar_backend
from nanoinfer.structured import GrammarCompiler, StructuredOutputsParams, allocate_token_bitmask
from nanoinfer.structured.bitmask_ref import unpack_bitmask
from nanoinfer.structured.xgrammar_backend import unsuitable_reason
from tests.structured.conftest import QWEN3_VOCAB, TINY_VOCAB
from tests.structured.test_backend import SCHEMA, VALID_TEXT

# benchmarks/structured_outputs.py's schema (the engine benchmark's 64 requests), closed objects only.
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 8},
                    "score": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                },
                "required": ["name", "score", "kind", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
# Nothing bounded in its strings: xgrammar's masks are llguidance's exactly.
UNBOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 5000},
        "label": {"type": "string"},
        "ratio": {"type": "number"},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "extra": {"type": "object"},
    },
    "required": ["id", "label"],
    "additionalProperties": False,
}


def _closed_nested(depth):
    return json.loads(
        '{"type":"object","additionalProperties":false,"properties":{"a":' * depth
        + '{"type":"integer"}'
        + '},"required":["a"]}' * depth
    )


def _open(*names):
    return {"type": "object", "properties": {name: {"type": "integer"} for name in names}}


def _string(pattern):
    return {"type": "string", "pattern": pattern}


ROUTES = {
    "tests' schema": (SCHEMA, "xgrammar"),
    "engine benchmark's schema": (ITEMS_SCHEMA, "xgrammar"),
    "unbounded strings": (UNBOUNDED_SCHEMA, "xgrammar"),
    "an open object (xgrammar: 40-800 ms)": (_open("name", "age"), "llguidance"),
    "an open nested object": ({"type": "array", "items": _open("x")}, "llguidance"),
    "nested 40 deep": (_closed_nested(40), "llguidance"),
    "600 enum values": ({"enum": list(range(600))}, "llguidance"),
    "300 properties": (dict(_open(*[f"p{i}" for i in range(300)]), additionalProperties=False), "llguidance"),
    "a repetition of letters": (_string("^[a-z]{1,64}$"), "llguidance"),
    "nested repetitions": (_string("^(([a-z]{1,8}-){1,8}x)$"), "llguidance"),
    'a pattern with "."': (_string("^a.b$"), "llguidance"),
    "a negated class": (_string("^[^a]+$"), "llguidance"),
    "format": ({"type": "string", "format": "date-time"}, "llguidance"),
    "required beyond properties": ({"type": "object", "required": ["b"]}, "llguidance"),
    # Compiles with llguidance, not with xgrammar ("Integer constraint must be a whole number"; 10^30
    # is out of its range): falls back.
    "an xgrammar error": ({"type": "integer", "minimum": 1.5}, "llguidance"),
    "an xgrammar range error": ({"type": "integer", "maximum": 10**30}, "llguidance"),
    "digits and dates": (_string(r"^\d{4}-[0-9]{2}-\d{2}$"), "xgrammar"),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_auto_routes_json_schemas(tiny, case):
    _, compiler = tiny
    schema, backend = ROUTES[case]
    start = time.perf_counter()
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    assert grammar.backend == backend
    assert time.perf_counter() - start < 0.5
    assert compiler.compile(StructuredOutputsParams(json_object=True)).backend == "xgrammar"


def test_unsuitable_reason_names_the_cause():
    def reason(schema):
        return unsuitable_reason(schema, len(json.dumps(schema)))

    assert reason(SCHEMA) is None and reason(ITEMS_SCHEMA) is None and reason(True) is None
    assert "additionalProperties" in reason(_open("a"))
    assert "keyword 'uniqueItems'" in reason({"type": "array", "uniqueItems": True})
    assert "nests more than 32" in reason(_closed_nested(32))
    assert reason(_closed_nested(31)) is None
    assert "bytes" in unsuitable_reason({}, 20000)
    assert "anyOf" in reason({"anyOf": [{"type": "integer"}] * 65})
    assert "enum/const" in reason({"anyOf": [{"enum": list(range(300))}, {"enum": list(range(213))}]})
    # Patterns: weight = repetitions x (letters, + 16 for the space); distinct patterns add up.
    assert reason(_string("^[a-z]{1,30}$")) is None  # 780
    assert "weigh" in reason(_string("^[a-z]{1,31}$"))  # 806
    assert "weigh" in reason(_string("^[A-Za-z ]{0,12}$"))  # 816
    assert reason(_string("^[0-9]{1,255}$|^x{3}$")) is None
    twenty, eleven = _string("^[a-z]{20}$"), _string("^[a-z]{11}$")  # 520 and 286
    assert "weigh" in reason({"anyOf": [twenty, eleven]}) and reason({"anyOf": [twenty, twenty]}) is None
    for pattern, why in [
        ("a.b", '"."'),
        ("[^a]", "negated"),
        (r"\D", r"escape \D"),
        (r"\p{L}", r"escape \p"),
        (r"\u00e9", r"escape \u"),
        ("(?=a)", "(?"),
        ("é", "ASCII"),
        ("[]a]", "empty class"),
        ("a{,3}", "malformed"),
        ("(a", "unclosed group"),
    ]:
        assert why in reason(_string(pattern)), pattern


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=False),
        StructuredOutputsParams(json=UNBOUNDED_SCHEMA),
        StructuredOutputsParams(json=UNBOUNDED_SCHEMA, disable_any_whitespace=False),
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=ITEMS_SCHEMA),
    ],
    ids=["object", "object_whitespace", "unbounded", "unbounded_whitespace", "schema", "items"],
)
def test_masks_and_end_of_output_match_llguidance(tiny_compilers, params):
    """Along random walks of tokens both allow, both masks are the same (a bounded string takes no escapes
    in xgrammar: those tokens are llguidance's only), and so are is_terminated() and is_accepting()."""
    tokenizer, compilers = tiny_compilers
    bounded = params.json in (SCHEMA, ITEMS_SCHEMA)
    ours, theirs = allocate_token_bitmask(1, TINY_VOCAB), allocate_token_bitmask(1, TINY_VOCAB)
    steps = 0
    for seed in range(6):
        rng = random.Random(seed)
        xgr = compilers["auto"].compile(params)
        llg = compilers["llguidance"].compile(params)
        assert xgr.backend == "xgrammar"
        for _ in range(250):
            xgr.fill_bitmask(ours, 0)
            llg.fill_bitmask(theirs, 0)
            mine, reference = unpack_bitmask(ours, TINY_VOCAB)[0], unpack_bitmask(theirs, TINY_VOCAB)[0]
            if bounded:
                assert not (mine & ~reference).any(), "xgrammar allowed a token that llguidance does not"
                only_llguidance = (reference & ~mine).nonzero().flatten().tolist()
                assert all("\\" in tokenizer.decode([t]) for t in only_llguidance), only_llguidance
            else:
                assert torch.equal(mine, reference)
            token = rng.choice((mine & reference).nonzero().flatten().tolist())
            assert xgr.accept_token(token) and llg.accept_token(token)
            assert xgr.is_terminated() == llg.is_terminated()
            assert xgr.is_accepting() == llg.is_accepting()
            steps += 1
            if token == tokenizer.eos_token_id:
                break
    assert steps > 300


@pytest.mark.parametrize(
    "schema, text",
    [
        ({"type": "integer", "maximum": 150}, "150"),
        ({"type": "integer"}, "12"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]"),
        ({"type": "array", "items": {"type": "integer"}}, "[3]"),
        ({"type": "string", "maxLength": 3}, '"abc"'),
        ({"enum": ["yes", "yes!"]}, '"yes"'),
        (SCHEMA, VALID_TEXT),
    ],
)
def test_end_of_output_as_llguidance(tiny_compilers, schema, text):
    """Token by token: the same answers to accept_token, is_accepting and is_terminated, EOS allowed at
    the same steps; then EOS again and again (ignore_eos), nothing else, and EOS-only masks."""
    tokenizer, compilers = tiny_compilers
    params = StructuredOutputsParams(json=schema)
    grammars = [compilers["auto"].compile(params), compilers["llguidance"].compile(params)]
    assert [g.backend for g in grammars] == ["xgrammar", "llguidance"]
    eos = tokenizer.eos_token_id
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)

    def state(grammar, token):
        grammar.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, TINY_VOCAB)[0]
        return (
            bool(allowed[eos]),
            grammar.accept_token(token),
            grammar.is_accepting(),
            grammar.is_terminated(),
        )

    tokens = tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        assert state(grammars[0], token) == state(grammars[1], token)
    for grammar in grammars:
        assert grammar.is_accepting()
        for _ in range(3):
            assert grammar.accept_token(eos)
            grammar.fill_bitmask(bitmask, 0)
            assert unpack_bitmask(bitmask, TINY_VOCAB)[0].nonzero().flatten().tolist() == [eos]
            assert not grammar.accept_token(tokens[0])
            assert grammar.is_terminated() and grammar.is_accepting() and grammar.error is None
        assert grammar.num_accepted == len(tokens) + 3


def test_fill_bitmasks_of_both_kinds_at_once(tiny):
    tokenizer, compiler = tiny
    tokens = tokenizer.encode(VALID_TEXT, add_special_tokens=False)
    grammars = []
    for n in (0, 7, 20, len(tokens)):
        grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
        for token in tokens[:n]:
            assert grammar.accept_token(token)
        grammars.append(grammar)
    assert grammars[-1].is_terminated() and grammars[-1].accept_token(tokenizer.eos_token_id)  # stopped
    grammars.append(compiler.compile(StructuredOutputsParams(regex="[a-z]{2,5}")))
    grammars.append(compiler.compile(StructuredOutputsParams(choice=["yes", "no"])))
    grammars.append(compiler.compile(StructuredOutputsParams(json_object=True)))
    assert [g.backend for g in grammars] == ["xgrammar"] * 4 + ["llguidance"] * 2 + ["xgrammar"]
    rows = [9, 0, 4, 2, 7, 5, 1]
    batched = allocate_token_bitmask(10, TINY_VOCAB)
    compiler.fill_bitmasks(list(zip(grammars, rows, strict=True)), batched)
    single = allocate_token_bitmask(10, TINY_VOCAB)
    for grammar, row in zip(grammars, rows, strict=True):
        grammar.fill_bitmask(single, row)
    assert torch.equal(batched, single)
    for row in (3, 6, 8):
        assert (batched[row] == -1).all()  # rows not listed are left as they were
    # The stopped one (row 2) allows EOS only.
    assert unpack_bitmask(batched, TINY_VOCAB)[2].nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def _byte_tokens(tokenizer):
    """The tiny byte-level tokenizer's token of each byte (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    characters = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in characters]
    characters.update({b: chr(256 + i) for i, b in enumerate(others)})
    vocab = tokenizer.get_vocab()
    return {b: vocab[c] for b, c in characters.items()}


@pytest.mark.parametrize("max_length", [None, 6])
def test_strings_are_json_and_never_special_tokens(tiny, max_length):
    tokenizer, compiler = tiny
    byte = _byte_tokens(tokenizer)
    schema = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}

    def takes(data: bytes) -> bool:
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        assert grammar.backend == "xgrammar"
        return all(grammar.accept_token(byte[b]) for b in b'"' + data + b'"') and grammar.is_accepting()

    assert takes("aé€🚀".encode())
    for bad in (b"\x01", b"\t", b"\x7f", b"\xed\xa0\x80", b"\xc0\x80", b"\\/", b"\\u0041", b"\\x"):
        assert not takes(bad), bad
    # Escapes: in an unbounded string as llguidance takes them; a bounded one takes none.
    for escape in (b'\\"', b"\\\\", b"\\n", b"\\u001f", b"\\u007F"):
        assert takes(escape) is (max_length is None), escape
    # Added tokens (<|endoftext|>, <|im_start|>, <|im_end|>) are never text, nor the ids without a token.
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    assert grammar.accept_token(byte[ord('"')])
    bitmask = allocate_token_bitmask(1, TINY_VOCAB)
    grammar.fill_bitmask(bitmask, 0)
    allowed = unpack_bitmask(bitmask, TINY_VOCAB)[0]
    assert allowed[byte[ord("a")]] and not allowed[[0, 1, 2, *range(384, TINY_VOCAB)]].any()
    assert not any(grammar.accept_token(t) for t in (0, 1, 2, 390, -1, TINY_VOCAB))


def test_a_failing_xgrammar_ends_the_request_with_an_error(tiny):
    tokenizer, compiler = tiny
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))

    class Broken:
        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("broken")

        def is_completed(self):
            return False

    grammar._matcher = Broken()
    bitmask = allocate_token_bitmask(2, TINY_VOCAB)
    compiler.fill_bitmasks([(grammar, 1)], bitmask)
    assert "broken" in grammar.error
    assert unpack_bitmask(bitmask, TINY_VOCAB)[1].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not grammar.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    assert not grammar.is_terminated() and not grammar.is_accepting()


def test_xgrammar_that_cannot_be_fixed_leaves_json_to_llguidance(tiny_compilers, monkeypatch, caplog):
    # Another xgrammar version writes its grammars otherwise: the start-up check fails.
    monkeypatch.setattr(xgrammar_backend, "fix_strings", lambda ebnf: ebnf)
    tokenizer, _ = tiny_compilers
    compiler = GrammarCompiler(tokenizer, TINY_VOCAB)
    with caplog.at_level(logging.WARNING, logger="nanoinfer.structured.backend"):
        assert compiler.compile(StructuredOutputsParams(json=SCHEMA)).backend == "llguidance"
    assert "xgrammar is not usable" in caplog.text and compiler.backend == "llguidance"
    with pytest.raises(RuntimeError, match="not fixed as expected"):
        GrammarCompiler(tokenizer, TINY_VOCAB, backend="xgrammar").compile(
            StructuredOutputsParams(json=SCHEMA)
        )


def test_forced_text_takes_the_tokenizers_first_token_qwen3(qwen3, qwen3_llguidance):
    """Before a property name, both allow only the first token of the tokenizer's tokenization of it
    ("Hifred": "H", "if", "red"; the longest match would be "Hi"), not every prefix."""
    schema = {"type": "object", "properties": {"Hifred": {"type": "integer"}}, "additionalProperties": False}
    masks = []
    for tokenizer, compiler in (qwen3, qwen3_llguidance):
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        for token in tokenizer.encode('{"', add_special_tokens=False):
            assert grammar.accept_token(token)
        bitmask = allocate_token_bitmask(1, QWEN3_VOCAB)
        grammar.fill_bitmask(bitmask, 0)
        masks.append(unpack_bitmask(bitmask, QWEN3_VOCAB)[0].nonzero().flatten().tolist())
    assert masks[0] == masks[1] == tokenizer.encode("H", add_special_tokens=False)


# At the routing limits (benchmarks/structured_backends.py --limits measures them: 5-80 ms).
AT_THE_LIMITS = {
    "256 optional properties": dict(_open(*[f"p{i}" for i in range(256)]), additionalProperties=False),
    "512 enum values": {"enum": [f"value_{i:05d}" for i in range(512)]},
    "32 levels": _closed_nested(31),
    "patterns of weight 800": {
        "type": "array",
        "items": {"anyOf": [_string("^[a-z]{1,16}$"), _string("^[A-Z]{1,14}$"), _string("^[0-9]{1,255}$")]},
    },
}


def test_schemas_at_the_limits_compile_quickly_qwen3(qwen3):
    _, compiler = qwen3
    for name, schema in AT_THE_LIMITS.items():
        params = StructuredOutputsParams(json=schema)
        elapsed = []
        for _ in range(2):  # the least disturbed of two (the machine may be shared)
            compiler.xgrammar.clear_cache()
            start = time.perf_counter()
            grammar = compiler.compile(params)
            elapsed.append(time.perf_counter() - start)
        assert grammar.backend == "xgrammar", name
        assert min(elapsed) < 0.2, f"{name}: {min(elapsed):.3f} s"
