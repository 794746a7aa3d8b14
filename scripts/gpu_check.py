"""GPU correctness check for the whole engine, in one run on a CUDA machine.

1. Kernels: runs scripts/gpu_kernels.py (every Triton kernel against its torch reference, bf16).
2. Engine vs transformers, bf16, on random-weight Qwen3 checkpoints built here (head_dim 64 and 128):
   greedy tokens in eager mode and with CUDA graphs, block sizes 16 and 256, compared with the
   logprob-closeness rule: the first divergence must be at a near-tie of the float32 reference
   (top-2 logit margin under NEAR_TIE).
3. Chunked prefill, prefix-cache hits and preemption on the GPU, against the same reference.
4. The FP8 KV cache against the bf16 one; structured outputs (valid, other rows untouched).

Writes $OUT/gpu_check.json; exits non-zero on any failure.
Usage: python3 scripts/gpu_check.py [--skip-kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoinfer import LLM, SamplingParams  # noqa: E402
from tests.fixtures import build_model  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402

# bf16 rounding moves logits by ~1e-2 of their scale; below this float32 margin a flip is a near-tie.
NEAR_TIE = 0.05
MAX_TOKENS = 48
RESULTS: dict = {"checks": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def first_divergence(got: list[int], ref: list[int], margins: list[float]) -> tuple[bool, str]:
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):  # lengths are compared after
        if a != b:
            ok = margins[i] < NEAR_TIE
            return ok, f"diverged at {i} (margin {margins[i]:.4f}: {'near-tie' if ok else 'NOT a near-tie'})"
    return len(got) == len(ref), "identical"


def check(name: str, llm: LLM, hf, prompts: list[list[int]], refs: dict) -> bool:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    all_ok = True
    notes = []
    for prompt, out in zip(prompts, outputs, strict=True):
        key = tuple(prompt)
        if key not in refs:
            refs[key] = hf_greedy(hf, prompt, MAX_TOKENS)
        ok, note = first_divergence(out.outputs[0].token_ids, *refs[key])
        all_ok &= ok
        notes.append(note)
    stats = llm.engine_stats()
    leak_free = stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    all_ok &= leak_free
    entry = {
        "name": name, "ok": all_ok, "notes": notes, "leak_free": leak_free,
        "cached_tokens": [o.num_cached_tokens for o in outputs], "preemptions": stats["num_preemptions"],
    }  # fmt: skip
    RESULTS["checks"].append(entry)
    log(
        f"{'PASS' if all_ok else 'FAIL'} {name}: {notes} cached={entry['cached_tokens']} "
        f"preempt={stats['num_preemptions']}"
    )
    return all_ok


class _HFOnDevice:
    """transformers model in float32 on the GPU: the reference for bf16 runs."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()

    def __call__(self, input_ids, **kwargs):
        return self.model(input_ids.cuda(), **kwargs)


def _check_model(prefix: str, head_dim: int = 128) -> str:
    """The engine checks' random bf16 checkpoint (Qwen3-like: 4 layers, 8 query and 2 KV heads), in a
    fresh temporary directory."""
    return build_model(
        tempfile.mkdtemp(prefix=prefix), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048, weight_std=0.04,
        dtype="bfloat16",
    )  # fmt: skip


def engine_checks() -> bool:
    ok = True
    rng = random.Random(0)
    for head_dim in (128, 64):
        path = _check_model(f"gpu-check-hd{head_dim}-", head_dim=head_dim)
        hf = _HFOnDevice(path)
        refs: dict = {}
        prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 15, 16, 17, 100, 300, 700)]
        for block_size in (16, 256):
            for eager in (True, False):
                mode = "eager" if eager else "cudagraph"
                llm = LLM(path, kvcache_block_size=block_size, enforce_eager=eager)
                graphs = llm.llm_engine.engine_core.executor.runner.graphs
                graphs_ok = eager or (graphs is not None and bool(graphs.graphs))
                ok &= check(f"hd{head_dim} bs{block_size} {mode}", llm, hf, prompts, refs) and graphs_ok
                llm.close()
        # Synchronous scheduling (async is the default on CUDA): the same rule against the reference.
        llm = LLM(path, kvcache_block_size=16, async_scheduling=False)
        ok &= check(f"hd{head_dim} sync scheduling", llm, hf, prompts, refs)
        llm.close()
        # Chunked prefill (mixed prefill + decode steps), then prefix hits on a second batch sharing the
        # prompts' prefixes.
        llm = LLM(path, kvcache_block_size=16, max_num_batched_tokens=64)
        ok &= check(f"hd{head_dim} chunked prefill (64-token budget)", llm, hf, prompts, refs)
        shared = [p[:96] + [5, 6, 7] for p in prompts if len(p) >= 100]
        ok &= check(f"hd{head_dim} prefix hits", llm, hf, shared, refs)
        ok &= all(c > 0 for c in RESULTS["checks"][-1]["cached_tokens"])
        llm.close()
        # Preemption: the first five prompts need 25 blocks at full length, one more than the pool
        # (the longest prompt alone needs 22, so every request fits on its own).
        llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=24, enforce_eager=False)
        ok &= check(f"hd{head_dim} preemption", llm, hf, prompts[:6], refs)
        ok &= RESULTS["checks"][-1]["preemptions"] > 0
        llm.close()
        del hf
        torch.cuda.empty_cache()
    return ok


