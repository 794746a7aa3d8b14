"""Tensor-parallel check on 2 GPUs (NCCL): correctness and throughput of TP=2 against TP=1.

1. Correctness, bf16, CUDA graphs on: greedy tokens at TP=2 against TP=1 on random-weight Qwen3
   checkpoints built here, with the logprob-closeness rule: the sequences must be identical up to their
   first divergence, and that divergence must be at a near-tie of the TP=1 run (top-2 logprob margin
   under --near-tie), with chunked prefill; models: one with a single KV head (replicated on both
   ranks) and 4 query heads, with prefix-cache hits, and the Qwen3-0.6B shape (16 query / 8 KV heads)
   with a KV pool small enough to preempt sequences; the latter again in float32 under a tight rule
   (--near-tie-fp32), where rounding can no longer hide a fault of the tensor-parallel path.
2. Throughput: nanoinfer's offline generate at TP=1 and TP=2 on Qwen3-0.6B- and Qwen3-8B-shaped random
   checkpoints (written in bf16 straight from GPU tensors), with a reduced version of the benchmark
   workload: 64 sequences, prompts of 100-1024 random tokens, 100-512 output tokens, seed 0,
   temperature 0.6, EOS ignored.
3. A worker SIGKILLed in the middle of a TP=2 generation: rank 0 must raise a RuntimeError in seconds
   (or, blocked inside NCCL, be ended by the watchdog: see killed_worker_check).

Writes $OUT/gpu_tp.json (after each stage, so a run cut short keeps what it measured); exits non-zero
when a correctness check fails.

    python3 scripts/gpu_tp_check.py                 # on a machine with 2 GPUs
    python3 scripts/gpu_tp_check.py --tiny          # CPU, gloo, tiny shapes: a dry run of this script
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Should anything hang, every thread's stack every HANG_DUMP_S (240) seconds, in rank 0 and in the
# workers too (spawned processes re-run this module's top level).
faulthandler.dump_traceback_later(float(os.environ.get("HANG_DUMP_S", "240")), repeat=True)

# NVLink multicast stays off (the shared machines' rule); workers inherit the environment.
for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoinfer import LLM, SamplingParams  # noqa: E402
from nanoinfer.benchmarks.random_checkpoint import QWEN3_SHAPES, write_random_qwen3  # noqa: E402
from nanoinfer.benchmarks.throughput import add_workload_args, workload_from_args  # noqa: E402
from tests.fixtures import build_model  # noqa: E402

TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=384, tie_word_embeddings=False,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


class Report:
    def __init__(self, path: Path, setup: dict):
        self.path = path
        self.data = {"setup": setup, "correctness": [], "throughput": [], "errors": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- correctness -----------------------------------------------------------------------------------------


def top2_margin(position_logprobs) -> float | None:
    """top-1 minus top-2 logprob at one generated position (None when logprobs are missing)."""
    if not position_logprobs:
        return None
    values = sorted((lp.logprob for lp in position_logprobs.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else None


def compare_greedy(reference, candidate, near_tie: float) -> dict:
    """The logprob-closeness rule, per sequence: identical, or diverging first at a near-tie of the
    reference."""
    sequences = []
    max_logprob_diff = 0.0
    for ref_out, got_out in zip(reference, candidate, strict=True):
        ref, got = ref_out.outputs[0], got_out.outputs[0]
        first = next(
            (i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=False)) if a != b), None
        )
        common = len(ref.token_ids) if first is None else first
        # How far the two runs' logprobs of the same tokens drift before any divergence.
        if ref.logprobs and got.logprobs:
            for i in range(common):
                token = ref.token_ids[i]
                diff = abs(ref.logprobs[i][token].logprob - got.logprobs[i][token].logprob)
                max_logprob_diff = max(max_logprob_diff, diff)
        if first is None:
            ok = len(ref.token_ids) == len(got.token_ids)
            sequences.append({"status": "identical" if ok else "length differs", "ok": ok})
            continue
        margin = top2_margin(ref.logprobs[first]) if ref.logprobs else None
        ok = margin is not None and margin < near_tie
        sequences.append(
            {
                "status": "near-tie divergence" if ok else "DIVERGED",
                "ok": ok,
                "at": first,
                "reference_margin": margin,
                "reference": ref.token_ids[first : first + 4],
                "got": got.token_ids[first : first + 4],
            }
        )
    return {
        "ok": all(s["ok"] for s in sequences),
        "identical": sum(s["status"] == "identical" for s in sequences),
        "near_tie_divergences": sum(s["status"] == "near-tie divergence" for s in sequences),
        "failures": sum(not s["ok"] for s in sequences),
        "max_logprob_diff_before_divergence": round(max_logprob_diff, 5),
        "sequences": sequences,
    }


def correctness_check(
    name: str,
    model: str,
    engine_kwargs: dict,
    prompts,
    max_tokens: int,
    near_tie: float,
    expect: str,
):
    """Greedy generation of ``prompts`` at TP=1 and TP=2, then of prompts sharing the first one's prefix,
    compared with the closeness rule. ``expect``: "prefix hits" (the sharing prompts must hit the prefix
    cache) or "preemption" (the pool is too small for the batch: sequences must be preempted)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    first = prompts[0]
    sharing = [first + [7, 8, 9], first[: len(first) // 2 + 20]]
    outputs, cached, preemptions = {}, {}, {}
    for tp in (1, 2):
        started = time.perf_counter()
        with LLM(model, tensor_parallel_size=tp, **engine_kwargs) as llm:
            outputs[tp] = llm.generate(prompts, params, use_tqdm=False)
            second = llm.generate(sharing, params, use_tqdm=False)
            outputs[tp] += second
            cached[tp] = [o.num_cached_tokens for o in second]
            preemptions[tp] = llm.engine_stats()["num_preemptions"]
        log(f"  {name}: TP={tp} generated in {time.perf_counter() - started:.1f}s")
        release_memory()
    result = {"name": name, "expect": expect, **compare_greedy(outputs[1], outputs[2], near_tie)}
    result["prefix_cached_tokens"] = cached
    result["num_preemptions"] = preemptions
    expected_seen = all(cached[2]) if expect == "prefix hits" else all(preemptions.values())
    if not expected_seen:
        result["ok"] = False
        result["failures"] += 1
    log(
        f"  {name}: {'OK' if result['ok'] else 'FAIL'}: {result['identical']} identical, "
        f"{result['near_tie_divergences']} near-tie divergences, {result['failures']} failures; "
        f"max logprob diff before divergence {result['max_logprob_diff_before_divergence']}; "
        f"prefix-cached tokens {cached}; preemptions {preemptions} ({expect} expected)"
    )
    return result


def build_kv1_model(path: str) -> str:
    """4 query heads sharing 1 KV head (replicated at TP=2); head_dim 64 for the Triton kernels."""
    return build_model(
        path, num_key_value_heads=1, hidden_size=256, head_dim=64, num_hidden_layers=4,
        max_position_embeddings=2048,
    )  # fmt: skip


def random_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


# -- throughput ------------------------------------------------------------------------------------------


def time_throughput(shape_name: str, model: str, tp: int, engine_kwargs: dict, prompts, params) -> dict:
    started = time.perf_counter()
    with LLM(model, tensor_parallel_size=tp, **engine_kwargs) as llm:
        startup_s = time.perf_counter() - started
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        stats = llm.engine_stats()
    release_memory()
    output_tokens = sum(p.max_tokens for p in params)
    result = {
        "shape": shape_name,
        "tensor_parallel_size": tp,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 1),
        "total_tok_per_s": round((output_tokens + sum(map(len, prompts))) / elapsed, 1),
        "startup_s": round(startup_s, 1),
        "num_kv_blocks": stats["num_kv_blocks_total"],
        "num_preemptions": stats["num_preemptions"],
    }
    log(
        f"  {shape_name} TP={tp}: {output_tokens} tokens in {elapsed:.2f}s = "
        f"{result['output_tok_per_s']} tok/s (startup {startup_s:.1f}s, "
        f"{stats['num_kv_blocks_total']} KV blocks)"
    )
    return result


# -- a worker killed mid-generation -----------------------------------------------------------------------


def killed_worker_check(
    model: str, engine_kwargs: dict, kill_after_s: float = 0.5, deadline_s: float = 20.0
) -> dict:
    """SIGKILLs the worker while TP=2 generates: rank 0 must raise a RuntimeError naming it, in seconds,
    and close within ``deadline_s``. Under NCCL rank 0 can instead stay blocked inside NCCL (a kill
    early in the generation); the watchdog then exits the process with status 1 after logging why,
    so run each attempt in a process of its own (``--kill-after``). Should anything hang, faulthandler
    ends the script after ``2 * deadline_s``."""
    llm = LLM(model, tensor_parallel_size=2, **engine_kwargs)
    worker = llm.llm_engine.engine_core.executor.workers.processes[0]
    # Long enough (about 1800 steps) that the kill lands in the middle of the generation, most likely
    # inside a step, while rank 0 waits in a collective.
    prompts = random_prompts(64, 50, 200, 384, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=1800, ignore_eos=True)
    killer = threading.Timer(kill_after_s, os.kill, args=(worker.pid, signal.SIGKILL))
    faulthandler.dump_traceback_later(2 * deadline_s, exit=True)
    result: dict = {"name": "worker killed mid-generation"}
    try:
        killer.start()
        started = time.perf_counter()
        try:
            llm.generate(prompts, params, use_tqdm=False)
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e).splitlines()[0]
        # Seconds from the kill to the error.
        result["seconds_to_error"] = round(time.perf_counter() - started - kill_after_s, 2)
        log(f"  error after {result['seconds_to_error']} s: {result['error']}; closing")
        killer.join()
        closing = time.perf_counter()
        llm.close()
        result["close_s"] = round(time.perf_counter() - closing, 2)
    finally:
        faulthandler.cancel_dump_traceback_later()
    result["ok"] = bool(
        result["error"]
        and "worker rank 1" in result["error"]
        and result["seconds_to_error"] < deadline_s
        and result["close_s"] < deadline_s
    )
    result["worker_alive_after_close"] = worker.is_alive()
    result["ok"] &= not result["worker_alive_after_close"]
    log(f"  {result}")
    return result


