from __future__ import annotations

import torch
from torch import nn

from nanoinfer.layers.kernels import REFERENCE_KERNELS, SplitKPartials


class RMSNorm(nn.Module):
    """RMSNorm; given a residual it fuses the residual add, in place: returns (normed, new_residual),
    written into ``x`` and ``residual``. ``x`` may then be a projection's ``SplitKPartials``, summed
    as they load (the normed rows go to a new tensor)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernels = REFERENCE_KERNELS

    def forward(
        self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if isinstance(x, SplitKPartials):
                raise ValueError("RMSNorm of SplitKPartials needs the residual they are added to")
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if isinstance(x, SplitKPartials):
            return self.kernels.add_partials_rms_norm(x.parts, residual, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
