"""Tensor-parallel rank/size and the two collectives the model needs.

The process group is torch.distributed's default group, created by the executor before the model is
built; without one (a single process) every rank query answers 0/1 and the collectives are no-ops.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenates every rank's shard along ``dim`` on rank 0; other ranks get None."""
    size = tp_size()
    if size == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(size)] if tp_rank() == 0 else None
    dist.gather(x, shards, dst=0)
    return torch.cat(shards, dim=dim) if shards is not None else None
