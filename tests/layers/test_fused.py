"""The compiled fused ops (used on CUDA) compute what the plain functions compute."""

import torch

from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.fused import use_compiled_ops
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


def test_compiled_ops_match_plain_ops_across_token_counts():
    torch.manual_seed(0)
    plain = torch.nn.ModuleDict(
        {"norm": RMSNorm(32, 1e-6), "rope": RotaryEmbedding(16, 64, 10000.0), "act": SiluAndMul()}
    )
    plain["norm"].weight.data.normal_()
    fused = torch.nn.ModuleDict(
        {"norm": RMSNorm(32, 1e-6), "rope": RotaryEmbedding(16, 64, 10000.0), "act": SiluAndMul()}
    )
    fused.load_state_dict(plain.state_dict())
    assert use_compiled_ops(fused) == 3
    for tokens in (3, 7, 17):  # dynamic shapes: no recompilation per token count needed
        x, residual = torch.randn(tokens, 32), torch.randn(tokens, 32)
        torch.testing.assert_close(fused["norm"](x), plain["norm"](x))
        for a, b in zip(fused["norm"](x, residual), plain["norm"](x, residual), strict=True):
            torch.testing.assert_close(a, b)
        positions = torch.randint(0, 64, (tokens,))
        q, k = torch.randn(tokens, 4, 16), torch.randn(tokens, 2, 16)
        for a, b in zip(fused["rope"](positions, q, k), plain["rope"](positions, q, k), strict=True):
            torch.testing.assert_close(a, b)
        h = torch.randn(tokens, 64)
        torch.testing.assert_close(fused["act"](h), plain["act"](h))
