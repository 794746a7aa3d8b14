"""Reading checkpoints: model config, tokenizer and weights from a Hugging Face directory (safetensors,
single or sharded) or a GGUF file."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from nanoinfer.layers.linear import copy_checked, read_all
from nanoinfer.models.decoder import SUPPORTED_ARCHITECTURES, DecoderForCausalLM


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


# A model hub id ("Qwen/Qwen3-0.6B"): what a vLLM user passes where nanoinfer needs a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def missing_path_error(what: str, path: str) -> ValueError:
    """The error for a model or tokenizer path that does not exist, with how to download a hub id."""
    message = f"{what} path {path!r} does not exist"
    if _HUB_ID.fullmatch(path):
        name = path.rsplit("/", 1)[1]
        message += (
            f": nanoinfer loads local checkpoints only (no model hub); download it first, e.g. "
            f"`hf download {path} --local-dir {name}` (`huggingface-cli download` in older "
            f"huggingface_hub versions), then pass the directory {name!r} (or a .gguf file)"
        )
    return ValueError(message)


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))


def load_model_config(path: str) -> Any:
    """The transformers config of the checkpoint at ``path``, checked to be a supported model."""
    if not os.path.exists(path):
        raise missing_path_error("model", path)
    if is_gguf(path):
        from nanoinfer.models.gguf import load_gguf_config

        cfg = load_gguf_config(path)
    else:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"model path {path!r} is not a Hugging Face model directory (no config.json) nor a .gguf file"
            )
        if not _safetensors_files(path):
            raise ValueError(f"model directory {path!r} has no *.safetensors weight files")
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        quantization = getattr(cfg, "quantization_config", None)
        if quantization is not None:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ValueError(
                f"{path!r} is a quantized checkpoint ({method!r} in config.json's quantization_config); "
                "nanoinfer runs unquantized safetensors checkpoints and GGUF files"
            )
    archs = getattr(cfg, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} in {path!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return cfg


def load_tokenizer(model: str, tokenizer: str | None = None, chat_template: str | None = None):
    """The tokenizer of ``model`` (or the one at ``tokenizer``); ``chat_template`` (template text)
    replaces its chat template."""
    if tokenizer is None and is_gguf(model):
        from nanoinfer.models.gguf import load_gguf_tokenizer

        loaded = load_gguf_tokenizer(model)
    else:
        from transformers import AutoTokenizer

        path = tokenizer or model
        if not os.path.exists(path):
            raise missing_path_error("tokenizer", path)
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        loaded.chat_template = chat_template
    return loaded


def load_chat_template(template: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (vLLM's --chat-template)."""
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(
        f"chat_template {template!r} is neither an existing file nor a Jinja template (no '{{{{' or '{{%')"
    )


def load_generation_config(path: str, explicit: bool = False) -> tuple[dict[str, Any], str]:
    """The fields of ``path``'s generation_config.json (a model directory, or the directory given as
    generation_config) and where they come from. A GGUF file has none: the bundled default model gets
    nanoinfer's defaults for it. ``explicit``: the directory was named by the user, so it must hold
    one."""
    from nanoinfer.models.default_model import builtin_generation_config

    if is_gguf(path):
        builtin = builtin_generation_config(path)
        if builtin is not None:
            return builtin, f"nanoinfer's defaults for {os.path.basename(path)}"
        return {}, "none (the GGUF file has no generation_config.json)"
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        if explicit:
            raise ValueError(f"generation_config directory {path!r} has no generation_config.json")
        return {}, f"none (no generation_config.json in {path!r})"
    try:
        with open(file, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file!r}: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{file!r} must hold a JSON object")
    return fields, file


def iter_checkpoint_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """(Hugging Face parameter name, tensor or lazy safetensors slice) pairs, one file at a time."""
    if is_gguf(path):
        from nanoinfer.models.gguf import load_gguf_weights

        yield from load_gguf_weights(path, dtype)
        return
    from safetensors import safe_open

    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                # A lazy slice: each tensor-parallel rank's weight loader reads only its own part.
                yield name, f.get_slice(name)


def _default_weight_loader(param: nn.Parameter, loaded) -> None:
    copy_checked(param.data, read_all(loaded))


_KV_SCALE = re.compile(r"layers\.(\d+)\..*\b([kv])_scale$")


def load_weights(model: DecoderForCausalLM, path: str, dtype: torch.dtype) -> dict[tuple[int, str], float]:
    """Copies every checkpoint tensor into its (possibly fused, possibly sharded) parameter. Returns the
    FP8 KV-cache scales the checkpoint carries (vLLM's ``layers.<i>.self_attn.k_scale`` / ``v_scale``),
    by (layer index, "k" or "v")."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    kv_scales: dict[tuple[int, str], float] = {}
    for name, tensor in iter_checkpoint_weights(path, dtype):
        if name.endswith("rotary_emb.inv_freq") or (model.tie_word_embeddings and name == "lm_head.weight"):
            continue
        kv_scale = _KV_SCALE.search(name)
        if kv_scale is not None:
            kv_scales[(int(kv_scale.group(1)), kv_scale.group(2))] = float(read_all(tensor).float().max())
            continue
        for ckpt_part, (fused_part, shard_id) in model.packed_modules_mapping.items():
            if f".{ckpt_part}." in name:
                target = name.replace(f".{ckpt_part}.", f".{fused_part}.")
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter {target!r}")
                param.weight_loader(param, tensor, shard_id)
                loaded.add(f"{target}#{shard_id}")
                break
        else:
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            getattr(param, "weight_loader", _default_weight_loader)(param, tensor)
            loaded.add(name)
    expected = set()
    for name in params:
        fused = [(c, s) for c, (f, s) in model.packed_modules_mapping.items() if f".{f}." in name]
        if fused:
            expected.update(f"{name}#{s}" for _, s in fused)
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {path!r} is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    return kv_scales