def fp8_checks() -> bool:
    """FP8 KV cache against the bf16 cache on the GPU: greedy generations of 80 prompts under vLLM's
    check_logprobs_close rule (identical, or at the first mismatch each side's token is in the other's
    top-5 logprobs), through chunked prefill and prefix hits. With this model's 2 KV heads, decode rows
    from 66 up (a program per SM on 132 SMs) run the CUDA FP8 kernel, fewer the Triton kernel."""
    rng = random.Random(1)
    path = _check_model("gpu-check-fp8-")
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(20, 700))] for _ in range(80)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, kv_cache_dtype=kv, max_num_batched_tokens=512)
        outputs[kv] = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine_stats()
        leak_free = stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        outputs[kv + "_blocks"] = stats["num_kv_blocks_total"]
        llm.close()
    identical, failures = 0, []
    for i, (a, b) in enumerate(zip(outputs["auto"], outputs["fp8"], strict=True)):
        x, y = a.outputs[0], b.outputs[0]
        for j, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if tx != ty:
                if not (tx in y.logprobs[j] and ty in x.logprobs[j]):
                    failures.append(f"prompt {i} diverged at {j} outside the top-5")
                break
        else:
            identical += 1
    ok = not failures and leak_free
    RESULTS["fp8"] = {
        "ok": ok, "identical": identical, "failures": failures,
        "blocks_bf16": outputs["auto_blocks"], "blocks_fp8": outputs["fp8_blocks"],
    }  # fmt: skip
    verdict = "PASS" if ok else "FAIL"
    log(f"{verdict} fp8 vs bf16 KV: {identical}/{len(prompts)} identical, failures {failures}")
    return ok


def _logprobs_close(x, y) -> bool:
    """vLLM's check_logprobs_close: identical, or at the first mismatch each side's token is in the
    other's top logprobs."""
    for j, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
        if tx != ty:
            return tx in y.logprobs[j] and ty in x.logprobs[j]
    return True


def structured_checks() -> bool:
    """Structured outputs on the GPU (the Triton bitmask kernel, sampling deferred behind the forward
    pass under async scheduling): every constrained output is valid, and the unconstrained rows of the
    same batch are token-identical to a run without the constrained ones. Constraints after a
    reasoning span (its rows unconstrained until the span's end token, which a logit bias brings
    about) give valid answers after that token."""
    import re

    from nanoinfer import StructuredOutputsParams
    from nanoinfer.structured import ReasoningSpan

    path = _check_model("gpu-check-structured-")
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        },
        "required": ["name", "n", "tags"],
        "additionalProperties": False,
    }
    regex = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
    llm = LLM(path)
    plain = [
        SamplingParams(temperature=t, seed=i, max_tokens=32, ignore_eos=True, logprobs=5)
        for i, t in enumerate((0, 1))
    ]
    alone = llm.generate(["hello", "world"], plain, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=StructuredOutputsParams(
            **({"json": schema} if i % 2 else {"regex": regex})))
        for i in range(16)
    ]  # fmt: skip
    # Two ids of the tiny tokenizer stand for <think> and </think>: the prompt opened the reasoning.
    span = ReasoningSpan(
        *(llm.get_tokenizer().encode(t, add_special_tokens=False)[0] for t in "<>"), opened=True
    )
    constrained += [
        SamplingParams(temperature=1.0, seed=i, max_tokens=160, logit_bias={span.end_token_id: 5},
                       structured_outputs=StructuredOutputsParams(json=schema, reasoning=span))
        for i in range(16, 20)
    ]  # fmt: skip
    outputs = llm.generate(["hello", "world"] + ["data"] * 20, plain + constrained, use_tqdm=False)
    # Batch shapes differ between the runs, so bf16 logits may differ in rounding: the closeness rule.
    untouched = all(
        _logprobs_close(a.outputs[0], b.outputs[0]) for a, b in zip(alone, outputs[:2], strict=True)
    )
    invalid = []
    for i, output in enumerate(outputs[2:]):
        text = output.outputs[0].text
        if i >= 16:  # the answer after the reasoning span
            ids = output.outputs[0].token_ids
            end = ids.index(span.end_token_id) + 1 if span.end_token_id in ids else len(ids)
            text = llm.get_tokenizer().decode(ids[end:], skip_special_tokens=True)
        try:
            valid = (
                bool(re.fullmatch(regex, text))
                if i % 2 == 0 and i < 16
                else isinstance(json.loads(text), dict)
            )
        except ValueError:
            valid = False
        if not valid or output.outputs[0].finish_reason != "stop":
            invalid.append(text)
    stats = llm.engine_stats()
    leak_free = stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    llm.close()
    ok = untouched and not invalid and leak_free
    RESULTS["structured"] = {"ok": ok, "untouched": untouched, "invalid": invalid, "leak_free": leak_free}
    log(f"{'PASS' if ok else 'FAIL'} structured outputs: untouched={untouched} invalid={invalid}")
    return ok


