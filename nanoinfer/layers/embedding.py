"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

The slice is ceil(vocab / tp_size) rows on every rank, so that the LM head's per-rank logits have one
shape and can be gathered; the last rank's rows past the vocabulary stay zero and their logits are cut
off after the gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_reduce, gather_to_rank0, tp_rank, tp_size
from nanoinfer.layers.kernels import REFERENCE_KERNELS
from nanoinfer.layers.linear import copy_checked, loaded_shape, read_slice


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.vocab_per_rank = (vocab_size + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        shape = loaded_shape(loaded)
        if len(shape) != 2 or shape[0] != self.vocab_size:
            raise ValueError(
                f"embedding of shape {shape} does not match vocab_size={self.vocab_size} x hidden"
            )
        rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        if rows:
            copy_checked(param.data[:rows], read_slice(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.vocab_per_rank)
        y = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.weight)
        # Every token's row comes from exactly one rank; the others contribute zeros to the sum.
        y = y * in_shard.unsqueeze(-1).to(y.dtype)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; the full vocabulary row is gathered on rank 0 only (the
    sampler runs there), other ranks return None."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.kernels = REFERENCE_KERNELS

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.kernels.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        full = gather_to_rank0(logits, dim=-1)
        return full[..., : self.vocab_size] if full is not None else None
