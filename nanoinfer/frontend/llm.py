"""`LLM`: the offline batch API, call-compatible with vLLM's."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import count
from typing import Any

from tqdm.auto import tqdm

from nanoinfer.frontend.input_processor import PromptType, render_chat
from nanoinfer.frontend.llm_engine import LLMEngine
from nanoinfer.heap import freeze_heap
from nanoinfer.models.checkpoint import load_chat_template
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """``LLM(model, **engine_options)``; see :class:`nanoinfer.config.EngineConfig` for the options (vLLM's
    names where vLLM has them; vLLM options with no counterpart here are accepted at values that change
    nothing, see ``config.VLLM_NEUTRAL_OPTIONS``)."""

    def __init__(self, model: str, **kwargs: Any):
        self.llm_engine = LLMEngine.from_kwargs(model, **kwargs)
        self._request_ids = count()
        freeze_heap()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.llm_engine.close()
        # The engine's objects were frozen with the rest: collectable again, now that they are garbage.
        gc.unfreeze()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def engine_stats(self) -> dict[str, int]:
        return self.llm_engine.stats()

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: the model's
        generation_config.json defaults (see the generation_config engine option), else SamplingParams()."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts; returns them in input order. ``use_tqdm`` may also be
        a tqdm-like progress bar class. ``lora_request`` and ``priority`` exist for vLLM's signature: there
        are no LoRA adapters and all requests have the same priority."""
        _check_lora_request(lora_request)
        prompt_list = _normalize_prompts(prompts)
        if priority is not None and (len(priority) != len(prompt_list) or any(p != 0 for p in priority)):
            raise ValueError(
                "priority is not supported: requests are scheduled first come, first served; leave it out "
                "(or pass 0 for every prompt)"
            )
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        config = engine.config
        request_ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        progress = use_tqdm if callable(use_tqdm) else tqdm
        bar = progress(
            total=len(prompt_list), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm
        )
        rates = {"prefill": 0.0, "decode": 0.0}
        # Prompts queued since the last step was launched: their tokens (times their completions).
        unlaunched_tokens = unlaunched_rows = 0
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                request_id = str(next(self._request_ids))
                # Only final outputs are collected here, so the engine need not build per-step ones.
                request = engine.input_processor.process(
                    request_id, prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                )
                engine.add_processed_request(request)
                request_ids.append(request_id)
                unlaunched_rows += len(request.children)
                unlaunched_tokens += len(request.prompt_token_ids) * len(request.children)
                if (
                    unlaunched_tokens >= config.max_num_batched_tokens
                    or unlaunched_rows >= config.max_num_seqs
                ):
                    # The prompts queued since the last step fill a step: the next one goes to the device
                    # now, which computes it while more are validated and queued (tens of microseconds
                    # each: queueing a few hundred prompts before the first step kept the device idle for
                    # tens of milliseconds). Every step launched so far took at most one budget of prompt
                    # tokens, so each finds a full budget waiting: the steps are those a fully queued
                    # engine would schedule. (Prompts whose blocks are cached need fewer tokens than
                    # counted: a step may then run fewer rows; each completion still samples from noise of
                    # its own seed, whatever its batch.)
                    self._step(finished, bar, rates)
                    unlaunched_tokens = unlaunched_rows = 0
            while len(finished) < len(request_ids):
                self._step(finished, bar, rates)
        except BaseException:
            # A bad prompt (or an interrupt) must not leave earlier requests holding KV blocks.
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def _step(self, finished: dict[str, RequestOutput], bar: Any, rates: dict[str, float]) -> None:
        """One engine step: its finished requests' outputs into ``finished``; the bar shows the last
        prompt-computing step's prompt tokens per second and the last decode step's new tokens per second."""
        engine = self.llm_engine
        before = engine.stats()
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = max(time.perf_counter() - start, 1e-9)
        after = engine.stats()
        prompt_tokens = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
        if prompt_tokens:
            rates["prefill"] = prompt_tokens / elapsed
        else:
            rates["decode"] = (after["num_generated_tokens"] - before["num_generated_tokens"]) / elapsed
        for output in outputs:
            if output.finished:
                finished[output.request_id] = output
                bar.update(1)
        bar.set_postfix({kind: f"{rate:.0f} tok/s" for kind, rate in rates.items()}, refresh=False)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders one conversation or a list of them with the chat template (``chat_template``, a file
        or template text, else the engine's: its chat_template option or the tokenizer's) and generates;
        vLLM's signature. Message content may be a string or a list of text parts; ``tools`` and
        ``chat_template_kwargs`` go to the template. Each output's ``prompt`` is the rendered text."""
        _check_lora_request(lora_request)
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: this model takes text only")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        template = load_chat_template(chat_template) if chat_template is not None else None
        prompts = []
        for conversation in conversations:
            text, ids = render_chat(
                self.get_tokenizer(),
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=template,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                content_format=chat_template_content_format,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _check_lora_request(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(
            "lora_request is not supported: nanoinfer has no LoRA adapters; leave it out (or pass None)"
        )


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
