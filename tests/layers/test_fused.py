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


def test_compiled_norm_survives_the_inputs_of_several_models_in_one_process():
    # Hidden states and per-head q/k of several models, one token or many, one KV head or several:
    # more specializations than dynamo's default recompile limit (8), which with fullgraph=True was a
    # hard failure when a process built a second engine (seen on 2 x H200).
    norm = RMSNorm(1, 1e-6)
    use_compiled_ops(norm)
    shapes = [(5, 64), (1, 64), (5, 4, 64), (1, 4, 64), (5, 1, 64), (1, 1, 64)]
    shapes += [(3, 128), (1, 128), (3, 8, 128), (1, 8, 128), (3, 1, 128)]
    for shape in shapes:
        norm.weight = torch.nn.Parameter(torch.randn(shape[-1]), requires_grad=False)
        x = torch.randn(shape)
        torch.testing.assert_close(
            norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        )
