"""Structured outputs: constraining generation to a JSON schema, regex, choice list or grammar.

``StructuredOutputsParams`` says what the output must look like; ``GrammarCompiler`` (one per engine)
turns it into a per-request ``Grammar`` matcher that fills token bitmasks; ``apply_token_bitmask_ref``
(torch) and ``triton_bitmask.apply_token_bitmask`` (GPU) apply them to logits; ``tool_call_constraint``
builds the constraint that forces OpenAI tool calls.
"""

from nanoinfer.structured.backend import Grammar, GrammarCompiler, allocate_token_bitmask
from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref
from nanoinfer.structured.params import StructuredOutputsParams
from nanoinfer.structured.tools import tool_call_constraint

__all__ = [
    "Grammar",
    "GrammarCompiler",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "apply_token_bitmask_ref",
    "tool_call_constraint",
]
