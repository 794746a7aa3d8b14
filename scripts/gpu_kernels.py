"""Check and time nanoinfer's Triton kernels on a CUDA GPU (one run of about 4 minutes on an H200).

1. Correctness against the pure-PyTorch references, in bf16 and with an FP8 (e4m3) KV cache, every
   output poisoned with NaN first (relative error under 1e-2, nothing left unwritten): the fused
   elementwise kernels, the sampler (tokens against the reference's inverse-CDF draws), GEMV,
   the KV store, decode (every variant, eager and CUDA-graph replay), prefill (every configuration).
2. Timing, in CUDA-graph replay (per call, averaged over a captured run of calls) unless noted:
   the elementwise kernels against the torch reference at T = 1, 256 and 16,384 (Qwen3-0.6B sizes); the
   sampler (checked first) against softmax + exponential + argmax at batch 1 and 256 x 151,936; GEMV
   configurations against cuBLAS for each Qwen3-0.6B projection at M = 1, 2, 4, 8, 16 (weight-read
   TB/s); the projections at M = 32-256 under cuBLAS and cuBLASLt (torch's preferred BLAS library); decode
   variants at batch x context 1x600, 8x600, 64x1024, 256x1024 (bf16 and FP8 KV, KV TB/s); prefill
   configurations on a 16,384-token batch of 29 sequences (eager: milliseconds per call); decode and
   prefill on token-major and head-major caches (the engine's FP8 pool is head-major); a 28-layer
   mock decode step at batch 1 and 16 built from these kernels, with and without programmatic
   dependent launch, and with cuBLAS projections.
Writes $OUT/gpu_kernels.json (default: the current directory) and prints a table last. A failing
section is reported and the others still run; the exit status is 1 if any check or section failed.

Usage: python3 scripts/gpu_kernels.py [--quick] [--only SECTION ...] [--compile-only] [--write-config]
  --quick         correctness on a smaller grid and fewer timed variants (scripts/gpu_check.py runs it)
  --compile-only  no GPU needed: compiles every kernel and configuration used here for sm_90 (Triton's
                  own ptxas), to catch compile errors before a GPU run
  --write-config  after decode_fp8_kernels, write this GPU model's tuned tiles (write_tuned_fp8_decode)
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial
from itertools import accumulate
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# The kernel modules only: a bare `nanoinfer` package stub keeps the engine's own imports (transformers,
# the server) out of this script, so it runs with torch and Triton alone.
if "nanoinfer" not in sys.modules:
    _package = types.ModuleType("nanoinfer")
    _package.__path__ = [str(REPO / "nanoinfer")]
    sys.modules["nanoinfer"] = _package

DEVICE = "cuda"
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
TOLERANCE = 1e-2
RESULTS: dict = {"correctness": [], "timing": {}}
TABLE: list[tuple[str, str]] = []

# Qwen3-0.6B
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS, EPS = 1024, 16, 8, 128, 3072, 151936, 28, 1e-6
# Timed shapes: decode batch x context; the prefill batch (tokens, sequences, length range); the mock
# decode step's batches and context; the sampler's batches.
DECODE_SHAPES = [(1, 600), (8, 600), (64, 1024), (256, 1024)]
PREFILL_BATCH = {"total": 16384, "count": 29, "low": 100, "high": 1024}
MOCK_STEP_BATCHES, MOCK_STEP_CONTEXT = (1, 16), 600
SAMPLER_BATCHES = (1, 256)
PROJECTIONS = {  # name: (N, K) of the weight [N, K]
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}


def log(msg: str) -> None:
    print(msg, flush=True)


def _modules():
    import nanoinfer.kernels.attention_ref as attention_ref
    import nanoinfer.kernels.elementwise_ref as elementwise_ref
    import nanoinfer.kernels.gemv_ref as gemv_ref
    import nanoinfer.kernels.sampling_ref as sampling_ref
    import nanoinfer.kernels.triton_attention as triton_attention
    import nanoinfer.kernels.triton_elementwise as triton_elementwise
    import nanoinfer.kernels.triton_gemv as triton_gemv
    import nanoinfer.kernels.triton_sampling as triton_sampling

    return types.SimpleNamespace(
        aref=attention_ref,
        eref=elementwise_ref,
        gref=gemv_ref,
        sref=sampling_ref,
        attn=triton_attention,
        elem=triton_elementwise,
        gemv=triton_gemv,
        samp=triton_sampling,
    )


K = None  # the kernel modules, loaded in main() (after --compile-only has set up its fake driver)


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


def rel_error(out, expected) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6)).item()


def record(kind: str, params: dict, ok: bool, err: float | None = None, note: str = "") -> None:
    RESULTS["correctness"].append({"kind": kind, **params, "pass": bool(ok), "rel_error": err, "note": note})
    desc = " ".join(f"{k}={v}" for k, v in params.items())
    err_s = "" if err is None else f" err={err:.2e}"
    log(f"{'PASS' if ok else 'FAIL'} {kind:10s} {desc}{err_s} {note}")


def check_close(kind: str, params: dict, out: torch.Tensor, expected: torch.Tensor, note: str = "") -> None:
    nan = bool(out.isnan().any())
    err = rel_error(out, expected)
    record(kind, params, (not nan) and err < TOLERANCE, err, note + (" NaN left!" if nan else ""))


def poison(*shape, dtype=DTYPE) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def randn(gen, *shape, dtype=DTYPE, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def bench(fn, rep=100) -> float:
    """Median milliseconds per call, eager."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def graph_bench(fn, calls=20, rep=60) -> float:
    """Milliseconds per call of ``fn`` replayed in a CUDA graph holding ``calls`` calls back to back
    (launch gaps between consecutive calls count; the graph launch itself is amortised)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    ms = bench(graph.replay, rep) / calls
    del graph
    return ms


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def cos_sin_table(max_position: int, head_dim: int, theta: float = 1e6) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    view = torch.empty(num_blocks, num_kv_heads, block_size, head_dim, dtype=cache.dtype, device=DEVICE)
    view = view.transpose(1, 2)
    view.copy_(cache)
    return view


class Paged:
    """Random K/V scattered into a shuffled block pool, and the block tables pointing at it. With
    ``fp8_scales`` the pool is e4m3, quantized by the reference."""

    def __init__(self, gen, seq_lens, num_kv_heads, head_dim, block_size, fp8_scales=None, width=None):
        self.seq_lens_list = list(seq_lens)
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        width = max(blocks_per_seq + [1, width or 1])
        num_blocks = sum(blocks_per_seq) + 4
        perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).int()
        # Row-strided view; unused entries name a real block so reads past seq_len give wrong data.
        storage = torch.full((len(seq_lens), width + 2), num_blocks - 1, dtype=torch.int32, device=DEVICE)
        starts = [0, *accumulate(blocks_per_seq)]
        for b, nb in enumerate(blocks_per_seq):
            storage[b, :nb] = perm[starts[b] : starts[b] + nb]
        self.block_tables = storage[:, :width]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
        self.v_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
        self.k_scale = self.v_scale = None
        if fp8_scales is not None:
            # Stored as the engine stores an FP8 pool: each kv head's slots of a block together, seen
            # through [num_blocks, block_size, num_kv_heads, head_dim] views.
            self.k_scale, self.v_scale = fp8_scales
            self.k_cache = _head_major(K.aref.quantize_fp8_ref(self.k_cache, self.k_scale))
            self.v_cache = _head_major(K.aref.quantize_fp8_ref(self.v_cache, self.v_scale))
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * self.k_cache.element_size()

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def fp8_scales(k=0.05, v=0.02):
    # Randn values of up to about 5 over these scales stay well inside e4m3's +-448.
    return (
        torch.tensor([k], dtype=torch.float32, device=DEVICE),
        torch.tensor([v], dtype=torch.float32, device=DEVICE),
    )


def causal_flops(seq_lens, q_lens, num_heads, head_dim) -> float:
    total = 0
    for s, q in zip(seq_lens, q_lens, strict=True):
        total += q * (s - q) + q * (q + 1) / 2  # query i at position s-q+i sees s-q+i+1 keys
    return 4.0 * total * num_heads * head_dim


def prefill_batch_lengths(total: int, count: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Sequence lengths like the benchmark's prefill steps: ``count`` sequences in [low, high]
    summing to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (count,), generator=gen).double()
    lens = (lens * total / lens.sum()).round().clamp(low, high).long().tolist()
    i = 0
    while sum(lens) != total:
        step = 1 if sum(lens) < total else -1
        if low <= lens[i % count] + step <= high:
            lens[i % count] += step
        i += 1
    return lens


# ----------------------------------------------------------------------------------------------------
# 1. Correctness
# ----------------------------------------------------------------------------------------------------


def check_elementwise(gen, token_counts=(1, 7, 256, 4097)):
    for tokens in token_counts:
        x = randn(gen, tokens, HIDDEN + 64)[:, :HIDDEN]  # row-strided
        weight = randn(gen, HIDDEN)
        out = poison(tokens, HIDDEN)
        K.elem.rms_norm(x, weight, EPS, out=out)
        check_close("rms_norm", {"T": tokens}, out, K.eref.rms_norm_ref(x, weight, EPS))

        x = randn(gen, tokens, HIDDEN)
        residual = randn(gen, tokens, HIDDEN)
        expected_x, expected_r = K.eref.add_rms_norm_ref(x.clone(), residual.clone(), weight, EPS)
        K.elem.add_rms_norm(x, residual, weight, EPS)
        check_close("add_norm", {"T": tokens, "out": "residual"}, residual, expected_r)
        check_close("add_norm", {"T": tokens, "out": "x"}, x, expected_x)

        for splits in (2, 4):
            parts = torch.randn(splits, tokens, HIDDEN, generator=gen, device=DEVICE)
            residual = randn(gen, tokens, HIDDEN)
            expected_x, expected_r = K.eref.add_partials_rms_norm_ref(parts, residual.clone(), weight, EPS)
            out = poison(tokens, HIDDEN)
            K.elem.add_partials_rms_norm(parts, residual, weight, EPS, out=out)
            check_close(
                "add_partials_norm", {"T": tokens, "S": splits, "out": "residual"}, residual, expected_r
            )
            check_close("add_partials_norm", {"T": tokens, "S": splits, "out": "x"}, out, expected_x)

        gate_up = randn(gen, tokens, 2 * INTER)
        out = poison(tokens, INTER)
        K.elem.silu_and_mul(gate_up, out=out)
        check_close("silu_mul", {"T": tokens}, out, K.eref.silu_and_mul_ref(gate_up))


def check_qk_norm_rope_store(gen, token_counts=(1, 33, 256)):
    cos_sin = cos_sin_table(4096, HEAD_DIM)
    for tokens in token_counts:
        for block_size in (16, 256):
            for cache_dtype in (DTYPE, FP8):
                for qk_norm in (True, False):
                    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
                    qkv = randn(gen, tokens, width)
                    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE)
                    num_blocks = max(4, 2 * math.ceil(tokens / block_size))
                    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
                    slots[::5] = -1
                    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
                    k_cache = torch.full(shape, float("nan"), device=DEVICE).to(cache_dtype)
                    v_cache = k_cache.clone()
                    scales = fp8_scales(0.02, 0.01) if cache_dtype == FP8 else (None, None)
                    weights = (randn(gen, HEAD_DIM), randn(gen, HEAD_DIM)) if qk_norm else (None, None)
                    args = (positions, cos_sin, HEADS, KV_HEADS, HEAD_DIM, *weights, EPS)
                    exp_qkv, exp_k, exp_v = qkv.clone(), k_cache.clone(), v_cache.clone()
                    K.eref.qk_norm_rope_store_ref(exp_qkv, *args, exp_k, exp_v, slots, *scales)
                    K.elem.qk_norm_rope_store(qkv, *args, k_cache, v_cache, slots, *scales)
                    params = {
                        "T": tokens,
                        "bs": block_size,
                        "cache": str(cache_dtype).split(".")[-1],
                        "norm": qk_norm,
                    }
                    check_close("rope_qkv", params, qkv, exp_qkv)
                    valid = slots >= 0
                    for name, got, exp in (("k", k_cache, exp_k), ("v", v_cache, exp_v)):
                        got_rows = got.view(-1, KV_HEADS, HEAD_DIM)[slots[valid]].float()
                        exp_rows = exp.view(-1, KV_HEADS, HEAD_DIM)[slots[valid]].float()
                        untouched = got.float().isnan().sum() == exp.float().isnan().sum()
                        err = rel_error(got_rows, exp_rows)
                        # FP8: one e4m3 step (2^-3) where the kernel's bf16 k differs in its last bit.
                        limit = 0.03 if cache_dtype == FP8 else TOLERANCE
                        ok = bool(untouched) and not bool(got_rows.isnan().any()) and err < limit
                        record(f"rope_{name}", params, ok, err, "" if untouched else "wrote other slots!")
        empty = torch.empty(0, device=DEVICE, dtype=DTYPE)
        qkv = randn(gen, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE)
        slots = torch.zeros(tokens, dtype=torch.long, device=DEVICE)
        weight = randn(gen, HEAD_DIM)
        args = (positions, cos_sin, HEADS, KV_HEADS, HEAD_DIM, weight, weight, EPS, empty, empty, slots)
        expected = qkv.clone()
        K.eref.qk_norm_rope_store_ref(expected, *args)
        K.elem.qk_norm_rope_store(qkv, *args)
        check_close("rope_qkv", {"T": tokens, "cache": "none"}, qkv, expected)
        # q written to a separate (poisoned) buffer, as the piecewise graphs' capture asks for.
        qkv = randn(gen, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        expected = qkv.clone()
        exp_q, _, _ = K.eref.qk_norm_rope_store_ref(expected, *args)
        q_out = poison(tokens, HEADS, HEAD_DIM)
        K.elem.qk_norm_rope_store(qkv, *args, q_out=q_out)
        check_close("rope_q_out", {"T": tokens, "cache": "none"}, q_out, exp_q)
        check_close(
            "rope_qkv",
            {"T": tokens, "q_out": True},
            qkv[:, HEADS * HEAD_DIM :],
            expected[:, HEADS * HEAD_DIM :],
        )


def check_sampler(gen, batches=(1, 7, 256)):
    """The inverse-CDF kernels against the torch reference: every token in the vocabulary with a
    positive weight, greedy rows the argmax, and the same token as the reference on all rows but those
    whose draw falls within the running sums' rounding of a boundary (at most 1% of the rows, and one)."""
    for batch in batches:
        seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen, device=DEVICE)
        offsets = torch.randint(0, 2**40, (batch,), generator=gen, device=DEVICE)
        for dtype in (torch.bfloat16, torch.float32):
            logits = randn(gen, batch, VOCAB + 128, dtype=dtype, scale=4.0)[:, :VOCAB]  # row-strided
            temperature = torch.rand(batch, generator=gen, device=DEVICE) * 1.5
            temperature[::3] = 0.0
            out = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
            K.samp.inverse_cdf_sample(logits, temperature, seeds, offsets, out=out)
            expected = K.sref.inverse_cdf_sample_ref(logits, temperature, seeds, offsets)
            valid = bool(((out >= 0) & (out < VOCAB)).all())
            greedy = temperature == 0
            x = logits.float()
            chosen = x.gather(1, out.clamp(0, VOCAB - 1).unsqueeze(1)).squeeze(1)
            ok_greedy = torch.equal(out[greedy], x[greedy].argmax(dim=1))
            ok_weight = bool((chosen > float("-inf")).all())
            differ = int((out != expected).sum())
            ok = valid and ok_greedy and ok_weight and differ <= max(1, batch // 100)
            record(
                "inverse_cdf_sample",
                {"B": batch, "dtype": str(dtype).split(".")[-1]},
                ok,
                differ,
                f"{differ} of {batch} tokens differ from the reference",
            )


def check_gemv(gen):
    for name, (n, k) in PROJECTIONS.items():
        weight = randn(gen, n, k, scale=0.05)
        for m in (1, 2, 4, 8, 16):
            x = randn(gen, m, k)
            out = poison(m, n)
            K.gemv.gemv(x, weight, out=out)
            check_close(
                "gemv",
                {"proj": name, "M": m},
                out,
                K.gref.gemv_ref(x, weight),
                str(K.gemv.gemv_config(m, n, k)),
            )
    n, k = PROJECTIONS["down"]
    weight = randn(gen, n, k, scale=0.05)
    for m in (1, 4, 16):
        # The MLP's down projection with silu(gate) * up computed as its input loads.
        gate_up = randn(gen, m, 2 * k)
        out = poison(m, n)
        config = K.gemv.preferred_config(m, n, k)
        K.gemv.gemv(gate_up, weight, out=out, config=config, gated=True)
        check_close(
            "gemv_gated",
            {"proj": "down", "M": m},
            out,
            K.gref.silu_mul_gemv_ref(gate_up, weight),
            str(config),
        )
    check_gemv_pdl_chain(gen)
    weight, bias = randn(gen, 300, 96), randn(gen, 300)
    for config in (None, K.gemv.GemvConfig(16, 32, 3, True), K.gemv.GemvConfig(8, 32, 2)):
        x = randn(gen, 5, 96)
        out = poison(5, 300)
        K.gemv.gemv(x, weight, bias, out=out, config=config)
        check_close("gemv", {"shape": "5x96x300+bias"}, out, K.gref.gemv_ref(x, weight, bias), str(config))


def check_gemv_pdl_chain(gen, depth=8):
    """GEMVs launched with PDL in a CUDA graph, each reading the previous one's output (their weights
    load before the wait for it): against the same chain of references, with the buffers poisoned."""
    n = k = HIDDEN
    weights = [randn(gen, n, k, scale=k**-0.5) for _ in range(depth)]
    for m, config in ((1, None), (4, K.gemv.GemvConfig(block_n=4, block_k=1024, num_warps=2)),
                      (16, K.gemv.GemvConfig(32, 128, 4, True))):  # fmt: skip
        x = randn(gen, m, k)
        outs = [poison(m, n) for _ in range(depth)]

        def chain(x=x, outs=outs, config=config):
            for i, weight in enumerate(weights):
                K.gemv.gemv(x if i == 0 else outs[i - 1], weight, out=outs[i], config=config, pdl=True)

        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        expected = x
        for weight in weights:
            expected = K.gref.gemv_ref(expected, weight)
        check_close("gemv_pdl_chain", {"M": m, "depth": depth}, outs[-1], expected, str(config))


def check_store(gen, head_dim, block_size, num_kv_heads=8, num_tokens=300):
    num_blocks = math.ceil(num_tokens * 1.5 / block_size) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    qkv = randn(gen, num_tokens, 4 * num_kv_heads, head_dim, scale=8.0)
    key, value = qkv[:, 2 * num_kv_heads : 3 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device=DEVICE) < 0.2] = -1
    for cache_dtype in (DTYPE, FP8):
        k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(cache_dtype)
        v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(cache_dtype)
        scales = fp8_scales() if cache_dtype == FP8 else (None, None)
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        K.aref.store_kvcache_ref(key, value, expected_k, expected_v, slots, *scales)
        K.attn.store_kvcache(key, value, k_cache, v_cache, slots, *scales)
        same = torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8)) and torch.equal(
            v_cache.view(torch.uint8), expected_v.view(torch.uint8)
        )
        record("store", {"D": head_dim, "bs": block_size, "cache": str(cache_dtype).split(".")[-1]}, same)


