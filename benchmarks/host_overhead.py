"""Host (Python) cost of one engine decode step, with the model stubbed out (CPU only).

Where the host's work per step exceeds the GPU's, the GPU sits idle. It is measured here without one: a
tiny random Qwen3 checkpoint whose forward pass is replaced by zeros and whose logits are a fixed
random [batch, 512] tensor, and the sampling kernel by an argmax (on a GPU it is one kernel launch; its
torch definition, which the CPU runs instead, hashes noise for every logit and would dominate), so
what remains is scheduling, block bookkeeping, input preparation, the sampler's glue, and output
processing. Batches of ``--batch-sizes``
sequences with ``--context``-token prompts decode ``--steps`` steps each (temperature 0.6, outputs
returned at the end as ``LLM.generate`` does).

    python3 benchmarks/host_overhead.py [--batch-sizes 64,256] [--profile] [--result-file F]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

import nanoinfer.sample.sampler as sampler_module
from nanoinfer import LLM, SamplingParams
from nanoinfer.benchmarks.random_checkpoint import write_random_qwen3
from nanoinfer.sampling_params import RequestOutputKind

TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False,
)  # fmt: skip


def measure(model: str, batch_size: int, context: int, steps: int, profile: bool) -> dict:
    blocks_per_seq = (context + steps + 15) // 16 + 1
    llm = LLM(
        model,
        device="cpu",
        max_num_seqs=batch_size,
        max_model_len=context + steps + 16,
        max_num_batched_tokens=batch_size * context,
        num_kvcache_blocks=batch_size * blocks_per_seq,
    )
    runner = llm.llm_engine.engine_core.executor.runner
    hidden_size = TINY_SHAPE["hidden_size"]
    logits = torch.randn(batch_size, TINY_SHAPE["vocab_size"])
    runner.model.forward = lambda input_ids, positions, meta: torch.zeros(len(input_ids), hidden_size)
    runner.model.compute_logits = lambda hidden: logits[: len(hidden)]
    sampler_module.sample_temperature_only = lambda logits, metadata: logits.argmax(dim=-1)
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.6, ignore_eos=True, max_tokens=steps + 8, output_kind=RequestOutputKind.FINAL_ONLY
    )
    rng = random.Random(0)
    for i in range(batch_size):
        engine.add_request(str(i), [rng.randrange(3, 380) for _ in range(context)], params)
    while engine.engine_core.scheduler.waiting:
        engine.step()
    engine.step()
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        engine.step()
    if profiler:
        profiler.disable()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    result = {
        "batch_size": batch_size,
        "context": context,
        "steps": steps,
        "host_ms_per_step": round(step_ms, 3),
    }
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats("nanoinfer", 12)
        result["profile"] = text.getvalue()
    llm.close()
    return result


def main() -> int:
    # One thread: what is measured is Python; a thread pool competing with other processes for the cores
    # adds stalls of a scheduler time slice to whole steps.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="also print the top functions (slower)")
    parser.add_argument("--result-file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nanoinfer-host-") as model:
        write_random_qwen3(model, TINY_SHAPE, max_position_embeddings=args.context + args.steps + 64)
        results = [
            measure(model, int(b), args.context, args.steps, args.profile)
            for b in args.batch_sizes.split(",")
        ]
    print("batch | context | host ms per decode step")
    for r in results:
        print(f"{r['batch_size']} | {r['context']} | {r['host_ms_per_step']}")
        if "profile" in r:
            print(r["profile"])
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