# -- main ------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU (gloo), tiny shapes and workload: a dry run")
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b", help="throughput shapes, comma-separated")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-kill", action="store_true", help="skip the killed-worker check (run last)")
    parser.add_argument(
        "--kill-repeats", type=int, default=1, help="killed-worker runs, each killing 0.3 s later"
    )
    parser.add_argument("--kill-after", type=float, default=0.5, help="seconds into the first run's generate")
    # 0.1: twice the single-GPU check's 0.05 (bf16 against a float32 reference), since here both runs
    # are bf16, each rounded its own way (the all-reduce changes the summation order).
    parser.add_argument("--near-tie", type=float, default=0.1, help="largest top-2 logprob margin of a tie")
    # float32: the two runs differ by summation order only (about 1e-6 relative per layer).
    parser.add_argument("--near-tie-fp32", type=float, default=0.01, help="the same, for the float32 check")
    add_workload_args(parser)
    parser.set_defaults(num_seqs=64, max_output_len=512)
    parser.add_argument(
        "--workdir", default=None, help="where the random checkpoints go (default: a temp dir)"
    )
    args = parser.parse_args()
    if args.tiny:
        args.num_seqs, args.min_input_len, args.max_input_len = 8, 10, 60
        args.min_output_len, args.max_output_len = 8, 24
        device, dtype = "cpu", "float32"
        torch.set_num_threads(1)  # this rank; the worker takes one thread too
    else:
        if torch.cuda.device_count() < 2:
            log(f"needs 2 GPUs, found {torch.cuda.device_count()}; use --tiny for a CPU dry run")
            return 2
        device, dtype = "cuda", "bfloat16"

    out = Path(os.environ.get("OUT", ".")) / "gpu_tp.json"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="nanoinfer-tp-"))
    report = Report(
        out,
        {
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
            "dtype": dtype,
            "tiny": args.tiny,
            "workload": {
                k: getattr(args, k)
                for k in (
                    "num_seqs",
                    "min_input_len",
                    "max_input_len",
                    "min_output_len",
                    "max_output_len",
                    "temperature",
                    "workload_seed",
                )
            },
        },
    )
    engine_kwargs = dict(device=device, dtype=dtype)
    ok = True
    checkpoints: dict[str, str] = {}

    def random_checkpoint(shape_name: str) -> str:
        if shape_name not in checkpoints:
            path = str(workdir / shape_name)
            started = time.perf_counter()
            shape = TINY_SHAPE if args.tiny else QWEN3_SHAPES[shape_name]
            write_random_qwen3(path, shape, device=device, max_position_embeddings=4096)
            log(f"wrote random {shape_name} checkpoint in {time.perf_counter() - started:.1f}s")
            checkpoints[shape_name] = path
        return checkpoints[shape_name]

    if not args.skip_correctness:
        log("correctness: TP=2 against TP=1, greedy, logprob-closeness rule")
        # The second check's pool holds about a quarter of its batch: sequences are preempted.
        small_pool = dict(num_kvcache_blocks=8 if args.tiny else 100)
        checks = [
            (
                "one KV head replicated (4 q / 1 kv heads)",
                lambda: build_kv1_model(str(workdir / "kv1")),
                384,
                {},
                "prefix hits",
                args.near_tie,
            ),
            (
                "qwen3-0.6b shape, small KV pool",
                lambda: random_checkpoint("qwen3-0.6b"),
                TINY_SHAPE["vocab_size"] if args.tiny else 10000,
                small_pool,
                "preemption",
                args.near_tie,
            ),
            (
                "qwen3-0.6b shape, small KV pool, float32",
                lambda: random_checkpoint("qwen3-0.6b"),
                TINY_SHAPE["vocab_size"] if args.tiny else 10000,
                dict(small_pool, dtype="float32"),
                "preemption",
                args.near_tie_fp32,
            ),
        ]
        num, lo, hi, new = (4, 24, 60, 16) if args.tiny else (16, 60, 600, 64)
        # A prefill budget below the longest prompts: chunked prefill; small graphs: a quick start.
        correctness_kwargs = dict(
            engine_kwargs,
            max_num_batched_tokens=16 if args.tiny else 256,
            max_num_seqs=32,
            max_model_len=2048,
        )
        for name, build, vocab, extra_kwargs, expect, near_tie in checks:
            try:
                model = build()
                prompts = random_prompts(num, lo, hi, vocab, seed=1)
                kwargs = dict(correctness_kwargs, **extra_kwargs)
                result = correctness_check(name, model, kwargs, prompts, new, near_tie, expect)
                ok &= result["ok"]
                report.data["correctness"].append(result)
            except Exception:
                ok = False
                report.data["errors"].append(
                    {"stage": f"correctness: {name}", "traceback": traceback.format_exc()}
                )
                log(traceback.format_exc())
            report.save()

    if not args.skip_throughput:
        log("throughput: TP=1 vs TP=2")
        for shape_name in [s for s in args.shapes.split(",") if s]:
            try:
                model = random_checkpoint(shape_name)
                vocab = TINY_SHAPE["vocab_size"] if args.tiny else QWEN3_SHAPES[shape_name]["vocab_size"]
                prompts, params = workload_from_args(args, vocab)
                # Only num_seqs sequences ever run: no CUDA graphs for larger batches.
                kwargs = dict(engine_kwargs, max_num_seqs=args.num_seqs, max_model_len=2048)
                runs = [time_throughput(shape_name, model, tp, kwargs, prompts, params) for tp in (1, 2)]
                report.data["throughput"].extend(runs)
                speedup = runs[1]["output_tok_per_s"] / runs[0]["output_tok_per_s"]
                report.data.setdefault("speedup_tp2_over_tp1", {})[shape_name] = round(speedup, 3)
                log(f"  {shape_name}: TP=2 / TP=1 throughput = {speedup:.2f}x")
            except Exception:
                report.data["errors"].append(
                    {"stage": f"throughput: {shape_name}", "traceback": traceback.format_exc()}
                )
                log(traceback.format_exc())
            report.save()
            if not args.tiny and shape_name in checkpoints:
                # The 8B checkpoint is 16 GB: do not keep it around.
                shutil.rmtree(checkpoints.pop(shape_name), ignore_errors=True)

    if not args.skip_kill:
        log("a worker killed mid-generation")
        try:
            kv1 = str(workdir / "kv1")
            if not os.path.isdir(kv1):
                build_kv1_model(kv1)
            report.data["killed_worker"] = []
            for attempt in range(args.kill_repeats):
                report.data["killed_worker"].append({"started": True})
                report.save()  # a hang still leaves a trace of how far the run got
                kill_kwargs = dict(engine_kwargs, max_model_len=2048, max_num_seqs=64)
                result = killed_worker_check(kv1, kill_kwargs, kill_after_s=args.kill_after + 0.3 * attempt)
                report.data["killed_worker"][-1] = result
                ok &= result["ok"]
        except Exception:
            report.data["errors"].append({"stage": "killed worker", "traceback": traceback.format_exc()})
            log(traceback.format_exc())

    report.data["ok"] = ok and not report.data["errors"]
    report.save()
    log(f"{'PASS' if report.data['ok'] else 'FAIL'}; results in {out}")
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
