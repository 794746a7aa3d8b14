from __future__ import annotations

import torch
from torch import nn

from nanoinfer.layers.kernels import REFERENCE_KERNELS


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it fuses the residual add, in place: returns (normed, new_residual),
    written into ``x`` and ``residual``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernels = REFERENCE_KERNELS

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
