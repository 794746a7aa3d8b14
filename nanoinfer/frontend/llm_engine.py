"""`LLMEngine`: vLLM's synchronous engine surface (add_request, step, abort_request), as a thin frontend
over the token-in/token-out EngineCore: the input processor tokenizes and validates, the output
processor detokenizes and builds RequestOutputs."""

from __future__ import annotations

import logging
from typing import Any

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCore
from nanoinfer.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType
from nanoinfer.frontend.output_processor import OutputProcessor
from nanoinfer.models.checkpoint import load_tokenizer
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, start_grammar_processes: bool = False):
        """``start_grammar_processes``: see EngineCore (AsyncLLM's engine, which serves requests as they
        come, starts them with itself)."""
        self.config = config
        self.tokenizer = load_tokenizer(config.model, config.tokenizer, config.chat_template_text)
        logger.info("%s", describe_generation_defaults(config))
        self.engine_core = EngineCore(config, self.tokenizer, start_grammar_processes=start_grammar_processes)
        self.input_processor = InputProcessor(
            config, self.tokenizer, self.engine_core.num_kv_blocks, self.engine_core.structured_outputs
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters gets (the model's generation config)."""
        return self.config.default_sampling_params()

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request; on error nothing is queued or allocated."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.add_processed_request(self.input_processor.process(request_id, prompt, params, arrival_time))

    def add_processed_request(self, request: ProcessedRequest) -> None:
        """Queues a request that ``input_processor.process`` made (on any thread: tokenizing and
        validating need not run between this engine's steps); on error nothing is queued or allocated."""
        self.output_processor.add_request(request)  # raises ValueError for an id in use
        added = []
        try:
            for child in request.children:
                self.engine_core.add_request(child)
                added.append(child.request_id)
        except BaseException:
            self.output_processor.abort_request(request.request_id)
            self.engine_core.abort_requests(added)
            raise

    def abort_request(self, request_id: str | list[str]) -> bool:
        """Removes the request(s) wherever they are and frees their KV blocks; False if none was known."""
        known = False
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            children = self.output_processor.abort_request(rid)
            known = known or bool(children)
            self.engine_core.abort_requests(children)
        return known

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs its requests' output kinds call for."""
        core_outputs = self.engine_core.step()
        outputs, ended = self.output_processor.process_outputs(core_outputs.outputs)
        if ended:
            self.engine_core.abort_requests(ended)
        return outputs

    def stats(self) -> dict[str, int]:
        return self.engine_core.stats()

    def close(self) -> None:
        """Stops the engine core (and its tensor-parallel workers); the engine is unusable afterwards."""
        if self.engine_core is not None:
            self.engine_core.close()
            self.engine_core = None


def describe_generation_defaults(config: EngineConfig) -> str:
    """One line saying which default sampling parameters are in force, and where they come from."""
    defaults = config.generation_defaults
    if not defaults:
        return f"default sampling parameters: SamplingParams()'s ({config.generation_defaults_source})"
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return f"default sampling parameters: {shown} (from {config.generation_defaults_source})"
