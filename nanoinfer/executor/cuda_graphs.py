"""CUDA graphs of the model's forward pass for pure-decode batches (one query token per row).

One graph per batch size in :func:`cuda_graph_batch_sizes`; a batch of B rows replays the smallest graph
of at least B rows, its extra rows padded (no K/V write, context length 0). The graphs read their inputs
from the model runner's persistent step buffers, so a replay needs no copies beyond filling those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.layers.attention import AttentionMetadata


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then steps of 16, up to max_num_seqs."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b < cap] + list(range(16, cap + 1, 16))
    if not sizes or sizes[-1] < cap:
        sizes.append(cap)
    return sizes


@dataclass
class StepBuffers:
    """The device tensors a forward pass reads, sized for the largest step; a step fills a prefix."""

    input_ids: torch.Tensor  # int64 [max tokens]
    positions: torch.Tensor  # int64 [max tokens]
    slot_mapping: torch.Tensor  # int64 [max tokens]
    query_start_loc: torch.Tensor  # int32 [max rows + 1]
    seq_lens: torch.Tensor  # int32 [max rows]
    block_tables: torch.Tensor  # int32 [max rows, max blocks]

    @classmethod
    def allocate(cls, max_tokens: int, max_rows: int, table_width: int, device: torch.device) -> StepBuffers:
        return cls(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(max_rows + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_rows, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_rows, table_width, dtype=torch.int32, device=device),
        )

    def decode_metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            num_decode_rows=batch_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )


class CudaGraphs:
    def __init__(self, model: nn.Module, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype):
        self.model = model
        self.buffers = buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.output = torch.zeros(
            buffers.seq_lens.shape[0], hidden_size, dtype=dtype, device=buffers.seq_lens.device
        )

    @torch.inference_mode()
    def capture(self, sizes: list[int], max_model_len: int) -> None:
        b = self.buffers
        b.query_start_loc.copy_(torch.arange(len(b.query_start_loc), dtype=torch.int32))
        pool = None
        for bs in reversed(sizes):  # largest first so smaller graphs fit in its memory pool
            graph = torch.cuda.CUDAGraph()
            meta = b.decode_metadata(bs, max_model_len)
            # One eager run first: lazy initialisation (kernel compilation) must not be captured.
            self.output[:bs] = self.model(b.input_ids[:bs], b.positions[:bs], meta)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool):
                self.output[:bs] = self.model(b.input_ids[:bs], b.positions[:bs], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))

    def batch_size_for(self, num_rows: int) -> int | None:
        """The graph a pure-decode batch of ``num_rows`` rows replays, or None (run eagerly)."""
        return next((bs for bs in self.graphs if bs >= num_rows), None)

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.output[:batch_size]

    def clear(self) -> None:
        self.graphs.clear()
