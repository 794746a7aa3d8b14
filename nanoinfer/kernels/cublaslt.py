"""Projections through cuBLASLt with the fastest of the algorithms its heuristic offers, timed per shape.

``torch.mm`` runs cuBLAS's first heuristic choice. At a decode step's 17-256 rows the projections are
small GEMMs whose time is mostly their ramp and tail (docs/benchmarks.md, FP8 section), where the first
choice need not be the fastest. :class:`TunedLinear` asks cuBLASLt for up to ``candidates`` algorithms
per (rows, out features, in features, dtype), times each once on the call's own operands with L2
flushed before every timed call (in the engine the weights come from DRAM), and keeps the fastest. It
tunes only outside graph capture and only for the row counts it was given (the decode graphs' sizes,
whose eager run before capture tunes them); any other call is ``F.linear``, its reference.
CUDA only; the library is the cuBLASLt that torch loaded.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_DATA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
_DESC_TRANSA = 3  # cublasLtMatmulDescAttributes_t CUBLASLT_MATMUL_DESC_TRANSA
_OP_T = 1  # cublasOperation_t CUBLAS_OP_T
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t


class Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: an algorithm, the workspace it needs, and whether it applies."""

    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass
class MatmulPlan:
    """cuBLASLt's descriptors of one row-major ``out[M, N] = x[M, K] @ weight[N, K].T`` (column-major:
    ``out.T = op_T(weight) @ x.T``, the ``TN`` form cuBLAS runs torch.mm in), and its algorithms."""

    desc: ctypes.c_void_p
    weight_layout: ctypes.c_void_p
    x_layout: ctypes.c_void_p
    out_layout: ctypes.c_void_p
    algos: list[Heuristic]


class CublasLt:
    """The cuBLASLt calls this module makes, on the library torch loaded, with one workspace."""

    def __init__(self, device: torch.device, workspace_bytes: int = 32 << 20):
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        self._check("cublasLtCreate", ctypes.byref(self.handle))
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)

    def _check(self, name: str, *args: Any) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with cuBLAS status {status}")

    def _layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(
            "cublasLtMatrixLayoutCreate",
            ctypes.byref(layout),
            ctypes.c_int(_DATA_TYPES[dtype]),
            ctypes.c_uint64(rows),
            ctypes.c_uint64(cols),
            ctypes.c_int64(ld),
        )
        return layout

    def plan(self, m: int, n: int, k: int, x_stride: int, dtype: torch.dtype, candidates: int) -> MatmulPlan:
        desc = ctypes.c_void_p()
        self._check(
            "cublasLtMatmulDescCreate", ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F), ctypes.c_int(0)
        )
        transpose = ctypes.c_int32(_OP_T)
        self._check(
            "cublasLtMatmulDescSetAttribute",
            desc,
            ctypes.c_int(_DESC_TRANSA),
            ctypes.byref(transpose),
            ctypes.c_size_t(4),
        )
        weight_layout = self._layout(dtype, k, n, k)
        x_layout = self._layout(dtype, k, m, x_stride)
        out_layout = self._layout(dtype, n, m, n)
        preference = ctypes.c_void_p()
        self._check("cublasLtMatmulPreferenceCreate", ctypes.byref(preference))
        size = ctypes.c_size_t(self.workspace.numel())
        self._check(
            "cublasLtMatmulPreferenceSetAttribute",
            preference,
            ctypes.c_int(_PREF_MAX_WORKSPACE_BYTES),
            ctypes.byref(size),
            ctypes.c_size_t(8),
        )
        results, returned = (Heuristic * candidates)(), ctypes.c_int(0)
        self._check(
            "cublasLtMatmulAlgoGetHeuristic",
            self.handle,
            desc,
            weight_layout,
            x_layout,
            out_layout,
            out_layout,
            preference,
            ctypes.c_int(candidates),
            results,
            ctypes.byref(returned),
        )
        self._check("cublasLtMatmulPreferenceDestroy", preference)
        algos = [r for r in results[: returned.value] if r.state == 0]
        return MatmulPlan(desc, weight_layout, x_layout, out_layout, algos)

    def matmul(
        self, plan: MatmulPlan, algo: Heuristic, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
    ) -> None:
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._check(
            "cublasLtMatmul",
            self.handle,
            plan.desc,
            ctypes.byref(alpha),
            ctypes.c_void_p(weight.data_ptr()),
            plan.weight_layout,
            ctypes.c_void_p(x.data_ptr()),
            plan.x_layout,
            ctypes.byref(beta),
            ctypes.c_void_p(out.data_ptr()),
            plan.out_layout,
            ctypes.c_void_p(out.data_ptr()),
            plan.out_layout,
            ctypes.byref(algo.algo),
            ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(algo.workspace_size),
            ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
        )


