"""The offline benchmark's probes measure what they say (CPU, tiny random model)."""

from nanoinfer import LLM, SamplingParams
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


def test_recorded_steps_cover_every_scheduled_token(tmp_path):
    llm = _engine(tmp_path)
    try:
        prompts = [[7] * 300, [8] * 120, [9] * 40]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with throughput._recorded_steps(llm) as steps:
            llm.generate(prompts, params, use_tqdm=False)
        # Every prompt token once, then one token per step for each of the other 5 outputs.
        assert sum(s.tokens for s in steps) == 300 + 120 + 40 + 3 * 5
        assert all(s.gpu_ms is None and s.gpu_idle_ms is None for s in steps)  # no device off CUDA
    finally:
        llm.close()


def test_step_time_summary_groups_steps_and_counts_their_bytes():
    steps = [
        throughput.StepRecord(tokens=1, rows=1, context_tokens=600, ms=1.0),
        throughput.StepRecord(200, 200, 200_000, ms=8.0, gpu_ms=7.5, gpu_idle_ms=0.25),
        throughput.StepRecord(180, 180, 100_000, ms=6.0, gpu_ms=4.0, gpu_idle_ms=1.45),
        throughput.StepRecord(tokens=4096, rows=5, context_tokens=4096, ms=30.0),
    ]
    summary = throughput.step_time_summary(
        steps, weight_bytes=1000, kv_bytes_per_token=10, copy_bandwidth=1e9
    )
    assert list(summary) == ["decode 1", "decode 129-256", "prompt"]
    assert summary["decode 129-256"]["steps"] == 2 and summary["decode 129-256"]["ms"] == 14.0
    # (2 x 1000 weight bytes + 300,000 tokens x 10 bytes) at 1 GB/s
    assert summary["decode 129-256"]["bytes_ms"] == round(3_002_000 / 1e9 * 1e3, 1)
    assert summary["decode 129-256"]["gpu_ms"] == 11.5 and summary["decode 129-256"]["gpu_idle_ms"] == 1.7
    assert "gpu_ms" not in summary["prompt"]  # recorded off CUDA: no device times
    assert "bytes_ms" not in throughput.step_time_summary(steps, 1000, 10, None)["prompt"]


def test_decode_profiles_of_one_engine_never_hit_the_prefix_cache(tmp_path):
    # The benchmark's order: a decode profile, then a mixed one whose per-step prompts, drawn from the
    # same seed's stream, were block-aligned copies of the first profile's prompts.
    llm = _engine(tmp_path)
    try:
        throughput.profile_decode_step(llm, batch=4, context=64)
        mixed = throughput.profile_decode_step(llm, batch=2, context=32, prompt_per_step=64)
        assert mixed["cached_prompt_tokens"] == 0
        # The count sees hits: the same mixed profile again finds its prompts cached.
        again = throughput.profile_decode_step(llm, batch=2, context=32, prompt_per_step=64)
        assert again["cached_prompt_tokens"] > 0
    finally:
        llm.close()


def test_kernel_categories_name_every_decode_attention_kernel():
    # The profile's attention share must count the CUDA FP8 decode kernel (a template instantiation).
    for name in ("void fp8_paged_decode<128, 16, 0, 0, 2, 1>(void const*, un", "_decode_kernel"):
        assert throughput._kernel_category(name.lower()) == "attention"
    assert throughput._kernel_category("nvjet_sm90_tst_96x128_64x7_2x1_v_bz_tnn") == "gemm"
    for name in ("_softmax_chunk_kernel", "_inverse_cdf_pick_kernel"):
        assert throughput._kernel_category(name) == "sampler_and_reductions"
