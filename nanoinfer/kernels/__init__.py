"""Attention kernels on the paged KV cache.

`attention_ref` is the pure-PyTorch definition (and the CPU backend); `triton_attention` holds the
Triton kernels, imported lazily and only on CUDA so that a CPU install never needs Triton.
"""
