"""The engine's greedy output must equal transformers' on the same checkpoint (fp32, CPU)."""

import random

import pytest

from nanoinfer import LLM, SamplingParams
from tests.reference import assert_greedy_match, hf_greedy, load_hf_model

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(lengths, seed=0, vocab=380):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    return load_hf_model(tiny_qwen3)


def _check(llm, hf_model, prompts, params=GREEDY):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(hf_model, prompt, params.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)
        assert out.finished and out.outputs[0].finish_reason == "length"
    stats = llm.engine_stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    return outputs


@pytest.mark.parametrize("block_size", [16, 256])
def test_batch_of_mixed_lengths(tiny_qwen3, hf_model, block_size):
    llm = LLM(tiny_qwen3, kvcache_block_size=block_size)
    # shorter than, equal to and longer than one block of 16 (and of 256 for the last one)
    _check(llm, hf_model, _prompts([1, 5, 15, 16, 17, 40, 300]))


def test_tied_embeddings(tiny_qwen3_tied):
    hf = load_hf_model(tiny_qwen3_tied)
    _check(LLM(tiny_qwen3_tied), hf, _prompts([3, 20, 33], seed=1))


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_chunked_prefill(tiny_qwen3, hf_model, budget):
    llm = LLM(tiny_qwen3, max_num_batched_tokens=budget)
    prompts = _prompts([7, 23, 40], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _check(llm, hf_model, prompts, params)


def test_prefix_cache_hits(tiny_qwen3, hf_model):
    llm = LLM(tiny_qwen3, kvcache_block_size=16)
    shared = _prompts([40], seed=3)[0]
    first = _check(llm, hf_model, [shared + [5, 6, 7]])
    assert first[0].num_cached_tokens == 0
    # Sharing 40 tokens = 2 whole blocks of 16; the partial third block is never cached.
    second = _check(llm, hf_model, [shared + [9, 9], shared[:35] + [11]])
    assert [o.num_cached_tokens for o in second] == [32, 32]
    stats = llm.engine_stats()
    assert stats["prefix_cache_hit_tokens"] == 64


def test_block_aligned_prompt_fully_cached(tiny_qwen3, hf_model):
    llm = LLM(tiny_qwen3, kvcache_block_size=16)
    prompt = _prompts([32], seed=4)
    _check(llm, hf_model, prompt)
    again = _check(llm, hf_model, prompt)
    # Both blocks are cached, but the last one is recomputed to get logits for the last token.
    assert again[0].num_cached_tokens == 16


def test_preemption_keeps_outputs(tiny_qwen3, hf_model):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=6)
    prompts = _prompts([20, 20, 20, 20], seed=5)
    _check(llm, hf_model, prompts)
    assert llm.engine_stats()["num_preemptions"] > 0


def test_chunked_prefill_prefix_hit_and_preemption_together(tiny_qwen3, hf_model):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=7, max_num_batched_tokens=10)
    base = _prompts([36], seed=6)[0]
    prompts = [base + [i + 3] * (i + 1) for i in range(4)]
    _check(llm, hf_model, prompts)
    _check(llm, hf_model, prompts)
    stats = llm.engine_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_decode_crossing_into_new_block(tiny_qwen3, hf_model):
    # A 16-token prompt fills its table exactly; the first decode step needs one more block column.
    llm = LLM(tiny_qwen3, kvcache_block_size=16)
    _check(llm, hf_model, _prompts([16, 31, 32], seed=7))
