"""Which implementation of a decoder layer's fused elementwise kernels the layers call: the Triton
kernels on CUDA, their pure-PyTorch references elsewhere (the CPU path; also what the Triton kernels are
tested against). The model runner picks one for the whole model with :func:`use_kernels`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from nanoinfer.kernels import elementwise_ref


@dataclass(frozen=True)
class LayerKernels:
    rms_norm: Callable
    add_rms_norm: Callable  # in place: (x, residual) <- (rms_norm(x + residual), x + residual)
    silu_and_mul: Callable
    qk_norm_rope_store: Callable  # in place on the fused qkv; stores k and v in the paged cache


REFERENCE_KERNELS = LayerKernels(
    rms_norm=elementwise_ref.rms_norm_ref,
    add_rms_norm=elementwise_ref.add_rms_norm_ref,
    silu_and_mul=elementwise_ref.silu_and_mul_ref,
    qk_norm_rope_store=elementwise_ref.qk_norm_rope_store_ref,
)


def triton_kernels() -> LayerKernels:
    from nanoinfer.kernels import triton_elementwise as kernels  # Triton is imported only on CUDA

    return LayerKernels(
        rms_norm=kernels.rms_norm,
        add_rms_norm=kernels.add_rms_norm,
        silu_and_mul=kernels.silu_and_mul,
        qk_norm_rope_store=kernels.qk_norm_rope_store,
    )


def use_kernels(model: nn.Module, kernels: LayerKernels) -> None:
    """Makes every layer of ``model`` that has fused kernels call ``kernels``."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
