"""Which implementation of a decoder layer's fused elementwise kernels the layers call: the Triton
kernels on CUDA, their pure-PyTorch references elsewhere (the CPU path; also what the Triton kernels are
tested against). The model runner picks one for the whole model with :func:`use_kernels`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kernels import elementwise_ref


@dataclass(frozen=True)
class LayerKernels:
    rms_norm: Callable
    add_rms_norm: Callable  # in place: (x, residual) <- (rms_norm(x + residual), x + residual)
    silu_mul_linear: Callable  # silu(gate) * up of x = [gate | up], @ weight.T + bias
    qk_norm_rope_store: Callable  # in place on the fused qkv; stores k and v in the paged cache
    linear: Callable  # x @ weight.T + bias


def _silu_mul_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(elementwise_ref.silu_and_mul_ref(x), weight, bias)


REFERENCE_KERNELS = LayerKernels(
    rms_norm=elementwise_ref.rms_norm_ref,
    add_rms_norm=elementwise_ref.add_rms_norm_ref,
    silu_mul_linear=_silu_mul_linear_ref,
    qk_norm_rope_store=elementwise_ref.qk_norm_rope_store_ref,
    linear=F.linear,
)


def triton_kernels(pdl: bool = True) -> LayerKernels:
    """The Triton kernels; with ``pdl`` (CUDA only) launched with programmatic dependent launch: a kernel
    starts while its predecessor finishes and waits for it only where it reads its output (on an H200
    the 28-layer decode graph of the Qwen3-0.6B shape took 1106 us instead of 1201 at batch 1)."""
    from nanoinfer.kernels import triton_elementwise as kernels  # Triton is imported only on CUDA
    from nanoinfer.kernels import triton_gemv

    def gemv_config(x: torch.Tensor, weight: torch.Tensor) -> triton_gemv.GemvConfig | None:
        # Small batches read the weights once: a GEMV kernel where it measured faster than cuBLAS.
        if x.dim() != 2 or x.stride(1) != 1:
            return None
        return triton_gemv.preferred_config(x.shape[0], weight.shape[0], weight.shape[1])

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        config = gemv_config(x, weight)
        if config is None:
            return F.linear(x, weight, bias)
        return triton_gemv.gemv(x, weight, bias, config=config, pdl=pdl)

    def silu_mul_linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Where the projection runs as a GEMV, the activation is computed as its input loads.
        config = gemv_config(x, weight)
        if config is None:
            return F.linear(kernels.silu_and_mul(x, pdl=pdl), weight, bias)
        return triton_gemv.gemv(x, weight, bias, config=config, pdl=pdl, gated=True)

    return LayerKernels(
        rms_norm=functools.partial(kernels.rms_norm, pdl=pdl),
        add_rms_norm=functools.partial(kernels.add_rms_norm, pdl=pdl),
        silu_mul_linear=silu_mul_linear,
        qk_norm_rope_store=functools.partial(kernels.qk_norm_rope_store, pdl=pdl),
        linear=linear,
    )


def use_kernels(model: nn.Module, kernels: LayerKernels) -> None:
    """Makes every layer of ``model`` that has fused kernels call ``kernels``."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
