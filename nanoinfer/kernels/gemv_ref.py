"""Pure-PyTorch definition of the small-batch projection that `triton_gemv.gemv` computes."""

from __future__ import annotations

import torch


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K].T (+ ``bias`` [N]) with float32 accumulation, rounded once to
    ``x``'s dtype: [M, N]."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
