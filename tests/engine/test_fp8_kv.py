"""FP8 (e4m3) KV cache on the CPU: the option, the pool that holds more blocks in the same bytes, the
per-layer scales (from the checkpoint, or calibrated), and generations close to the default cache under
vLLM's logprob-closeness rule, through prefix hits and preemption, with no block leaked."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoinfer import LLM, SamplingParams
from nanoinfer.config import EngineConfig
from tests.fixtures import build_model
from tests.reference import check_logprobs_close

SPACE = 1 << 23


def _prompts(count=16, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(4, 90))] for _ in range(count)]


def _stored_scales(llm):
    layers = llm.llm_engine.engine_core.executor.runner.attention_layers
    return [(float(layer.k_scale), float(layer.v_scale)) for layer in layers]


def _all_free(llm):
    stats = llm.engine_stats()
    return stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


def test_bad_kv_cache_dtype_is_rejected(tiny_qwen3):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3'\)"):
        EngineConfig.from_kwargs(tiny_qwen3, kv_cache_dtype="int4")


def test_fp8_pool_holds_more_blocks_and_generations_stay_close(tiny_qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = _prompts()
    with LLM(tiny_qwen3, cpu_kvcache_space_bytes=SPACE, dtype="bfloat16") as reference:
        expected = reference.generate(prompts, params, use_tqdm=False)
        reference_blocks = reference.engine_stats()["num_kv_blocks_total"]
    # The reference's block size: twice the blocks in the same bytes.
    fp8 = {"kv_cache_dtype": "fp8", "kvcache_block_size": 16}
    with LLM(tiny_qwen3, cpu_kvcache_space_bytes=SPACE, dtype="bfloat16", **fp8) as llm:
        assert llm.engine_stats()["num_kv_blocks_total"] >= 1.9 * reference_blocks
        runner = llm.llm_engine.engine_core.executor.runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn
        # Each kv head's slots of a block are stored together (ModelRunner._allocate_kv_cache).
        k_cache = runner.attention_layers[0].k_cache
        assert (
            k_cache.stride(2) == k_cache.shape[1] * k_cache.shape[3] and k_cache.stride(1) == k_cache.shape[3]
        )
        got = llm.generate(prompts, params, use_tqdm=False)
        assert _all_free(llm)
        scales = _stored_scales(llm)
    assert check_logprobs_close(expected, got) >= 8
    assert all(k > 0 and v > 0 for k, v in scales)


def test_fp8_through_prefix_hits_and_preemption_leaks_nothing(tiny_qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5)
    prompts = _prompts(8, seed=1)
    longest = max(prompts, key=len)
    assert len(longest) >= 48
    shared = [longest[:48] + [7, 8, i] for i in range(3)]  # prefix hits on its first 3 blocks
    kwargs = {
        "num_kvcache_blocks": 14,
        "kvcache_block_size": 16,
        "max_num_batched_tokens": 32,
        "kv_cache_dtype": "fp8_e4m3",
    }
    with LLM(tiny_qwen3, num_kvcache_blocks=200) as reference:
        expected = reference.generate(prompts + shared, params, use_tqdm=False)
    with LLM(tiny_qwen3, **kwargs) as llm:
        got = llm.generate(prompts + shared, params, use_tqdm=False)
        assert llm.engine_stats()["num_preemptions"] > 0
        assert _all_free(llm)
    check_logprobs_close(expected, got)


def test_checkpoint_scales_are_used(tmp_path):
    path = build_model(str(tmp_path / "scaled"), num_hidden_layers=2)
    weights = load_file(f"{path}/model.safetensors")
    for i, (k, v) in enumerate([(0.02, 0.03), (0.05, 0.07)]):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(weights, f"{path}/model.safetensors")
    with LLM(path, kv_cache_dtype="fp8") as llm:
        assert [x for pair in _stored_scales(llm) for x in pair] == pytest.approx([0.02, 0.03, 0.05, 0.07])
        out = llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    with LLM(path) as llm:  # a 16-bit cache ignores the scales
        assert llm.llm_engine.engine_core.executor.runner.attention_layers[0].k_scale is None
