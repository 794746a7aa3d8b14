"""Prometheus metrics of a serving engine, on a registry of its own (so several servers can coexist).

Per-request timings arrive from the engine thread through the RequestStatsListener methods; engine-wide
numbers (queue lengths, KV cache use, preemptions, prefix-cache hits) are copied from
``LLMEngine.stats()`` when the metrics are scraped.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.generation_tokens = labelled(
            Counter("nanoinfer:generation_tokens", "Generated tokens.", labels, registry=r)
        )
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
        self.inter_token_latency = labelled(
            Histogram(
                "nanoinfer:inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request.",
                labels,
                buckets=_ITL_BUCKETS,
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
        self.generation_tokens.inc(num_tokens)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        if itl_s is not None:
            # Tokens that arrive together (several per step) share the gap.
            for _ in range(num_tokens):
                self.inter_token_latency.observe(itl_s / num_tokens)

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
