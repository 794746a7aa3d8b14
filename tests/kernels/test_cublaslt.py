"""`cublaslt.TunedLinear` against its reference ``F.linear``: which calls it takes (CPU), and on CUDA the
tuned projection's output on random shapes, eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoinfer.kernels.cublaslt import TunedLinear, fastest


def test_fastest_prefers_the_heuristic_order_on_ties_and_skips_wrong_algorithms():
    assert fastest([5.0, 4.0, 4.0]) == 1
    assert fastest([float("inf"), 7.5]) == 1
    assert fastest([3.0]) == 0


def test_calls_it_does_not_tune_are_f_linear():
    linear = TunedLinear(rows=[32])
    x, weight = torch.randn(32, 64), torch.randn(48, 64)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))  # on the CPU
    assert linear.plans == {}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_tuned_projection_matches_f_linear_on_random_shapes(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    m = int(torch.randint(17, 257, (1,), generator=generator))
    n = 16 * int(torch.randint(8, 400, (1,), generator=generator))
    k = 16 * int(torch.randint(8, 200, (1,), generator=generator))
    x = torch.randn(m, k, generator=generator).to("cuda", dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to("cuda", dtype)
    linear = TunedLinear(rows=[m], candidates=8, reps=2)
    out = linear(x, weight)
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    assert len(linear.plans) == 1 and len(next(iter(linear.tuning_us.values()))) >= 1


@needs_cuda
def test_a_graph_replays_the_tuned_projection_and_capture_never_tunes():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    linear = TunedLinear(rows=[64, 128], candidates=8, reps=2)
    eager = linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    untuned = torch.randn(128, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(graph):
        out = linear(x, weight)
        untuned_out = linear(untuned, weight)  # 128 rows were not tuned: F.linear inside the capture
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(untuned_out, F.linear(untuned, weight))
    assert eager.shape == out.shape and len(linear.plans) == 1