def decode_configs(quick: bool) -> dict:
    configs = {
        "merge_kernel": K.attn.MERGE_KERNEL_DECODE,
        "fused": K.attn.FUSED_DECODE,
        "fused_n32": K.attn.DecodeConfig(block_n=32),
        "fused_n16": K.attn.DecodeConfig(block_n=16),
        "fused_n32_min2": K.attn.DecodeConfig(block_n=32, min_split_tiles=2),
        "fused_n64_min2": K.attn.DecodeConfig(min_split_tiles=2),
        "fused_t2": K.attn.DecodeConfig(target_programs_per_sm=2),
        "fused_n32_w2": K.attn.DecodeConfig(block_n=32, num_warps=2),
        "fused_s2": K.attn.DecodeConfig(num_stages=2),
        # Whether loads are pipelined (s1 against s3/s4) and how tile size and warps move the FP8 cache.
        "fused_n32_s1": K.attn.DecodeConfig(block_n=32, num_stages=1),
        "fused_n32_s4": K.attn.DecodeConfig(block_n=32, num_stages=4),
        "fused_n16_w2": K.attn.DecodeConfig(block_n=16, num_warps=2),
        "fused_n32_w1": K.attn.DecodeConfig(block_n=32, num_warps=1),
        "fused_n128_w8": K.attn.DecodeConfig(block_n=128, num_warps=8),
        "fused_n32_w1_s2": K.attn.DecodeConfig(block_n=32, num_warps=1, num_stages=2),
        "fused_n16_w1_s4": K.attn.DecodeConfig(block_n=16, num_warps=1, num_stages=4),
        # Registers capped so that more one-warp programs fit on a multiprocessor (ptxas -v on the sm_90
        # FP8 kernel: 220 registers uncapped, 9 warps per SM; 168 spills 140 bytes, 128 spills 276; the
        # 16-key tiles use 176, capped at 128 they spill 24 bytes).
        "merge_n32_w1_s2_r168": K.attn.DecodeConfig(
            mode="merge_kernel", block_n=32, num_warps=1, num_stages=2, max_registers=168
        ),
        "merge_n32_w1_s2_r128": K.attn.DecodeConfig(
            mode="merge_kernel", block_n=32, num_warps=1, num_stages=2, max_registers=128
        ),
        "merge_n16_w1_s3_r128": K.attn.DecodeConfig(
            mode="merge_kernel", block_n=16, num_warps=1, num_stages=3, max_registers=128
        ),
        "merge_n16_w1_s4_r128": K.attn.DecodeConfig(
            mode="merge_kernel", block_n=16, num_warps=1, num_stages=4, max_registers=128
        ),
        "merge_n32_w2_s2_r128": K.attn.DecodeConfig(
            mode="merge_kernel", block_n=32, num_warps=2, num_stages=2, max_registers=128
        ),
        **{n: c for n, c in balanced_decode_configs().items() if n == "balanced" or n.endswith("_m4")},
        "fp8_balanced": K.attn.FP8_BALANCED_DECODE,
    }
    quick_names = ("merge_kernel", "fused", "fused_n32", "balanced", "fp8_balanced")
    return {k: configs[k] for k in quick_names} if quick else configs


def balanced_decode_configs() -> dict:
    """Balanced-mode variants (one split length per batch, from its longest sequence): the bf16 tiles,
    FP8's four-warp tiles and its capped one-warp tiles, each with a floor of 1, 2 or 4 splits (the
    one-warp tiles up to 16) and a split target of 4 or 8 programs per SM."""
    tiles = {
        "n64": {},
        "n32": {"block_n": 32},
        "n16_w1_r128": {"block_n": 16, "num_warps": 1, "max_registers": 128},
    }
    configs = {"balanced": K.attn.DecodeConfig(mode="balanced")}
    for tile, spec in tiles.items():
        for target in (4, 8):
            for floor in (1, 2, 4, 8, 16) if tile.startswith("n16") else (1, 2, 4):
                configs[f"balanced_{tile}_t{target}_m{floor}"] = K.attn.DecodeConfig(
                    mode="balanced", target_programs_per_sm=target, min_splits=floor, **spec
                )
    return configs


