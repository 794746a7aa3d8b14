"""Split-K at the end of a residual branch: the attention output and MLP down projections returned as
float32 partial products (``SplitKPartials``) that the next residual add + RMSNorm sums; the policy of
when; and the engine giving the same tokens with every such projection split."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nanoinfer import LLM, SamplingParams
from nanoinfer.kernels import elementwise_ref
from nanoinfer.layers.kernels import (
    REFERENCE_KERNELS,
    SplitKPartials,
    residual_branch_splits,
    split_k_linear,
    split_k_linear_ref,
    use_kernels,
)
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import RowParallelLinear


@pytest.mark.parametrize("m,n,k,splits", [(1, 8, 32, 2), (17, 24, 96, 4), (5, 16, 64, 1)])
def test_split_k_partials_sum_to_the_projection(m, n, k, splits):
    gen = torch.Generator().manual_seed(m + n + k)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    partials = split_k_linear_ref(x, weight, splits)
    assert partials.parts.shape == (splits, m, n) and partials.parts.dtype == torch.float32
    for i in range(splits):  # each part is the product over its own K range
        span = slice(i * k // splits, (i + 1) * k // splits)
        torch.testing.assert_close(partials.parts[i], x[:, span] @ weight[:, span].T)
    torch.testing.assert_close(partials.parts.sum(0), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(split_k_linear(x, weight, splits).parts, partials.parts)  # CPU: the reference


def test_residual_branch_splits_follow_the_measured_policy():
    o, down = (1024, 2048), (1024, 3072)  # Qwen3-0.6B's attention output and MLP down: (N, K)
    assert [residual_branch_splits(m, *o) for m in (1, 16, 17, 128, 129, 256, 257)] == [1, 1, 4, 4, 2, 2, 1]
    assert residual_branch_splits(64, *down) == 4
    assert residual_branch_splits(64, 4096, 4096) == 1  # wide outputs have tiles enough
    assert residual_branch_splits(64, 1024, 1024) == 1  # not a reducing projection
    assert residual_branch_splits(64, 1000, 2020) == 1  # K ranges that would not stay 16-byte aligned


def test_rms_norm_sums_partials_into_the_residual():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.randn(32, generator=gen)
    parts = torch.randn(3, 5, 32, generator=gen)
    residual = torch.randn(5, 32, generator=gen, dtype=torch.float32).to(torch.float16)
    expected_x, expected_residual = norm(parts.sum(0).to(torch.float16), residual.clone())
    got_x, got_residual = norm(SplitKPartials(parts), residual)
    assert got_residual is residual
    torch.testing.assert_close(got_residual, expected_residual, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_x, expected_x, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="needs the residual"):
        norm(SplitKPartials(parts))


def test_row_parallel_linear_returns_partials_only_at_a_branch_end():
    x, weight = torch.randn(4, 64), torch.randn(16, 64)
    ending, plain = RowParallelLinear(64, 16, ends_residual_branch=True), RowParallelLinear(64, 16)
    for layer in (ending, plain):
        layer.weight.data = weight
        layer.kernels = replace(REFERENCE_KERNELS, residual_branch_linear=_always_split(2))
    assert isinstance(ending(x), SplitKPartials)
    assert isinstance(plain(x), torch.Tensor)
    torch.testing.assert_close(ending(x).parts.sum(0), plain(x), rtol=1e-5, atol=1e-5)


def _always_split(splits: int):
    """A residual_branch_linear that splits every projection whose K allows it, at any row count."""

    def residual_branch_linear(x, weight, bias=None, gated=False):
        x = elementwise_ref.silu_and_mul_ref(x) if gated else x
        if bias is not None or x.shape[1] % splits:
            return F.linear(x, weight, bias)
        return split_k_linear_ref(x, weight, splits)

    return residual_branch_linear


def test_engine_with_every_branch_end_split_gives_the_reference_tokens(tiny_qwen3):
    """Every attention output and MLP down projection of the model as split-K partials, summed by the
    norms after them (the layer-0 input norm has no residual; the final norm sums the last layer's):
    the same greedy tokens as the unsplit model, through prompt chunks and decode batches."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 30, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_model_len": 128}
    with LLM(tiny_qwen3, **kwargs) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_qwen3, **kwargs) as llm:
        model = llm.llm_engine.engine_core.executor.runner.model
        use_kernels(model, replace(REFERENCE_KERNELS, residual_branch_linear=_always_split(2)))
        got = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine_stats()
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
