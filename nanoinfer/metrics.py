"""Prometheus metrics of a serving engine, on a registry of its own (so several servers can coexist).

Per-request timings arrive from the engine thread through the RequestStatsListener methods; engine-wide
numbers (queue lengths, KV cache use, preemptions, prefix-cache hits) are copied from
``LLMEngine.stats()`` when the metrics are scraped.
"""

from __future__ import annotations

import bisect
import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

# Bucket edges in seconds, spanning a tiny CPU model to long prompts on a loaded GPU.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
_E2E_BUCKETS = (
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
)

# Engine stats that only grow, and the counter each one feeds.
_CUMULATIVE_STATS = {
    "num_preemptions": "preemptions",
    "prefix_cache_queried_tokens": "prefix_cache_queries",
    "prefix_cache_hit_tokens": "prefix_cache_hits",
}


class _PerTokenMetrics:
    """The two series that move with every generated token (the token counter and the inter-token
    latency histogram), kept in plain numbers and exported by this collector at scrape time.
    prometheus_client's Counter and Histogram take a lock and walk their value objects on each update:
    at hundreds of requests per step that was a measurable share of the API process's CPU."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._tokens = 0
        self._itl_counts = [0] * (len(_ITL_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self._itl_sum = 0.0

    def add(self, num_tokens: int, itl_s: float | None) -> None:
        """``num_tokens`` new tokens; with ``itl_s``, they arrived ``itl_s`` after the previous ones (and
        share that gap, as tokens that arrive together in one step do)."""
        with self._lock:
            self._tokens += num_tokens
            if itl_s is not None:
                gap = itl_s / num_tokens
                self._itl_counts[bisect.bisect_left(_ITL_BUCKETS, gap)] += num_tokens
                self._itl_sum += itl_s

    def collect(self):
        with self._lock:
            tokens, counts, total = self._tokens, list(self._itl_counts), self._itl_sum
        labels = [self.model_name]
        counter = CounterMetricFamily(
            "nanoinfer:generation_tokens", "Generated tokens.", labels=["model_name"]
        )
        counter.add_metric(labels, tokens)
        yield counter
        histogram = HistogramMetricFamily(
            "nanoinfer:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            labels=["model_name"],
        )
        cumulative, buckets = 0, []
        for bound, count in zip([*map(repr, _ITL_BUCKETS), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram.add_metric(labels, buckets, total)
        yield histogram


class ServingMetrics:
    """All serving metrics, labelled with the served model name; a RequestStatsListener."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        # Without this every counter and histogram also exports a `_created` timestamp series, which
        # doubles the output for no use here. (A process-wide switch, as in vLLM.)
        prometheus_client.disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def labelled(metric):
            return metric.labels(model_name=model_name)

        self.requests_running = labelled(
            Gauge("nanoinfer:num_requests_running", "Requests in the running batch.", labels, registry=r)
        )
        self.requests_waiting = labelled(
            Gauge("nanoinfer:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        )
        self.kv_cache_usage = labelled(
            Gauge(
                "nanoinfer:kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1).",
                labels,
                registry=r,
            )
        )
        self.prefix_cache_hit_rate = labelled(
            Gauge(
                "nanoinfer:prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
                labels,
                registry=r,
            )
        )
        self.preemptions = labelled(
            Counter("nanoinfer:num_preemptions", "Requests preempted to free KV blocks.", labels, registry=r)
        )
        self.prefix_cache_queries = labelled(
            Counter(
                "nanoinfer:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                labels,
                registry=r,
            )
        )
        self.prefix_cache_hits = labelled(
            Counter(
                "nanoinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
            )
        )
        self.prompt_tokens = labelled(
            Counter(
                "nanoinfer:prompt_tokens",
                "Prompt tokens of requests that started generating.",
                labels,
                registry=r,
            )
        )
        self._per_token = _PerTokenMetrics(model_name)
        r.register(self._per_token)
        self._request_success = Counter(
            "nanoinfer:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.time_to_first_token = labelled(
            Histogram(
                "nanoinfer:time_to_first_token_seconds",
                "Time from arrival to the first generated token.",
                labels,
                buckets=_TTFT_BUCKETS,
                registry=r,
            )
        )
        self.e2e_request_latency = labelled(
            Histogram(
                "nanoinfer:e2e_request_latency_seconds",
                "Time from arrival to the last token (or the abort).",
                labels,
                buckets=_E2E_BUCKETS,
                registry=r,
            )
        )
        self._last_cumulative = dict.fromkeys(_CUMULATIVE_STATS, 0)

    # -- RequestStatsListener (called on the engine thread) -------------------------------------------

    def on_prompt(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_new_tokens(self, num_tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        self._per_token.add(num_tokens, itl_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)

    def on_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._request_success.labels(model_name=self._model_name, finished_reason=finish_reason).inc()
        self.e2e_request_latency.observe(e2e_s)

    # -- scraping ---------------------------------------------------------------------------------------

    def update_engine_stats(self, stats: dict[str, int]) -> None:
        """Copies a ``LLMEngine.stats()`` snapshot into the gauges and cumulative counters."""
        self.requests_running.set(stats.get("num_running", 0))
        self.requests_waiting.set(stats.get("num_waiting", 0))
        total = stats.get("num_kv_blocks_total", 0)
        if total:
            self.kv_cache_usage.set(1.0 - stats.get("num_kv_blocks_free", total) / total)
        queried = stats.get("prefix_cache_queried_tokens", 0)
        self.prefix_cache_hit_rate.set(stats.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0)
        for key, counter_name in _CUMULATIVE_STATS.items():
            value = stats.get(key, 0)
            delta = value - self._last_cumulative[key]
            if delta > 0:
                getattr(self, counter_name).inc(delta)
            self._last_cumulative[key] = max(value, self._last_cumulative[key])

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
