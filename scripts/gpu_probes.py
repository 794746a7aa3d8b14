"""Probes of decode-step levers that were measured and not kept (docs/benchmarks.md, FP8 section,
twenty-second and twenty-fourth parts); each prints one line per shape and writes $OUT/<probe>.json.
CUDA only.

``l2_prefetch``: do the projections' cuBLAS calls get faster when their weights were prefetched into L2
(``prefetch.global.L2::evict_last``) while an attention-like kernel streamed the KV cache with an
``evict_first`` policy? 28 layers of Qwen3-0.6B-shaped weights ([qkv | o | gate_up | down] per layer,
contiguous), a streaming read of M x 600 x 2 KiB of "KV" per layer, the four GEMMs; CUDA graphs; us per
layer for each arrangement, beside the GEMMs alone over cold (DRAM) and hot (L2) weights.

``two_batch_overlap``: the engine's decode forward (FP8 KV) at B rows x context as one graph of B rows,
against two halves of B / 2 rows on two streams in one graph (each half's memory-bound attention free to
overlap the other's GEMMs), and the halves one after the other; ms per forward.

``cublaslt_algos``: is there a faster cuBLASLt algorithm than the one cuBLAS picks for the projections at
32-256 rows? Per projection and row count: ``torch.mm`` (what the engine calls; the split-K form for the
residual branches' ends beside it) against every algorithm ``cublasLtMatmulAlgoGetHeuristic`` offers
(32 asked for; it offered 8 on an H100), each timed in a graph of 20 calls rotating through enough
weight copies that every call reads its weight from DRAM, and each checked against ``torch.mm``; us
per call.

``cublas_pdl``: do cuBLAS's GEMMs wait for their predecessor (``griddepcontrol.wait``), so that the graph
edges into them could be made programmatic, as those into nanoinfer's own kernels are? Per projection of
the Qwen3-0.6B shape and decode graph row count: a graph of a kernel that lets its dependents launch at
once and writes the projection's input after spinning 50 us, then the projection (the engine's own
dispatch); the edge between them turned programmatic after capture; the input zeroed before each of 3
replays. A projection that does not wait reads the zeros. A control (a torch kernel, which does not
wait) must read them.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
from collections.abc import Callable

import torch

LAYERS = 28
HIDDEN, QKV, INTER, QDIM, VOCAB = 1024, 4096, 3072, 2048, 151936
# A layer's projections, (out features, in features), in the order the layer runs them.
PROJECTIONS = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, QDIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
RESIDUAL_BRANCH_ENDS = ("o", "down")  # split into K ranges at 17-256 rows (`residual_branch_splits`)

_STREAM_SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
extern "C" __global__ void stream_read(const uint4* __restrict__ p, int n, u32* sink, int evict_first,
                                       const char* __restrict__ pre, int pre_bytes) {
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int nthreads = gridDim.x * blockDim.x;
    for (int off = tid * 128; off < pre_bytes; off += nthreads * 128)
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(pre + off));
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    u32 acc = 0;
    for (int i = tid; i < n; i += 4 * nthreads) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            int j = i + u * nthreads;
            v[u].x = v[u].y = v[u].z = v[u].w = 0;
            if (j < n) {
                if (evict_first)
                    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                                 : "l"(p + j), "l"(policy));
                else
                    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + j));
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
}
extern "C" __global__ void prefetch_l2(const char* __restrict__ p, int nbytes) {
    int stride = gridDim.x * blockDim.x * 128;
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * 128; i < nbytes; i += stride)
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + i));
}
"""


