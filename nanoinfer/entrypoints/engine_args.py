"""Engine options as command-line flags (``--max-model-len`` etc.), derived from EngineConfig's fields,
with vLLM's spellings where they differ (``-tp``, ``--block-size``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any

from nanoinfer import config
from nanoinfer.config import GENERATION_CONFIG_MODES, EngineConfig

_SKIP = {"model"}

# What each option does, shown by --help. Every EngineConfig field needs an entry (a test checks); one
# missing would still get a flag, with a generic help.
ENGINE_OPTION_HELP = {
    "tokenizer": "tokenizer directory, if not the model's own",
    "max_num_batched_tokens": "token budget of one engine step; longer prefills are cut into chunks of it",
    "max_num_seqs": "most sequences running at once",
    "max_model_len": "context length in tokens, clamped to the model's (default: the model's)",
    "gpu_memory_utilization": "share of GPU memory for weights, activations and the KV cache",
    "tensor_parallel_size": "GPUs (or CPU processes) the model is split across",
    "enforce_eager": "run without CUDA graphs",
    "kvcache_block_size": "tokens per KV block: a power of two in [16, 256] (default: 16, or 64 with an FP8 "
    "cache)",
    "num_kvcache_blocks": "size of the KV block pool (default: computed from the memory budget)",
    "device": "where the model runs; auto picks cuda when a GPU is visible",
    "dtype": "weights and activations; auto is the checkpoint's 16-bit dtype on GPU, float32 on CPU",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "cpu_kvcache_space_bytes": "KV cache budget in bytes when running on the CPU",
    "attention_backend": "attention kernels; auto is triton on CUDA, torch (pure PyTorch) on CPU",
    "seed": "seed of the engine's random sampling; the same seed repeats a run's sampled answers",
    "cpu_num_threads": "CPU threads of the engine process (default: torch's, every core)",
    "async_scheduling": "schedule and prepare step n+1 while the device runs step n (default: on for CUDA)",
    "num_grammar_processes": "processes that hold constrained requests' grammars; 0: on the engine's "
    "thread (default: on CUDA one per two CPU cores, at most 8; 0 on the CPU)",
    "kv_cache_dtype": "K/V storage: auto (the model's dtype), or fp8 / fp8_e4m3 (half the bytes)",
    "chat_template": "a Jinja chat template (a file, or the template text) instead of the tokenizer's",
    "generation_config": "default sampling parameters: 'auto' reads the model's generation_config.json "
    "(nanoinfer's own for the bundled default model), 'vllm' uses none, DIR reads DIR/generation_config.json",
    "override_generation_config": "a JSON object merged over the default sampling parameters, with "
    "generation_config.json's names, e.g. '{\"temperature\": 0.5}'",
    "trust_remote_code": "accepted for vLLM compatibility: the built-in architectures run no remote code",
    "tokenizer_mode": "auto (vLLM's hf) only: the checkpoint's fast tokenizer, or a GGUF file's own",
    "quantization": "none, or gguf for a .gguf model (dequantized at load); other methods are rejected",
    "swap_space": "accepted for vLLM compatibility (GiB): preempted sequences are recomputed, never swapped",
    "disable_log_stats": "no periodic throughput / KV cache usage log lines",
}

# Extra option strings, vLLM's names for the same options.
ENGINE_OPTION_ALIASES = {
    "tensor_parallel_size": ["-tp"],
    "kvcache_block_size": ["--block-size"],
}

ENGINE_OPTION_CHOICES = {
    "device": list(config._DEVICES),
    "dtype": ["auto", *config._DTYPES],
    "attention_backend": list(config._ATTENTION_BACKENDS),
    "kv_cache_dtype": list(config.KV_CACHE_DTYPES),
}

# Placeholders in the usage line; the option's name already says what the value is.
_METAVARS = {int: "N", float: "X", str: "VALUE"}
_OPTION_METAVARS = {"tokenizer": "PATH"}


def _generation_config(text: str) -> str:
    if text in GENERATION_CONFIG_MODES or os.path.isdir(text):
        return text
    raise argparse.ArgumentTypeError(
        f"must be 'auto' (the model's generation_config.json), 'vllm' (no model defaults) "
        f"or a directory holding a generation_config.json, got {text!r}"
    )


def _json_object(text: str) -> dict:
    """A JSON object flag value (e.g. --override-generation-config '{"temperature": 0.5}')."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _help(name: str) -> str:
    default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)
    return ENGINE_OPTION_HELP[name] + ("" if default is None else f" (default: {default})")


def _add_vllm_options(group: argparse._ArgumentGroup) -> None:
    """vLLM's flags for options that live outside EngineConfig's numeric knobs; each maps to the engine
    keyword of the same name."""
    group.add_argument(
        "--chat-template", default=None, metavar="PATH_OR_TEMPLATE", help=_help("chat_template")
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_const",
        const=True,
        default=None,
        help=_help("trust_remote_code"),
    )
    group.add_argument(
        "--generation-config",
        type=_generation_config,
        default=None,
        metavar="{auto,vllm,DIR}",
        help=_help("generation_config"),
    )


# Engine keywords set by _add_vllm_options (not by the EngineConfig loop, even once they are fields).
VLLM_OPTION_NAMES = ("chat_template", "trust_remote_code", "generation_config")


def _engine_fields() -> list[dataclasses.Field]:
    return [
        f
        for f in dataclasses.fields(EngineConfig)
        if f.init and f.name not in _SKIP and f.name not in VLLM_OPTION_NAMES
    ]


def _shown_default(f: dataclasses.Field) -> str | None:
    if f.default is dataclasses.MISSING or f.default is None:
        return None  # the help text says what an unset option means
    return str(f.default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Adds one ``--flag`` per engine option; unset flags keep the engine's defaults."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options")
    for f in _engine_fields():
        flags = ["--" + f.name.replace("_", "-"), *ENGINE_OPTION_ALIASES.get(f.name, [])]
        help_text = ENGINE_OPTION_HELP.get(f.name, f"the engine option {f.name}")
        shown = _shown_default(f)
        if shown is not None:
            help_text += f" (default: {shown})"
        hint = hints[f.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        # Every default is None: only the flags given on the command line reach the engine.
        if base is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in ENGINE_OPTION_CHOICES:
            group.add_argument(
                *flags, type=base, choices=ENGINE_OPTION_CHOICES[f.name], default=None, help=help_text
            )
        elif base in (int, float, str):
            metavar = _OPTION_METAVARS.get(f.name, _METAVARS[base])
            group.add_argument(*flags, type=base, default=None, metavar=metavar, help=help_text)
        else:  # structured options (dicts, lists) are given as JSON, as vLLM's are
            parse = _json_object if typing.get_origin(base) is dict else json.loads
            group.add_argument(*flags, type=parse, default=None, metavar="JSON", help=help_text)
    _add_vllm_options(group)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user actually set on the command line.

    The vLLM options are passed whether or not EngineConfig knows them yet: an option the engine does
    not support is then its TypeError naming it, never a silently dropped flag.
    """
    names = [f.name for f in _engine_fields()] + list(VLLM_OPTION_NAMES)
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
