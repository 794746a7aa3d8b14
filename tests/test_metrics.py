"""The per-token series kept outside prometheus_client export what its own Histogram and Counter would."""

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nanoinfer.metrics import _ITL_BUCKETS, ServingMetrics


def _samples(text: bytes, prefix: str) -> dict:
    return {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name.startswith(prefix)
    }


def test_per_token_series_match_prometheus_client():
    rng = random.Random(0)
    metrics = ServingMetrics("m")
    registry = CollectorRegistry()
    tokens = Counter("nanoinfer:generation_tokens", "Generated tokens.", ["model_name"], registry=registry)
    itl = Histogram(
        "nanoinfer:inter_token_latency_seconds",
        "ITL",
        ["model_name"],
        buckets=_ITL_BUCKETS,
        registry=registry,
    )
    for _ in range(2000):
        num_tokens = rng.choice([1, 1, 1, 2, 4])
        # Gaps on the bucket bounds too (a bound is inclusive).
        gap = rng.choice([rng.uniform(0, 3), rng.choice(_ITL_BUCKETS)]) * num_tokens
        first = rng.random() < 0.05
        metrics.on_new_tokens(num_tokens, 0.1 if first else None, None if first else gap)
        tokens.labels(model_name="m").inc(num_tokens)
        if not first:
            for _ in range(num_tokens):
                itl.labels(model_name="m").observe(gap / num_tokens)
    ours = _samples(metrics.render(), "nanoinfer:inter_token_latency_seconds")
    reference = _samples(generate_latest(registry), "nanoinfer:inter_token_latency_seconds")
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert abs(ours[key] - value) <= 1e-6 * max(1.0, abs(value)), key
    assert _samples(metrics.render(), "nanoinfer:generation_tokens") == _samples(
        generate_latest(registry), "nanoinfer:generation_tokens"
    )
