import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.fused import compiled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused [gate | up] projection output."""

    def __init__(self) -> None:
        super().__init__()
        self.fn = silu_and_mul

    def use_compiled_ops(self) -> None:
        self.fn = compiled(silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
