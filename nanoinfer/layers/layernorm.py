from __future__ import annotations

import torch
from torch import nn

from nanoinfer.layers.fused import compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sum is rounded to the activation dtype before normalising, as transformers does, so the
    # residual stream matches the reference bit for bit in fp32 and closely in bf16.
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it fuses the residual add: returns (normed, new_residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.norm_fn, self.add_norm_fn = rms_norm, add_rms_norm

    def use_compiled_ops(self) -> None:
        self.norm_fn, self.add_norm_fn = compiled(rms_norm), compiled(add_rms_norm)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.norm_fn(x, self.weight, self.eps)
        return self.add_norm_fn(x, residual, self.weight, self.eps)
