"""The offline API: input forms, validation errors, EOS handling, and that failures free every block."""

import json
import shutil

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, max_model_len=128, kvcache_block_size=16)


def _all_free(llm):
    stats = llm.engine_stats()
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0
    )


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Paged attention")
    single = llm.generate("Paged attention", GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == "Paged attention" and single[0].prompt_token_ids == ids
    outs = llm.generate(["Paged attention", "Prefix caching"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Paged attention", "Prefix caching"]
    assert outs[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    by_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == by_dict[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    per_prompt = llm.generate(
        [ids, ids], [GREEDY, SamplingParams(temperature=0.0, max_tokens=2)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [6, 2]
    out = per_prompt[0].outputs[0]
    assert out.index == 0 and out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert _all_free(llm)


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    two = llm.chat([messages, messages], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_default_sampling_params_generate_16_tokens(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_engine_option_lists_valid_ones(tiny_qwen3):
    with pytest.raises(TypeError, match="max_num_seqs"):
        LLM(tiny_qwen3, max_num_sequences=4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kvcache_block_size": 24}, "kvcache_block_size"),
        ({"kvcache_block_size": 8}, "kvcache_block_size"),
        ({"kvcache_block_size": 512}, "kvcache_block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"num_kvcache_blocks": 0}, "num_kvcache_blocks"),
    ],
)
def test_config_validation(tiny_qwen3, kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(tiny_qwen3, **kwargs)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_block_sizes_accepted(tiny_qwen3, block_size):
    assert (
        EngineConfig.from_kwargs(tiny_qwen3, kvcache_block_size=block_size).kvcache_block_size == block_size
    )


def test_max_model_len_clamped_to_model(tiny_qwen3):
    cfg = EngineConfig.from_kwargs(tiny_qwen3, max_model_len=100_000)
    assert cfg.max_model_len == 512
    assert cfg.device == "cpu" and str(cfg.torch_dtype) == "torch.float32"


def test_bad_prompts_raise_and_leak_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([[5] * 10, [5] * 129], GREEDY, use_tqdm=False)
    assert _all_free(llm)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[5, 6], []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        llm.generate([[5, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 1 entries"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    assert _all_free(llm)
    # The engine still works after the errors.
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finished


def test_request_larger_than_the_whole_kv_pool(tiny_qwen3):
    small = LLM(tiny_qwen3, kvcache_block_size=16, num_kvcache_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 20], SamplingParams(max_tokens=20), use_tqdm=False)
    assert _all_free(small)


def test_eos_stops_unless_ignored(tiny_qwen3, tmp_path):
    probe = LLM(tiny_qwen3)
    prompt = [[7, 8, 9, 10]]
    first = probe.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    eos = first[0].outputs[0].token_ids[2]
    # Same weights, but the model's EOS is the third token greedy decoding produces.
    model_dir = shutil.copytree(tiny_qwen3, tmp_path / "eos_model")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(model_dir))
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[
        0
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first[0].outputs[0].token_ids[: stopped.token_ids.index(eos) + 1]
    ignored = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert ignored[0].outputs[0].finish_reason == "length" and len(ignored[0].outputs[0].token_ids) == 5
    assert _all_free(llm)


def test_bad_model_paths(tmp_path, tiny_qwen3):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(f"{tiny_qwen3}/config.json", no_weights / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights))
    other = shutil.copytree(tiny_qwen3, tmp_path / "gpt2ish")
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(other))


def test_sampling_is_seeded_by_engine_seed(tiny_qwen3):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = LLM(tiny_qwen3, seed=3).generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(tiny_qwen3, seed=3).generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_the_engine_heap_is_frozen_while_it_runs_and_given_back_at_close(tiny_qwen3):
    # A full collection over the startup heap (torch's, the model's objects) is a stall of 0.1-0.4 s in
    # the middle of a batch; frozen, collections never traverse it.
    import gc

    engine = LLM(tiny_qwen3, max_model_len=128)
    try:
        assert gc.get_freeze_count() > 0
        engine.generate("Paged attention", GREEDY, use_tqdm=False)
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0


def _record_schedules(core) -> list:
    """A list that receives, for each of the core's schedules from now on, its (request id, tokens) rows."""
    schedules = []
    original = core.scheduler.schedule

    def schedule():
        out = original()
        schedules.append([(r.request_id, r.num_tokens) for r in out.scheduled])
        return out

    core.scheduler.schedule = schedule
    return schedules


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_start_while_prompts_are_queued_once_each_step_is_filled(tiny_qwen3, async_scheduling):
    """generate() launches a step each time the prompts queued since the last launch fill a step's token
    budget (the device computes it while more are queued): every step is the one a fully queued engine
    schedules, and the outputs are the same."""
    options = dict(max_model_len=128, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    prompts = [[5 + i] * 20 for i in range(10)]
    pipelined = LLM(tiny_qwen3, **options)
    core = pipelined.llm_engine.engine_core
    queued_at_step = []
    original_step = core.step

    def step():
        queued_at_step.append(len(core.scheduler.requests))
        return original_step()

    core.step = step
    schedules = _record_schedules(core)
    outputs = pipelined.generate(prompts, GREEDY, use_tqdm=False)
    # 20-token prompts: every fourth fills the 64-token budget; then the two left join the queue.
    assert queued_at_step[:3] == [4, 8, 10]
    assert _all_free(pipelined)

    engine = LLM(tiny_qwen3, **options).llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    queued_schedules = _record_schedules(engine.engine_core)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert schedules == queued_schedules
    expected = [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_bad_prompt_after_the_first_step_started_leaks_nothing(tiny_qwen3, async_scheduling):
    """The first step is on its way when a later prompt turns out invalid: the call raises, every request of
    the call is aborted and frees its blocks, and the engine runs the next call as a fresh one would."""
    llm = LLM(tiny_qwen3, max_model_len=128, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    prompts = [[5 + i] * 20 for i in range(5)]
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([*prompts, [5] * 129], GREEDY, use_tqdm=False)
    assert _all_free(llm)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    fresh = LLM(tiny_qwen3, max_model_len=128, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    expected = fresh.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    assert _all_free(llm)
