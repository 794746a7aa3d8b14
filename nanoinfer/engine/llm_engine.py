"""The engine loop: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nanoinfer.config import EngineConfig
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.executor.batch import ModelInput, ScheduledRow
from nanoinfer.models.checkpoint import load_tokenizer
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams

PromptType = str | list[int] | dict


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.monotonic)

    def output(self) -> RequestOutput:
        seq = self.seq
        completion = CompletionOutput(
            index=0,
            text=self.detokenizer.text,
            token_ids=seq.completion_token_ids,
            finish_reason=seq.finish_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=seq.finish_reason is not None,
            num_cached_tokens=max(seq.num_cached_prompt_tokens, 0),
        )


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from nanoinfer.executor.model_runner import ModelRunner  # imports torch model code

        self.config = config
        self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        self.eos_token_ids = self._eos_token_ids()
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks, config.kvcache_block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, _Request] = {}
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        gen_eos = getattr(self.config.hf_config, "eos_token_id", None)
        for value in (self.tokenizer.eos_token_id, gen_eos):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list | tuple):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    # -- requests --------------------------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list | tuple):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validates and queues a request; on error nothing is queued or allocated."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, more than max_model_len={max_len} "
                "(the maximum context length)"
            )
        # Every token that ever needs K/V (all but the last sampled one) must fit in the whole pool.
        kv_tokens = min(len(token_ids) + params.max_tokens - 1, max_len)
        needed = self.block_manager.blocks_needed(kv_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({kv_tokens} tokens) but the KV cache holds only "
                f"{self.block_manager.num_blocks} blocks of {self.config.kvcache_block_size} tokens; "
                "shorten the prompt or max_tokens"
            )
        seq = Sequence(token_ids, params, self.config.kvcache_block_size, request_id)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids)
        self.requests[request_id] = _Request(request_id, text, token_ids, params, seq, detok)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request.seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one batch; returns the outputs of requests that advanced."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        rows = []
        for seq in scheduled.seqs:
            start = seq.num_computed_tokens
            end = start + seq.num_scheduled_tokens
            rows.append(
                ScheduledRow(
                    token_ids=seq.token_ids[start:end],
                    start_pos=start,
                    block_table=list(seq.block_table),
                    sample=end == seq.num_tokens,
                    params=seq.params,
                )
            )
        sampled = self.model_runner.execute(ModelInput(scheduled.is_prefill, rows))
        if scheduled.is_prefill:
            self.num_prompt_tokens_computed += scheduled.num_tokens
        ready = self.scheduler.postprocess(scheduled.seqs)
        outputs = []
        for seq, token_id in zip(ready, sampled, strict=True):
            request = self.requests[seq.request_id]
            seq.append_token(token_id)
            self.num_generated_tokens += 1
            request.detokenizer.add_token(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.requests[seq.request_id]
            outputs.append(request.output())
        return outputs

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def stats(self) -> dict[str, int]:
        bm = self.block_manager
        return {
            "num_kv_blocks_total": bm.num_blocks,
            "num_kv_blocks_free": bm.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queried_tokens": bm.queried_tokens,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
        }

    def close(self) -> None:
        """Stops the model runner (and its tensor-parallel workers); the engine is unusable afterwards."""
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = None
