"""Pure-PyTorch definition of the small-batch projection that `triton_gemv.gemv` computes."""

from __future__ import annotations

import torch

from nanoinfer.kernels.elementwise_ref import silu_and_mul_ref


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K].T (+ ``bias`` [N]) with float32 accumulation, rounded once to
    ``x``'s dtype: [M, N]."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def silu_mul_gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``gemv(x, weight, bias, gated=True)``: ``x`` [M, 2K] = [gate | up], the product over silu(gate) *
    up (rounded to ``x``'s dtype, as a separate activation kernel's output is)."""
    return gemv_ref(silu_and_mul_ref(x), weight, bias)
