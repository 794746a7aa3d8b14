"""StructuredOutputsParams: exactly one constraint, right types, bounded sizes, the field named."""

import json

import pytest

from nanoinfer.structured.params import (
    MAX_CHOICE_BYTES,
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    MAX_REGEX_BYTES,
    MAX_SCHEMA_BYTES,
    StructuredOutputsParams,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"json": SCHEMA}, "json"),
        ({"json": json.dumps(SCHEMA)}, "json"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'start: "a"'}, "grammar"),
        ({"json_object": True}, "json_object"),
    ],
)
def test_each_constraint_alone_is_accepted(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    assert params.disable_any_whitespace is True


def test_schema_text_is_the_same_for_a_dict_and_its_json():
    assert (
        StructuredOutputsParams(json=SCHEMA).schema_text
        == StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)).schema_text
        == json.dumps(SCHEMA, separators=(",", ":"))
    )


def test_choice_tuple_is_normalized_to_a_list():
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": SCHEMA, "regex": "a"}, "got json and regex"),
        ({"choice": ["a"], "json_object": True}, "got choice and json_object"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
        ({"json": 3}, "structured_outputs.json must be a JSON schema object"),
        ({"json": ""}, "structured_outputs.json must be a non-empty string"),
        ({"json": {"enum": [{1, 2}]}}, "structured_outputs.json is not serializable as JSON"),
        ({"json": {"maximum": float("inf")}}, "structured_outputs.json is not serializable as JSON"),
        ({"json": "[" * 100_000 + "]" * 100_000}, "structured_outputs.json must be at most"),
        (
            {"json": {"enum": ["x" * MAX_SCHEMA_BYTES]}},
            f"structured_outputs.json must be at most {MAX_SCHEMA_BYTES}",
        ),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"regex": ["a"]}, "structured_outputs.regex must be a non-empty string"),
        (
            {"regex": "a" * (MAX_REGEX_BYTES + 1)},
            f"structured_outputs.regex must be at most {MAX_REGEX_BYTES}",
        ),
        (
            {"grammar": 'start: "' + "a" * MAX_GRAMMAR_BYTES + '"'},
            "structured_outputs.grammar must be at most",
        ),
        ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, r"structured_outputs.choice\[1\] must be a non-empty string"),
        ({"choice": ["a", ""]}, r"structured_outputs.choice\[1\] must be a non-empty string"),
        ({"choice": [str(i) for i in range(MAX_CHOICES + 1)]}, f"at most {MAX_CHOICES} entries"),
        ({"choice": ["é" * (MAX_CHOICE_BYTES // 2 + 1)]}, r"structured_outputs.choice\[0\] must be at most"),
        ({"json_object": 1}, "structured_outputs.json_object must be a bool"),
        ({"json_object": True, "disable_any_whitespace": "no"}, "structured_outputs.disable_any_whitespace"),
    ],
)
def test_bad_input_is_rejected_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_deeply_nested_schema_is_rejected_not_a_recursion_error():
    nested: dict = {}
    for _ in range(5000):
        nested = {"items": nested}
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        StructuredOutputsParams(json=nested)
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        StructuredOutputsParams(json="[" * 30_000 + "]" * 30_000)