def decode_reference(query, paged, seq_lens, scale) -> torch.Tensor:
    """The reference of one decode call on ``paged``."""
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    return K.aref.paged_attention_ref(
        query, paged.k_cache, paged.v_cache, qsl, seq_lens, paged.block_tables, scale, **paged.scales
    )


def check_decode(
    gen, head_dim, block_size, group, batch, max_ctx, num_kv_heads, config_name, config, fp8=False
):
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device=DEVICE)
    lens[0] = max_ctx
    if batch > 1:
        lens[-1] = 0
    paged = Paged(gen, lens.tolist(), num_kv_heads, head_dim, block_size, fp8_scales() if fp8 else None)
    num_heads = num_kv_heads * group
    query = randn(gen, batch, num_heads + 2 * num_kv_heads, head_dim)[:, :num_heads]
    out = poison(batch, num_heads, head_dim)
    scale = head_dim**-0.5
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
    K.attn.paged_decode_attention(*args, out=out, config=config, **paged.scales)
    expected = decode_reference(query, paged, paged.seq_lens, scale)
    splits = K.attn.decode_num_splits(
        batch, num_kv_heads, paged.block_tables.shape[1] * block_size, num_sms(), config
    )
    zeros_ok = bool((out[paged.seq_lens == 0] == 0).all())
    params = {
        "cfg": config_name,
        "kv": "fp8" if fp8 else "bf16",
        "D": head_dim,
        "bs": block_size,
        "G": group,
        "Hkv": num_kv_heads,
        "B": batch,
        "ctx": max_ctx,
    }
    nan = bool(out.isnan().any())
    err = rel_error(out, expected)
    record("decode", params, (not nan) and err < TOLERANCE and zeros_ok, err, f"grid splits={splits}")


def check_decode_graph(gen, config_name, config, fp8=False, pdl=False):
    batch, num_heads, num_kv_heads, head_dim, block_size = 8, 16, 8, 128, 16
    paged = Paged(gen, [2048] * batch, num_kv_heads, head_dim, block_size, fp8_scales() if fp8 else None)
    query = randn(gen, batch, num_heads, head_dim)
    lens = paged.seq_lens.clone()
    out = torch.empty_like(query)
    workspace = K.attn.DecodeWorkspace.allocate(
        batch, num_heads, num_kv_heads, head_dim, paged.block_tables.shape[1] * block_size, DEVICE, config
    )
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, lens, head_dim**-0.5)

    def call():
        K.attn.paged_decode_attention(
            *args, out=out, workspace=workspace, config=config, pdl=pdl, **paged.scales
        )

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    worst, ok = 0.0, True
    for _ in range(4):
        new = torch.randint(0, 2049, (batch,), generator=gen, device=DEVICE).int()
        new[0] = 0
        lens.copy_(new)
        query.copy_(torch.randn(query.shape, generator=gen, device=DEVICE))
        out.fill_(float("nan"))
        graph.replay()
        expected = decode_reference(query, paged, lens, head_dim**-0.5)
        err = rel_error(out, expected)
        worst = max(worst, err)
        ok = ok and not bool(out.isnan().any()) and err < TOLERANCE and bool((out[0] == 0).all())
    ok = ok and not bool(workspace.counters.any())
    params = {"cfg": config_name, "kv": "fp8" if fp8 else "bf16", "pdl": pdl, "B": batch}
    record("graph", params, ok, worst, "decode replayed with new seq_lens")


# The names of the engine's default prefill tilings in prefill_configs (16-bit and FP8 caches).
PREFILL_DEFAULT, PREFILL_FP8_DEFAULT = "gqa m64n32w4s3 (default)", "gqa m64n64w4s3 (fp8 default)"


def prefill_configs(quick: bool) -> dict:
    P = K.attn.PrefillConfig
    configs = {
        "m64n64w4s3": P(),
        "m64n64w4s4": P(num_stages=4),
        "m64n128w4s3": P(block_n=128),
        "m128n64w4s3": P(block_m=128),
        "m128n64w8s3": P(block_m=128, num_warps=8),
        "m128n128w8s3": P(block_m=128, block_n=128, num_warps=8),
        "m128n64w8s4": P(block_m=128, num_warps=8, num_stages=4),
        PREFILL_FP8_DEFAULT: P(pack_gqa=True),
        "gqa m128n64w8s3": P(block_m=128, num_warps=8, pack_gqa=True),
        "gqa m128n128w8s3": P(block_m=128, block_n=128, num_warps=8, pack_gqa=True),
        "gqa m128n64w4s3": P(block_m=128, pack_gqa=True),
        "gqa m256n64w8s3": P(block_m=256, num_warps=8, pack_gqa=True),
        "m64n32w4s3": P(block_n=32),
        PREFILL_DEFAULT: P(block_n=32, pack_gqa=True),
        "m64n64w4s2": P(num_stages=2),
        "gqa m64n64w4s2": P(num_stages=2, pack_gqa=True),
        "gqa m64n64w4s4": P(num_stages=4, pack_gqa=True),
        "gqa m64n64w8s3": P(num_warps=8, pack_gqa=True),
    }
    if quick:
        return {k: configs[k] for k in (PREFILL_DEFAULT, PREFILL_FP8_DEFAULT, "m64n64w4s3")}
    return configs


def check_prefill(
    gen,
    head_dim,
    block_size,
    group,
    batch,
    max_q,
    prefix,
    num_kv_heads,
    config_name,
    config,
    fp8=False,
    padding_rows=2,
):
    host_gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen, device=DEVICE)))
    q_lens = torch.randint(1, max_q + 1, (batch,), generator=host_gen).tolist()
    q_lens[0] = max_q
    prefixes = (
        torch.randint(0, 3 * max_q + 1, (batch,), generator=host_gen).tolist() if prefix else [0] * batch
    )
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    paged = Paged(gen, seq_lens, num_kv_heads, head_dim, block_size, fp8_scales() if fp8 else None)
    num_heads = num_kv_heads * group
    num_tokens = sum(q_lens) + padding_rows
    query = randn(gen, num_tokens, num_heads, head_dim)
    qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = poison(num_tokens, num_heads, head_dim)
    scale = head_dim**-0.5
    args = (query, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables)
    K.attn.paged_prefill_attention(*args, max(q_lens), scale, out=out, config=config, **paged.scales)
    expected = K.aref.paged_attention_ref(*args, scale, **paged.scales)
    params = {
        "cfg": config_name,
        "kv": "fp8" if fp8 else "bf16",
        "D": head_dim,
        "bs": block_size,
        "G": group,
        "B": batch,
        "max_q": max_q,
        "prefix": bool(prefix),
    }
    check_close("prefill", params, out, expected)


def run_correctness(quick: bool):
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    sections = [
        ("elementwise", lambda: check_elementwise(gen)),
        ("qk_norm_rope_store", lambda: check_qk_norm_rope_store(gen)),
        ("sampler", lambda: check_sampler(gen)),
        ("gemv", lambda: check_gemv(gen)),
        ("store", lambda: [check_store(gen, d, bs) for d in (64, 128) for bs in (16, 256)]),
        ("decode", lambda: run_decode_correctness(gen, quick)),
        ("prefill", lambda: run_prefill_correctness(gen, quick)),
    ]
    for name, section in sections:
        guarded(f"correctness/{name}", section)
    failures = [c for c in RESULTS["correctness"] if not c["pass"]]
    RESULTS["correctness_summary"] = {"cases": len(RESULTS["correctness"]), "failures": len(failures)}
    TABLE.append(
        ("correctness", f"{len(RESULTS['correctness']) - len(failures)}/{len(RESULTS['correctness'])} PASS")
    )


def run_decode_correctness(gen, quick):
    configs = decode_configs(quick)
    shapes = [
        # head_dim, block_size, group, batch, max_ctx, num_kv_heads
        (128, 16, 2, 1, 600, 8),
        (128, 16, 2, 8, 4096, 8),
        (64, 256, 4, 7, 1000, 4),
        (128, 64, 8, 64, 333, 2),
        (64, 16, 1, 256, 1024, 4),
        (128, 16, 2, 1, 1, 8),
        (128, 256, 7, 3, 2000, 2),
    ]
    # Every shape through the schemes and the FP8 default; the other variants (timed at head_dim 128,
    # block 16) on the timed shapes' kind, a long context and a GQA group of 7 (padded query rows).
    schemes = ("merge_kernel", "fused", "balanced", "fp8_balanced")
    for name, config in configs.items():
        for shape in shapes if name in schemes else (shapes[0], shapes[1], shapes[6]):
            check_decode(gen, *shape, name, config)
    for name in schemes:
        for shape in shapes[:4]:
            check_decode(gen, *shape, name, configs[name], fp8=True)
        check_decode_graph(gen, name, configs[name])
        check_decode_graph(gen, name, configs[name], pdl=True)
        check_decode_graph(gen, name, configs[name], fp8=True)


def run_prefill_correctness(gen, quick):
    shapes = [
        # head_dim, block_size, group, batch, max_q, prefix, num_kv_heads
        (128, 16, 2, 3, 300, False, 8),
        (128, 16, 2, 3, 300, True, 8),
        (64, 256, 4, 8, 77, True, 2),
        (128, 64, 8, 1, 1024, False, 1),
        (64, 16, 1, 4, 129, True, 4),
        (128, 16, 7, 2, 100, True, 2),
    ]
    # The packed configurations also see groups of 8 and 7 (masked rows of a padded group).
    for name, config in prefill_configs(quick).items():
        if "default" in name:
            chosen = shapes
        elif config.pack_gqa:
            chosen = (shapes[0], shapes[1], shapes[3], shapes[5])
        else:
            chosen = shapes[:2]
        for shape in chosen:
            check_prefill(gen, *shape, name, config)
    for shape in shapes[:3]:
        check_prefill(gen, *shape, "fp8 default", K.attn.FP8_PREFILL, fp8=True)
        check_prefill(gen, *shape, "gqa m128n64w8", K.attn.PrefillConfig(128, 64, 8, 3, True), fp8=True)
    # Decode-shaped rows through the prefill kernel (no padding rows: the reference's batched decode path
    # takes one query row per sequence).
    check_prefill(gen, 128, 16, 2, 4, 1, True, 8, "short", K.attn.SHORT_QUERY_PREFILL, padding_rows=0)


# ----------------------------------------------------------------------------------------------------
# 2. Timing
# ----------------------------------------------------------------------------------------------------


def time_ceiling():
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = bench(partial(dst.copy_, src), rep=100)
    tbps = 2 * n * 2 / ms / 1e9
    RESULTS["timing"]["copy_bandwidth_tbps"] = tbps
    TABLE.append(("device-to-device copy (read+write)", f"{tbps:.2f} TB/s"))


