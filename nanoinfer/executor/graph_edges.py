"""Programmatic edges into cuBLAS's GEMM kernels in captured CUDA graphs (Hopper and later).

nanoinfer's own kernels launch with programmatic dependent launch (`triton_elementwise.pdl_prologue`,
`cuda_decode`), so stream capture gives the graph edges into them the programmatic type: each kernel
starts while its predecessor finishes and waits (``griddepcontrol.wait``) before it reads. cuBLAS's
launches carry no launch attribute, so the edges into its kernels stay full dependencies: a projection
is launched only once its predecessor has exited and flushed, four times per layer in a decode step
of 17-256 rows. cuBLAS's Hopper GEMMs (the ``nvjet`` family) wait for their predecessor before they
read (their code has the wait; ``tests/executor/test_graph_edges.py`` checks on the GPU that each one
the projections use reads its input only after a predecessor that lets it launch at once has written
it), so once a graph is captured the full edges from a kernel into one of them are made programmatic,
and the graph is instantiated after that.

A kernel that waits does so in every program before it reads or writes memory its predecessors touch,
so a programmatic chain stays ordered: each kernel completes only after its predecessor has.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# cuBLAS's Hopper GEMM kernels that wait for their predecessor before reading their operands.
WAITING_KERNEL_PREFIXES = ("nvjet_sm90_",)

_CU_GRAPH_NODE_TYPE_KERNEL = 0
_CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1  # the edge fires once every block has triggered or exited
_CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1


@dataclass(frozen=True)
class GraphEdge:
    """One dependency of a CUDA graph: node handles, and whether it is programmatic."""

    source: int
    destination: int
    programmatic: bool


def waits_for_predecessor(kernel_name: str) -> bool:
    """Whether the kernel is one of cuBLAS's that wait for their predecessor before reading."""
    return kernel_name.startswith(WAITING_KERNEL_PREFIXES)


def edges_to_make_programmatic(
    edges: Sequence[GraphEdge], kernel_names: Mapping[int, str], waits: Callable[[str], bool]
) -> list[GraphEdge]:
    """The full edges from a kernel node into a kernel node that ``waits`` (by its name). Edges from
    or into other nodes (copies, memsets, events) stay: programmatic launch is between kernels only."""
    return [
        edge
        for edge in edges
        if not edge.programmatic
        and edge.source in kernel_names
        and edge.destination in kernel_names
        and waits(kernel_names[edge.destination])
    ]


class _EdgeData(ctypes.Structure):
    """The driver API's CUgraphEdgeData."""

    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


class _KernelNodeParams(ctypes.Structure):
    """The driver API's CUDA_KERNEL_NODE_PARAMS_v2."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


@functools.cache
def _driver() -> Any:
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")


def _graph_nodes(graph: int) -> list[int]:
    count = ctypes.c_size_t(0)
    _check(_driver().cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(_driver().cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    return list(nodes[: count.value])


def _kernel_name(node: int) -> str | None:
    """The kernel's name if ``node`` is a kernel node, else None."""
    driver = _driver()
    node_type = ctypes.c_int(-1)
    _check(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(node_type)), "cuGraphNodeGetType")
    if node_type.value != _CU_GRAPH_NODE_TYPE_KERNEL:
        return None
    params = _KernelNodeParams()
    _check(
        driver.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
        "cuGraphKernelNodeGetParams",
    )
    name = ctypes.c_char_p()
    if params.func:
        _check(driver.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    else:
        _check(driver.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return (name.value or b"").decode(errors="replace")


def _graph_edges(graph: int) -> list[GraphEdge]:
    driver = _driver()
    count = ctypes.c_size_t(0)
    _check(
        driver.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)),
        "cuGraphGetEdges",
    )
    sources = (ctypes.c_void_p * count.value)()
    destinations = (ctypes.c_void_p * count.value)()
    data = (_EdgeData * count.value)()
    _check(
        driver.cuGraphGetEdges_v2(ctypes.c_void_p(graph), sources, destinations, data, ctypes.byref(count)),
        "cuGraphGetEdges",
    )
    return [
        GraphEdge(sources[i], destinations[i], data[i].type == _CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        for i in range(count.value)
    ]


def graph_kernels(graph: torch.cuda.CUDAGraph) -> tuple[dict[int, str], list[GraphEdge]]:
    """The kernel nodes (handle to kernel name) and the edges of a graph captured with
    ``keep_graph=True`` and not yet instantiated."""
    handle = graph.raw_cuda_graph()
    names = {node: name for node in _graph_nodes(handle) if (name := _kernel_name(node)) is not None}
    return names, _graph_edges(handle)


def make_edges_programmatic(
    graph: torch.cuda.CUDAGraph, waits: Callable[[str], bool] = waits_for_predecessor
) -> int:
    """Turns the full edges from a kernel into a kernel that ``waits`` into programmatic ones, in a graph
    captured with ``keep_graph=True`` and not yet instantiated. Returns how many it turned."""
    names, edges = graph_kernels(graph)
    chosen = edges_to_make_programmatic(edges, names, waits)
    if not chosen:
        return 0
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = len(chosen)
    sources = (ctypes.c_void_p * count)(*(edge.source for edge in chosen))
    destinations = (ctypes.c_void_p * count)(*(edge.destination for edge in chosen))
    full = (_EdgeData * count)()
    programmatic = (_EdgeData * count)()
    for data in programmatic:
        data.from_port = _CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        data.type = _CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    driver = _driver()
    _check(
        driver.cuGraphRemoveDependencies_v2(handle, sources, destinations, full, ctypes.c_size_t(count)),
        "cuGraphRemoveDependencies",
    )
    _check(
        driver.cuGraphAddDependencies_v2(handle, sources, destinations, programmatic, ctypes.c_size_t(count)),
        "cuGraphAddDependencies",
    )
    return count


def supports_programmatic_edges(device: torch.device) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
