"""The messages between the API-server process and the engine-core process, and their msgpack encoding.

Each message is one ZeroMQ frame: a msgspec Struct encoded as a msgpack array whose first element is the
message's tag. The payload types are the engine's own dataclasses (EngineRequest with its
SamplingParams, EngineCoreOutput with its TokenLogprobs), which msgspec encodes field by field and
decodes by setting the fields and then calling ``__post_init__``: a decoded SamplingParams is
validated again and equals the one sent. No pickle: a message can only become these types.

API -> engine: :class:`AddRequests`, :class:`AbortRequests`, :class:`UtilityCall`, :class:`Shutdown`.
Engine -> API: :class:`Ready`, :class:`Outputs` (one per engine step), :class:`UtilityResult`,
:class:`FatalError`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from nanoinfer.engine.request import EngineRequest
from nanoinfer.engine.scheduler import EngineCoreOutput

# The engine-core methods a utility call may name (the engine process maps each to its implementation):
# "ping" answers its arguments as a list (a round trip), "stats" is EngineCore.stats(),
# "has_unfinished_requests" is EngineCore.has_unfinished_requests().
UTILITY_METHODS = ("ping", "stats", "has_unfinished_requests")


# -- API process -> engine process -----------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    """Requests the input processor validated and tokenized; the core adds them in order."""

    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Core request ids to drop wherever they are (ids the core does not know are ignored)."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """Runs ``method`` (one of UTILITY_METHODS) with ``args`` on the core between two steps; answered by
    a UtilityResult with the same ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stops the engine loop: the process closes the core and exits with status 0."""


# -- engine process -> API process -----------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core is built and the loop runs: what the frontend needs before it can take requests."""

    num_kv_blocks: int  # the KV pool's size (the input processor checks each request fits in it)
    pid: int
    stats: dict[str, int]  # EngineCore.stats() before any request


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """One engine step's outputs, with the same attribute names as core.EngineCoreOutputs. Also carries
    the error outputs of requests the core rejected when they were added (then both counts are 0)."""

    outputs: list[EngineCoreOutput]
    # Tokens the step computed: prompt tokens (prefill) and sampled tokens.
    num_prompt_tokens: int
    num_generated_tokens: int
    timestamp: float  # time.time() in the engine process when the step's outputs were ready


class UtilityResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: Any = None
    error: str | None = None  # set when the call failed (then value is None)


class FatalError(msgspec.Struct, tag="fatal", array_like=True):
    """The engine process cannot go on (its core failed to start, or a step failed for no one request's
    fault); it exits with status 1 right after sending this."""

    text: str  # the error and its traceback


EngineInput = AddRequests | AbortRequests | UtilityCall | Shutdown
EngineOutput = Ready | Outputs | UtilityResult | FatalError

# msgspec encoders and decoders keep no state between calls: one of each serves every thread.
_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineOutput)


def encode(message: EngineInput | EngineOutput) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes | memoryview) -> EngineInput:
    """Raises msgspec.DecodeError (bad bytes) or msgspec.ValidationError (a field out of range or of the
    wrong type, e.g. a SamplingParams that fails its own validation)."""
    return _input_decoder.decode(data)


def decode_output(data: bytes | memoryview) -> EngineOutput:
    return _output_decoder.decode(data)
