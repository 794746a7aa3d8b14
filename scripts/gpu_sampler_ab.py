"""Does vLLM-parity sampling cost the default (temperature-only) throughput anything? An A/B on one GPU.

"baseline" is the sampler of the core-engine commit (0561f46): every row sampled by one
temperature-scaled softmax and one exponential race, with no per-row parameter checks. "head" is the
sampler as it is now. Both run in one engine (same KV pool, same CUDA graphs): the offline throughput
benchmark's workload (benchmarks/throughput.py defaults: 256 sequences, prompts of 100-1024 tokens,
100-1024 output tokens, temperature 0.6, EOS ignored), generated in turn with each sampler,
alternating baseline, head, baseline, head, ... so that drift of the machine hits both alike, after one
untimed pass, with prefix caching off.

Writes $OUT/sampler_ab.json with every run and the head/baseline ratio of the mean throughputs.

    python3 scripts/gpu_sampler_ab.py --model CKPT [--reps 3] [--num-seqs 256 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoinfer import LLM  # noqa: E402
from nanoinfer.benchmarks.throughput import add_workload_args, workload_from_args  # noqa: E402
from nanoinfer.executor.batch import SamplerOutput  # noqa: E402
from nanoinfer.layers.sampler import Sampler  # noqa: E402


def baseline_forward(self, logits, rows, generator=None, prompt_logprobs=None):
    """The core-engine commit's Sampler.forward (temperature only), returning today's SamplerOutput."""
    if logits is None:
        return SamplerOutput([])
    temperatures = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
    temperatures = temperatures.to(logits.device)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    is_greedy = temperatures == 0
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)
    sampled = (probs / noise).argmax(dim=-1)
    return SamplerOutput(torch.where(is_greedy, greedy, sampled).tolist())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--reps", type=int, default=3)
    add_workload_args(parser)
    args = parser.parse_args()

    samplers = {"baseline": baseline_forward, "head": Sampler.forward}
    # The runs repeat one workload: with prefix caching the later ones would skip most of the prefill.
    llm = LLM(args.model, enable_prefix_caching=False)
    prompts, params = workload_from_args(args, llm.llm_engine.config.hf_config.vocab_size)
    output_tokens = sum(p.max_tokens for p in params)
    # One untimed pass: the compiled ops specialize on the first prompt lengths they meet.
    llm.generate(prompts, params, use_tqdm=False)
    runs = []
    for rep in range(args.reps):
        for variant, forward in samplers.items():
            Sampler.forward = forward
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            tok_per_s = output_tokens / (time.perf_counter() - started)
            runs.append({"variant": variant, "rep": rep, "output_tok_per_s": round(tok_per_s, 1)})
            print(f"{variant} rep {rep}: {tok_per_s:.1f} tok/s", flush=True)
    Sampler.forward = samplers["head"]
    llm.close()

    means = {v: statistics.mean(r["output_tok_per_s"] for r in runs if r["variant"] == v) for v in samplers}
    summary = {
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "output_tokens": output_tokens,
        "runs": runs,
        "mean_output_tok_per_s": {v: round(m, 1) for v, m in means.items()},
        "head_over_baseline": round(means["head"] / means["baseline"], 4),
    }
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_ab.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