def time_elementwise(gen, quick):
    res = {}
    cos_sin = cos_sin_table(4096, HEAD_DIM)
    weight = randn(gen, HIDDEN)
    norm_w = randn(gen, HEAD_DIM)
    # 16,384 tokens: the benchmark's prefill step, where these kernels are bandwidth-bound.
    for tokens in (1, 256) if quick else (1, 256, 16384):
        x, residual = randn(gen, tokens, HIDDEN), randn(gen, tokens, HIDDEN)
        out = torch.empty_like(x)
        gate_up = randn(gen, tokens, 2 * INTER)
        act = torch.empty(tokens, INTER, device=DEVICE, dtype=DTYPE)
        qkv = randn(gen, tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEVICE)
        block_size = 16
        num_blocks = 2 * math.ceil(tokens / block_size) + 2
        shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = (
            torch.zeros(shape, device=DEVICE, dtype=DTYPE),
            torch.zeros(shape, device=DEVICE, dtype=DTYPE),
        )
        k8, v8 = k_cache.to(FP8), v_cache.to(FP8)
        scales = fp8_scales()
        if tokens > 256:  # a prefill step's tokens fill consecutive slots of their blocks
            slots = torch.arange(tokens, device=DEVICE)
        else:
            slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
        rope_args = (positions, cos_sin, HEADS, KV_HEADS, HEAD_DIM, norm_w, norm_w, EPS)
        cases = {
            "rms_norm": (
                partial(K.elem.rms_norm, x, weight, EPS, out=out),
                partial(K.eref.rms_norm_ref, x, weight, EPS),
                2 * x.numel() * 2,
            ),
            "add_rms_norm": (
                partial(K.elem.add_rms_norm, x, residual, weight, EPS),
                partial(K.eref.add_rms_norm_ref, x, residual, weight, EPS),
                4 * x.numel() * 2,
            ),
            "silu_and_mul": (
                partial(K.elem.silu_and_mul, gate_up, out=act),
                partial(K.eref.silu_and_mul_ref, gate_up),
                (gate_up.numel() + act.numel()) * 2,
            ),
            "qk_norm_rope_store": (
                partial(K.elem.qk_norm_rope_store, qkv, *rope_args, k_cache, v_cache, slots),
                partial(K.eref.qk_norm_rope_store_ref, qkv, *rope_args, k_cache, v_cache, slots),
                (qkv.numel() + HEADS * HEAD_DIM * tokens + 2 * KV_HEADS * HEAD_DIM * tokens) * 2,
            ),
            "qk_norm_rope_store fp8": (
                partial(K.elem.qk_norm_rope_store, qkv, *rope_args, k8, v8, slots, *scales),
                partial(K.eref.qk_norm_rope_store_ref, qkv, *rope_args, k8, v8, slots, *scales),
                (qkv.numel() + HEADS * HEAD_DIM * tokens) * 2 + 2 * KV_HEADS * HEAD_DIM * tokens,
            ),
        }
        if not quick and tokens == 256:
            for per_program in (1, 2, 4, 8, 16):
                cases[f"qk_norm_rope_store hpp={per_program}"] = (
                    partial(
                        K.elem.qk_norm_rope_store,
                        qkv,
                        *rope_args,
                        k_cache,
                        v_cache,
                        slots,
                        heads_per_program=per_program,
                    ),
                    None,
                    None,
                )
        for name, (kernel, reference, moved) in cases.items():
            entry = {}
            try:
                entry["triton_us"] = graph_bench(kernel) * 1e3
                if tokens == 1 and reference is not None:
                    # Back-to-back calls with programmatic dependent launch: the launch gaps PDL hides.
                    entry["triton_pdl_us"] = graph_bench(partial(kernel, pdl=True)) * 1e3
                if reference is not None:
                    # The store's reference picks the valid slots with a boolean mask (a host sync),
                    # which a CUDA graph cannot capture; a failed capture also breaks later ones.
                    eager = name.startswith("qk_norm_rope_store")
                    entry["torch_ref_us"] = (bench(reference) if eager else graph_bench(reference)) * 1e3
                if moved:
                    entry["tbps"] = moved / entry["triton_us"] / 1e6
            except Exception as exc:  # noqa: BLE001 - one case failing leaves the others
                entry["error"] = repr(exc)[:300]
            res[f"{name} T={tokens}"] = entry
            line = (
                f"{entry.get('triton_us', float('nan')):.2f} us"
                + (f" (pdl {entry['triton_pdl_us']:.2f})" if "triton_pdl_us" in entry else "")
                + (f" ({entry['tbps']:.2f} TB/s)" if "tbps" in entry else "")
                + (f", torch ref {entry['torch_ref_us']:.2f} us" if "torch_ref_us" in entry else "")
                + (" ERROR" if "error" in entry else "")
            )
            TABLE.append((f"{name} T={tokens} (graph)", line))
    RESULTS["timing"]["elementwise"] = res


def torch_sampler(logits, temperature):
    """The torch baseline: softmax of logits / T, an exponential race, argmax (vLLM's sampler)."""
    probs = (logits / temperature.unsqueeze(1)).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_().clamp_min_(1e-10)
    return probs.div_(noise).argmax(dim=-1)


def time_sampler(gen, quick):
    res = {}
    for batch in SAMPLER_BATCHES:
        logits = randn(gen, batch, VOCAB, scale=4.0)
        temperature = torch.full((batch,), 0.8, device=DEVICE)
        seeds = torch.arange(batch, device=DEVICE)
        offsets = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
        out = torch.empty(batch, dtype=torch.int64, device=DEVICE)
        entry = {"torch_us": graph_bench(partial(torch_sampler, logits, temperature)) * 1e3}
        for chunk in (None, 1024, 2048, 4096) if not quick else (None,):
            label = f"chunk {chunk}" if chunk else "default"
            fn = partial(
                K.samp.inverse_cdf_sample, logits, temperature, seeds, offsets, out=out, chunk_size=chunk
            )
            entry[f"triton_us {label}"] = graph_bench(fn) * 1e3
        greedy = torch.zeros(batch, device=DEVICE)
        entry["triton_greedy_us"] = (
            graph_bench(partial(K.samp.inverse_cdf_sample, logits, greedy, seeds, offsets, out=out)) * 1e3
        )
        entry["torch_argmax_us"] = graph_bench(partial(torch.argmax, logits, dim=-1)) * 1e3
        entry["logits_read_tbps"] = logits.numel() * 2 / entry["triton_us default"] / 1e6
        res[f"B{batch}"] = entry
        TABLE.append(
            (
                f"sampler B={batch} x {VOCAB} (graph)",
                f"inverse CDF {entry['triton_us default']:.1f} us "
                f"({entry['logits_read_tbps']:.2f} TB/s logits), "
                f"greedy {entry['triton_greedy_us']:.1f} us; torch softmax+exp+argmax "
                f"{entry['torch_us']:.1f} us, torch argmax {entry['torch_argmax_us']:.1f} us",
            )
        )
    RESULTS["timing"]["sampler"] = res


def gemv_candidates(m: int, quick: bool) -> list:
    C = K.gemv.GemvConfig
    if m <= 4:
        configs = [
            C(8, 512),
            C(8, 1024),
            C(4, 1024, num_warps=2),
            C(16, 256),
            C(8, 512, split_k=2),
            C(8, 256, split_k=4),
            C(16, 512, num_warps=8),
            C(32, 128, use_dot=True),
        ]
    else:
        configs = [
            C(16, 128, use_dot=True),
            C(32, 128, use_dot=True),
            C(64, 128, use_dot=True),
            C(16, 256, split_k=2, use_dot=True),
            C(32, 128, split_k=4, use_dot=True),
            C(64, 64, split_k=2, use_dot=True),
            C(32, 256, use_dot=True, num_stages=4),
            C(8, 256),
        ]
    return configs[:3] if quick else configs


def time_gemv(gen, quick):
    res = {}
    sms = num_sms()
    for name, (n, k) in PROJECTIONS.items():
        weight = randn(gen, n, k, scale=0.05)
        bytes_read = weight.numel() * 2
        for m in (1, 2, 4, 8, 16):
            x = randn(gen, m, k)
            out = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
            expected = torch.nn.functional.linear(x, weight)
            entry = {"cublas_us": graph_bench(partial(torch.nn.functional.linear, x, weight)) * 1e3}
            default = K.gemv.gemv_config(m, n, k, sms)
            entry["default_config"] = str(default)
            entry["default_us"] = graph_bench(partial(K.gemv.gemv, x, weight, out=out, config=default)) * 1e3
            try:
                pdl = partial(K.gemv.gemv, x, weight, out=out, config=default, pdl=True)
                entry["default_pdl_us"] = graph_bench(pdl) * 1e3
            except Exception as exc:  # noqa: BLE001 - PDL is optional
                entry["default_pdl_error"] = repr(exc)[:200]
            sweep = {}
            for config in gemv_candidates(m, quick):
                try:
                    us = graph_bench(partial(K.gemv.gemv, x, weight, out=out, config=config)) * 1e3
                    sweep[str(config)] = {"us": us, "ok": rel_error(out, expected) < TOLERANCE}
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                    sweep[str(config)] = {"error": repr(exc)[:200]}
            timed = {c: v["us"] for c, v in sweep.items() if v.get("ok")}
            best = min(timed, key=timed.get) if timed else None
            entry.update(sweep=sweep, best_config=best, best_us=timed.get(best))
            for key in ("cublas_us", "default_us", "best_us"):
                if entry.get(key):
                    entry[key.replace("_us", "_tbps")] = bytes_read / entry[key] / 1e6
            res[f"{name} M={m}"] = entry
            TABLE.append(
                (
                    f"gemv {name} {k}->{n} M={m} (graph)",
                    f"cuBLAS {entry['cublas_us']:.1f} us ({entry['cublas_tbps']:.2f} TB/s), triton default "
                    f"{entry['default_us']:.1f} us ({entry['default_tbps']:.2f}), best "
                    + (f"{entry['best_us']:.1f} us ({entry['best_tbps']:.2f}) {best}" if best else "none"),
                )
            )
        del weight
    RESULTS["timing"]["gemv"] = res


GEMM_ROWS = (32, 64, 128, 256)
# Enough distinct copies of a weight that back-to-back calls read it from DRAM, as the engine's layers
# do, rather than from the 50 MB L2.
ROTATED_WEIGHT_BYTES = 160 << 20


def rotating(fn, *operands_per_copy) -> Callable:
    """A call of ``fn`` that takes the next copy of its operands at each call."""
    state = {"i": 0}

    def call():
        operands = operands_per_copy[state["i"] % len(operands_per_copy)]
        state["i"] += 1
        return fn(*operands)

    return call


