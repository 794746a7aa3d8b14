"""The offline benchmark's probes measure what they say (CPU, tiny random model)."""

from nanoinfer import LLM
from nanoinfer.benchmarks import throughput
from tests.fixtures import build_model


def _engine(tmp_path) -> LLM:
    # Token ids up to 10,000, as the probes draw them.
    return LLM(
        build_model(str(tmp_path), vocab_size=10240),
        device="cpu",
        max_num_batched_tokens=1024,
        max_model_len=1024,
        max_num_seqs=16,
    )


def test_prefill_probes_of_one_engine_never_hit_the_prefix_cache(tmp_path):
    llm = _engine(tmp_path)
    try:
        eager = throughput.prefill_step_time(llm, num_tokens=512, seed=throughput.EAGER_PREFILL_SEED)
        later = throughput.prefill_step_time(llm, num_tokens=512)
        assert eager["tokens"] == later["tokens"] == 512
        assert eager["cached_tokens"] == later["cached_tokens"] == 0
        # The count sees hits: the same probe again finds its prompts cached.
        assert throughput.prefill_step_time(llm, num_tokens=512)["cached_tokens"] > 0
    finally:
        llm.close()


def test_single_sequence_latency_prefills_every_prompt(tmp_path):
    llm = _engine(tmp_path)
    try:
        first = throughput.single_sequence_latency(llm)
        again = throughput.single_sequence_latency(llm, seed=throughput.WITHOUT_PDL_SEED)
        assert first["cached_tokens"] == again["cached_tokens"] == 0
        assert {"ttft_ms", "tpot_ms"} <= first.keys()  # timings: not asserted (a noisy CPU)
    finally:
        llm.close()
