"""Linear layers that know how they are split across tensor-parallel ranks.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this rank's slice
of a checkpoint tensor into place, so fusing (q/k/v -> qkv, gate/up -> gate_up) and sharding both
happen at load time, in one place. ``loaded`` is a tensor or a lazy safetensors slice
(``safe_open(...).get_slice(name)``); from a slice only this rank's rows or columns are read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanoinfer.distributed import all_reduce, tp_rank, tp_size
from nanoinfer.layers.kernels import REFERENCE_KERNELS, SplitKPartials


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_slice(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, size)``, reading only that part when ``loaded`` is a lazy slice."""
    shape = loaded_shape(loaded)
    if start < 0 or start + size > shape[dim]:
        raise ValueError(
            f"checkpoint tensor of shape {shape} has no rows [{start}, {start + size}) along dim {dim}"
        )
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def read_all(loaded: Any) -> torch.Tensor:
    # A lazy safetensors slice; [...] also reads a 0-dimensional tensor, which [:] cannot.
    return loaded if isinstance(loaded, torch.Tensor) else loaded[...]


def copy_checked(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` without broadcasting: a shape mismatch is a checkpoint error."""
    if target.shape != source.shape:
        raise ValueError(
            f"checkpoint tensor shard of shape {tuple(source.shape)} does not match the parameter shard "
            f"of shape {tuple(target.shape)}"
        )
    target.copy_(source)


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None):
        super().__init__()
        # Captured at build time: the layer stays valid whatever scope is open later.
        self.tp_rank, self.tp_size, self.tp_dim = tp_rank(), tp_size(), tp_dim
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.kernels = REFERENCE_KERNELS

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_dim < len(loaded_shape(loaded)):
            size = param.size(self.tp_dim)
            copy_checked(param.data, read_slice(loaded, self.tp_dim, self.tp_rank * size, size))
        else:
            copy_checked(param.data, read_all(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


class ReplicatedLinear(_ParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias, tp_dim=None)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; no communication (the next row-parallel layer reduces)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        out_per_rank = _divide(out_features, tp_size(), "output features")
        super().__init__(in_features, out_per_rank, bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up_proj): each rank
    holds its slice of every projection, one after the other."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        for size in output_sizes:
            _divide(size, tp_size(), "output features")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        copy_checked(param.data.narrow(0, offset, size), read_slice(loaded, 0, self.tp_rank * size, size))


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

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            # Rank r's query heads all belong to KV head r // kv_replicas (heads are grouped in order).
            size, index = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}; expected 'q', 'k' or 'v'")
        copy_checked(param.data.narrow(0, offset, size), read_slice(loaded, 0, index * size, size))


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial sums are all-reduced at the exit. ``gated_input``:
    the input is a gated MLP's [gate | up] (this rank's slices of both), and the projection is over
    silu(gate) * up (the MLP's down projection, with the activation fused into it).
    ``ends_residual_branch``: the output only feeds the next residual add + RMSNorm (``RMSNorm`` with a
    residual), so on one rank it may be returned as ``SplitKPartials`` for that norm to sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gated_input: bool = False,
        ends_residual_branch: bool = False,
    ):
        in_per_rank = _divide(in_features, tp_size(), "input features")
        super().__init__(in_per_rank, out_features, bias, tp_dim=1)
        self.gated_input = gated_input
        self.ends_residual_branch = ends_residual_branch

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        project = self.kernels.silu_mul_linear if self.gated_input else self.kernels.linear
        if self.tp_size == 1:
            if self.ends_residual_branch:
                return self.kernels.residual_branch_linear(x, self.weight, self.bias, self.gated_input)
            return project(x, self.weight, self.bias)
        # Only rank 0 adds the bias, so that the sum contains it once.
        y = project(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y)
