"""One decode-attention call shape, for Nsight Compute: the default configuration at ``--batch`` x
``--context`` over a bf16 or FP8 cache laid out as the engine lays it out (scripts/gpu_kernels.py's
``Paged``: shuffled blocks; FP8 head-major), called ``--warmup`` times and then ``--calls`` times, timed
with CUDA events. Under ``ncu -k regex:_decode_kernel --launch-skip <warmup> --launch-count 1`` the
profiled launch is the first timed one (a call whose grid needs splits also launches the merge kernel,
which that regex leaves out). ``scripts/h200_run.sh decode_profile`` runs it under ncu.

    python3 scripts/gpu_decode_profile.py [--kv fp8] [--batch 256] [--context 1024] [--warmup 5] [--calls 20]
        [--staged DEPTH]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402 (it stubs the package so that the kernel modules load alone)

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 8, 2, 128, 16  # Qwen3-0.6B, the engine's block size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--staged",
        type=int,
        metavar="DEPTH",
        help="FP8: cuda_decode's kernel with DEPTH tiles staged in shared memory",
    )
    args = parser.parse_args()
    if args.staged is not None and args.kv != "fp8":
        parser.error("--staged needs --kv fp8")
    gpu_kernels.K = K = gpu_kernels._modules()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scales = gpu_kernels.fp8_scales() if args.kv == "fp8" else None
    paged = gpu_kernels.Paged(gen, [args.context] * args.batch, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, scales)
    query = torch.randn(
        args.batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16
    )
    config = K.attn.default_decode_config(args.batch, paged.k_cache.dtype)
    if args.staged is not None:
        config = replace(K.attn.FP8_CUDA_DECODE, stage_in_shared=True, num_stages=args.staged)
    call_args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
    for _ in range(args.warmup):
        K.attn.paged_decode_attention(*call_args, config=config, **paged.scales)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.calls):
        K.attn.paged_decode_attention(*call_args, config=config, **paged.scales)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.calls
    print(f"{args.kv} {args.batch} x {args.context}: {config}")
    print(f"{us:.1f} us per call (eager, back to back), {paged.kv_bytes / us / 1e6:.2f} TB/s of KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
