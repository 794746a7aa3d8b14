"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies this
rank's slice of a checkpoint tensor into place, so fusing (q/k/v -> qkv, gate/up -> gate_up) and
sharding both happen at load time, in one place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_reduce, tp_rank, tp_size


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank(), tp_size(), tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(_ParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias, tp_dim=None)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; no communication (the next row-parallel layer reduces)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        out_per_rank = _divide(out_features, tp_size(), "output features")
        super().__init__(in_features, out_per_rank, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads are split across ranks; when there are fewer KV heads
    than ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, size, "attention heads")
        if num_kv_heads >= size:
            self.num_kv_heads = _divide(num_kv_heads, size, "key/value heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(size, num_kv_heads, "tensor_parallel_size over key/value heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, index * size, size))


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial sums are all-reduced at the exit."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        in_per_rank = _divide(in_features, tp_size(), "input features")
        super().__init__(in_per_rank, out_features, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() == 1:  # the bias is added once, after the reduction: not split
            param.data.copy_(loaded)
            return
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias so the all-reduce sums it once.
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)
