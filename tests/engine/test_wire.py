"""The engine-process messages survive msgpack exactly: every field of every message type, SamplingParams
validated again (and equal) on decoding, TokenLogprobs with infinities, int64 seeds at both ends."""

import dataclasses
import math

import msgspec
import pytest

from nanoinfer.engine import wire
from nanoinfer.engine.request import EngineRequest
from nanoinfer.engine.scheduler import EngineCoreOutput
from nanoinfer.sample.logprobs import TokenLogprobs
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams
from nanoinfer.structured.params import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _params_variants() -> list[SamplingParams]:
    """Every field away from its default, in several combinations (and every output kind)."""
    return [
        SamplingParams(),
        SamplingParams(
            n=3,
            temperature=0.7,
            top_p=0.85,
            top_k=40,
            min_p=0.05,
            presence_penalty=-0.5,
            frequency_penalty=1.25,
            repetition_penalty=1.1,
            seed=INT64_MIN,
            stop=["\n\n", "END"],
            stop_token_ids=[7, 11],
            include_stop_str_in_output=True,
            max_tokens=300,
            min_tokens=5,
            ignore_eos=True,
            logprobs=20,
            prompt_logprobs=0,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            logit_bias={5: -100.0, 151_935: 2.5},
            allowed_token_ids=[3, 5, 9],
            bad_words=["foo", " bar"],
            bad_words_token_ids=[[10, 11], [12]],
            structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {}}}),
        ),
        SamplingParams(
            temperature=0.0,
            seed=INT64_MAX,
            stop="x",
            max_tokens=None,
            logprobs=0,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"], disable_any_whitespace=False),
        ),  # fmt: skip
        SamplingParams(
            temperature=1e-9,
            top_k=-1,
            output_kind=RequestOutputKind.FINAL_ONLY,
            prompt_logprobs=5,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]+@x\.com"),
        ),  # fmt: skip
    ]


def _assert_same_params(got: SamplingParams, expected: SamplingParams) -> None:
    assert type(got) is SamplingParams
    for f in dataclasses.fields(SamplingParams):
        a, b = getattr(got, f.name), getattr(expected, f.name)
        assert a == b and type(a) is type(b), f.name
    assert type(got.output_kind) is RequestOutputKind
    # __post_init__ ran on decoding: the derived state exists and agrees.
    assert got.temperature_only == expected.temperature_only
    assert got == expected


def _requests() -> list[EngineRequest]:
    return [
        EngineRequest(
            request_id=f"req-{i}#{i % 2}",
            prompt_token_ids=[i, 151_935, 0, 1 << 31, *range(i * 3)],
            params=params,
            seed=seed,
            eos_token_ids=(2, 151_643) if i % 2 else (),
            leader_id="req-0#0" if i == 2 else None,
            arrival_time=1_700_000_000.123456 + i,
        )
        for i, (params, seed) in enumerate(
            zip(_params_variants(), (0, INT64_MIN, INT64_MAX, -12345), strict=True)
        )
    ]


def test_add_requests_round_trip_every_field():
    message = wire.AddRequests(_requests())
    got = wire.decode_input(wire.encode(message))
    assert type(got) is wire.AddRequests
    assert len(got.requests) == len(message.requests)
    for decoded, sent in zip(got.requests, message.requests, strict=True):
        assert type(decoded) is EngineRequest
        for f in dataclasses.fields(EngineRequest):
            if f.name != "params":
                value = getattr(decoded, f.name)
                assert value == getattr(sent, f.name) and type(value) is type(getattr(sent, f.name)), f.name
        _assert_same_params(decoded.params, sent.params)
    assert got == message


def test_decoded_params_are_validated():
    """A SamplingParams out of range on the wire fails decoding with the field's own message."""
    fields = msgspec.to_builtins(SamplingParams())
    for name, value, fragment in [
        ("top_p", 7.0, "top_p"),
        ("n", 0, "n must be"),
        ("output_kind", 9, "output_kind"),
    ]:
        bad = wire.AddRequests([EngineRequest("r", [1], SamplingParams(), seed=0)])
        raw = msgspec.to_builtins(bad)
        raw[1][0]["params"] = {**fields, name: value}
        with pytest.raises(msgspec.ValidationError, match=fragment):
            wire.decode_input(msgspec.msgpack.encode(raw))


def test_small_input_messages_round_trip():
    for message in [
        wire.AbortRequests(["a", "b#1", ""]),
        wire.AbortRequests([]),
        wire.UtilityCall(0, "stats"),
        wire.UtilityCall(INT64_MAX, "ping", [1, "two", [3.5, None], {"k": True}]),
        wire.Shutdown(),
    ]:
        got = wire.decode_input(wire.encode(message))
        assert type(got) is type(message) and got == message


def _logprobs(num_positions: int, num_top: int, start: int) -> TokenLogprobs:
    return TokenLogprobs(
        token_ids=[start + i for i in range(num_positions)],
        logprobs=[-0.1 * i - 1e-12 for i in range(num_positions - 1)] + [-math.inf],
        ranks=[1 + i for i in range(num_positions)],
        top_token_ids=[[j for j in range(num_top)] for _ in range(num_positions)],
        top_logprobs=[[-(j + 0.5) / 3 for j in range(num_top)] for _ in range(num_positions)],
    )


def test_outputs_round_trip_every_field():
    outputs = [
        EngineCoreOutput("plain", [42]),
        EngineCoreOutput(
            "ended",
            [5, 151_935],
            finish_reason="stop",
            stop_reason=151_935,
            new_logprobs=_logprobs(2, 3, 5),
            prompt_logprobs=_logprobs(4, 0, 100),
            prompt_logprobs_start=17,
            num_cached_tokens=48,
        ),
        EngineCoreOutput("long", [1], finish_reason="length", new_logprobs=_logprobs(1, 20, 1)),
        EngineCoreOutput("failed", [], finish_reason="error", error="sampling failed: RuntimeError('x')"),
    ]
    message = wire.Outputs(
        outputs, num_prompt_tokens=4096, num_generated_tokens=3, timestamp=1_700_000_000.987654
    )
    got = wire.decode_output(wire.encode(message))
    assert type(got) is wire.Outputs and got == message
    assert [type(o) for o in got.outputs] == [EngineCoreOutput] * len(outputs)
    assert type(got.outputs[1].new_logprobs) is TokenLogprobs
    assert got.outputs[1].new_logprobs.logprobs[-1] == -math.inf
    assert got.timestamp == message.timestamp


def test_small_output_messages_round_trip():
    for message in [
        wire.Ready(num_kv_blocks=123_456, pid=4321, stats={"num_kv_blocks_free": 123_456, "num_running": 0}),
        wire.UtilityResult(3, value={"num_running": 2, "nested": [1, 2.5, None]}),
        wire.UtilityResult(4),
        wire.UtilityResult(5, error="KeyError: 'x'"),
        wire.FatalError("Traceback (most recent call last):\n  ...\nRuntimeError: boom ✗"),
    ]:
        got = wire.decode_output(wire.encode(message))
        assert type(got) is type(message) and got == message


def test_directions_do_not_mix():
    """An engine-bound message is not a valid engine output, and the other way round."""
    with pytest.raises(msgspec.ValidationError):
        wire.decode_output(wire.encode(wire.Shutdown()))
    with pytest.raises(msgspec.ValidationError):
        wire.decode_input(wire.encode(wire.FatalError("x")))
    with pytest.raises(msgspec.DecodeError):
        wire.decode_input(b"\xc1 not msgpack")
