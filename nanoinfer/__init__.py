"""nanoinfer: a compact LLM inference engine with a vLLM-compatible offline API."""

from nanoinfer.frontend.llm import LLM
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
