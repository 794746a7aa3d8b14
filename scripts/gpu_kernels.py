"""Check and time the Triton attention kernels on a CUDA GPU.

1. Correctness (bf16) over a grid of shapes against the pure-PyTorch reference: store_kvcache, decode,
   prefill with and without a cached prefix, decode replayed in a CUDA graph.
2. Timing: store_kvcache; decode at batch 256 x context 1024 (Qwen3-0.6B attention shape) as effective
   KV bandwidth; decode latency at batch 1 x 512.
3. Prefill timing against the torch reference and torch's FlashAttention varlen kernel.

Writes everything to $OUT/gpu_kernels.json (default: the current directory) and prints a table.
Usage: python3 scripts/gpu_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from functools import partial
from itertools import accumulate
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    # Loaded by path so that this script only depends on the kernel modules, not on the whole package.
    spec = importlib.util.spec_from_file_location(
        f"_gpu_kernels_{name}", REPO / "nanoinfer" / "kernels" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ref = _load("attention_ref")
kernels = _load("triton_attention")
varlen = _load("varlen_prefill")

DEVICE = "cuda"
DTYPE = torch.bfloat16
TOLERANCE = 1e-2
RESULTS: dict = {"correctness": [], "timing": {}}
TABLE: list[tuple[str, str]] = []


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------------
# Random paged inputs
# ----------------------------------------------------------------------------------------------------


class Paged:
    """Random K/V scattered into a shuffled block pool, and the block tables pointing at it."""

    def __init__(self, gen, seq_lens, num_kv_heads, head_dim, block_size, spare_blocks=4):
        self.seq_lens_list = list(seq_lens)
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        width = max(blocks_per_seq + [1])
        num_blocks = sum(blocks_per_seq) + spare_blocks
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
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.kv_bytes = sum(seq_lens) * num_kv_heads * head_dim * 2 * self.k_cache.element_size()


def qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim):
    qkv = torch.randn(
        num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE
    )
    return (
        qkv[:, :num_heads],
        qkv[:, num_heads : num_heads + num_kv_heads],
        qkv[:, num_heads + num_kv_heads :],
    )


def num_sms() -> int:
    return kernels._num_sms(torch.device(DEVICE))


def rel_error(out, expected) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6)).item()


def record(kind: str, params: dict, ok: bool, err: float | None = None, note: str = "") -> None:
    RESULTS["correctness"].append({"kind": kind, **params, "pass": ok, "rel_error": err, "note": note})
    desc = " ".join(f"{k}={v}" for k, v in params.items())
    err_s = "" if err is None else f" err={err:.2e}"
    log(f"{'PASS' if ok else 'FAIL'} {kind:8s} {desc}{err_s} {note}")


def causal_flops(seq_lens, q_lens, num_heads, head_dim) -> float:
    total = 0
    for s, q in zip(seq_lens, q_lens, strict=True):
        # query i at position s-q+i sees s-q+i+1 keys
        total += q * (s - q) + q * (q + 1) / 2
    return 4.0 * total * num_heads * head_dim


# ----------------------------------------------------------------------------------------------------
# 1. Correctness
# ----------------------------------------------------------------------------------------------------


def check_store(gen, head_dim, block_size, num_kv_heads=8, num_tokens=300):
    num_blocks = math.ceil(num_tokens * 1.5 / block_size) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
    _, key, value = qkv_views(gen, num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device=DEVICE) < 0.2] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kvcache_ref(key, value, expected_k, expected_v, slots)
    kernels.store_kvcache(key, value, k_cache, v_cache, slots)
    ok = torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    record("store", {"D": head_dim, "bs": block_size, "T": num_tokens}, ok)


def check_decode(gen, head_dim, block_size, group, batch, max_ctx, num_kv_heads, zero_rows=0):
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device=DEVICE)
    lens[0] = max_ctx
    if zero_rows:
        lens[-zero_rows:] = 0
    paged = Paged(gen, lens.tolist(), num_kv_heads, head_dim, block_size)
    num_heads = num_kv_heads * group
    query, _, _ = qkv_views(gen, batch, num_heads, num_kv_heads, head_dim)
    out = torch.full((batch, num_heads, head_dim), float("nan"), device=DEVICE, dtype=DTYPE)
    scale = head_dim**-0.5
    kernels.paged_decode_attention(
        query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale, out=out
    )
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    expected = ref.paged_attention_ref(
        query, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, scale
    )
    nan = bool(out.isnan().any())
    err = rel_error(out, expected)
    splits = kernels.decode_num_splits(
        batch, num_kv_heads, paged.block_tables.shape[1] * block_size, num_sms()
    )
    zeros_ok = bool((out[paged.seq_lens == 0] == 0).all())
    params = {
        "D": head_dim, "bs": block_size, "G": group, "Hkv": num_kv_heads, "B": batch, "max_ctx": max_ctx,
    }  # fmt: skip
    record(
        "decode",
        params,
        (not nan) and err < TOLERANCE and zeros_ok,
        err,
        f"splits={splits}" + (" NaN!" if nan else ""),
    )


def check_prefill(gen, head_dim, block_size, group, batch, max_q, prefix, num_kv_heads, padding_rows=2):
    host_gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen, device=DEVICE)))
    q_lens = torch.randint(1, max_q + 1, (batch,), generator=host_gen).tolist()
    q_lens[0] = max_q
    if prefix:
        prefixes = torch.randint(0, 3 * max_q + 1, (batch,), generator=host_gen).tolist()
        prefixes[0] = 3 * max_q
    else:
        prefixes = [0] * batch
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    paged = Paged(gen, seq_lens, num_kv_heads, head_dim, block_size)
    num_heads = num_kv_heads * group
    num_tokens = sum(q_lens) + padding_rows
    query, _, _ = qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim)
    qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = torch.full((num_tokens, num_heads, head_dim), float("nan"), device=DEVICE, dtype=DTYPE)
    scale = head_dim**-0.5
    args = (query, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables)
    kernels.paged_prefill_attention(*args, max(q_lens), scale, out=out)
    expected = ref.paged_attention_ref(*args, scale)
    nan = bool(out.isnan().any())
    err = rel_error(out, expected)
    params = {
        "D": head_dim, "bs": block_size, "G": group, "Hkv": num_kv_heads, "B": batch,
        "max_q": max_q, "prefix": bool(prefix), "max_ctx": max(seq_lens),
    }  # fmt: skip
    record("prefill", params, (not nan) and err < TOLERANCE, err, " NaN!" if nan else "")
    for kind, fn, wanted in (
        ("varlen", varlen.varlen_prefill_attention, varlen.varlen_attn_available()),
        (
            "varlen_p",
            varlen.varlen_prefill_attention_paged,
            varlen.varlen_paged_available() and block_size == 256,
        ),
    ):
        if not wanted:
            continue
        try:
            got = fn(*args, max(q_lens), max(seq_lens), scale)
            n = sum(q_lens)
            verr = rel_error(got[:n], expected[:n])
            record(kind, params, bool(not got[:n].isnan().any()) and verr < TOLERANCE, verr, "optional")
        except Exception as exc:  # noqa: BLE001 - report and go on; varlen is optional
            record(kind, params, False, None, f"optional, error: {exc!r}"[:200])


def check_decode_graph(gen):
    batch, num_heads, num_kv_heads, head_dim, block_size = 8, 16, 8, 128, 16
    paged = Paged(gen, [2048] * batch, num_kv_heads, head_dim, block_size)
    query = torch.randn(batch, num_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
    lens = paged.seq_lens.clone()
    out = torch.empty_like(query)
    workspace = kernels.DecodeWorkspace.allocate(
        batch, num_heads, num_kv_heads, head_dim, paged.block_tables.shape[1] * block_size, DEVICE
    )
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, lens, head_dim**-0.5)
    kernels.paged_decode_attention(*args, out=out, workspace=workspace)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_decode_attention(*args, out=out, workspace=workspace)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    worst, ok = 0.0, True
    for _ in range(4):
        new = torch.randint(0, 2049, (batch,), generator=gen, device=DEVICE).int()
        new[0] = 0
        lens.copy_(new)
        query.copy_(torch.randn(query.shape, generator=gen, device=DEVICE))
        out.fill_(float("nan"))
        graph.replay()
        expected = ref.paged_attention_ref(
            query, paged.k_cache, paged.v_cache, qsl, lens, paged.block_tables, head_dim**-0.5
        )
        err = rel_error(out, expected)
        worst = max(worst, err)
        ok = ok and not bool(out.isnan().any()) and err < TOLERANCE and bool((out[0] == 0).all())
    record(
        "graph", {"B": batch, "D": head_dim, "bs": block_size}, ok, worst, "decode replayed with new seq_lens"
    )


def run_correctness(quick: bool):
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    for head_dim in (64, 128):
        for block_size in (16, 64, 256):
            check_store(gen, head_dim, block_size)
    batches = [1, 7, 64, 256]
    contexts = [4096, 1000, 333, 4096]
    i = 0
    for head_dim in (64, 128):
        for block_size in (16, 64, 256):
            for group in (1, 2, 4, 8):
                num_kv_heads = 2 if group == 8 else 4
                batch = batches[i % 4] if not quick else min(batches[i % 4], 16)
                check_decode(
                    gen,
                    head_dim,
                    block_size,
                    group,
                    batch,
                    contexts[i % 4],
                    num_kv_heads,
                    zero_rows=1 if batch > 1 else 0,
                )
                i += 1
    check_decode(gen, 128, 16, 2, 1, 1, 8)  # context 1
    check_decode(gen, 128, 16, 2, 1, 4096, 8)  # batch 1, many splits
    check_decode(gen, 128, 16, 2, 256, 1024, 8, zero_rows=32)  # the timed shape, with padding rows
    check_decode_graph(gen)
    i = 0
    for head_dim in (64, 128):
        for block_size in (16, 64, 256):
            for group in (1, 2, 4, 8):
                num_kv_heads = 2 if group == 8 else 4
                for prefix in (False, True):
                    batch = (1, 3, 8)[i % 3]
                    max_q = (1024, 300, 77)[i % 3] if not quick else 64
                    check_prefill(gen, head_dim, block_size, group, batch, max_q, prefix, num_kv_heads)
                    i += 1
    # Decode-shaped rows through the prefill kernel (no padding rows: the reference's batched decode path
    # takes one query row per sequence).
    check_prefill(gen, 128, 16, 2, 4, 1, True, 8, padding_rows=0)
    # varlen_attn is an optional comparison path: its failures are reported but do not fail the run.
    failures = [c for c in RESULTS["correctness"] if not c["pass"] and not c["kind"].startswith("varlen")]
    RESULTS["correctness_summary"] = {"cases": len(RESULTS["correctness"]), "failures": len(failures)}
    TABLE.append(
        ("correctness", f"{len(RESULTS['correctness']) - len(failures)}/{len(RESULTS['correctness'])} PASS")
    )


# ----------------------------------------------------------------------------------------------------
# 2. / 3. Timing
# ----------------------------------------------------------------------------------------------------


def bench(fn, rep=200) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_bench(fn, rep=200) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, rep)


def host_profile(fn, calls=300) -> str:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    log(text.getvalue())
    return text.getvalue()


def time_ceiling():
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=DEVICE, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = bench(partial(dst.copy_, src), rep=100)
    tbps = 2 * n * 2 / ms / 1e9
    RESULTS["timing"]["copy_bandwidth_tbps"] = tbps
    TABLE.append(("device-to-device copy (read+write)", f"{tbps:.2f} TB/s"))


def time_store(gen):
    out = {}
    num_kv_heads, head_dim, block_size = 8, 128, 16
    for num_tokens in (256, 16384):
        num_blocks = num_tokens * 2 // block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
        v_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
        _, key, value = qkv_views(gen, num_tokens, 16, num_kv_heads, head_dim)
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
        store_args = (key, value, k_cache, v_cache, slots)
        ms = bench(partial(kernels.store_kvcache, *store_args))
        ms_ref = bench(partial(ref.store_kvcache_ref, *store_args))
        moved = 2 * 2 * num_tokens * num_kv_heads * head_dim * 2  # K and V, read + write
        out[f"T{num_tokens}"] = {
            "triton_us": ms * 1e3,
            "torch_ref_us": ms_ref * 1e3,
            "tbps": moved / ms / 1e9,
        }
        TABLE.append(
            (
                f"store_kvcache T={num_tokens}",
                f"{ms * 1e3:.1f} us ({moved / ms / 1e9:.2f} TB/s), torch ref {ms_ref * 1e3:.1f} us",
            )
        )
    RESULTS["timing"]["store_kvcache"] = out


DECODE_VARIANTS = [
    # (block_n, num_warps, num_stages, splits or None = default)
    (64, 4, 3, None),
    (64, 4, 2, None),
    (64, 4, 4, None),
    (32, 4, 3, None),
    (128, 4, 3, None),
    (128, 8, 3, None),
    (64, 4, 3, 2),
    (64, 4, 3, 4),
]


def time_decode(gen, quick: bool):
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    scale = head_dim**-0.5
    res = {}
    for block_size in (16, 256):
        batch, ctx = 256, 1024
        paged = Paged(gen, [ctx] * batch, num_kv_heads, head_dim, block_size)
        query = torch.randn(batch, num_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
        out = torch.empty_like(query)
        args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
        ms = bench(partial(kernels.paged_decode_attention, *args, out=out))
        tbps = paged.kv_bytes / ms / 1e9
        entry = {
            "B": batch,
            "ctx": ctx,
            "us": ms * 1e3,
            "kv_tbps": tbps,
            "kv_bytes": paged.kv_bytes,
            "variants": [],
        }
        TABLE.append(
            (f"decode B={batch} ctx={ctx} bs={block_size}", f"{ms * 1e3:.1f} us, {tbps:.2f} TB/s KV")
        )
        default_splits = kernels.decode_num_splits(
            batch, num_kv_heads, paged.block_tables.shape[1] * block_size, num_sms()
        )
        for block_n, warps, stages, splits in DECODE_VARIANTS if not quick else DECODE_VARIANTS[:2]:
            splits = splits or default_splits
            try:
                fn = partial(
                    kernels._launch_decode,
                    *args,
                    out,
                    None,
                    splits,
                    num_heads // num_kv_heads,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )
                fn()
                vms = bench(fn)
                ok = rel_error(out, kernels.paged_decode_attention(*args)) < TOLERANCE
                v = {"block_n": block_n, "warps": warps, "stages": stages, "splits": splits, "us": vms * 1e3,
                     "kv_tbps": paged.kv_bytes / vms / 1e9, "same_output": ok}  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
                v = {
                    "block_n": block_n,
                    "warps": warps,
                    "stages": stages,
                    "splits": splits,
                    "error": repr(exc)[:300],
                }
            entry["variants"].append(v)
            log(f"  decode variant bs={block_size}: {v}")
        if block_size == 16:
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref.paged_attention_ref(
                query, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables, scale
            )
            torch.cuda.synchronize()
            entry["torch_ref_us_one_call"] = (time.perf_counter() - t0) * 1e6
            TABLE.append(("  torch ref (same shape, one call)", f"{entry['torch_ref_us_one_call']:.0f} us"))
        res[f"bs{block_size}_B{batch}_ctx{ctx}"] = entry
        del paged

        # batch 1 x 512: latency, eager (launch overhead included) and CUDA-graph replay
        paged = Paged(gen, [512], num_kv_heads, head_dim, block_size)
        query = torch.randn(1, num_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
        out = torch.empty_like(query)
        args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
        workspace = kernels.DecodeWorkspace.allocate(1, num_heads, num_kv_heads, head_dim, 512, DEVICE)
        fn = partial(kernels.paged_decode_attention, *args, out=out, workspace=workspace)
        eager = bench(fn)
        graphed = graph_bench(fn)
        # Host time per eager call (Python + Triton launch), without waiting for the GPU.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        if block_size == 16:
            RESULTS["decode_host_profile"] = host_profile(fn)
        res[f"bs{block_size}_B1_ctx512"] = {
            "eager_us": eager * 1e3,
            "graph_us": graphed * 1e3,
            "host_us": host_us,
        }
        TABLE.append(
            (
                f"decode B=1 ctx=512 bs={block_size}",
                f"eager {eager * 1e3:.1f} us (host {host_us:.0f} us), graph replay {graphed * 1e3:.1f} us",
            )
        )
    # Other shapes with the default configuration: how the split heuristic does away from the target.
    for batch, ctx in ((64, 4096), (32, 4096), (8, 8192), (1, 32768), (256, 200)):
        block_size = 16
        paged = Paged(gen, [ctx] * batch, num_kv_heads, head_dim, block_size)
        query = torch.randn(batch, num_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
        out = torch.empty_like(query)
        args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale)
        ms = graph_bench(partial(kernels.paged_decode_attention, *args, out=out))
        splits = kernels.decode_num_splits(
            batch, num_kv_heads, paged.block_tables.shape[1] * block_size, num_sms()
        )
        tbps = paged.kv_bytes / ms / 1e9
        sweep = {}
        for other in sorted({max(1, splits // 2), splits * 2, min(64, splits * 4)} - {splits}):
            launch = partial(kernels._launch_decode, *args, out, None, other, num_heads // num_kv_heads)
            sweep[other] = paged.kv_bytes / graph_bench(launch) / 1e9
        res[f"bs{block_size}_B{batch}_ctx{ctx}_graph"] = {
            "us": ms * 1e3, "kv_tbps": tbps, "splits": splits, "kv_tbps_by_other_splits": sweep,
        }  # fmt: skip
        log(f"  decode B={batch} ctx={ctx}: splits={splits} {tbps:.2f} TB/s; others {sweep}")
        TABLE.append(
            (
                f"decode B={batch} ctx={ctx} bs={block_size} (graph)",
                f"{ms * 1e3:.1f} us, {tbps:.2f} TB/s KV, splits={splits}",
            )
        )
        del paged
    RESULTS["timing"]["decode"] = res


PREFILL_VARIANTS = [
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (64, 32, 4, 3),
    (128, 128, 8, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 2),
]


def time_prefill(gen, quick: bool):
    num_heads, num_kv_heads, head_dim = 16, 8, 128
    scale = head_dim**-0.5
    res = {}
    scenarios = {
        "8x1024_no_prefix": ([1024] * 8, [1024] * 8),
        "4x512_over_2048_prefix": ([2560] * 4, [512] * 4),
    }
    for block_size in (16, 256):
        for name, (seq_lens, q_lens) in scenarios.items():
            paged = Paged(gen, seq_lens, num_kv_heads, head_dim, block_size)
            num_tokens = sum(q_lens)
            query = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
            qsl = torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
            args = (query, paged.k_cache, paged.v_cache, qsl, paged.seq_lens, paged.block_tables)
            flops = causal_flops(seq_lens, q_lens, num_heads, head_dim)
            out = torch.empty_like(query)
            ms = bench(partial(kernels.paged_prefill_attention, *args, max(q_lens), scale, out=out))
            ms_ref = bench(partial(ref.paged_attention_ref, *args, scale), rep=50)
            entry = {
                "triton_us": ms * 1e3,
                "triton_tflops": flops / ms / 1e9,
                "torch_ref_us": ms_ref * 1e3,
                "variants": [],
            }
            line = (
                f"triton {ms * 1e3:.0f} us ({flops / ms / 1e9:.0f} TFLOP/s), torch ref {ms_ref * 1e3:.0f} us"
            )
            for label, fn, wanted in (
                ("varlen_gather", varlen.varlen_prefill_attention, varlen.varlen_attn_available()),
                (
                    "varlen_paged",
                    varlen.varlen_prefill_attention_paged,
                    varlen.varlen_paged_available() and block_size % 256 == 0,
                ),
            ):
                if not wanted:
                    continue
                try:
                    vms = bench(partial(fn, *args, max(q_lens), max(seq_lens), scale))
                    entry[f"{label}_us"] = vms * 1e3
                    entry[f"{label}_tflops"] = flops / vms / 1e9
                    line += f", {label} {vms * 1e3:.0f} us"
                except Exception as exc:  # noqa: BLE001 - optional path
                    entry[f"{label}_error"] = repr(exc)[:300]
                    line += f", {label} error"
            if varlen.varlen_attn_available():
                try:
                    key, value, cu_seq_k = varlen.gather_context(*args[1:3], *args[4:6])
                    # KV heads repeated up front (this torch's varlen_attn has no enable_gqa), so only
                    # the FlashAttention kernel itself is timed.
                    key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
                    value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
                    attend = partial(
                        varlen.varlen_causal_attention,
                        query, key, value, qsl, cu_seq_k, max(q_lens), max(seq_lens), scale,
                    )  # fmt: skip
                    vms = bench(attend)
                    entry["varlen_fa_only_us"] = vms * 1e3
                    entry["varlen_fa_only_tflops"] = flops / vms / 1e9
                    line += f" (FA alone {vms * 1e3:.0f} us)"
                except Exception as exc:  # noqa: BLE001 - optional path
                    entry["varlen_fa_only_error"] = repr(exc)[:300]
            TABLE.append((f"prefill {name} bs={block_size}", line))
            if block_size == 16:
                for cfg in PREFILL_VARIANTS if not quick else PREFILL_VARIANTS[:2]:
                    try:
                        fn = partial(
                            kernels._launch_prefill,
                            *args,
                            max(q_lens),
                            scale,
                            out,
                            num_heads // num_kv_heads,
                            cfg,
                        )
                        fn()
                        vms = bench(fn)
                        v = {"config": cfg, "us": vms * 1e3, "tflops": flops / vms / 1e9}
                    except Exception as exc:  # noqa: BLE001
                        v = {"config": cfg, "error": repr(exc)[:300]}
                    entry["variants"].append(v)
                    log(f"  prefill variant {name}: {v}")
            res[f"{name}_bs{block_size}"] = entry
            del paged
    RESULTS["timing"]["prefill"] = res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller correctness grid and fewer variants")
    parser.add_argument("--skip-correctness", action="store_true")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    RESULTS["env"] = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "varlen_attn": varlen.varlen_attn_available(),
        "varlen_attn_params": sorted(varlen._varlen_api()[1]) if varlen.varlen_attn_available() else None,
    }  # fmt: skip
    log(json.dumps(RESULTS["env"]))
    out_dir = Path(os.environ.get("OUT", "."))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    start = time.perf_counter()
    stages = [("ceiling", time_ceiling)]
    if not opts.skip_correctness:
        stages.append(("correctness", lambda: run_correctness(opts.quick)))
    stages += [
        ("store", lambda: time_store(gen)),
        ("decode", lambda: time_decode(gen, opts.quick)),
        ("prefill", lambda: time_prefill(gen, opts.quick)),
    ]
    for name, stage in stages:
        t0 = time.perf_counter()
        try:
            stage()
        except Exception:  # noqa: BLE001 - keep the other stages' numbers
            tb = traceback.format_exc()
            log(tb)
            RESULTS.setdefault("errors", {})[name] = tb[-2000:]
            TABLE.append((name, "ERROR (see log)"))
        log(f"[{name}] {time.perf_counter() - t0:.1f} s")
        (out_dir / "gpu_kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    RESULTS["wall_s"] = time.perf_counter() - start
    (out_dir / "gpu_kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    width = max(len(k) for k, _ in TABLE)
    print("\n" + "=" * 100)
    for key, value in TABLE:
        print(f"{key:<{width}}  {value}")
    failures = RESULTS.get("correctness_summary", {}).get("failures", 0)
    return 1 if failures or RESULTS.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
