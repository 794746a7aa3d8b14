"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights dequantized at load time.

Which step is done by whom, and why:

- The header (metadata and tensor table) is parsed here. ``gguf.GGUFReader`` turns every vocabulary
  string into numpy views (about 4 s for SmolLM2's 49k tokens and 49k merges on two cores) and fails
  on a cut file with a bare struct/numpy error; this parser skips string arrays it is not asked for and
  names the file, the field and the byte offset when the file ends early.
- Dequantization is the ``gguf`` package's (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants,
  the IQ types), the same code transformers runs for these architectures, so both load equal values.
- llama.cpp stores llama's q/k projection rows permuted for its rotary layout; transformers'
  ``LlamaTensorProcessor`` undoes that. Qwen2/Qwen3 files are written unpermuted.
- The tokenizer (vocabulary, merges, special tokens, chat template) is built by transformers from the
  file's metadata.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# general.architecture -> the transformers model class it corresponds to.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # v1 (32-bit counts) predates every file still in circulation
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEQUANT_ROW_ELEMENTS = 4096

# Metadata value types (gguf.GGUFValueType): fixed-size scalars, then string (8) and array (9).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# Tensor names: llama.cpp's -> Hugging Face's (the suffix .weight/.bias is kept).
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR_RE = re.compile(r"(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: slowest-moving dimension first (ggml lists them reversed)
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    # Values as Python scalars/strings/lists; string arrays not asked for are kept as their length.
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def is_gguf_path(path: str | os.PathLike) -> bool:
    """A path with the .gguf suffix, or an existing file that starts with the GGUF magic bytes."""
    path = os.fspath(path)
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(_MAGIC)) == _MAGIC


