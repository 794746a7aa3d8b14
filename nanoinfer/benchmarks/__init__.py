"""Benchmarks: `throughput` (the engine alone) and `serve` (a running OpenAI-compatible server)."""
