"""Serving benchmark: random prompts sent to a running OpenAI-compatible server at a given request rate.

Prompts are random token ids (optionally behind a shared prefix) sent as token-id lists to
/v1/completions (or as decoded text to /v1/chat/completions), with ignore_eos so that every output has
exactly the requested length. Arrivals are a Poisson process at --request-rate (or all at once for
inf), capped at --max-concurrency in flight. Every request streams, which gives TTFT (time to the first
text), ITL (gaps between text chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # reported in milliseconds
PERCENTILES = (50, 90, 99)
_MAX_ERRORS_KEPT = 5


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RequestResult:
    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


# -- arguments -----------------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name to request (as served)")
    parser.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the model's directory or .gguf file, for its tokenizer (default: --model, which is a path "
        "when the server was started as `nanoinfer serve PATH` without --served-model-name)",
    )
    parser.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens after the prefix")
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [L*(1-R), L*(1+R)]; 0 makes them exact",
    )
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0, help="random tokens shared by all prompts"
    )
    parser.add_argument(
        "--request-rate", type=_rate, default=math.inf, help="requests per second (Poisson), or inf (default)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly the output length (vLLM's ignore_eos); --no-ignore-eos for servers that "
        "reject the field (transformers serve)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs a good request meets, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)",
    )
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="sweep --request-rates and plot latency vs rate to this file (needs matplotlib)",
    )
    parser.add_argument(
        "--request-rates", default=None, help="comma-separated rates for --plot, e.g. 1,2,4,inf"
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="untimed requests (their own random prompts) sent first, so that one-time costs stay out",
    )
    parser.add_argument("--seed", type=int, default=0)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request rate must be a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0, got {text!r}")
    return value


def parse_request_rates(text: str) -> list[float]:
    try:
        rates = [_rate(part.strip()) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--request-rates: {e}") from None
    if not rates:
        raise ValueError("--request-rates needs at least one rate, e.g. 1,2,4,inf")
    return rates


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput entries look like ttft:MS, tpot:MS or e2el:MS; got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} needs a number of milliseconds, got {value!r}") from None
        if not slos[name] > 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {value!r}")
    return slos


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.shared_prefix_len < 0:
        raise ValueError(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if (args.plot is None) != (args.request_rates is None):
        raise ValueError("--plot and --request-rates go together")
    # Checked before the run, which can take long, rather than when its results are in.
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or nanoinfer[bench])")
    for flag, path in (("--plot", args.plot), ("--result-file", args.result_file)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag}: the directory of {path!r} does not exist")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the checkpoint at ``path`` (a Hugging Face directory or a .gguf file)."""
    from nanoinfer.models.checkpoint import load_tokenizer as load_checkpoint_tokenizer

    if not os.path.exists(path):
        raise ValueError(
            f"no tokenizer at {path!r}: pass --tokenizer with the served model's directory or .gguf file "
            "(nothing is downloaded from a model hub)"
        )
    try:
        return load_checkpoint_tokenizer(path)
    except OSError as e:  # transformers' "can't load tokenizer" for a directory without tokenizer files
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None


# -- dataset -------------------------------------------------------------------------------------------------