def read_gguf_header(path: str | os.PathLike, string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """Parses the metadata and tensor table and checks every tensor lies inside the file.

    ``string_arrays`` names the string-array keys to read in full (e.g. "tokenizer.ggml.tokens").
    Raises FileNotFoundError for a missing path and ValueError for anything that is not a complete GGUF
    file, naming the file and what is wrong.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file; expected a .gguf checkpoint file")
    size = os.path.getsize(path)
    if size < len(_MAGIC):
        raise ValueError(f"{path!r} is not a GGUF file: it is only {size} bytes long")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _HeaderParser(path, buf, set(string_arrays)).parse()


class _HeaderParser:
    def __init__(self, path: str, buf: mmap.mmap, string_arrays: set[str]):
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.string_arrays = string_arrays

    def parse(self) -> GGUFHeader:
        magic = self.buf[: len(_MAGIC)]
        if magic != _MAGIC:
            raise ValueError(
                f"{self.path!r} is not a GGUF file: it starts with {magic!r} instead of the magic {_MAGIC!r}"
            )
        self.pos = len(_MAGIC)
        (version,) = self._unpack("<I", "the format version")
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(
                f"{self.path!r} is GGUF version {version}; supported versions are {list(_SUPPORTED_VERSIONS)}"
            )
        tensor_count, kv_count = self._unpack("<QQ", "the tensor and metadata counts")
        # Every entry takes at least 8 bytes, so larger counts can only come from a corrupt header; checking
        # here keeps a garbage count from turning into a long loop.
        self._need(
            8 * (tensor_count + kv_count),
            f"{kv_count} metadata entries and {tensor_count} tensor descriptions",
        )

        metadata: dict[str, Any] = {}
        for i in range(kv_count):
            key = self._string(f"the name of metadata entry {i}")
            (value_type,) = self._unpack("<I", f"the type of metadata {key!r}")
            metadata[key] = self._value(value_type, key, keep_strings=key in self.string_arrays)

        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(
                f"{self.path!r} is corrupt: general.alignment={alignment!r} is not a power of two"
            )

        table = [self._tensor_entry(i) for i in range(tensor_count)]
        data_start = (self.pos + alignment - 1) // alignment * alignment
        tensors = {}
        for name, shape, ggml_type, offset in table:
            info = GGUFTensorInfo(
                name, shape, ggml_type, data_start + offset, _tensor_nbytes(self.path, name, shape, ggml_type)
            )
            if info.offset + info.nbytes > self.size:
                raise ValueError(
                    f"{self.path!r} is truncated: tensor {name!r} occupies bytes {info.offset}.."
                    f"{info.offset + info.nbytes} but the file has only {self.size} bytes"
                )
            tensors[name] = info
        if "general.architecture" not in metadata:
            raise ValueError(f"{self.path!r} has no general.architecture metadata entry")
        return GGUFHeader(self.path, version, metadata, tensors)

    def _tensor_entry(self, index: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string(f"the name of tensor {index}")
        (n_dims,) = self._unpack("<I", f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"{self.path!r} is corrupt: tensor {name!r} has {n_dims} dimensions")
        dims = self._unpack(f"<{n_dims}Q", f"the shape of tensor {name!r}")
        ggml_type, offset = self._unpack("<IQ", f"the type and offset of tensor {name!r}")
        return name, tuple(reversed(dims)), ggml_type, offset

    def _need(self, nbytes: int, what: str) -> None:
        if self.pos + nbytes > self.size:
            raise ValueError(
                f"{self.path!r} is truncated or corrupt: reading {what} at byte {self.pos} needs {nbytes} "
                f"bytes but the file ends at byte {self.size}"
            )

    def _unpack(self, fmt: str, what: str) -> tuple:
        nbytes = struct.calcsize(fmt)
        self._need(nbytes, what)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += nbytes
        return values

    def _string(self, what: str) -> str:
        (length,) = self._unpack("<Q", what)
        self._need(length, what)
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path!r} is corrupt: {what} is not valid UTF-8 ({e})") from None

    def _value(self, value_type: int, key: str, keep_strings: bool) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._unpack("<" + _SCALAR_FORMATS[value_type], f"the value of metadata {key!r}")[0]
        if value_type == _STRING:
            return self._string(f"the value of metadata {key!r}")
        if value_type != _ARRAY:
            raise ValueError(
                f"{self.path!r} is corrupt: metadata {key!r} has unknown value type {value_type}"
            )
        element_type, count = self._unpack("<IQ", f"the element type and length of metadata array {key!r}")
        if element_type in _SCALAR_FORMATS:
            return list(self._unpack(f"<{count}{_SCALAR_FORMATS[element_type]}", f"metadata array {key!r}"))
        if element_type == _STRING and not keep_strings:
            # Walk the length prefixes only: decoding a 150k-entry vocabulary costs a noticeable fraction
            # of a second and only the tokenizer needs it.
            self._need(8 * count, f"metadata array {key!r}")
            for _ in range(count):
                (length,) = self._unpack("<Q", f"an element of metadata array {key!r}")
                self._need(length, f"an element of metadata array {key!r}")
                self.pos += length
            return count
        return [self._value(element_type, key, keep_strings) for _ in range(count)]


def _tensor_nbytes(path: str, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"{path!r}: tensor {name!r} has unknown ggml type id {ggml_type}") from None
    if shape[-1] % block_size:
        raise ValueError(
            f"{path!r} is corrupt: tensor {name!r} has rows of {shape[-1]} elements, not a multiple of the "
            f"{GGMLQuantizationType(ggml_type).name} block size {block_size}"
        )
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def _architecture(header: GGUFHeader) -> str:
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{header.path!r} holds a {arch!r} model; supported GGUF architectures are "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _arch_key(header: GGUFHeader, key: str, required: bool = True) -> Any:
    full_key = f"{header.architecture}.{key}"
    value = header.metadata.get(full_key)
    if value is None and required:
        raise ValueError(f"{header.path!r} lacks the metadata entry {full_key!r}")
    return value


def _hf_tensor_names(header: GGUFHeader) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, for every tensor in the file."""
    if "rope_freqs.weight" in header.tensors:
        raise ValueError(
            f"{header.path!r} carries rope_freqs.weight (Llama-3.1-style RoPE frequency scaling), which "
            f"nanoinfer does not support"
        )
    names = {}
    for gguf_name in header.tensors:
        block = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
        if block and block[2] in _BLOCK_TENSOR_NAMES:
            names[gguf_name] = f"model.layers.{block[1]}.{_BLOCK_TENSOR_NAMES[block[2]]}.{block[3]}"
            continue
        glob = _GLOBAL_TENSOR_RE.fullmatch(gguf_name)
        if glob and glob[1] in _GLOBAL_TENSOR_NAMES:
            names[gguf_name] = f"{_GLOBAL_TENSOR_NAMES[glob[1]]}.{glob[2]}"
            continue
        raise ValueError(
            f"{header.path!r}: tensor {gguf_name!r} has no counterpart in a dense "
            f"{header.architecture!r} decoder (mixture-of-experts and multimodal GGUFs are not supported)"
        )
    return names


def load_gguf_config(path: str | os.PathLike):
    """A transformers config (LlamaConfig / Qwen2Config / Qwen3Config) rebuilt from the file's metadata."""
    from transformers import AutoConfig

    header = read_gguf_header(path)
    arch = _architecture(header)
    _hf_tensor_names(header)  # unsupported tensors fail here, before any weights are read
    if "token_embd.weight" not in header.tensors:
        raise ValueError(f"{header.path!r} has no token_embd.weight tensor")

    hidden_size = _arch_key(header, "embedding_length")
    num_heads = _arch_key(header, "attention.head_count")
    num_kv_heads = _arch_key(header, "attention.head_count_kv", required=False) or num_heads
    if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int):
        raise ValueError(f"{header.path!r}: per-layer attention head counts are not supported")
    # Qwen3 states its head size (128 in Qwen3-0.6B, where hidden/heads is 64); llama files state the
    # rotary width, which is the head size for llama.
    head_dim = (
        _arch_key(header, "attention.key_length", required=False)
        or _arch_key(header, "rope.dimension_count", required=False)
        or hidden_size // num_heads
    )
    scaling = _arch_key(header, "rope.scaling.type", required=False)
    if scaling not in (None, "none"):
        raise ValueError(f"{header.path!r} uses RoPE scaling {scaling!r}, which nanoinfer does not support")

    tensors = header.tensors
    kwargs: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden_size,
        "intermediate_size": _arch_key(header, "feed_forward_length"),
        "num_hidden_layers": _arch_key(header, "block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _arch_key(header, "context_length"),
        "rms_norm_eps": _arch_key(header, "attention.layer_norm_rms_epsilon"),
        # llama.cpp writes output.weight only when the output projection is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    rope_theta = _arch_key(header, "rope.freq_base", required=False)
    if rope_theta is not None:
        kwargs["rope_theta"] = float(rope_theta)
    if arch != "qwen2":  # Qwen2 always has q/k/v biases and its config has no switch for them
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    meta = header.metadata
    for config_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if meta.get(gguf_key) is not None:
            kwargs[config_key] = meta[gguf_key]
    # Chat models may end a turn with end-of-turn/-message tokens distinct from EOS (Llama 3.1's <|eot_id|>
    # and <|eom_id|>); generation has to stop at any of them, as their Hugging Face generation configs say.
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = list(dict.fromkeys(meta[k] for k in eos_keys if k in meta))
    if eos_ids:
        kwargs["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids

    config = AutoConfig.for_model(arch, **kwargs)
    if rope_theta is not None and getattr(config, "rope_theta", None) is None:
        # transformers 5 keeps it in config.rope_parameters only; keep the classic attribute readable too.
        config.rope_theta = float(rope_theta)
    return config


def load_gguf_weights(path: str | os.PathLike, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face parameter name, tensor) pairs in file order, each dequantized and cast to ``dtype``.

    ``lm_head.weight`` appears only when the file has its own output projection (untied embeddings).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    arch = _architecture(header)
    hf_names = _hf_tensor_names(header)
    unpermute = None
    if arch == "llama":
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        num_heads = _arch_key(header, "attention.head_count")
        num_kv_heads = _arch_key(header, "attention.head_count_kv", required=False) or num_heads
        processor = LlamaTensorProcessor(
            config={"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads}
        )
        unpermute = processor.process

    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    for info in header.tensors.values():
        qtype = GGMLQuantizationType(info.ggml_type)
        packed = data[info.offset : info.offset + info.nbytes].reshape(_dequant_rows(info.shape), -1)
        try:
            values = dequantize(packed, qtype).reshape(info.shape)
        except NotImplementedError:
            raise ValueError(
                f"{header.path!r}: tensor {info.name!r} is stored as {qtype.name}, which nanoinfer cannot "
                "dequantize"
            ) from None
        if unpermute is not None:
            values = unpermute(values, info.name).weights
        # F32 tensors come back as views of the memory map; torch needs memory it may own and write.
        if np.may_share_memory(values, data) or not values.flags.c_contiguous:
            values = np.array(values, order="C")
        yield hf_names[info.name], torch.from_numpy(values).to(dtype)


def _dequant_rows(shape: tuple[int, ...]) -> int:
    """How many rows to hand gguf's dequantize, which loops in Python over groups of 16 rows.

    Whole tensor rows are merged into rows of about 4096 values: with SmolLM2's 576-wide rows that halves
    the load time, and each group of 16 still fits in the CPU cache (much longer rows get slower again).
    Dequantization is blockwise, so the grouping does not change any value.
    """
    num_rows = int(np.prod(shape[:-1], dtype=np.int64))
    merged = max(1, _DEQUANT_ROW_ELEMENTS // shape[-1])
    while num_rows % merged:
        merged -= 1
    return num_rows // merged


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in the file's metadata, with its chat template and special tokens."""
    from transformers import PreTrainedTokenizerFast

    header = read_gguf_header(path)
    if "tokenizer.ggml.model" not in header.metadata:
        raise ValueError(f"{header.path!r} has no tokenizer in its metadata; pass a tokenizer separately")
    directory, name = os.path.split(os.path.abspath(header.path))
    # PreTrainedTokenizerFast rather than AutoTokenizer: the latter first rebuilds the model config through
    # transformers' slow GGUF reader (seconds) just to choose a class, and ends up with this one anyway.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name, local_files_only=True)
    eos_id = header.metadata.get("tokenizer.ggml.eos_token_id")
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        raise ValueError(
            f"{header.path!r}: the tokenizer built from the file has EOS id {tokenizer.eos_token_id}, but "
            f"the metadata says {eos_id}"
        )
    return tokenizer