@functools.cache
def _library() -> ctypes.CDLL:
    """The cuBLASLt torch has loaded (a matmul loads it), found among the process's mappings."""
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    if not paths:
        raise RuntimeError("torch has not loaded cuBLASLt")
    return ctypes.CDLL(paths[0])


def fastest(times_us: list[float]) -> int:
    """The index of the fastest algorithm; ties go to the earlier (the heuristic's own order)."""
    return min(range(len(times_us)), key=lambda i: (times_us[i], i))


class TunedLinear:
    """``x @ weight.T`` through the fastest cuBLASLt algorithm for the shape, at the given row counts."""

    def __init__(self, rows: Collection[int], candidates: int = 16, reps: int = 7):
        self.rows = frozenset(rows)
        self.candidates = candidates
        self.reps = reps
        self._lt: CublasLt | None = None
        self._flush: torch.Tensor | None = None
        # (m, n, k, x row stride, dtype, device) -> (plan, chosen algorithm)
        self.plans: dict[tuple, tuple[MatmulPlan, Heuristic]] = {}
        self.tuning_us: dict[tuple, list[float]] = {}  # every candidate's time, for the record

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        if (
            m not in self.rows
            or not x.is_cuda
            or x.dtype not in (torch.float16, torch.bfloat16)
            or weight.dtype != x.dtype
            or x.stride(1) != 1
            or not weight.is_contiguous()
        ):
            return F.linear(x, weight)
        key = (m, n, k, x.stride(0), x.dtype, x.device)
        chosen = self.plans.get(key)
        if chosen is None:
            if torch.cuda.is_current_stream_capturing():
                return F.linear(x, weight)
            chosen = self._tune(key, x, weight)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self._library(x.device).matmul(chosen[0], chosen[1], x, weight, out)
        return out

    def _library(self, device: torch.device) -> CublasLt:
        if self._lt is None:
            self._lt = CublasLt(device)
            l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
            self._flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device=device)
        return self._lt

    def _tune(self, key: tuple, x: torch.Tensor, weight: torch.Tensor) -> tuple[MatmulPlan, Heuristic]:
        m, n, k, x_stride, dtype, _ = key
        lt = self._library(x.device)
        plan = lt.plan(m, n, k, x_stride, dtype, self.candidates)
        if not plan.algos:
            raise RuntimeError(f"cuBLASLt offers no algorithm for {m}x{k} @ {k}x{n} in {dtype}")
        out = torch.empty(m, n, dtype=dtype, device=x.device)
        expected = F.linear(x, weight).float()
        times = []
        for algo in plan.algos:
            lt.matmul(plan, algo, x, weight, out)
            right = torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2)
            times.append(self._time(lt, plan, algo, x, weight, out) if right else float("inf"))
        self.tuning_us[key] = times
        chosen = (plan, plan.algos[fastest(times)])
        self.plans[key] = chosen
        return chosen

    def _time(self, lt, plan, algo, x, weight, out) -> float:
        """Median us of one call with L2 flushed before it."""
        samples = []
        for _ in range(self.reps):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            lt.matmul(plan, algo, x, weight, out)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return statistics.median(samples)
