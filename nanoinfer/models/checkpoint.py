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


def _is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


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
        raise ValueError(f"model path {path!r} does not exist")
    if _is_gguf(path):
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
    archs = getattr(cfg, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} in {path!r}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return cfg


def load_tokenizer(model: str, tokenizer: str | None = None):
    if tokenizer is None and _is_gguf(model):
        from nanoinfer.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or model)


def iter_checkpoint_weights(path: str, dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """(Hugging Face parameter name, tensor or lazy safetensors slice) pairs, one file at a time."""
    if _is_gguf(path):
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