def time_gemm(gen, quick):
    """The projections at the workload's mid and large decode batches (32-256 rows), each captured in a
    graph of back-to-back calls over rotating weight copies (read from DRAM, as the engine's layers
    read them): cuBLAS (the engine's [N, K] weights, and the same stored [K, N]), and the strided-batched
    split-K product of float32 partials at 2 and 4 splits.
    For the projections that end a residual branch (o, down) also the engine's two ways through the
    branch's end, under PDL: the projection (after silu_and_mul for down) then add_rms_norm, against
    ``residual_branch_linear`` (split-K where ``residual_branch_splits`` says) then the norm that sums
    the partials."""
    from nanoinfer.layers import kernels as layer_kernels

    kernels = layer_kernels.triton_kernels(pdl=True)
    res = {}
    bandwidth = RESULTS["timing"].get("copy_bandwidth_tbps") or 4.2
    norm_weight = randn(gen, HIDDEN)
    for name, (n, k) in PROJECTIONS.items():
        if name == "lm_head":
            continue
        copies = max(2, ROTATED_WEIGHT_BYTES // (n * k * 2))
        weights = [(randn(gen, n, k, scale=0.05),) for _ in range(copies)]
        # The same weights stored [K, N]: cuBLAS's other operand layout (NN), whose kernels differ.
        transposed = [(w.t().contiguous(),) for (w,) in weights]
        for m in GEMM_ROWS if not quick else (64, 256):
            x = randn(gen, m, k)
            entry = {
                "floor_us": n * k * 2 / bandwidth / 1e6,
                "cublas_us": graph_bench(rotating(partial(torch.nn.functional.linear, x), *weights)) * 1e3,
                "cublas_kn_us": graph_bench(rotating(partial(torch.mm, x), *transposed)) * 1e3,
            }
            for splits in (2, 4):
                bmm = partial(layer_kernels.split_k_linear, x, splits=splits)
                entry[f"split{splits}_us"] = graph_bench(rotating(bmm, *weights)) * 1e3
            if name in ("o", "down"):
                gated = name == "down"
                x_in = randn(gen, m, 2 * k) if gated else x
                residual = randn(gen, m, HIDDEN)

                def before(w, x_in=x_in, residual=residual, gated=gated):
                    y = (kernels.silu_mul_linear if gated else kernels.linear)(x_in, w)
                    return kernels.add_rms_norm(y, residual, norm_weight, EPS)

                def after(w, x_in=x_in, residual=residual, gated=gated):
                    y = kernels.residual_branch_linear(x_in, w, None, gated)
                    if isinstance(y, layer_kernels.SplitKPartials):
                        return kernels.add_partials_rms_norm(y.parts, residual, norm_weight, EPS)
                    return kernels.add_rms_norm(y, residual, norm_weight, EPS)

                saved = residual.clone()
                expected, _ = before(weights[0][0])
                expected = expected.clone()
                residual.copy_(saved)
                got, _ = after(weights[0][0])
                entry["branch_end_ok"] = rel_error(got, expected) < TOLERANCE
                entry["branch_end_splits"] = layer_kernels.residual_branch_splits(m, n, k)
                entry["branch_end_before_us"] = graph_bench(rotating(before, *weights)) * 1e3
                entry["branch_end_after_us"] = graph_bench(rotating(after, *weights)) * 1e3
            res[f"{name} M={m}"] = entry
            text = (
                f"cuBLAS {entry['cublas_us']:.1f} us ([K, N] weights {entry['cublas_kn_us']:.1f}), "
                f"split-K 2 / 4 {entry['split2_us']:.1f} / "
                f"{entry['split4_us']:.1f} us, weight read {entry['floor_us']:.1f} us"
            )
            if "branch_end_after_us" in entry:
                text += (
                    f"; +add_rms_norm {entry['branch_end_before_us']:.1f} -> "
                    f"{entry['branch_end_after_us']:.1f} us (splits {entry['branch_end_splits']}"
                    f"{'' if entry['branch_end_ok'] else ', MISMATCH'})"
                )
            TABLE.append((f"gemm {name} {k}->{n} M={m} (graph, DRAM weights)", text))
        del weights, transposed
    RESULTS["timing"]["gemm"] = res


def time_decode(gen, quick):
    res = {}
    configs = decode_configs(quick)
    block_size = 16
    for fp8 in (False, True):
        kv = "fp8" if fp8 else "bf16"
        for batch, ctx in DECODE_SHAPES:
            paged = Paged(gen, [ctx] * batch, KV_HEADS, HEAD_DIM, block_size, fp8_scales() if fp8 else None)
            query = randn(gen, batch, HEADS, HEAD_DIM)
            out = torch.empty_like(query)
            args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
            entry = {}
            width = paged.block_tables.shape[1] * block_size
            # "default": the configuration the engine gets for this batch and cache dtype.
            for name, config in {"default": None, **configs}.items():
                workspace = K.attn.DecodeWorkspace.allocate(
                    batch, HEADS, KV_HEADS, HEAD_DIM, width, DEVICE, config, cache_dtype=paged.k_cache.dtype
                )
                fn = partial(
                    K.attn.paged_decode_attention,
                    *args,
                    out=out,
                    workspace=workspace,
                    config=config,
                    **paged.scales,
                )
                try:
                    us = graph_bench(fn) * 1e3
                    entry[name] = {"us": us, "kv_tbps": paged.kv_bytes / us / 1e6}
                except Exception as exc:  # noqa: BLE001
                    entry[name] = {"error": repr(exc)[:300]}
            if batch == 1:
                # The engine's block tables are as wide as the longest allowed sequence: the grid's split
                # count follows that width, the fused kernel's used splits follow seq_len.
                wide = Paged(
                    gen,
                    [ctx],
                    KV_HEADS,
                    HEAD_DIM,
                    block_size,
                    fp8_scales() if fp8 else None,
                    width=4096 // 16,
                )
                wide_args = (
                    query,
                    wide.k_cache,
                    wide.v_cache,
                    wide.block_tables,
                    wide.seq_lens,
                    HEAD_DIM**-0.5,
                )
                for name in ("merge_kernel", "fused"):
                    fn = partial(
                        K.attn.paged_decode_attention,
                        *wide_args,
                        out=out,
                        config=configs[name],
                        **wide.scales,
                    )
                    us = graph_bench(fn) * 1e3
                    entry[f"{name} table4096"] = {"us": us, "kv_tbps": wide.kv_bytes / us / 1e6}
                    if not quick:
                        fn = partial(fn, pdl=True)
                        entry[f"{name} table4096 pdl"] = {"us": graph_bench(fn) * 1e3}
            res[f"{kv} B={batch} ctx={ctx}"] = entry
            timed = {k: v["us"] for k, v in entry.items() if "us" in v and "table" not in k}
            best = min(timed, key=timed.get)
            default = entry["default"]
            TABLE.append(
                (
                    f"decode {kv} B={batch} ctx={ctx} (graph)",
                    f"default {default['us']:.1f} us ({default['kv_tbps']:.2f} TB/s KV), "
                    f"best {best} {timed[best]:.1f} us",
                )
            )
            del paged
    RESULTS["timing"]["decode"] = res


def workload_decode_lengths(batch: int, seed: int = 0, num_seqs: int = 256) -> list[int]:
    """Context lengths of the bench workload's decode step at which ``batch`` of its ``num_seqs``
    sequences (prompts and outputs of 100-1,024 tokens each) are still running, in random order."""
    rng = random.Random(seed)
    prompts = [rng.randint(100, 1024) for _ in range(num_seqs)]
    outputs = [rng.randint(100, 1024) for _ in range(num_seqs)]
    running = sorted(range(num_seqs), key=lambda i: -outputs[i])[:batch]
    step = outputs[running[-1]] - 1
    lengths = [prompts[i] + step for i in running]
    rng.shuffle(lengths)
    return lengths


def previous_decode_config(batch: int, fp8: bool):
    """The engine's decode configuration before balanced mode (tree 89acc5d, FP8 full grids: 16-key
    one-warp tiles capped at 128 registers, unsplit; FP8 below 12 programs per SM: 32-key tiles)."""
    programs = batch * KV_HEADS
    if not fp8 or programs < 3 * num_sms():
        return K.attn.MERGE_KERNEL_DECODE
    if programs >= 12 * num_sms():
        return K.attn.DecodeConfig(
            mode="merge_kernel", block_n=16, num_warps=1, num_stages=3, max_registers=128
        )
    return K.attn.DecodeConfig(block_n=32)


def time_checked_decode(args, out, expected, paged, config) -> dict:
    """One decode configuration on ``args`` (4096-token tables, PDL on as in the engine): its output
    checked against ``expected``, then timed in CUDA-graph replay; an exception is recorded instead."""
    batch = out.shape[0]
    workspace = K.attn.DecodeWorkspace.allocate(
        batch, HEADS, KV_HEADS, HEAD_DIM, 4096, DEVICE, config, cache_dtype=paged.k_cache.dtype
    )
    fn = partial(
        K.attn.paged_decode_attention, *args, out=out, workspace=workspace, config=config, pdl=True,
        **paged.scales,
    )  # fmt: skip
    try:
        out.fill_(float("nan"))
        fn()
        err = rel_error(out, expected)
        ok = err < TOLERANCE and not bool(out.isnan().any())
        us = graph_bench(fn) * 1e3
        return {"us": us, "kv_tbps": paged.kv_bytes / us / 1e6, "err": err, "ok": ok}
    except Exception as exc:  # noqa: BLE001
        return {"error": repr(exc)[:300]}


def time_decode_mixed(gen, quick):
    """Decode over the bench workload's mixed context lengths (``workload_decode_lengths``) with the
    engine's 4096-token tables, every batch from 1 to 256 rows in steps: the previous default, today's
    default and every balanced variant, bf16 and FP8, in CUDA-graph replay; KV TB/s over the bytes read."""
    res = {}
    variants = balanced_decode_configs()
    if quick:
        variants = {k: variants[k] for k in ("balanced",)}
    block_size = 16
    for fp8 in (False, True):
        kv = "fp8" if fp8 else "bf16"
        for batch in (2, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
            lens = workload_decode_lengths(batch)
            paged = Paged(
                gen, lens, KV_HEADS, HEAD_DIM, block_size, fp8_scales() if fp8 else None, width=4096 // 16
            )
            query = randn(gen, batch, HEADS, HEAD_DIM)
            out = torch.empty_like(query)
            args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
            expected = decode_reference(query, paged, paged.seq_lens, HEAD_DIM**-0.5)
            entry = {"max_len": max(lens), "mean_len": sum(lens) / batch}
            configs = {"previous": previous_decode_config(batch, fp8), "default": None, **variants}
            for name, config in configs.items():
                entry[name] = time_checked_decode(args, out, expected, paged, config)
                if not entry[name].get("ok", True):
                    record("decode_mixed", {"cfg": name, "kv": kv, "B": batch}, False, entry[name]["err"])
            res[f"{kv} B={batch}"] = entry
            timed = {k: v["us"] for k, v in entry.items() if isinstance(v, dict) and "us" in v}
            best = min(timed, key=timed.get)
            nan = float("nan")
            TABLE.append(
                (
                    f"decode mixed {kv} B={batch} (max {max(lens)}, mean {sum(lens) / batch:.0f})",
                    f"previous {timed.get('previous', nan):.1f} us, default {timed.get('default', nan):.1f} "
                    f"({entry['default'].get('kv_tbps', 0):.2f} TB/s), best {best} {timed[best]:.1f}",
                )
            )
            del paged
    RESULTS["timing"]["decode_mixed"] = res


def cuda_decode_resources(config) -> dict:
    """Registers per thread, dynamic shared memory and resident programs per SM of ``cuda_decode``'s
    kernel as ``config`` compiles it (bf16 queries, Qwen3-0.6B's head shape, 16-slot blocks)."""
    import ctypes

    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    from nanoinfer.kernels import cuda_decode

    cache = torch.zeros(1, 16, KV_HEADS, HEAD_DIM, device=DEVICE).to(FP8)
    query = torch.zeros(1, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    ints = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    kernel = cuda_decode.kernel_for(query, cache, cache, query, ints, ints[0], config.cuda_tiling)
    if kernel is None:
        return {"error": "not compiled"}
    libcuda = _get_gpu_runtime_library()
    registers, programs = ctypes.c_int(), ctypes.c_int()
    _check_cuda(libcuda.cuFuncGetAttribute(ctypes.byref(registers), 4, kernel.function.func))  # NUM_REGS
    _check_cuda(
        libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(programs), kernel.function.func, 32, ctypes.c_size_t(kernel.shared_mem)
        )
    )
    return {"registers": registers.value, "shared_mem": kernel.shared_mem, "programs_per_sm": programs.value}


def time_decode_fp8_kernels(gen, quick, write_config=False):
    """The FP8 decode kernels side by side: Triton's balanced one-warp tiles (``FP8_BALANCED_DECODE``)
    and the engine's default (``merge_kernel``'s Triton tiles at one row) against
    ``cuda_decode``'s kernel (``FP8_CUDA_DECODE``) with 2 or 3 tiles in flight in registers
    (``cuda_d*``) or 2 to 4 staged in shared memory (``cuda_s*``), split targets of 32, 64 or 128
    programs per SM, registers capped at 128 (16 warps per SM) or not, the grid's KV heads first
    (``*_h``) or its sequences, FP8 converted by bit moves (``*bits*``) or ``cvt``, the accumulators
    rescaled lazily (``*lazy*``) or every tile, over the bench
    workload's mixed lengths from 1 to 256 rows (4096-token tables) and uniform 16 x 1536, 64 / 256 x
    1024; every output checked against the reference;
    CUDA-graph replay, PDL on as in the engine. ``resources``: each CUDA variant's registers per thread,
    shared memory per program and programs per SM (the driver's occupancy calculator). With
    ``write_config``, ``write_tuned_fp8_decode`` then picks this GPU model's tiles."""
    res = {}
    variants = {
        "default": None,
        "merge_kernel": K.attn.MERGE_KERNEL_DECODE,
        "triton": K.attn.FP8_BALANCED_DECODE,
    }
    tilings = (  # (tiles in flight, programs per SM, register cap, staged, KV heads first)
        (2, 32, None, False, False),
        (2, 64, None, False, False),
        (2, 128, None, False, False),
        (3, 64, None, False, False),
        (2, 64, 128, False, False),
        (2, 64, None, False, True),
        (2, 64, None, True, False),
        (3, 32, None, True, False),
        (3, 64, None, True, False),
        (4, 64, None, True, False),
        (2, 32, None, False, True),
        (2, 128, None, False, True),
        (2, 64, None, True, True),
        (3, 32, None, True, True),
        (3, 64, None, True, True),
        (3, 128, None, True, True),
        (4, 64, None, True, True),
    )
    for depth, target, registers, staged, heads_first in tilings:
        config = replace(
            K.attn.FP8_CUDA_DECODE, target_programs_per_sm=target, num_stages=depth, max_registers=registers,
            stage_in_shared=staged, kv_heads_first=heads_first,
        )  # fmt: skip
        name = f"cuda_{'s' if staged else 'd'}{depth}_t{target}" + (f"_r{registers}" if registers else "")
        variants[name + ("_h" if heads_first else "")] = config
    # FP8 to float16 by bit moves instead of cvt (K and V, K only, V only), and the accumulators rescaled
    # lazily, on the engine's tiles; bit moves on the staged ones.
    for convert in ("bits", "bits_keys", "bits_values"):
        variants[f"cuda_{convert}"] = replace(K.attn.FP8_CUDA_DECODE, fp8_convert=convert)
        variants[f"cuda_lazy_{convert}"] = replace(
            K.attn.FP8_CUDA_DECODE, fp8_convert=convert, lazy_rescale=True
        )
    variants["cuda_lazy"] = replace(K.attn.FP8_CUDA_DECODE, lazy_rescale=True)
    variants["cuda_s2_t64_h_bits"] = replace(
        K.attn.FP8_CUDA_DECODE, stage_in_shared=True, num_stages=2, kv_heads_first=True, fp8_convert="bits"
    )
    res["resources"] = {}
    for name, config in variants.items():
        if config is not None and config.kernel == "cuda":
            try:
                res["resources"][name] = cuda_decode_resources(config)
            except Exception as exc:  # noqa: BLE001
                res["resources"][name] = {"error": repr(exc)[:300]}
    TABLE.append(("decode fp8 kernels' resources", json.dumps(res["resources"])))
    shapes = [(f"mixed B={b}", workload_decode_lengths(b)) for b in (1, 2, 8, 16, 24, 32, 64, 128, 192, 256)]
    shapes += [("uniform 16 x 1536", [1536] * 16)]
    shapes += [("uniform 64 x 1024", [1024] * 64), ("uniform 256 x 1024", [1024] * 256)]
    if quick:
        shapes = shapes[-2:]
    for label, lens in shapes:
        batch = len(lens)
        paged = Paged(gen, lens, KV_HEADS, HEAD_DIM, 16, fp8_scales(), width=4096 // 16)
        query = randn(gen, batch, HEADS, HEAD_DIM)
        out = torch.empty_like(query)
        args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
        expected = decode_reference(query, paged, paged.seq_lens, HEAD_DIM**-0.5)
        entry = {}
        for name, config in variants.items():
            entry[name] = time_checked_decode(args, out, expected, paged, config)
            if "err" in entry[name]:
                record(
                    "decode_fp8_kernels", {"cfg": name, "shape": label}, entry[name]["ok"], entry[name]["err"]
                )
        res[label] = entry
        timed = {k: v["us"] for k, v in entry.items() if "us" in v}
        best = min(timed, key=timed.get) if timed else "none"
        TABLE.append(
            (
                f"decode fp8 kernels {label}",
                ", ".join(f"{k} {v:.1f}" for k, v in timed.items()) + f" us; best {best}",
            )
        )
        del paged
    RESULTS["timing"]["decode_fp8_kernels"] = res
    if write_config and not quick:
        write_tuned_fp8_decode(res, variants)


def time_decode_fp8_block_sizes(gen, quick):
    """The engine's FP8 decode kernel (its default config, and with FP8 converted by bit moves:
    ``bits``) over pools of 16- to 256-token blocks (the engine's ``kvcache_block_size``): the bench
    workload's mixed lengths at 128 and 256 rows and uniform 256 x 1024, each output checked; CUDA-graph
    replay, PDL on. A larger block means fewer block-table reads per 16-key tile and longer contiguous
    runs of each KV head's bytes."""
    res = {}
    shapes = [(f"mixed B={b}", workload_decode_lengths(b)) for b in (128, 256)]
    shapes += [("uniform 256 x 1024", [1024] * 256)]
    bits = replace(K.attn.FP8_CUDA_DECODE, fp8_convert="bits")
    for label, lens in shapes[-1:] if quick else shapes:
        batch = len(lens)
        query = randn(gen, batch, HEADS, HEAD_DIM)
        out = torch.empty_like(query)
        entry = {}
        for block_size in (16, 32, 64, 128, 256):
            paged = Paged(gen, lens, KV_HEADS, HEAD_DIM, block_size, fp8_scales(), width=4096 // block_size)
            args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
            expected = decode_reference(query, paged, paged.seq_lens, HEAD_DIM**-0.5)
            for suffix, config in (("", None), (" bits", bits)):
                name = f"bs{block_size}{suffix}"
                entry[name] = time_checked_decode(args, out, expected, paged, config)
                if "err" in entry[name]:
                    record(
                        "decode_fp8_block_sizes",
                        {"cfg": name, "shape": label},
                        entry[name]["ok"],
                        entry[name]["err"],
                    )
            del paged
        res[label] = entry
        TABLE.append(
            (
                f"decode fp8 block sizes {label}",
                ", ".join(
                    f"{k} {v['us']:.1f} us {v['kv_tbps']:.2f} TB/s" if "us" in v else f"{k} {v}"
                    for k, v in entry.items()
                ),
            )
        )
    RESULTS["timing"]["decode_fp8_block_sizes"] = res


# The tuned tiles must beat FP8_CUDA_DECODE's by this fraction over the shapes below to be written: the
# ratio of two variants' times moves by about 1% between sweeps (H100, runs 93 and 112).
TUNED_MIN_GAIN = 0.02


def write_tuned_fp8_decode(res: dict, variants: dict) -> None:
    """This GPU model's tuned-config file (``triton_attention.tuned_fp8_decode_config`` reads it): the
    CUDA variant with the least time summed over the mixed lengths at 64 to 256 rows (the bench
    workload's costly decode steps) where it beats FP8_CUDA_DECODE's own tiles by TUNED_MIN_GAIN, as
    the fields that differ from FP8_CUDA_DECODE; otherwise no file (a stale one is removed). A copy
    goes to $OUT."""
    base = K.attn.FP8_CUDA_DECODE
    shapes = [label for label in res if label.startswith("mixed B=") and int(label.split("=")[1]) >= 64]
    totals = {
        name: sum(res[label][name]["us"] for label in shapes)
        for name, config in variants.items()
        if config is not None
        and config.kernel == "cuda"
        and all(res[label][name].get("ok") for label in shapes)
    }
    baseline = [name for name in totals if variants[name] == base]
    if not baseline:
        raise RuntimeError("no timed variant has FP8_CUDA_DECODE's tiles to compare against")
    best = min(totals, key=totals.get)
    base_us = min(totals[name] for name in baseline)
    gain = 1 - totals[best] / base_us
    name = torch.cuda.get_device_name()
    path = K.attn.DEVICE_CONFIG_DIR / K.attn.device_config_file(name)
    chosen = {
        field.name: getattr(variants[best], field.name)
        for field in fields(K.attn.DecodeConfig)
        if getattr(variants[best], field.name) != getattr(base, field.name)
    }
    if gain < TUNED_MIN_GAIN:  # also where the best is FP8_CUDA_DECODE's own tiles (gain <= 0)
        path.unlink(missing_ok=True)
        verdict = f"FP8_CUDA_DECODE kept (best {best} {totals[best]:.1f} us, {gain:+.1%}); no {path.name}"
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(chosen, indent=1) + "\n")
        out_dir = Path(os.environ.get("OUT", "."))
        (out_dir / path.name).write_text(path.read_text())
        verdict = f"{best} written to {path.name}: {chosen} ({totals[best]:.1f} against {base_us:.1f} us)"
    K.attn.tuned_fp8_decode_config.cache_clear()
    K.attn._device_fp8_decode_config.cache_clear()
    RESULTS["timing"]["decode_fp8_tuned"] = {"totals_us": totals, "best": best, "gain": gain}
    TABLE.append(("decode fp8 tuned config", verdict))
    log(verdict)


def _token_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.contiguous()


def time_layouts(gen, quick):
    """Decode (every DECODE_SHAPES shape) and prefill (the prefill batch) with the default configurations
    on a token-major cache ([block, slot, head, dim] storage) and a head-major one ([block, head, slot,
    dim], the engine's FP8 pool), for bf16 and FP8: the same outputs, and the time of each."""
    res = {}
    lens = prefill_batch_lengths(**PREFILL_BATCH)
    for fp8 in (False, True):
        kv = "fp8" if fp8 else "bf16"
        shapes = [("decode", batch, ctx) for batch, ctx in DECODE_SHAPES] + [("prefill", len(lens), 0)]
        for kind, batch, ctx in shapes[-2:] if quick else shapes:
            seq_lens = lens if kind == "prefill" else [ctx] * batch
            paged = Paged(gen, seq_lens, KV_HEADS, HEAD_DIM, 16, fp8_scales() if fp8 else None)
            num_queries = sum(seq_lens) if kind == "prefill" else batch
            query = randn(gen, num_queries, HEADS, HEAD_DIM)
            entry, outs = {}, {}
            for layout, convert in (("token_major", _token_major), ("head_major", _head_major)):
                k_cache, v_cache = convert(paged.k_cache), convert(paged.v_cache)
                out = poison(num_queries, HEADS, HEAD_DIM)
                if kind == "prefill":
                    qsl = torch.tensor([0, *accumulate(seq_lens)], dtype=torch.int32, device=DEVICE)
                    fn = partial(
                        K.attn.paged_prefill_attention, query, k_cache, v_cache, qsl, paged.seq_lens,
                        paged.block_tables, max(seq_lens), HEAD_DIM**-0.5, out=out, **paged.scales,
                    )  # fmt: skip
                    us = bench(fn) * 1e3
                else:
                    fn = partial(
                        K.attn.paged_decode_attention, query, k_cache, v_cache, paged.block_tables,
                        paged.seq_lens, HEAD_DIM**-0.5, out=out, **paged.scales,
                    )  # fmt: skip
                    us = graph_bench(fn) * 1e3
                fn()
                outs[layout] = out.clone()
                entry[layout] = {"us": round(us, 2), "kv_tbps": round(paged.kv_bytes / us / 1e6, 3)}
            same = torch.equal(outs["token_major"], outs["head_major"])
            record("layout", {"kind": kind, "kv": kv, "batch": batch, "ctx": ctx}, same)
            key = f"{kind} {kv} " + (
                f"B={batch} ctx={ctx}" if kind == "decode" else f"{sum(seq_lens)} tokens"
            )
            res[key] = {**entry, "identical_outputs": same}
            TABLE.append(
                (
                    f"layout {key}",
                    f"token-major {entry['token_major']['us']:.1f} us, head-major "
                    f"{entry['head_major']['us']:.1f} us" + ("" if same else " (OUTPUTS DIFFER)"),
                )
            )
            del paged
    RESULTS["timing"]["layout"] = res


def varlen_flash_attention():
    """torch's FlashAttention varlen kernel on contiguous K/V (a reference point; None if absent)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)

    def attend(query, key, value, cu_seq, max_len, scale):
        kwargs = {"scale": scale}
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = query.shape[1] != key.shape[1]
        else:
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0)
        else:
            kwargs["is_causal"] = True
        return varlen_attn(query, key, value, cu_seq, cu_seq, max_len, max_len, **kwargs)

    return attend


def time_prefill(gen, quick):
    res = {}
    lens = prefill_batch_lengths(**PREFILL_BATCH)
    scale = HEAD_DIM**-0.5
    flops = causal_flops(lens, lens, HEADS, HEAD_DIM)
    RESULTS["timing"]["prefill_batch"] = {"seq_lens": lens, "tokens": sum(lens), "flops": flops}
    for block_size in (16, 256) if not quick else (16,):
        for fp8 in (False, True):
            paged = Paged(gen, lens, KV_HEADS, HEAD_DIM, block_size, fp8_scales() if fp8 else None)
            query = randn(gen, sum(lens), HEADS, HEAD_DIM)
            qsl = torch.tensor([0, *accumulate(lens)], dtype=torch.int32, device=DEVICE)
            out = torch.empty_like(query)
            args = (
                query,
                paged.k_cache,
                paged.v_cache,
                qsl,
                paged.seq_lens,
                paged.block_tables,
                max(lens),
                scale,
            )
            configs = prefill_configs(quick)
            if fp8 or block_size == 256:
                configs = {
                    k: v
                    for k, v in configs.items()
                    if k
                    in (
                        PREFILL_DEFAULT,
                        PREFILL_FP8_DEFAULT,
                        "m64n64w4s3",
                        "m128n64w8s3",
                        "gqa m128n64w8s3",
                    )
                }
            entry = {}
            for name, config in configs.items():
                try:
                    fn = partial(
                        K.attn.paged_prefill_attention, *args, out=out, config=config, **paged.scales
                    )
                    ms = bench(fn, rep=100)
                    entry[name] = {"us": ms * 1e3, "tflops": flops / ms / 1e9}
                except Exception as exc:  # noqa: BLE001
                    entry[name] = {"error": repr(exc)[:300]}
                log(f"  prefill bs={block_size} fp8={fp8} {name}: {entry[name]}")
            attend = varlen_flash_attention()
            if attend is not None and not fp8 and block_size == 16:
                try:
                    key, value = (
                        randn(gen, sum(lens), KV_HEADS, HEAD_DIM),
                        randn(gen, sum(lens), KV_HEADS, HEAD_DIM),
                    )
                    ms = bench(partial(attend, query, key, value, qsl, max(lens), scale), rep=100)
                    entry["torch varlen_attn (contiguous K/V)"] = {"us": ms * 1e3, "tflops": flops / ms / 1e9}
                except Exception as exc:  # noqa: BLE001 - optional reference point
                    entry["torch varlen_attn (contiguous K/V)"] = {"error": repr(exc)[:300]}
            res[f"bs{block_size} {'fp8' if fp8 else 'bf16'}"] = entry
            timed = {k: v["tflops"] for k, v in entry.items() if "tflops" in v}
            best = max(timed, key=timed.get)
            default = entry.get(PREFILL_FP8_DEFAULT if fp8 else PREFILL_DEFAULT, {})
            kv_name = "fp8" if fp8 else "bf16"
            default_us, default_tflops = default.get("us", float("nan")), default.get("tflops", float("nan"))
            TABLE.append(
                (
                    f"prefill {sum(lens)} tokens ({len(lens)} seqs) bs={block_size} {kv_name}",
                    f"default {default_us:.0f} us ({default_tflops:.0f} TFLOP/s), "
                    f"best {best} {entry[best]['us']:.0f} us ({timed[best]:.0f} TFLOP/s)",
                )
            )
            del paged
    RESULTS["timing"]["prefill"] = res


# ----------------------------------------------------------------------------------------------------
# Mock decode step: 28 Qwen3-0.6B layers from these kernels, in one CUDA graph
# ----------------------------------------------------------------------------------------------------


class MockDecodeStep:
    """The decode step of a Qwen3-0.6B-shaped model at ``batch`` x ``ctx`` built from these kernels
    (random weights, distinct per layer so nothing stays in L2): per layer add_rms_norm, qkv projection,
    qk_norm_rope_store, decode attention, o projection, add_rms_norm, gate_up, down (with silu_and_mul
    fused into it, as the engine runs it at small batches); then the final norm, the LM head and the
    sampler. Projections through ``gemv`` or cuBLAS (with a separate silu_and_mul)."""

    def __init__(self, gen, batch, ctx, fp8=False):
        self.batch = batch
        self.layers = []
        for _ in range(LAYERS):
            self.layers.append(
                {
                    "qkv": randn(gen, *PROJECTIONS["qkv"], scale=0.03),
                    "o": randn(gen, *PROJECTIONS["o"], scale=0.03),
                    "gate_up": randn(gen, *PROJECTIONS["gate_up"], scale=0.03),
                    "down": randn(gen, *PROJECTIONS["down"], scale=0.02),
                    "norm1": randn(gen, HIDDEN).abs(),
                    "norm2": randn(gen, HIDDEN).abs(),
                    "q_norm": randn(gen, HEAD_DIM).abs(),
                    "k_norm": randn(gen, HEAD_DIM).abs(),
                    "paged": Paged(gen, [ctx] * batch, KV_HEADS, HEAD_DIM, 16, fp8_scales() if fp8 else None),
                }
            )
            paged = self.layers[-1]["paged"]
            # The new token goes to position ctx - 1 of each sequence: the last entry of its table row.
            last_block = paged.block_tables.long()[:, (ctx - 1) // 16]
            self.layers[-1]["slots"] = last_block * 16 + (ctx - 1) % 16
        self.lm_head = randn(gen, *PROJECTIONS["lm_head"], scale=0.03)
        self.final_norm = randn(gen, HIDDEN).abs()
        self.cos_sin = cos_sin_table(4096, HEAD_DIM)
        self.hidden = randn(gen, batch, HIDDEN)
        self.positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device=DEVICE)
        width = self.layers[0]["paged"].block_tables.shape[1]
        self.workspace = K.attn.DecodeWorkspace.allocate(
            batch, HEADS, KV_HEADS, HEAD_DIM, width * 16, DEVICE, cache_dtype=FP8 if fp8 else DTYPE
        )
        self.temperature = torch.full((batch,), 0.7, device=DEVICE)
        self.seeds = torch.arange(batch, device=DEVICE)
        self.offsets = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
        self.tokens = torch.empty(batch, dtype=torch.int64, device=DEVICE)
        self.num_bytes = (
            sum(
                w.numel() * 2
                for layer in self.layers
                for w in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])
            )
            + self.lm_head.numel() * 2
        )
        self.num_bytes += sum(layer["paged"].kv_bytes for layer in self.layers)

    def run(self, cublas: bool = False, pdl: bool = False) -> torch.Tensor:
        """One step through the Triton kernels; the sampled tokens go to ``self.tokens``. Returns the
        logits."""

        def project(x, w):
            return torch.nn.functional.linear(x, w) if cublas else K.gemv.gemv(x, w, pdl=pdl)

        def project_gated(gate_up, w):
            if cublas:
                return torch.nn.functional.linear(K.elem.silu_and_mul(gate_up, pdl=pdl), w)
            return K.gemv.gemv(gate_up, w, pdl=pdl, gated=True)

        x = self.hidden.clone()
        residual = torch.zeros_like(x)
        for layer in self.layers:
            K.elem.add_rms_norm(x, residual, layer["norm1"], EPS, pdl=pdl)
            attn = self._attention(layer, project(x, layer["qkv"]), pdl)
            x = project(attn, layer["o"])
            K.elem.add_rms_norm(x, residual, layer["norm2"], EPS, pdl=pdl)
            x = project_gated(project(x, layer["gate_up"]), layer["down"])
        K.elem.add_rms_norm(x, residual, self.final_norm, EPS, pdl=pdl)
        logits = project(x, self.lm_head)
        K.samp.inverse_cdf_sample(
            logits, self.temperature, self.seeds, self.offsets, out=self.tokens, pdl=pdl
        )
        return logits

    def _attention(self, layer: dict, qkv: torch.Tensor, pdl: bool) -> torch.Tensor:
        """QK-norm, RoPE and the K/V store, then decode attention: [batch, heads * head_dim]."""
        paged = layer["paged"]
        q, _, _ = K.elem.qk_norm_rope_store(
            qkv, self.positions, self.cos_sin, HEADS, KV_HEADS, HEAD_DIM, layer["q_norm"], layer["k_norm"],
            EPS, paged.k_cache, paged.v_cache, layer["slots"], paged.k_scale, paged.v_scale, pdl=pdl,
        )  # fmt: skip
        attn = K.attn.paged_decode_attention(
            q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5,
            workspace=self.workspace, pdl=pdl, **paged.scales,
        )  # fmt: skip
        return attn.view(self.batch, -1)

    def run_reference(self) -> torch.Tensor:
        """The same step through the pure-PyTorch references: the logits."""
        x = self.hidden.clone()
        residual = torch.zeros_like(x)
        qsl = torch.arange(self.batch + 1, dtype=torch.int32, device=DEVICE)
        for layer in self.layers:
            K.eref.add_rms_norm_ref(x, residual, layer["norm1"], EPS)
            qkv = K.gref.gemv_ref(x, layer["qkv"])
            paged = layer["paged"]
            q, _, _ = K.eref.qk_norm_rope_store_ref(
                qkv,
                self.positions,
                self.cos_sin,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                layer["q_norm"],
                layer["k_norm"],
                EPS,
                paged.k_cache,
                paged.v_cache,
                layer["slots"],
                paged.k_scale,
                paged.v_scale,
            )
            attn = K.aref.paged_attention_ref(
                q,
                paged.k_cache,
                paged.v_cache,
                qsl,
                paged.seq_lens,
                paged.block_tables,
                HEAD_DIM**-0.5,
                **paged.scales,
            )
            x = K.gref.gemv_ref(attn.reshape(self.batch, -1), layer["o"])
            K.eref.add_rms_norm_ref(x, residual, layer["norm2"], EPS)
            x = K.gref.gemv_ref(K.eref.silu_and_mul_ref(K.gref.gemv_ref(x, layer["gate_up"])), layer["down"])
        K.eref.add_rms_norm_ref(x, residual, self.final_norm, EPS)
        return K.gref.gemv_ref(x, self.lm_head)


def time_mock_step(gen, quick):
    res = {}
    for batch in MOCK_STEP_BATCHES if not quick else MOCK_STEP_BATCHES[:1]:
        step = MockDecodeStep(gen, batch, MOCK_STEP_CONTEXT)
        entry = {"weights_and_kv_bytes": step.num_bytes}
        # The whole step against the references: errors of 28 layers of bf16 add up, hence 5e-2.
        err = rel_error(step.run(), step.run_reference())
        record(
            "mock_step", {"B": batch, "ctx": MOCK_STEP_CONTEXT}, err < 5e-2, err, "logits vs the references"
        )
        step.run()
        eager_tokens = step.tokens.clone()
        for label, kwargs in (
            ("triton", {}),
            ("triton+pdl", {"pdl": True}),
            ("cublas projections", {"cublas": True}),
        ):
            try:
                ms = graph_bench(partial(step.run, **kwargs), calls=1, rep=200)
                graph_tokens = step.tokens.clone()
                entry[label] = {"ms": ms, "tbps": step.num_bytes / ms / 1e9}
                if label != "cublas projections":
                    entry[label]["same_tokens_as_eager"] = bool(torch.equal(graph_tokens, eager_tokens))
            except Exception as exc:  # noqa: BLE001
                entry[label] = {"error": repr(exc)[:300]}
        res[f"B{batch} ctx{MOCK_STEP_CONTEXT}"] = entry
        TABLE.append(
            (
                f"mock decode step B={batch} ctx={MOCK_STEP_CONTEXT}, {LAYERS} layers (graph)",
                ", ".join(
                    f"{k} {v['ms'] * 1e3:.0f} us ({v['tbps']:.2f} TB/s)" if "ms" in v else f"{k} ERROR"
                    for k, v in entry.items()
                    if isinstance(v, dict)
                ),
            )
        )
        del step
        torch.cuda.empty_cache()
    RESULTS["timing"]["mock_decode_step"] = res


# ----------------------------------------------------------------------------------------------------
# --compile-only: every kernel and configuration compiled for sm_90, no GPU
# ----------------------------------------------------------------------------------------------------


H200_MAX_SHARED_BYTES = 232448  # per block, opted in (227 KiB)


def compile_only(quick: bool) -> int:
    """Compiles (never runs) each kernel launch this script makes, for an H200 (sm_90), with Triton's
    bundled ptxas: a fake driver reports the target and every launch becomes a warm-up."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(CompileOnlyDriver())
    launch = JITFunction.run
    compiled: list[str] = []

    def warm_up_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.__name__)
        if kernel.metadata.shared > H200_MAX_SHARED_BYTES:
            raise ValueError(f"{self.__name__} needs {kernel.metadata.shared} bytes of shared memory")
        return kernel

    JITFunction.run = warm_up_only
    global K
    K = _modules()
    # The kernels refuse pdl=True off CUDA; here nothing is launched, so the PDL variants compile too.
    for module in (K.elem, K.attn, K.gemv, K.samp):
        module.launch_options = lambda pdl, device: {"launch_pdl": True} if pdl else {}
    failures = []

    def attempt(label: str, fn: Callable, *args, **kwargs) -> None:
        started = time.perf_counter()
        try:
            fn(*args, **kwargs)
            log(f"OK   {label} ({time.perf_counter() - started:.1f} s)")
        except Exception:  # noqa: BLE001 - report every failing compile
            failures.append(label)
            log(f"FAIL {label}\n{traceback.format_exc()}")

    def t(*shape, dtype=DTYPE):
        return torch.empty(*shape, dtype=dtype)

    ones = torch.ones(1)
    for tokens in (1, 256):
        attempt(f"rms_norm T={tokens}", K.elem.rms_norm, t(tokens, HIDDEN), t(HIDDEN), EPS, pdl=True)
        attempt(
            f"add_rms_norm T={tokens}",
            K.elem.add_rms_norm,
            t(tokens, HIDDEN),
            t(tokens, HIDDEN),
            t(HIDDEN),
            EPS,
        )
        attempt(f"silu_and_mul T={tokens}", K.elem.silu_and_mul, t(tokens, 2 * INTER), pdl=True)
        for splits in (2, 4):
            attempt(
                f"add_partials_rms_norm T={tokens} S={splits}",
                K.elem.add_partials_rms_norm,
                torch.empty(splits, tokens, HIDDEN),
                t(tokens, HIDDEN),
                t(HIDDEN),
                EPS,
                pdl=True,
            )
        qkv = t(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        positions = torch.zeros(tokens, dtype=torch.long)
        for cache_dtype in (DTYPE, FP8):
            cache = t(64, 16, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
            scales = (ones, ones) if cache_dtype == FP8 else (None, None)
            rope_args = (
                qkv,
                positions,
                torch.zeros(4096, HEAD_DIM),
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                t(HEAD_DIM),
                t(HEAD_DIM),
            )
            for per_program in (None, 1, 2, 4, 8, 16):
                label = f"qk_norm_rope_store T={tokens} {cache_dtype} hpp={per_program}"
                attempt(
                    label,
                    K.elem.qk_norm_rope_store,
                    *rope_args,
                    EPS,
                    cache,
                    cache,
                    positions,
                    *scales,
                    heads_per_program=per_program,
                    pdl=True,
                )
        empty = t(0)
        attempt(
            f"qk_norm_rope_store T={tokens} no cache",
            K.elem.qk_norm_rope_store,
            qkv,
            positions,
            torch.zeros(4096, HEAD_DIM),
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            None,
            None,
            EPS,
            empty,
            empty,
            positions,
        )
        cache = t(300, 16, KV_HEADS, HEAD_DIM)
        attempt(
            f"qk_norm_rope_store T={tokens} q_out",
            K.elem.qk_norm_rope_store,
            *rope_args,
            EPS,
            cache,
            cache,
            positions,
            q_out=t(tokens, HEADS, HEAD_DIM),
            pdl=True,
        )
    for batch in (1, 256):
        rows = torch.zeros(batch, dtype=torch.long)
        for chunk in (None, 1024, 2048, 4096):
            attempt(
                f"inverse_cdf_sample B={batch} chunk={chunk}",
                K.samp.inverse_cdf_sample,
                t(batch, VOCAB),
                torch.ones(batch),
                rows,
                rows,
                chunk_size=chunk,
                pdl=True,
            )
    for name, (n, k) in PROJECTIONS.items():
        weight = t(n, k)
        for m in (1, 2, 4, 8, 16):
            for config in [None, *gemv_candidates(m, quick)]:
                attempt(f"gemv {name} M={m} {config}", K.gemv.gemv, t(m, k), weight, config=config, pdl=True)
    for cache_dtype in (DTYPE, FP8):
        scales = {"k_scale": ones, "v_scale": ones} if cache_dtype == FP8 else {}
        cache = t(300, 16, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
        kv = t(8, KV_HEADS, HEAD_DIM)
        attempt(
            f"store_kvcache {cache_dtype}",
            K.attn.store_kvcache,
            kv,
            kv,
            cache,
            cache,
            torch.zeros(8, dtype=torch.long),
            **scales,
        )
        for batch in (1, 8, 256):
            tables = torch.zeros(batch, 64, dtype=torch.int32)
            lens = torch.zeros(batch, dtype=torch.int32)
            for name, config in {**decode_configs(quick), **balanced_decode_configs()}.items():
                for pdl in (False, True):
                    attempt(
                        f"decode {cache_dtype} B={batch} {name} pdl={pdl}",
                        K.attn.paged_decode_attention,
                        t(batch, HEADS, HEAD_DIM),
                        cache,
                        cache,
                        tables,
                        lens,
                        0.1,
                        config=config,
                        pdl=pdl,
                        **scales,
                    )
        qsl = torch.zeros(30, dtype=torch.int32)
        for name, config in prefill_configs(quick).items():
            attempt(
                f"prefill {cache_dtype} {name}",
                K.attn.paged_prefill_attention,
                t(1024, HEADS, HEAD_DIM),
                cache,
                cache,
                qsl,
                torch.zeros(29, dtype=torch.int32),
                torch.zeros(29, 64, dtype=torch.int32),
                1024,
                0.1,
                config=config,
                **scales,
            )
    log(
        f"\n{len(compiled)} launches compiled, {len(failures)} failures"
        + "".join(f"\n  {f}" for f in failures)
    )
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------------


def guarded(name: str, stage: Callable) -> None:
    """Runs one section; an exception is recorded and the run goes on."""
    started = time.perf_counter()
    try:
        stage()
    except Exception:  # noqa: BLE001 - keep the other sections' numbers
        tb = traceback.format_exc()
        log(tb)
        RESULTS.setdefault("errors", {})[name] = tb[-3000:]
        TABLE.append((name, "ERROR (see log)"))
        torch.cuda.synchronize()
    log(f"[{name}] {time.perf_counter() - started:.1f} s")


SECTIONS = (
    "ceiling", "correctness", "elementwise", "sampler", "gemv", "gemm", "decode", "decode_mixed",
    "decode_fp8_kernels", "decode_fp8_block_sizes", "prefill", "layout", "mock_step",
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller correctness grid and fewer variants")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90; no GPU")
    parser.add_argument(
        "--write-config",
        action="store_true",
        help="after decode_fp8_kernels, write this GPU model's tuned FP8 decode tiles "
        "(nanoinfer/kernels/configs/fp8_decode/) where a variant beats FP8_CUDA_DECODE by 2%%",
    )
    opts = parser.parse_args()
    if opts.compile_only:
        return compile_only(opts.quick)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --compile-only)", file=sys.stderr)
        return 2
    import triton

    global K
    K = _modules()
    props = torch.cuda.get_device_properties(0)
    RESULTS["env"] = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    log(json.dumps(RESULTS["env"]))
    out_dir = Path(os.environ.get("OUT", "."))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    started = time.perf_counter()
    stages = {
        "ceiling": time_ceiling,
        "correctness": lambda: run_correctness(opts.quick),
        "elementwise": lambda: time_elementwise(gen, opts.quick),
        "sampler": lambda: (check_sampler(gen), time_sampler(gen, opts.quick)),
        "gemv": lambda: time_gemv(gen, opts.quick),
        "gemm": lambda: time_gemm(gen, opts.quick),
        "decode": lambda: time_decode(gen, opts.quick),
        "decode_mixed": lambda: time_decode_mixed(gen, opts.quick),
        "decode_fp8_kernels": lambda: time_decode_fp8_kernels(gen, opts.quick, opts.write_config),
        "decode_fp8_block_sizes": lambda: time_decode_fp8_block_sizes(gen, opts.quick),
        "prefill": lambda: time_prefill(gen, opts.quick),
        "layout": lambda: time_layouts(gen, opts.quick),
        "mock_step": lambda: time_mock_step(gen, opts.quick),
    }
    wanted = opts.only or [s for s in SECTIONS if not (s == "correctness" and opts.skip_correctness)]
    for name in SECTIONS:
        if name in wanted:
            guarded(name, stages[name])
            RESULTS["wall_s"] = time.perf_counter() - started
            (out_dir / "gpu_kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    width = max((len(k) for k, _ in TABLE), default=0)
    print("\n" + "=" * 120)
    for key, value in TABLE:
        print(f"{key:<{width}}  {value}")
    failures = RESULTS.get("correctness_summary", {}).get("failures", 0)
    return 1 if failures or RESULTS.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