def sample_random_requests(
    vocab_ids: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    shared_prefix_len: int = 0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token-id prompts: ``shared_prefix_len`` common tokens, then about ``input_len`` own ones."""
    rng = random.Random(seed)

    def length(center: int) -> int:
        low = max(1, math.floor(center * (1 - range_ratio)))
        high = max(low, math.ceil(center * (1 + range_ratio)))
        return rng.randint(low, high)

    prefix = rng.choices(vocab_ids, k=shared_prefix_len)
    return [
        BenchRequest(prefix + rng.choices(vocab_ids, k=length(input_len)), length(output_len))
        for _ in range(num_prompts)
    ]


def _vocab_ids(tokenizer: Any) -> list[int]:
    """Token ids a random prompt may use: everything but special tokens (EOS, chat markers...)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


# -- sending -------------------------------------------------------------------------------------------------


def _payload(
    endpoint: str,
    model: str,
    request: BenchRequest,
    temperature: float,
    tokenizer: Any,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    common = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        common["ignore_eos"] = True
    if endpoint == "/v1/chat/completions":
        text = tokenizer.decode(request.prompt_token_ids)
        return {
            **common,
            "messages": [{"role": "user", "content": text}],
            # Both names: servers that know only the older one (transformers serve) honour it too.
            "max_tokens": request.output_len,
            "max_completion_tokens": request.output_len,
        }
    return {**common, "prompt": request.prompt_token_ids, "max_tokens": request.output_len}


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return text


async def send_request(
    session: Any, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> RequestResult:
    """Streams one request; timestamps every network read that brings text. Events are split by hand on
    the raw bytes (one Python pass per read, not per line): the client has to keep up with a server that
    sends one event per step for hundreds of streams."""
    prompt_len = len(payload["prompt"]) if "prompt" in payload else 0
    result = RequestResult(success=False, prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    got_text = False
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:300]}"
                return result
            pending = b""
            done = False
            async for data in response.content.iter_any():
                pending += data
                *events, pending = pending.split(b"\n\n")
                text = False
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        body = line[len(b"data:") :].strip()
                        if body == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(body)
                        if "error" in chunk:
                            result.error = f"stream error: {chunk['error']}"
                            return result
                        text = text or bool(_chunk_text(chunk))
                        usage = chunk.get("usage")
                        if usage:
                            result.output_tokens = usage.get("completion_tokens", 0)
                            result.prompt_len = usage.get("prompt_tokens", prompt_len)
                if text:
                    now = time.perf_counter()
                    if got_text:
                        result.itl_s.append(now - last)
                    else:
                        result.ttft_s = now - start
                        got_text = True
                    last = now
                if done:
                    break
    except Exception as e:  # connection refused, reset, bad JSON...: the request failed
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el_s = time.perf_counter() - start
    if not got_text:
        result.ttft_s = result.e2el_s  # no text at all: the whole request was the wait
    if not result.output_tokens:
        result.output_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens") or 0
    result.success = True
    return result


async def run_benchmark(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    tokenizer: Any = None,
    api_key: str | None = None,
    seed: int = 0,
    warmup_requests: Sequence[BenchRequest] = (),
    ignore_eos: bool = True,
) -> tuple[list[RequestResult], float]:
    """Sends all requests (Poisson arrivals at ``request_rate``); returns their results and the duration.

    ``warmup_requests`` go first, all at once, untimed. The client is aiohttp (as vLLM's benchmark):
    at hundreds of concurrent streams httpx's connection pool and line decoding cost more CPU than the
    server under test.
    """
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + endpoint
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await _check_model(session, base_url, model, headers)

        async def one(request: BenchRequest) -> RequestResult:
            payload = _payload(endpoint, model, request, temperature, tokenizer, ignore_eos)
            if semaphore is None:
                return await send_request(session, url, payload, headers)
            async with semaphore:
                return await send_request(session, url, payload, headers)

        warmups = await asyncio.gather(*(one(request) for request in warmup_requests))
        failed = [w.error for w in warmups if not w.success]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}")

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.ensure_future(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    for request, result in zip(requests, results, strict=True):
        if not result.prompt_len:
            result.prompt_len = len(request.prompt_token_ids)
    return list(results), duration


async def _check_model(session: Any, base_url: str, model: str, headers: dict[str, str]) -> None:
    """Fails fast, before the timed run, if the server is unreachable or does not serve ``model``."""
    import aiohttp

    try:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
            status, body = response.status, await response.read()
    except aiohttp.ClientError as e:
        raise RuntimeError(f"cannot reach the server at {base_url}: {e!r}") from e
    if status != 200:
        raise RuntimeError(f"GET /v1/models failed with HTTP {status}: {body[:300].decode(errors='replace')}")
    served = [card.get("id") for card in json.loads(body).get("data", [])]
    # An empty list: a server that loads models on demand (transformers serve lists only its cache).
    if served and model not in served:
        raise RuntimeError(f"the server does not serve {model!r}; it serves {served}")


# -- statistics ----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(
    results: list[RequestResult], duration_s: float, goodput_slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Throughputs, latency statistics (ms) and goodput of one run."""
    ok = [r for r in results if r.success]
    samples_ms = {
        "ttft": [r.ttft_s * 1000 for r in ok],
        "tpot": [r.tpot_s * 1000 for r in ok if r.tpot_s is not None],
        "itl": [gap * 1000 for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s * 1000 for r in ok],
    }
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if goodput_slos:
        good = sum(1 for r in ok if _meets_slos(r, goodput_slos))
        summary["goodput"] = good / duration
        summary["goodput_slos_ms"] = dict(goodput_slos)
    for metric in LATENCY_METRICS:
        values = samples_ms[metric]
        summary[f"mean_{metric}_ms"] = sum(values) / len(values) if values else 0.0
        summary[f"median_{metric}_ms"] = percentile(values, 50)
        for q in PERCENTILES:
            if q != 50:
                summary[f"p{q}_{metric}_ms"] = percentile(values, q)
    summary["errors"] = [r.error for r in results if not r.success][:_MAX_ERRORS_KEPT]
    return summary


def _meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s or 0.0, "e2el": result.e2el_s}
    return all(measured[name] * 1000 <= limit for name, limit in slos.items())


def format_table(summary: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total generated tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    if "goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['goodput']:.2f}"))
    names = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency"}
    names["e2el"] = "End-to-end latency"
    for metric in LATENCY_METRICS:
        rows.append((f"-- {names[metric]} (ms) --", ""))
        rows.append(("Mean", f"{summary[f'mean_{metric}_ms']:.2f}"))
        rows.append(("Median", f"{summary[f'median_{metric}_ms']:.2f}"))
        for q in PERCENTILES[1:]:
            rows.append((f"P{q}", f"{summary[f'p{q}_{metric}_ms']:.2f}"))
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * (width + 14), " Serving Benchmark Result ".center(width + 14, "=")]
    lines += [f"{label:<{width}}{value:>14}" if value else label for label, value in rows]
    lines.append("=" * (width + 14))
    return "\n".join(lines)


def plot_sweep(runs: list[dict[str, Any]], path: str) -> None:
    """Latency percentiles (and output throughput) against request rate, one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_rate_label(run["request_rate"]) for run in runs]
    x = list(range(len(runs)))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, metric, title in zip(
        axes,
        ("ttft", "tpot", "e2el"),
        ("Time to first token", "Time per output token", "End-to-end latency"),
        strict=False,
    ):
        for q in PERCENTILES:
            key = f"median_{metric}_ms" if q == 50 else f"p{q}_{metric}_ms"
            ax.plot(x, [run[key] for run in runs], marker="o", label=f"p{q}")
        ax.set_title(f"{title} (ms)")
        ax.set_ylabel("ms")
    axes[3].plot(x, [run["output_throughput"] for run in runs], marker="o", color="black")
    axes[3].set_title("Output throughput (tok/s)")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{runs[0]['model']} at {runs[0]['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(sweeps: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Several servers' sweeps (label -> runs of one request-rate sweep each) on one figure: TTFT p50
    and p99, TPOT p50 and output throughput against request rate, log-scaled (peers differ by orders of
    magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(
        {_rate_label(run["request_rate"]) for runs in sweeps.values() for run in runs},
        key=lambda label: math.inf if label == "inf" else float(label),
    )
    panels = (
        ("median_ttft_ms", "TTFT p50 (ms)"),
        ("p99_ttft_ms", "TTFT p99 (ms)"),
        ("median_tpot_ms", "TPOT p50 (ms)"),
        ("output_throughput", "Output throughput (tok/s)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 4.5))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label, runs in sweeps.items():
            points = sorted((rates.index(_rate_label(run["request_rate"])), run[key]) for run in runs)
            # A zero cannot be drawn on a log scale (a server that sends a whole reply at once has TPOT 0).
            points = [(x, y) for x, y in points if y > 0]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate_label(rate: float | str) -> str:
    return "inf" if rate == "inf" or rate == math.inf else f"{rate:g}"


# -- entry points --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark (or the rate sweep) described by ``args``; returns the exit status."""
    try:
        _validate(args)
        slos = parse_goodput(args.goodput)
        rates = parse_request_rates(args.request_rates) if args.plot else [args.request_rate]
        tokenizer = load_tokenizer(args.tokenizer or args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab_ids = _vocab_ids(tokenizer)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    runs = []
    for i, rate in enumerate(rates):
        # Fresh prompts for each rate of a sweep (reused ones would be prefix-cache hits), and warm-up
        # prompts of their own.
        requests, warmups = (
            sample_random_requests(
                vocab_ids,
                count,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                args.shared_prefix_len,
                seed,
            )
            for count, seed in ((args.num_prompts, args.seed + i), (args.num_warmups, -1 - args.seed - i))
        )
        cpu_before = time.process_time()
        try:
            results, duration = asyncio.run(
                run_benchmark(
                    args.base_url,
                    args.endpoint,
                    args.model,
                    requests,
                    rate,
                    args.max_concurrency,
                    args.temperature,
                    tokenizer,
                    api_key,
                    args.seed,
                    warmups,
                    args.ignore_eos,
                )
            )
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        summary = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": args.model,
            "num_prompts": args.num_prompts,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "shared_prefix_len": args.shared_prefix_len,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "max_concurrency": args.max_concurrency,
            **summarize(results, duration, slos),
            # This client's CPU seconds (warm-up included): close to duration_s, the client was the limit.
            "client_cpu_s": time.process_time() - cpu_before,
        }
        print(f"request rate {_rate_label(rate)} req/s")
        print(format_table(summary))
        runs.append(summary)
    # The results first: a plot that fails must not lose them.
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"runs": runs} if args.plot else runs[0], f, indent=2)
    if args.plot:
        plot_sweep(runs, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if all(run["completed"] for run in runs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nanoinfer bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(parser)
    return run(parser.parse_args(argv))