def _with_and_without_graphs(
    path: str, prompts: list, params: list, graphs_name: str, replay_name: str
) -> tuple[bool, list[list[list[int]]], list[int]]:
    """The prompts' tokens from two fresh engines, the first with the decode graphs in the CudaGraphs
    attribute ``graphs_name``, the second with those dropped: whether they were captured, each run's
    tokens, and how many times each run called the replay method ``replay_name``."""
    tokens, replays = [], []
    captured = True
    for keep in (True, False):
        llm = LLM(path)
        graphs = llm.llm_engine.engine_core.executor.runner.graphs
        chosen = getattr(graphs, graphs_name)
        captured = captured and bool(chosen)
        if not keep:
            chosen.clear()
        calls = [0]
        replay = getattr(graphs, replay_name)

        def counted(batch_size, _replay=replay, _calls=calls):
            _calls[0] += 1
            return _replay(batch_size)

        setattr(graphs, replay_name, counted)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        replays.append(calls[0])
        llm.close()
    return captured, tokens, replays


def _report_comparison(
    key: str, label: str, ok: bool, captured: bool, tokens: list[list[list[int]]], replays: list[int]
) -> bool:
    """Records and logs a with-and-without-graphs comparison (``_with_and_without_graphs``)."""
    mismatched = [i for i, (a, b) in enumerate(zip(*tokens, strict=True)) if a != b]
    RESULTS[key] = {"ok": ok, "captured": captured, "replays": replays, "mismatched_prompts": mismatched}
    log(f"{'PASS' if ok else 'FAIL'} {label}: replays {replays}, mismatched prompts {mismatched}")
    return ok


def graph_sampling_checks() -> bool:
    """Temperature-only sampling inside the decode graphs against the same engine sampling after the
    graph's forward pass (its sampling graphs dropped): identical tokens, greedy and seeded rows."""
    path = _check_model("gpu-check-graph-sampling-")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 40, 90, 200, 333, 20, 64, 7, 150)]
    params = [
        SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, seed=i, max_tokens=40, ignore_eos=True)
        for i in range(len(prompts))
    ]
    captured, tokens, replays = _with_and_without_graphs(
        path, prompts, params, "sampling_graphs", "replay_and_sample"
    )
    ok = captured and tokens[0] == tokens[1]
    return _report_comparison(
        "graph_sampling", "sampling inside the decode graphs", ok, captured, tokens, replays
    )


def masked_graph_sampling_checks() -> bool:
    """Constrained rows sampled by the masked sampling graphs (bitmask and inverse-CDF sampling in one replay)
    against the same engine sampling them eagerly after the forward graph (its masked graphs dropped):
    identical tokens for the constrained rows and the unconstrained ones beside them."""
    from nanoinfer import StructuredOutputsParams

    path = _check_model("gpu-check-masked-sampling-")
    regex = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
    params = [
        SamplingParams(
            temperature=0.9, seed=i, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=regex)
        )
        for i in range(6)
    ] + [SamplingParams(temperature=0.8, seed=20 + i, max_tokens=40, ignore_eos=True) for i in range(3)]
    prompts = ["data", "hello", "world"] * 3
    captured, tokens, used = _with_and_without_graphs(
        path, prompts, params, "masked_sampling_graphs", "replay_masked_sampling"
    )
    ok = captured and used[0] >= 10 and used[1] == 0 and tokens[0] == tokens[1]
    return _report_comparison("masked_graph_sampling", "masked sampling graphs", ok, captured, tokens, used)


ENGINE_CHECKS = {
    "engine": engine_checks,
    "graph_sampling": graph_sampling_checks,
    "fp8": fp8_checks,
    "structured": structured_checks,
    "masked_graph_sampling": masked_graph_sampling_checks,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--only", nargs="+", choices=sorted(ENGINE_CHECKS), help="these engine checks only")
    opts = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    ok = True
    if not opts.skip_kernels:
        started = time.perf_counter()
        kernel_run = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_kernels.py"), "--quick"])
        RESULTS["kernels_ok"] = kernel_run.returncode == 0
        ok &= RESULTS["kernels_ok"]
        log(
            f"[kernels] {'PASS' if RESULTS['kernels_ok'] else 'FAIL'} in {time.perf_counter() - started:.0f}s"
        )
    try:
        started = time.perf_counter()
        for name, check in ENGINE_CHECKS.items():
            if opts.only is None or name in opts.only:
                ok &= check()
        log(f"[engine] {time.perf_counter() - started:.0f}s")
    except Exception:  # noqa: BLE001 - report and fail
        RESULTS["error"] = traceback.format_exc()
        log(RESULTS["error"])
        ok = False
    RESULTS["ok"] = bool(ok)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))
    log("GPU CHECK " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
