"""Host time of real engine decode steps, and where it goes (cProfile), at a few batch sizes.

Unlike ``host_overhead.py`` (CPU only, model stubbed), this runs the engine as configured on a real
checkpoint (on CUDA: graphs, kernels, copies), so that the launch costs of the device path show. For each
batch size: ``--context``-token random prompts prefill, then ``--steps`` decode steps are timed without
the profiler, then the same number again under cProfile. Prints ms per step and the functions with the
most cumulative time; ``--result-file`` also writes them as JSON.

    python3 benchmarks/host_profile.py --model /tmp/qwen3-0.6b [--batch-sizes 1,16,64] [--result-file F]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from pathlib import Path

from nanoinfer import LLM, SamplingParams
from nanoinfer.benchmarks.throughput import git_commit
from nanoinfer.sampling_params import RequestOutputKind


def profile_batch(llm: LLM, batch: int, context: int, steps: int, top: int) -> dict:
    engine = llm.llm_engine
    vocab_size = engine.config.hf_config.vocab_size
    rng = random.Random(batch)
    params = SamplingParams(
        temperature=0.6, max_tokens=2 * steps + 16, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(3, vocab_size) for _ in range(context)], params)
    while engine.engine_core.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = (time.perf_counter() - started) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:top]
    functions = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": calls,
            "own_us_per_step": round(own / steps * 1e6, 1),
            "cumulative_us_per_step": round(cumulative / steps * 1e6, 1),
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]
    return {"batch": batch, "context": context, "ms_per_step": round(plain_ms, 3), "functions": functions}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=40, help="functions listed, by cumulative time")
    parser.add_argument("--result-file")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, max_num_seqs=max(batches))
    results = []
    try:
        for batch in batches:
            entry = profile_batch(llm, batch, args.context, args.steps, args.top)
            results.append(entry)
            print(f"batch {batch}: {entry['ms_per_step']:.3f} ms per step without the profiler")
            for f in entry["functions"]:
                cumulative, own = f["cumulative_us_per_step"], f["own_us_per_step"]
                print(f"  {cumulative:9.1f} us cumulative {own:8.1f} own  {f['function']}")
    finally:
        llm.close()
    if args.result_file:
        result = {"benchmark": "host_profile", "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                  "model": args.model, "results": results}  # fmt: skip
        Path(args.result_file).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
