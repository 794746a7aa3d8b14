import torch
from torch import nn

from nanoinfer.layers.kernels import REFERENCE_KERNELS


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused [gate | up] projection output."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = REFERENCE_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)