def graph_ms(run: Callable[[], None], replays: int = 15) -> float:
    """Median ms of one replay of a CUDA graph of ``run`` (run once eagerly first). Not gpu_kernels'
    ``graph_bench``: its ``do_bench`` flushes L2 between replays, which the L2 probe must not have done
    for it, and importing that script stubs the ``nanoinfer`` package the overlap probe's engine needs."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def l2_prefetch(args) -> dict:
    stream_kernel = torch.cuda._compile_kernel(_STREAM_SOURCE, "stream_read")
    prefetch_kernel = torch.cuda._compile_kernel(_STREAM_SOURCE, "prefetch_l2")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device = torch.device("cuda")
    sink = torch.zeros(4, dtype=torch.int32, device=device)
    per_layer = sum(n * k for n, k in PROJECTIONS.values())
    # One more layer than run, so that layer l's prefetch range ends in layer l + 1's qkv.
    weights = torch.randn((LAYERS + 1) * per_layer, device=device, dtype=torch.bfloat16) * 0.02
    offsets, offset = {}, 0
    for name, (n, k) in PROJECTIONS.items():
        offsets[name] = offset
        offset += n * k

    def weight(layer: int, name: str) -> torch.Tensor:
        start = layer * per_layer + offsets[name]
        n, k = PROJECTIONS[name]
        return weights[start : start + n * k].view(n, k)

    def prefetch_range(layer: int) -> tuple[torch.Tensor, int]:
        """What layer ``layer`` reads after its attention: its o, gate_up and down, then the next qkv."""
        start = layer * per_layer + offsets["o"]
        end = (layer + 1) * per_layer + offsets["o"]
        return weights[start:end], (end - start) * weights.element_size()

    results = {}
    for m in (64, 128, 256):
        kv_layer = m * 600 * 2048
        kv = torch.randint(0, 255, (LAYERS * kv_layer,), dtype=torch.uint8, device=device)
        x = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)
        attn = torch.randn(m, QDIM, device=device, dtype=torch.bfloat16)
        outs = {name: torch.empty(m, n, device=device, dtype=x.dtype) for name, (n, _) in PROJECTIONS.items()}
        side = torch.cuda.Stream()

        def stream(layer, evict_first, prefetch=None, kv=kv, kv_layer=kv_layer):
            view = kv[layer * kv_layer : (layer + 1) * kv_layer]
            target, size = prefetch if prefetch is not None else (sink, 0)
            stream_kernel(
                grid=(2 * sms, 1, 1), block=(512, 1, 1),
                args=[view, kv_layer // 16, sink, int(evict_first), target, size],
            )  # fmt: skip

        def gemms(layer, hot=False, x=x, attn=attn, outs=outs):
            source = 0 if hot else layer
            torch.mm(attn, weight(source, "o").t(), out=outs["o"])
            torch.mm(x, weight(source, "gate_up").t(), out=outs["gate_up"])
            torch.mm(outs["gate_up"][:, :INTER], weight(source, "down").t(), out=outs["down"])
            torch.mm(x, weight(0 if hot else layer + 1, "qkv").t(), out=outs["qkv"])

        def prefetch(layer):
            target, size = prefetch_range(layer)
            prefetch_kernel(grid=(sms, 1, 1), block=(256, 1, 1), args=[target, size])

        def side_prefetch(layer, side=side):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(layer)
            stream(layer, True)
            torch.cuda.current_stream().wait_stream(side)

        per_layer_steps = {
            "stream_then_gemms": lambda layer: (stream(layer, False), gemms(layer)),
            "evict_first_then_gemms": lambda layer: (stream(layer, True), gemms(layer)),
            "prefetch_in_stream_then_gemms": lambda layer: (
                stream(layer, True, prefetch_range(layer)),
                gemms(layer),
            ),
            "prefetch_on_side_stream_then_gemms": lambda layer: (side_prefetch(layer), gemms(layer)),
            "stream_prefetch_gemms": lambda layer: (stream(layer, True), prefetch(layer), gemms(layer)),
            "stream_only": lambda layer: stream(layer, False),
            "stream_only_with_prefetch": lambda layer: stream(layer, True, prefetch_range(layer)),
            "gemms_cold": gemms,
            "gemms_hot": lambda layer: gemms(layer, hot=True),
        }
        entry = {}
        for name, step in per_layer_steps.items():
            entry[f"{name}_us"] = round(
                graph_ms(lambda step=step: [step(layer) for layer in range(LAYERS)]) * 1e3 / LAYERS, 2
            )
        entry["stream_tbps"] = round(kv_layer / entry["stream_only_us"] / 1e6, 3)
        results[f"M={m}"] = entry
        print(f"l2_prefetch M={m}", json.dumps(entry), flush=True)
        del kv
        torch.cuda.empty_cache()
    return results


def two_batch_overlap(args) -> dict:
    from nanoinfer.frontend.llm import LLM
    from nanoinfer.layers.attention import AttentionMetadata

    llm = LLM(args.model, kv_cache_dtype="fp8")
    runner = llm.llm_engine.engine_core.executor.runner
    model, buffers = runner.model, runner.buffers
    first = runner.attention_layers[0]
    backend = first.backend
    workspaces = (
        backend.decode_workspace,
        type(backend.decode_workspace).allocate(
            buffers.seq_lens.shape[0], first.num_heads, runner.num_kv_heads, runner.head_dim,
            buffers.block_tables.shape[1] * runner.block_size, runner.device, cache_dtype=runner.kv_dtype,
        ),
    )  # fmt: skip

    def metadata(lo: int, hi: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=buffers.slot_mapping[lo:hi],
            query_start_loc=buffers.query_start_loc[: hi - lo + 1],
            seq_lens=buffers.seq_lens[lo:hi],
            block_tables=buffers.block_tables[lo:hi],
            num_decode_rows=hi - lo,
            max_query_len=1,
            max_seq_len=runner.config.max_model_len,
        )

    results = {"kv_blocks": runner.num_kv_blocks}
    with torch.inference_mode():
        buffers.query_start_loc.copy_(torch.arange(len(buffers.query_start_loc), dtype=torch.int32))
        for batch, context in ((256, 1024), (256, 600), (128, 1024), (64, 1024)):
            blocks = context // runner.block_size
            pool = torch.randperm(runner.num_kv_blocks, device=runner.device)[: batch * blocks]
            buffers.block_tables[:batch, :blocks] = pool.view(batch, blocks).int()
            buffers.seq_lens[:batch] = context
            buffers.positions[:batch] = context - 1
            buffers.slot_mapping[:batch] = -1  # nothing written: every replay reads the same cache
            buffers.input_ids[:batch] = torch.randint(0, 1000, (batch,), device=runner.device)
            out = torch.empty(batch, HIDDEN, dtype=torch.bfloat16, device=runner.device)
            half = batch // 2

            def forward(lo, hi, workspace, out=out):
                backend.decode_workspace = workspace  # read when each layer's attention is issued
                out[lo:hi] = model(buffers.input_ids[lo:hi], buffers.positions[lo:hi], metadata(lo, hi))

            def halves(side, half=half, batch=batch, forward=forward):
                main = torch.cuda.current_stream()  # the capture's stream
                if side is not None:
                    side.wait_stream(main)
                forward(0, half, workspaces[0])
                with torch.cuda.stream(side or main):
                    forward(half, batch, workspaces[1])
                if side is not None:
                    main.wait_stream(side)
                backend.decode_workspace = workspaces[0]

            entry = {
                "one_batch_ms": graph_ms(lambda fwd=forward, rows=batch: fwd(0, rows, workspaces[0])),
                "halves_serial_ms": graph_ms(lambda halves=halves: halves(None)),
                "halves_two_streams_ms": graph_ms(lambda halves=halves: halves(torch.cuda.Stream())),
                "halves_two_streams_side_high_priority_ms": graph_ms(
                    lambda halves=halves: halves(torch.cuda.Stream(priority=-1))
                ),
            }
            entry = {key: round(value, 4) for key, value in entry.items()}
            results[f"B={batch} x {context}"] = entry
            print(f"two_batch_overlap B={batch} x {context}", json.dumps(entry), flush=True)
    llm.close()
    return results


class _EdgeData(ctypes.Structure):
    """The driver API's CUgraphEdgeData."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]  # fmt: skip


