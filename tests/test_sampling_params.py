"""SamplingParams: vLLM's defaults, normalization, and a ValueError naming the field for bad values."""

import dataclasses

import pytest

from nanoinfer import SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.include_stop_str_in_output) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos) == (16, 0, False)
    assert (p.logprobs, p.prompt_logprobs, p.skip_special_tokens) == (None, None, True)
    assert p.temperature_only and not p.greedy


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop_token_ids == [3]
    assert SamplingParams(top_k=-1).top_k == -1 and not SamplingParams(top_k=-1).uses_top_k
    greedy = SamplingParams(temperature=1e-6, top_k=5, top_p=0.5, min_p=0.1)
    assert greedy.greedy and (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert greedy.temperature_only
    assert SamplingParams(max_tokens=None).max_tokens is None
    for name, value in [
        ("top_k", 5),
        ("top_p", 0.9),
        ("min_p", 0.1),
        ("repetition_penalty", 1.1),
        ("seed", 0),
    ]:
        assert not SamplingParams(**{name: value}).temperature_only, name
    assert not SamplingParams(logprobs=0).temperature_only
    assert not SamplingParams(min_tokens=2).temperature_only


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, "[1, 1024]"),
        ("n", 1.5, "[1, 1024]"),
        ("n", 10_000, "[1, 1024]"),
        ("temperature", -0.1, "[0, 1e+06]"),
        ("temperature", float("nan"), "[0, 1e+06]"),
        ("temperature", "1", "[0, 1e+06]"),
        ("temperature", 1e308, "[0, 1e+06]"),
        ("top_p", 0.0, "[1.2e-38, 1]"),
        ("top_p", 1e-300, "[1.2e-38, 1]"),
        ("top_p", 1.01, "[1.2e-38, 1]"),
        ("top_k", -2, "-1, 0"),
        ("top_k", 2.0, "-1, 0"),
        ("top_k", 1 << 40, "up to 2147483647"),
        ("min_p", -0.1, "0 or in [1.2e-38, 1]"),
        ("min_p", 1e-300, "0 or in [1.2e-38, 1]"),
        ("min_p", 1.5, "0 or in [1.2e-38, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.1, "[-2, 2]"),
        ("frequency_penalty", float("inf"), "[-2, 2]"),
        ("repetition_penalty", 0.0, "[1e-06, 1e+06]"),
        ("repetition_penalty", 1e-300, "[1e-06, 1e+06]"),
        ("repetition_penalty", 1e300, "[1e-06, 1e+06]"),
        ("repetition_penalty", True, "[1e-06, 1e+06]"),
        ("seed", 1.0, "integer"),
        ("stop", "", "non-empty"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", [1], "non-empty"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop_token_ids", 5, "list"),
        ("include_stop_str_in_output", 1, "bool"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("ignore_eos", "yes", "bool"),
        ("logprobs", 21, "[0, 20]"),
        ("logprobs", -1, "[0, 20]"),
        ("prompt_logprobs", True, "[0, 20]"),
        ("skip_special_tokens", None, "bool"),
    ],
)
def test_bad_values_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    text = str(info.value)
    # The server maps the first word of the message to the offending request field.
    assert text.split(" ", 1)[0] == field and message in text


def test_min_tokens_at_most_max_tokens():
    SamplingParams(min_tokens=5, max_tokens=5)
    SamplingParams(min_tokens=100, max_tokens=None)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=6, max_tokens=5)


def test_replace_revalidates():
    p = SamplingParams(top_k=3)
    p.top_k = -7
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(p)
