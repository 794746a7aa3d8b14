"""torch.compile for the small elementwise pieces of a layer (RMSNorm with the residual add, RoPE,
SiLU-and-mul). Eagerly each is 5-10 tiny kernels; compiled, one or two. Inside a decode CUDA graph of a
28-layer model that is over a thousand launches fewer per step.

Layers call plain functions by default (CPU, tests, ``enforce_eager``); the model runner switches every
layer to the compiled versions with :func:`use_compiled_ops` before warm-up and graph capture."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

# Each compiled function is specialized per input rank, dtype and size-1 dimension (one token, one KV
# head), and every model, dtype and tensor-parallel split built in the process adds its own: a process
# holding a few engines (tests, a TP=1 vs TP=2 benchmark) went past dynamo's default of 8 on 2 x H200.
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled(fn: Callable) -> Callable:
    """One compiled version per function, shared by all layers; dynamic in the token count. Not
    fullgraph: past the recompile limit dynamo then runs the function eagerly instead of failing."""
    return torch.compile(fn, dynamic=True)


def use_compiled_ops(model: nn.Module) -> int:
    """Switches every layer that has fused ops to their compiled versions; returns how many."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    switched = 0
    for module in model.modules():
        if hasattr(module, "use_compiled_ops"):
            module.use_compiled_ops()
            switched += 1
    return switched
