"""Kernels of the decode and prefill steps, each a pure-PyTorch reference beside its Triton version.

* ``attention_ref`` / ``triton_attention``: the paged KV cache (store, split-KV decode, prefill), FP8 KV.
* ``elementwise_ref`` / ``triton_elementwise``: RMSNorm, residual add + RMSNorm, SiLU-and-mul, and
  QK-norm + RoPE + KV-cache store in one launch.
* ``sampling_ref`` / ``triton_sampling``: counter-based noise and inverse-CDF sampling.
* ``gemv_ref`` / ``triton_gemv``: small-batch projections (1-16 rows).

The references are the CPU path and the definition the kernels are tested against; the Triton modules
import Triton at top level and are imported only where it is installed (CUDA, or its CPU interpreter in
the tests).
"""
