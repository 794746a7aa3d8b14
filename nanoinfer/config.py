"""The one engine configuration object: user options validated once, "auto" values resolved up front."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# vLLM's names: "auto" stores K/V in the model's dtype; the FP8 names store e4m3 with per-layer scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_DEVICES = ("auto", "cuda", "cpu")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")


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
    # Tokens per KV block. 16 (vLLM's default) gives fine-grained prefix-cache hits; any power of two
    # from 16 to 256 works.
    kvcache_block_size: int = 16
    # Override the computed size of the KV block pool.
    num_kvcache_blocks: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    # KV cache budget when running on the CPU (there is no free-memory probe like CUDA's).
    cpu_kvcache_space_bytes: int = 4 << 30
    attention_backend: str = "auto"
    seed: int = 0
    # Schedule and prepare step n+1 while the device runs step n. None: on for CUDA, off on the CPU
    # (where it gains nothing; it works there too, with the same tokens).
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"

    # Resolved in __post_init__.
    hf_config: Any = field(init=False, repr=False, default=None)
    torch_dtype: torch.dtype = field(init=False, default=torch.float32)
    kv_cache_torch_dtype: torch.dtype = field(init=False, default=torch.float32)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        valid = cls.option_names()
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options are {valid}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        self._validate_ranges()
        self.device = self._resolve_device()
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda"
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        elif self.attention_backend == "triton" and self.device != "cuda":
            raise ValueError("attention_backend='triton' needs device='cuda'")

        from nanoinfer.models.checkpoint import load_model_config

        self.hf_config = load_model_config(self.model)
        self.torch_dtype = self._resolve_dtype()
        self.kv_cache_torch_dtype = self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn
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
        _check_int("seed", self.seed, 0)
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
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None or a bool, got {self.async_scheduling!r}")

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


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
