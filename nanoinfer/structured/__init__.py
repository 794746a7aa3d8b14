"""Structured outputs: constraining generation to a JSON schema, regex, choice list or grammar.

``StructuredOutputsParams`` says what the output must look like (with a ``ReasoningSpan``: what follows
a reasoning model's reasoning); ``GrammarCompiler`` (one per engine)
turns it into a per-request ``Grammar`` matcher that fills token bitmasks; ``apply_token_bitmask_ref``
(torch) and ``triton_bitmask.apply_token_bitmask`` (GPU) apply them to logits; ``tool_call_constraint``
builds the constraint that forces OpenAI tool calls.

Only ``StructuredOutputsParams`` is imported with the package: the others load llguidance (and the first
JSON schema loads xgrammar), which an engine that never sees a constrained request does not need (they
are imported on first access).
"""

import importlib

from nanoinfer.structured.params import ReasoningSpan, StructuredOutputsParams

_LAZY = {
    "Grammar": "nanoinfer.structured.backend",
    "GrammarCompiler": "nanoinfer.structured.backend",
    "allocate_token_bitmask": "nanoinfer.structured.backend",
    "apply_token_bitmask_ref": "nanoinfer.structured.bitmask_ref",
    "tool_call_constraint": "nanoinfer.structured.tools",
}

__all__ = ["ReasoningSpan", "StructuredOutputsParams", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
