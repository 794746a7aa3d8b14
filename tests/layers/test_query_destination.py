"""The attention layer's query destination: a backend that names where the rotated queries must go (the
piecewise CUDA graphs' static query buffer) gets them there from the fused q/k kernel, with the same
tokens as a backend that reads them in place."""

from __future__ import annotations

import torch

from nanoinfer import LLM, SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]


class BufferedQueries:
    """Wraps a backend: asks for the queries in one static buffer and checks every call reads them there."""

    def __init__(self, inner, buffer: torch.Tensor):
        self.inner, self.buffer = inner, buffer
        self.name = inner.name
        self.calls = self.elsewhere = 0

    def query_destination(self, num_tokens: int) -> torch.Tensor:
        return self.buffer[:num_tokens]

    def attend(self, query, *args, **kwargs):
        self.calls += 1
        self.elsewhere += query.data_ptr() != self.buffer.data_ptr()
        return self.inner.attend(query, *args, **kwargs)


def _generate(tiny_qwen3: str, buffered: bool) -> tuple[list[list[int]], list[BufferedQueries]]:
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    try:
        runner = llm.llm_engine.engine_core.executor.runner
        wrappers = []
        if buffered:
            for layer in runner.attention_layers:
                buffer = torch.full((64, layer.num_heads, layer.head_dim), float("nan"), dtype=runner.dtype)
                layer.backend = BufferedQueries(layer.backend, buffer)
                wrappers.append(layer.backend)
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], wrappers
    finally:
        llm.close()


def test_queries_go_where_the_backend_asks_and_tokens_do_not_change(tiny_qwen3):
    plain, _ = _generate(tiny_qwen3, buffered=False)
    buffered, wrappers = _generate(tiny_qwen3, buffered=True)
    assert buffered == plain
    assert wrappers and all(w.calls > 0 for w in wrappers)
    assert sum(w.elsewhere for w in wrappers) == 0