class _KernelNodeParams(ctypes.Structure):
    """The driver API's CUDA_KERNEL_NODE_PARAMS_v2."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]  # fmt: skip


def _driver_call(name: str, *args) -> None:
    from torch.cuda._utils import _get_gpu_runtime_library

    result = getattr(_get_gpu_runtime_library(), name)(*args)
    if result != 0:
        raise RuntimeError(f"{name} failed with CUDA driver error {result}")


def _kernel_names(graph: int) -> dict[int, str]:
    """Kernel node handle -> kernel name, for a captured (kept) graph."""
    count = ctypes.c_size_t(0)
    _driver_call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    _driver_call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
    names = {}
    for node in nodes:
        node_type = ctypes.c_int(-1)
        _driver_call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(node_type))
        if node_type.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            continue
        params, name = _KernelNodeParams(), ctypes.c_char_p()
        _driver_call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
        if params.func:
            _driver_call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
        else:
            _driver_call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
        names[node] = name.value.decode()
    return names


def _turn_edges_from(graph: int, source_name: str) -> list[str]:
    """Makes the full edges from the kernel ``source_name`` into other kernels programmatic; returns the
    names of the kernels they lead into."""
    names = _kernel_names(graph)
    count = ctypes.c_size_t(0)
    _driver_call("cuGraphGetEdges_v2", ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
    sources, destinations = (ctypes.c_void_p * count.value)(), (ctypes.c_void_p * count.value)()
    data = (_EdgeData * count.value)()
    _driver_call(
        "cuGraphGetEdges_v2", ctypes.c_void_p(graph), sources, destinations, data, ctypes.byref(count)
    )
    turned = []
    for source, destination, edge in zip(sources, destinations, data, strict=True):
        if source in names and destination in names and source_name in names[source] and edge.type == 0:
            full = _EdgeData()
            programmatic = _EdgeData(from_port=1, type=1)  # the programmatic port and dependency type
            pair = (ctypes.c_void_p(source), ctypes.c_void_p(destination))
            _driver_call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(pair[0]),
                         ctypes.byref(pair[1]), ctypes.byref(full), ctypes.c_size_t(1))  # fmt: skip
            _driver_call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), ctypes.byref(pair[0]),
                         ctypes.byref(pair[1]), ctypes.byref(programmatic), ctypes.c_size_t(1))  # fmt: skip
            turned.append(names[destination])
    return turned


@functools.cache
def _spin_then_copy() -> Callable[[torch.Tensor, torch.Tensor], None]:
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
        tl.store(destination + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)

    def launch(source: torch.Tensor, destination: torch.Tensor) -> None:
        grid = (triton.cdiv(source.numel(), 1024),)
        spin_then_copy[grid](source, destination, source.numel(), 50_000, BLOCK=1024)

    return launch


def _reads_after_write(project: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor) -> dict:
    """Whether ``project`` behind a programmatic edge from spin_then_copy reads the written input."""
    from nanoinfer.layers.kernels import SplitKPartials

    def dense(result):
        return result.parts.sum(0) if isinstance(result, SplitKPartials) else result.float()

    spin, x = _spin_then_copy(), torch.empty_like(source)
    expected = dense(project(source))
    spin(source, x)
    project(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        spin(source, x)
        out = project(x)
    turned = _turn_edges_from(graph.raw_cuda_graph(), "spin_then_copy")
    graph.instantiate()
    correct = []
    for _ in range(3):
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        correct.append(bool(torch.allclose(dense(out), expected, rtol=1e-2, atol=1e-2)))
    return {"kernels": turned, "correct": correct}


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # fmt: skip


class _CublasLt:
    """Row-major ``out[M, N] = x[M, K] @ weight[N, K].T`` in bf16 through cuBLASLt with a chosen algorithm:
    column-major ``out.T = op_T(weight) @ x.T`` (``TN``, as cuBLAS runs torch.mm)."""

    COMPUTE_32F, R_32F, R_16BF, TRANSA, OP_T, MAX_WORKSPACE = 68, 0, 14, 3, 1, 1

    def __init__(self, workspace_bytes: int = 32 << 20):
        torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))  # loads cuBLAS(Lt)
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcublasLt.so" in line)
        self.lib = ctypes.CDLL(path)  # the one torch loaded
        self.handle = ctypes.c_void_p()
        self._check("cublasLtCreate", ctypes.byref(self.handle))
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")

    def _check(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with cuBLAS status {status}")

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check("cublasLtMatrixLayoutCreate", ctypes.byref(layout), ctypes.c_int(self.R_16BF),
                    ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld))  # fmt: skip
        return layout

    def plan(self, m: int, n: int, k: int, count: int = 32) -> tuple[tuple, list[_Heuristic]]:
        desc = ctypes.c_void_p()
        self._check("cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(self.COMPUTE_32F),
                    ctypes.c_int(self.R_32F))  # fmt: skip
        trans = ctypes.c_int32(self.OP_T)
        self._check("cublasLtMatmulDescSetAttribute", desc, ctypes.c_int(self.TRANSA), ctypes.byref(trans),
                    ctypes.c_size_t(4))  # fmt: skip
        layouts = (self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n))
        preference = ctypes.c_void_p()
        self._check("cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
        size = ctypes.c_size_t(self.workspace.numel())
        self._check("cublasLtMatmulPreferenceSetAttribute", preference, ctypes.c_int(self.MAX_WORKSPACE),
                    ctypes.byref(size), ctypes.c_size_t(8))  # fmt: skip
        results, returned = (_Heuristic * count)(), ctypes.c_int(0)
        self._check("cublasLtMatmulAlgoGetHeuristic", self.handle, desc, layouts[0], layouts[1], layouts[2],
                    layouts[2], preference, ctypes.c_int(count), results, ctypes.byref(returned))  # fmt: skip
        return (desc, *layouts), [r for r in results[: returned.value] if r.state == 0]

    def matmul(self, plan: tuple, algo: _Heuristic, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor):
        desc, a_layout, b_layout, c_layout = plan
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._check("cublasLtMatmul", self.handle, desc, ctypes.byref(alpha),
                    ctypes.c_void_p(weight.data_ptr()), a_layout, ctypes.c_void_p(x.data_ptr()), b_layout,
                    ctypes.byref(beta),
                    ctypes.c_void_p(out.data_ptr()), c_layout, ctypes.c_void_p(out.data_ptr()), c_layout,
                    ctypes.byref(algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
                    ctypes.c_size_t(algo.workspace_size),
                    ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))  # fmt: skip


def _time_algos(lt: _CublasLt, project: Callable | None, weights: list[torch.Tensor], m: int) -> dict:
    """us per call of torch.mm, the engine's split-K form (``project``, where given) and each cuBLASLt
    algorithm, over ``m`` rows, rotating through ``weights``."""
    calls = 20
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    expected = torch.mm(x, weights[0].t()).float()

    def us_per_call(call: Callable[[torch.Tensor], object]) -> float:
        return round(
            graph_ms(lambda: [call(weights[i % len(weights)]) for i in range(calls)]) * 1e3 / calls, 2
        )

    entry = {"torch_mm_us": us_per_call(lambda w: torch.mm(x, w.t(), out=out))}
    if project is not None:
        entry["engine_split_k_us"] = us_per_call(lambda w: project(x, w))
    plan, algos = lt.plan(m, n, k)
    timed = []
    for index, algo in enumerate(algos):
        out.zero_()
        lt.matmul(plan, algo, x, weights[0], out)
        if not torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2):
            timed.append({"index": index, "wrong": True})
            continue
        us = us_per_call(lambda w, algo=algo: lt.matmul(plan, algo, x, w, out))
        timed.append(
            {"index": index, "us": us, "waves": round(algo.waves_count, 2), "workspace": algo.workspace_size}
        )
    right = [t for t in timed if "us" in t]
    entry["num_algos"] = len(algos)
    entry["heuristic_first_us"] = right[0]["us"] if right and right[0]["index"] == 0 else None
    entry["best_us"] = min((t["us"] for t in right), default=None)
    entry["algos"] = timed
    return entry


def cublaslt_algos(args) -> dict:
    from nanoinfer.layers.kernels import triton_kernels

    kernels = triton_kernels(pdl=True)
    lt = _CublasLt()
    results = {}
    for name, (n, k) in PROJECTIONS.items():
        copies = max(2, -(-160_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        project = kernels.residual_branch_linear if name in RESIDUAL_BRANCH_ENDS else None
        for m in (32, 64, 128, 256):
            entry = _time_algos(lt, project, weights, m)
            results[f"{name} M={m}"] = entry
            summary = {key: value for key, value in entry.items() if key != "algos"}
            print(f"cublaslt_algos {name} M={m}", json.dumps(summary), flush=True)
    return results


def cublas_pdl(args) -> dict:
    from nanoinfer.executor.cuda_graphs import cuda_graph_batch_sizes
    from nanoinfer.layers.kernels import triton_kernels

    kernels = triton_kernels(pdl=True)
    results = {}
    for name, (out_features, in_features) in {**PROJECTIONS, "lm_head": (VOCAB, HIDDEN)}.items():
        weight = (
            torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / in_features**0.5
        )
        linear = kernels.residual_branch_linear if name in RESIDUAL_BRANCH_ENDS else kernels.linear
        for rows in cuda_graph_batch_sizes(256):
            source = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            entry = _reads_after_write(lambda x, w=weight, f=linear: f(x, w), source)
            results[f"{name} M={rows}"] = entry
            print(f"cublas_pdl {name} M={rows}", json.dumps(entry), flush=True)
    control = _reads_after_write(lambda x: x * 2, torch.randn(256, HIDDEN, device="cuda"))
    results["control (torch elementwise)"] = control
    print("cublas_pdl control", json.dumps(control), flush=True)
    return results


PROBES = {
    "l2_prefetch": l2_prefetch,
    "two_batch_overlap": two_batch_overlap,
    "cublaslt_algos": cublaslt_algos,
    "cublas_pdl": cublas_pdl,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=list(PROBES))
    parser.add_argument("--model", help="checkpoint directory (two_batch_overlap)")
    args = parser.parse_args()
    if args.probe == "two_batch_overlap" and not args.model:
        parser.error("two_batch_overlap needs --model")
    result = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("NANOINFER_COMMIT", "unknown")}
    result.update(PROBES[args.probe](args))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"{args.probe}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
