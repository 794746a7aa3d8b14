"""The engine with the Triton kernels (attention, fused q/k norm + RoPE + KV store, norms, SiLU) run
through Triton's CPU interpreter in float32: the same tokens as the pure-PyTorch path, through mixed
prefill + decode batches, chunked prefill, prefix hits and async scheduling. On a GPU the same kernels
run compiled (scripts/gpu_check.py)."""

import random

import pytest

from nanoinfer import LLM, SamplingParams

pytest.importorskip("triton")

from nanoinfer.layers.attention import TritonAttentionBackend  # noqa: E402
from nanoinfer.layers.kernels import triton_kernels, use_kernels  # noqa: E402


def _use_triton(llm: LLM) -> None:
    runner = llm.llm_engine.engine_core.executor.runner
    use_kernels(runner.model, triton_kernels(pdl=False))  # programmatic dependent launch is CUDA-only
    backend = TritonAttentionBackend(pdl=False)
    first = runner.attention_layers[0]
    width = runner.input_batch.block_table.shape[1]
    backend.decode_workspace = backend.kernels.DecodeWorkspace.allocate(
        8,
        first.num_heads,
        first.num_kv_heads,
        first.head_dim,
        width * runner.block_size,
        "cpu",
        cache_dtype=runner.kv_dtype,
    )
    for layer in runner.attention_layers:
        layer.backend = backend
    runner._warm_up_kernels()  # on a GPU it runs at start-up: every kernel variant once, no K/V written


def test_triton_kernels_give_the_reference_tokens(tiny_qwen3):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (3, 17, 40, 70)]
    prompts.append(prompts[3][:48] + [5, 6])  # a prefix hit on the last prompt's blocks
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=1, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    kwargs = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "max_model_len": 128, "num_kvcache_blocks": 64}
    with LLM(tiny_qwen3, **kwargs) as reference:
        expected = reference.generate(prompts[:4], params[:4], use_tqdm=False)
        expected += reference.generate(prompts[4:], params[4:], use_tqdm=False)
    with LLM(tiny_qwen3, async_scheduling=True, **kwargs) as llm:
        _use_triton(llm)
        got = llm.generate(prompts[:4], params[:4], use_tqdm=False)
        got += llm.generate(prompts[4:], params[4:], use_tqdm=False)
        assert got[4].num_cached_tokens == 48
        stats = llm.engine_stats()
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
