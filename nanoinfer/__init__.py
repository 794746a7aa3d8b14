"""nanoinfer: a compact LLM inference engine with a vLLM-compatible offline API."""

from nanoinfer.frontend.llm import LLM
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
