"""`LLM`: the offline batch API, call-compatible with vLLM's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from itertools import count
from typing import Any

from tqdm.auto import tqdm

from nanoinfer.frontend.input_processor import PromptType
from nanoinfer.frontend.llm_engine import LLMEngine
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """``LLM(model, **engine_options)``; see :class:`nanoinfer.config.EngineConfig` for the options."""

    def __init__(self, model: str, **kwargs: Any):
        self.llm_engine = LLMEngine.from_kwargs(model, **kwargs)
        self._request_ids = count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.llm_engine.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def engine_stats(self) -> dict[str, int]:
        return self.llm_engine.stats()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts; returns them in input order."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                request_id = str(next(self._request_ids))
                # Only final outputs are collected here, so the engine need not build per-step ones.
                engine.add_request(
                    request_id, prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                )
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            # A bad prompt (or an interrupt) must not leave earlier requests holding KV blocks.
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while len(finished) < len(request_ids):
            before = engine.stats()
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = max(time.perf_counter() - start, 1e-9)
            after = engine.stats()
            prompt_tokens = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
            if prompt_tokens:
                prefill_tps = prompt_tokens / elapsed
            else:
                decode_tps = (after["num_generated_tokens"] - before["num_generated_tokens"]) / elapsed
            for output in outputs:
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            bar.set_postfix(
                prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s", refresh=False
            )
        bar.close()
        return [finished[r] for r in request_ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them and generates."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _normalize_prompts(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(
        f"prompts must be a str, a list of str, token ids or prompt dicts, got {type(prompts).__name__}"
    )
