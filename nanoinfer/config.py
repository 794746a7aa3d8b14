"""The one engine configuration object: user options validated once, "auto" values resolved up front."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanoinfer.sampling_params import SamplingParams

# vLLM's dtype names: "half" is float16 and "float" float32.
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "half": torch.float16,
    "float": torch.float32,
}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# vLLM's names: "auto" stores K/V in the model's dtype; the FP8 names store e4m3 with per-layer scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# An FP8 cache's default block size. On nano-vLLM's workload 64-token blocks beat 16-token ones by 0.7%
# on an H100 (docs/benchmarks.md, FP8 KV cache, run 115): the decode and prompt steps' device time by
# 0.3% and 1.5%, the rest host time (a block-table entry every 64 tokens instead of 16). Prefix-cache
# hits then come in 64-token steps.
FP8_DEFAULT_BLOCK_SIZE = 64
# Grammar processes on CUDA by default: one per two of the host's cores, at most 8. The structured-outputs
# benchmark on the H100's host (16 cores, docs/benchmarks.md, runs 79 and 81): 8 processes filled 64 rows in
# 560-650 us per step against 810-1,320 with 4, for a ratio of 0.77 on average over five runs (0.64-0.93)
# against 0.69 over two (0.63, 0.75).
MAX_DEFAULT_CUDA_GRAMMAR_PROCESSES = 8
MAX_GRAMMAR_PROCESSES = 16
_DEVICES = ("auto", "cuda", "cpu")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
# "hf" is vLLM's name for the same mode.
_TOKENIZER_MODES = ("auto", "hf")
GENERATION_CONFIG_MODES = ("auto", "vllm")

# vLLM engine options without a nanoinfer counterpart: accepted at the values listed (which change
# nothing here), anything else is a ValueError saying why it cannot be honoured. None as the allowed
# values: every value changes nothing.
VLLM_NEUTRAL_OPTIONS: dict[str, tuple[tuple | None, str]] = {
    "enable_lora": ((False,), "nanoinfer has no LoRA adapters"),
    "pipeline_parallel_size": ((1,), "nanoinfer has no pipeline parallelism (use tensor_parallel_size)"),
    "speculative_config": ((None,), "nanoinfer has no speculative decoding"),
    "revision": ((None,), "models are local paths, there is no hub revision to choose"),
    "tokenizer_revision": ((None,), "tokenizers are local paths, there is no hub revision to choose"),
    "hf_token": (None, "nothing is downloaded"),
    "cpu_offload_gb": ((0,), "weights are never offloaded to the CPU"),
    "enable_chunked_prefill": ((None, True), "prefills are always chunked to max_num_batched_tokens"),
    "skip_tokenizer_init": ((False,), "the engine always loads its tokenizer"),
    "disable_custom_all_reduce": (None, "tensor parallelism uses the process group's all-reduce"),
    "enable_sleep_mode": ((False,), "nanoinfer has no sleep mode"),
}
# vLLM's names of nanoinfer options.
VLLM_ALIASES = {"block_size": "kvcache_block_size"}

# generation_config.json fields that become default sampling parameters (vLLM's set), and their
# SamplingParams names.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_cuda_grammar_processes() -> int:
    """``num_grammar_processes`` on CUDA when not given (see MAX_DEFAULT_CUDA_GRAMMAR_PROCESSES)."""
    return max(1, min(MAX_DEFAULT_CUDA_GRAMMAR_PROCESSES, (os.cpu_count() or 2) // 2))


@dataclass
class EngineConfig:
    """Engine options. Construct with :meth:`from_kwargs` to get a TypeError listing valid options."""

    model: str
    tokenizer: str | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 256
    # None: the model's max_position_embeddings. Larger values are clamped to it.
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # Tokens per KV block: any power of two from 16 to 256. None: 16 (vLLM's default, fine-grained
    # prefix-cache hits) for a 16-bit cache, 64 for an FP8 one (FP8_DEFAULT_BLOCK_SIZE).
    kvcache_block_size: int | None = None
    # Override the computed size of the KV block pool.
    num_kvcache_blocks: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    # KV cache budget when running on the CPU (there is no free-memory probe like CUDA's).
    cpu_kvcache_space_bytes: int = 4 << 30
    attention_backend: str = "auto"
    # Seed of the random sampling of requests that give none; None: a different one every run.
    seed: int | None = 0
    # Schedule and prepare step n+1 while the device runs step n. None: on for CUDA, off on the CPU
    # (where it gains nothing; it works there too, with the same tokens).
    async_scheduling: bool | None = None
    # Processes that hold constrained requests' grammars, beside the engine's thread (see
    # engine/grammar_process.py); 0: the grammars live on the engine's thread. None: on CUDA one per two
    # of the host's cores (at most 8), 0 on the CPU (where they would take the cores the forward pass uses).
    num_grammar_processes: int | None = None
    kv_cache_dtype: str = "auto"
    # CPU threads of the engine process (torch.set_num_threads when the engine starts); None: torch's
    # default, every core.
    cpu_num_threads: int | None = None
    # A Jinja chat template (a file path, or the template text) used instead of the tokenizer's.
    chat_template: str | None = None
    # Default sampling parameters: "auto", the model's generation_config.json (for the bundled default
    # model, which has none, nanoinfer's own); "vllm", none; or a directory holding a
    # generation_config.json.
    generation_config: str = "auto"
    # Merged over those defaults, with generation_config.json's names (e.g. {"temperature": 0.5}).
    override_generation_config: dict[str, Any] | None = None
    # vLLM options accepted for compatibility, each checked to change nothing here:
    # the built-in architectures run no code from the checkpoint, whatever this says;
    trust_remote_code: bool = False
    # the tokenizer is the checkpoint's fast Hugging Face tokenizer (or a GGUF file's own);
    tokenizer_mode: str = "auto"
    # None, or "gguf" for a .gguf model (dequantized at load); quantized safetensors are not supported;
    quantization: str | None = None
    # CPU swap space in GiB: preempted sequences are recomputed, never swapped, so it is never used;
    swap_space: float = 4
    # no periodic statistics log lines (the server's throughput and KV cache usage every 10 s).
    disable_log_stats: bool = False

    # Resolved in __post_init__.
    hf_config: Any = field(init=False, repr=False, default=None)
    torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    kv_cache_torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    chat_template_text: str | None = field(init=False, repr=False, default=None)
    # SamplingParams keyword arguments that requests without sampling parameters get, and their source.
    generation_defaults: dict[str, Any] = field(init=False, default_factory=dict)
    generation_defaults_source: str = field(init=False, default="")
    # EOS ids of generation_config.json beyond the model config's and the tokenizer's.
    generation_eos_token_ids: tuple[int, ...] = field(init=False, default=())

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Also takes vLLM's names (VLLM_ALIASES) and vLLM options nanoinfer has no counterpart for,
        at values that change nothing (VLLM_NEUTRAL_OPTIONS)."""
        valid = cls.option_names()
        accepted = sorted([*valid, *VLLM_ALIASES, *VLLM_NEUTRAL_OPTIONS])
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options are {accepted}")
        for name in set(kwargs) & set(VLLM_NEUTRAL_OPTIONS):
            _check_neutral_option(name, kwargs.pop(name))
        for alias, name in VLLM_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise ValueError(f"{alias} is vLLM's name for {name}: give one of them, not both")
                kwargs[name] = kwargs.pop(alias)
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype) and self.dtype in _DTYPE_NAMES:
            self.dtype = _DTYPE_NAMES[self.dtype]
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 16 if self.kv_cache_dtype == "auto" else FP8_DEFAULT_BLOCK_SIZE
        self._validate_ranges()
        self.device = self._resolve_device()
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda"
        if self.num_grammar_processes is None:
            self.num_grammar_processes = default_cuda_grammar_processes() if self.device == "cuda" else 0
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        elif self.attention_backend == "triton" and self.device != "cuda":
            raise ValueError("attention_backend='triton' needs device='cuda'")

        from nanoinfer.models import checkpoint

        self.hf_config = checkpoint.load_model_config(self.model)
        self._check_quantization()
        self.torch_dtype = self._resolve_dtype()
        self.kv_cache_torch_dtype = self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.dtype = "auto" if self.dtype == "auto" else _DTYPE_NAMES[self.torch_dtype]
        if self.chat_template is not None:
            self.chat_template_text = checkpoint.load_chat_template(self.chat_template)
        self._resolve_generation_defaults()
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 1 << 20
        if self.max_model_len is None or self.max_model_len > model_max:
            self.max_model_len = model_max
        from nanoinfer.distributed import check_tensor_parallel_size

        check_tensor_parallel_size(self.hf_config, self.tensor_parallel_size)

    def _validate_ranges(self) -> None:
        if not isinstance(self.model, str | os.PathLike) or not str(self.model):
            raise ValueError("model must be a non-empty path")
        self.model = str(self.model)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.cpu_num_threads is not None:
            _check_int("cpu_num_threads", self.cpu_num_threads, 1)
        n = self.num_grammar_processes
        if n is not None and (
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_GRAMMAR_PROCESSES
        ):
            raise ValueError(
                f"num_grammar_processes must be an integer in [0, {MAX_GRAMMAR_PROCESSES}], got {n!r}"
            )
        _check_int("cpu_kvcache_space_bytes", self.cpu_kvcache_space_bytes, 1)
        if self.num_kvcache_blocks is not None:
            _check_int("num_kvcache_blocks", self.num_kvcache_blocks, 1)
        bs = self.kvcache_block_size
        if not isinstance(bs, int) or bs < 16 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two in [16, 256], got {bs!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, int | float) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of {('auto', *_DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("enforce_eager", "enable_prefix_caching", "trust_remote_code", "disable_log_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None or a bool, got {self.async_scheduling!r}")
        swap = self.swap_space
        if not isinstance(swap, int | float) or isinstance(swap, bool) or not 0 <= swap < float("inf"):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap!r}")
        if self.tokenizer_mode not in _TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode={self.tokenizer_mode!r} is not supported: nanoinfer uses the checkpoint's "
                f"fast Hugging Face tokenizer (or a GGUF file's own); use one of {_TOKENIZER_MODES}"
            )
        if self.chat_template is not None and (
            not isinstance(self.chat_template, str) or not self.chat_template
        ):
            raise ValueError(
                f"chat_template must be None, a file path or a Jinja template, got {self.chat_template!r}"
            )
        generation = self.generation_config
        if not isinstance(generation, str | os.PathLike) or not str(generation):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {generation!r}")
        self.generation_config = str(generation)
        override = self.override_generation_config
        if override is not None:
            if not isinstance(override, dict):
                raise ValueError(
                    f"override_generation_config must be a dict (a JSON object), got {override!r}"
                )
            unknown = sorted(set(override) - set(GENERATION_CONFIG_FIELDS))
            if unknown:
                raise ValueError(
                    f"override_generation_config has unknown field(s) {unknown}; the fields are "
                    f"{list(GENERATION_CONFIG_FIELDS)}"
                )

    def _check_quantization(self) -> None:
        from nanoinfer.models.checkpoint import is_gguf

        method = self.quantization
        if method is None:
            return
        if method == "gguf":
            if not is_gguf(self.model):
                raise ValueError(f"quantization='gguf' needs a .gguf model file, got {self.model!r}")
            return
        raise ValueError(
            f"quantization={method!r} is not supported: nanoinfer runs unquantized safetensors checkpoints "
            "and GGUF files (dequantized at load); use None (or 'gguf' for a .gguf file)"
        )

    def _resolve_generation_defaults(self) -> None:
        """vLLM's --generation-config and --override-generation-config: the default sampling parameters."""
        from nanoinfer.models.checkpoint import load_generation_config
        from nanoinfer.sampling_params import SamplingParams

        mode = self.generation_config
        if mode == "vllm":
            fields, source = {}, "none (generation_config='vllm')"
        else:
            fields, source = load_generation_config(
                self.model if mode == "auto" else mode, explicit=mode != "auto"
            )
            eos = fields.get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
            self.generation_eos_token_ids = tuple(
                t for t in eos_ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0
            )
        defaults = {
            name: fields[key] for key, name in GENERATION_CONFIG_FIELDS.items() if fields.get(key) is not None
        }
        if not defaults and fields:
            source = f"none ({source} sets no sampling parameter)"
        if self.override_generation_config:
            overrides = self.override_generation_config
            defaults.update(
                {
                    GENERATION_CONFIG_FIELDS[key]: value
                    for key, value in overrides.items()
                    if value is not None
                }
            )
            source += " with override_generation_config"
        try:
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(f"bad default sampling parameter from {source}: {e}") from None
        self.generation_defaults = defaults
        self.generation_defaults_source = source

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation defaults (vLLM's LLM.get_default_sampling_params)."""
        from nanoinfer.sampling_params import SamplingParams

        return SamplingParams(**self.generation_defaults)

    def _resolve_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available")
        return self.device

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        ckpt_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(ckpt_dtype, str):
            ckpt_dtype = _DTYPES.get(ckpt_dtype)
        if ckpt_dtype in (torch.float16, torch.bfloat16):
            return ckpt_dtype
        # A float32 checkpoint still runs in bf16 on GPU: the fast kernels are written for 16-bit.
        return torch.bfloat16

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def max_blocks_per_seq(self) -> int:
        return (self.max_model_len + self.kvcache_block_size - 1) // self.kvcache_block_size


def _check_neutral_option(name: str, value: Any) -> None:
    allowed, reason = VLLM_NEUTRAL_OPTIONS[name]
    if allowed is None or any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return
    shown = " or ".join(repr(a) for a in allowed)
    raise ValueError(f"{name}={value!r} is not supported: {reason}; leave it out (or pass {shown})")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
