"""Paged attention: the layer, the per-batch metadata it reads, and the pluggable kernel backends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.kernels.attention_ref import paged_attention_ref


@dataclass
class AttentionMetadata:
    """Where this batch's tokens sit in the paged KV cache. Built by the model runner for each forward
    pass and handed explicitly to every attention layer (no global context).

    A batch may mix rows of one query token (decoding; they come first) and longer rows (prompt chunks):
    the backend sends the first ``num_decode_rows`` rows to its decode kernel and the rest to its prefill
    kernel, in the same forward pass."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding row, writes nothing
    query_start_loc: torch.Tensor  # [batch + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    num_decode_rows: int
    max_query_len: int
    max_seq_len: int
    # query_start_loc of the rows after the decode rows, from 0 (what the prefill kernel takes).
    prefill_query_start_loc: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Attends over the paged cache (the new K/V are already in it: the fused q/k kernel stores them)."""

    name: str

    @abstractmethod
    def attend(
        self,
        query,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        k_scale=None,
        v_scale=None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output [tokens, heads, head_dim]: a new tensor, or written into ``out``."""

    def query_destination(self, num_tokens: int) -> torch.Tensor | None:
        """Where the layer should write its rotated queries ([num_tokens, heads, head_dim]) for this
        backend to read them, or None: anywhere (in place in the fused qkv)."""
        return None


class TorchAttentionBackend(AttentionBackend):
    """Pure PyTorch; runs anywhere (the CPU path and the reference). Not CUDA-graph capturable."""

    name = "torch"

    def attend(self, query, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, out=None):
        result = paged_attention_ref(
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return result if out is None else out.copy_(result)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels for CUDA: split-KV paged decode and paged prefill. Capturable in CUDA graphs."""

    name = "triton"

    def __init__(self, pdl: bool = True) -> None:
        from nanoinfer.kernels import triton_attention  # Triton is imported only on CUDA

        self.kernels = triton_attention
        # Programmatic dependent launch of the decode kernel, like the layer's other kernels (CUDA only).
        self.pdl = pdl
        # Split-KV scratch shared by every layer (they run one after another): allocated by the model
        # runner for its largest batch, before graph capture.
        self.decode_workspace = None

    def attend(self, query, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, out=None):
        num_decode = meta.num_decode_rows
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        if num_decode == len(meta.seq_lens):
            return self.kernels.paged_decode_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out=out,
                workspace=self.decode_workspace,
                pdl=self.pdl,
                **scales,
            )
        if num_decode == 0:
            return self.kernels.paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.max_query_len,
                scale,
                out=out,
                **scales,
            )
        if out is None:
            out = torch.empty_like(query)
        # Decode rows have one query token each, so the prefill rows' tokens start at num_decode.
        self.kernels.paged_decode_attention(
            query[:num_decode],
            k_cache,
            v_cache,
            meta.block_tables[:num_decode],
            meta.seq_lens[:num_decode],
            scale,
            out=out[:num_decode],
            workspace=self.decode_workspace,
            pdl=self.pdl,
            **scales,
        )
        self.kernels.paged_prefill_attention(
            query[num_decode:],
            k_cache,
            v_cache,
            meta.prefill_query_start_loc,
            meta.seq_lens[num_decode:],
            meta.block_tables[num_decode:],
            meta.max_query_len,
            scale,
            out=out[num_decode:],
            **scales,
        )
        return out


def create_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


class Attention(nn.Module):
    """One layer's attention over the paged cache. ``k_cache``/``v_cache`` are views into the engine's
    KV pool, attached by the model runner once the pool is allocated (empty until then, e.g. during
    the memory-profiling warm-up, when nothing is stored)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Dequantization scales of an FP8 cache (1-element float32 tensors); None for a 16-bit cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # While a list (the FP8 scale calibration): each forward pass before the cache exists appends
        # the largest |k| and |v| it would store.
        self.kv_amax: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def query_destination(self, num_tokens: int) -> torch.Tensor | None:
        """See :meth:`AttentionBackend.query_destination`."""
        return self.backend.query_destination(num_tokens)

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [tokens, num_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim], already in the
        cache (they are read here only before the cache exists)."""
        if self.k_cache.numel() == 0:
            if self.kv_amax is not None:
                self.kv_amax.append((k.abs().amax().float(), v.abs().amax().float()))
            return self._attend_uncached(q, k, v, meta)
        return self.backend.attend(
            q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale
        )

    def _attend_uncached(self, q, k, v, meta, query_chunk: int = 256) -> torch.Tensor:
        """Causal attention over this batch's own tokens only: used before the KV pool exists (the
        warm-up pass that measures peak activation memory, and the FP8 scale calibration), where every
        sequence starts at 0. Queries go ``query_chunk`` at a time against their keys so far: what this
        pass holds at once is then query_chunk x tokens scores per head, not a tokens x tokens matrix
        (16 GiB a head-set at 16,384 tokens where SDPA falls back to its math path), which the warm-up
        would count as activation memory and take from the KV pool."""
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        starts = meta.query_start_loc.tolist()
        for b in range(len(starts) - 1):
            s, e = starts[b], starts[b + 1]
            keys = k[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
            values = v[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
            for first in range(0, e - s, query_chunk):
                last = min(first + query_chunk, e - s)
                positions = torch.arange(last, device=q.device)
                visible = positions[None, :] <= positions[first:last, None]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q[s + first : s + last].transpose(0, 1),
                    keys[:, :last],
                    values[:, :last],
                    attn_mask=visible,
                    scale=self.scale,
                )
                out[s + first : s + last] = o.transpose(0, 1)
        return out
