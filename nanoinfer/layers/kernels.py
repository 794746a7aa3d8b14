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
class SplitKPartials:
    """A projection's output left as float32 partial products over ranges of its input features,
    ``parts`` [splits, tokens, out_features]: the next residual add + RMSNorm sums them as it loads
    them, so the split-K reduction costs no kernel of its own."""

    parts: torch.Tensor


@dataclass(frozen=True)
class LayerKernels:
    rms_norm: Callable
    add_rms_norm: Callable  # in place: (x, residual) <- (rms_norm(x + residual), x + residual)
    silu_mul_linear: Callable  # silu(gate) * up of x = [gate | up], @ weight.T + bias
    qk_norm_rope_store: Callable  # in place on the fused qkv; stores k and v in the paged cache
    linear: Callable  # x @ weight.T + bias
    # (x, weight, bias, gated) -> a tensor or SplitKPartials: the projection that ends a residual
    # branch (attention output, MLP down), whose output only the next add_rms_norm reads.
    residual_branch_linear: Callable
    # (parts, residual, weight, eps) -> (normed, residual): add_rms_norm of SplitKPartials.parts.
    add_partials_rms_norm: Callable


def _silu_mul_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(elementwise_ref.silu_and_mul_ref(x), weight, bias)


def _residual_branch_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor:
    return (_silu_mul_linear_ref if gated else F.linear)(x, weight, bias)


def split_k_views(x: torch.Tensor, weight: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] and ``weight`` [N, K] as [splits, M, K / splits] and [splits, K / splits, N]: strided
    views of the K ranges (nothing copied), whose batched product is the split-K partials."""
    m, k = x.shape
    n = weight.shape[0]
    x_parts = x.view(m, splits, k // splits).transpose(0, 1)
    w_parts = weight.view(n, splits, k // splits).transpose(0, 1).transpose(1, 2)
    return x_parts, w_parts


def split_k_linear_ref(x: torch.Tensor, weight: torch.Tensor, splits: int) -> SplitKPartials:
    """x @ weight.T as ``splits`` float32 partial products over equal ranges of K (the definition
    :func:`split_k_linear` computes with one batched cuBLAS call)."""
    x_parts, w_parts = split_k_views(x, weight, splits)
    return SplitKPartials(torch.bmm(x_parts.float(), w_parts.float()))


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> SplitKPartials:
    """:func:`split_k_linear_ref` as one strided-batched cuBLAS call on CUDA (16-bit inputs, float32
    partials out); elsewhere the reference (torch has no such call off CUDA)."""
    if not x.is_cuda or x.dtype == torch.float32:
        return split_k_linear_ref(x, weight, splits)
    x_parts, w_parts = split_k_views(x, weight, splits)
    return SplitKPartials(torch.bmm(x_parts, w_parts, out_dtype=torch.float32))


def residual_branch_splits(m: int, n: int, k: int) -> int:
    """How many K ranges a residual branch's last projection is split into at ``m`` rows (1: none).
    Measured on an H200 (bf16; Qwen3-0.6B's attention output 2048 -> 1024 and MLP down 3072 -> 1024;
    docs/benchmarks.md, runs 61-63): cuBLAS gives these narrow reducing projections few output tiles
    (6.2-8.4 us per call at 32-256 rows, against 1.0-1.5 us of weight reads); as 4 partial products
    (2 above 128 rows) they took 4.7-6.4 us, and the sum moves into the next add_rms_norm. Up to 16
    rows the GEMV kernel runs them; above 256 (prompt steps) cuBLAS has tiles enough."""
    if not 16 < m <= 256 or n > 2048 or k < 2 * n:
        return 1
    splits = 4 if m <= 128 else 2
    return splits if k % (8 * splits) == 0 else 1


REFERENCE_KERNELS = LayerKernels(
    rms_norm=elementwise_ref.rms_norm_ref,
    add_rms_norm=elementwise_ref.add_rms_norm_ref,
    silu_mul_linear=_silu_mul_linear_ref,
    qk_norm_rope_store=elementwise_ref.qk_norm_rope_store_ref,
    linear=F.linear,
    residual_branch_linear=_residual_branch_linear_ref,
    add_partials_rms_norm=elementwise_ref.add_partials_rms_norm_ref,
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

    def residual_branch_linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
    ) -> torch.Tensor | SplitKPartials:
        splits = 1
        if bias is None and x.dim() == 2 and x.is_contiguous() and weight.is_contiguous():
            splits = residual_branch_splits(x.shape[0], weight.shape[0], weight.shape[1])
        if splits == 1:
            return (silu_mul_linear if gated else linear)(x, weight, bias)
        return split_k_linear(kernels.silu_and_mul(x, pdl=pdl) if gated else x, weight, splits)

    return LayerKernels(
        rms_norm=functools.partial(kernels.rms_norm, pdl=pdl),
        add_rms_norm=functools.partial(kernels.add_rms_norm, pdl=pdl),
        silu_mul_linear=silu_mul_linear,
        qk_norm_rope_store=functools.partial(kernels.qk_norm_rope_store, pdl=pdl),
        linear=linear,
        residual_branch_linear=residual_branch_linear,
        add_partials_rms_norm=functools.partial(kernels.add_partials_rms_norm, pdl=pdl),
    )


def use_kernels(model: nn.Module, kernels: LayerKernels) -> None:
    """Makes every layer of ``model`` that has fused kernels call ``kernels``."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels
