"""Programmatic edges into cuBLAS's GEMMs (`graph_edges`): which edges are chosen (CPU), and on a Hopper
GPU that every projection of the Qwen3-0.6B shape, at every decode graph's row count, still reads its
input only once its predecessor has written it when the edge into it is programmatic. The predecessor
lets its dependents launch at once and writes the input only after spinning for 50 us, and the input
is zeroed before every replay: a projection that did not wait would read zeros. A control shows that a
kernel that does not wait does read them under such an edge."""

from __future__ import annotations

import functools

import pytest
import torch

from nanoinfer.executor.cuda_graphs import cuda_graph_batch_sizes
from nanoinfer.executor.graph_edges import (
    GraphEdge,
    edges_to_make_programmatic,
    graph_kernels,
    make_edges_programmatic,
    waits_for_predecessor,
)
from nanoinfer.layers.kernels import SplitKPartials


def test_only_full_edges_between_kernels_into_a_waiting_kernel_are_chosen():
    names = {1: "rms_norm_kernel", 2: "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT", 3: "elementwise_copy"}
    edges = [
        GraphEdge(1, 2, programmatic=False),  # kernel into a waiting GEMM: chosen
        GraphEdge(2, 3, programmatic=False),  # into a kernel that does not wait
        GraphEdge(3, 2, programmatic=True),  # already programmatic
        GraphEdge(9, 2, programmatic=False),  # from a memset or copy node (not a kernel)
        GraphEdge(1, 9, programmatic=False),  # into a node that is not a kernel
    ]
    assert edges_to_make_programmatic(edges, names, waits_for_predecessor) == [edges[0]]
    assert edges_to_make_programmatic(edges, names, lambda name: False) == []
    assert edges_to_make_programmatic([], names, waits_for_predecessor) == []


def test_only_cublas_hopper_gemms_count_as_waiting():
    assert waits_for_predecessor("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT")
    assert not waits_for_predecessor("nvjet_sm100_tst_256x128")  # not checked on a GPU of that kind
    assert not waits_for_predecessor("_add_rms_norm_kernel")
    assert not waits_for_predecessor("")


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs a Hopper GPU",
)

# Qwen3-0.6B's projections: out features, in features, and whether it is a residual branch's last one
# (split into K ranges at 17-256 rows, `residual_branch_splits`).
PROJECTIONS = {
    "qkv": (4096, 1024, False),
    "attention_output": (1024, 2048, True),
    "gate_up": (6144, 1024, False),
    "down": (1024, 3072, True),
    "vocabulary": (151936, 1024, False),
}
SPIN_NS = 50_000


@functools.cache
def _spin_then_copy():
    import triton
    import triton.language as tl

    @triton.jit
    def spin_then_copy(source, destination, n, spin_ns, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        start = tl.extra.cuda.globaltimer()
        now = start
        while now - start < spin_ns:
            now = tl.extra.cuda.globaltimer()
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(source + offsets, mask=offsets < n)
        tl.store(destination + offsets, values, mask=offsets < n)

    def launch(source: torch.Tensor, destination: torch.Tensor) -> None:
        spin_then_copy[(triton.cdiv(source.numel(), 1024),)](
            source, destination, source.numel(), SPIN_NS, BLOCK=1024
        )

    return launch


def _dense(result: torch.Tensor | SplitKPartials) -> torch.Tensor:
    return result.parts.sum(0) if isinstance(result, SplitKPartials) else result.float()


def _capture_behind_spin(source, x, project):
    """A graph of spin_then_copy(source -> x), then ``project(x)``; kept for its edges to be changed."""
    spin = _spin_then_copy()
    spin(source, x)
    project(x)  # kernel compilation and cuBLAS's workspace, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        spin(source, x)
        out = project(x)
    return graph, out


def _replay_on_zeroed_input(graph, x, out, expected) -> list[bool]:
    matches = []
    for _ in range(3):
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        matches.append(torch.allclose(_dense(out), expected, rtol=1e-2, atol=1e-2))
    return matches


@needs_hopper
@pytest.mark.parametrize("rows", cuda_graph_batch_sizes(256))
@pytest.mark.parametrize("projection", list(PROJECTIONS))
def test_projections_behind_programmatic_edges_read_their_input_after_it_is_written(projection, rows):
    from nanoinfer.layers.kernels import triton_kernels

    out_features, in_features, residual_branch = PROJECTIONS[projection]
    kernels = triton_kernels(pdl=True)
    project = kernels.residual_branch_linear if residual_branch else kernels.linear
    generator = torch.Generator(device="cuda").manual_seed(rows)
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    weight /= in_features**0.5
    source = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    x = torch.empty_like(source)
    expected = _dense(project(source, weight))
    graph, out = _capture_behind_spin(source, x, lambda x: project(x, weight))
    names, _ = graph_kernels(graph)
    turned = make_edges_programmatic(graph)
    graph.instantiate()
    gemms = sorted(name for name in names.values() if waits_for_predecessor(name))
    assert turned == (1 if gemms else 0), (turned, sorted(names.values()))
    assert all(_replay_on_zeroed_input(graph, x, out, expected)), (projection, rows, gemms)


@needs_hopper
def test_a_kernel_that_does_not_wait_reads_its_input_early_behind_a_programmatic_edge():
    source = torch.randn(256, 1024, device="cuda")
    x = torch.empty_like(source)
    graph, out = _capture_behind_spin(source, x, lambda x: x * 2)
    names, _ = graph_kernels(graph)
    turned = make_edges_programmatic(graph, waits=lambda name: "spin_then_copy" not in name)
    graph.instantiate()
    assert turned == 1, sorted(names.values())
    assert not any(_replay_on_zeroed_input(graph, x, out, source * 2))
