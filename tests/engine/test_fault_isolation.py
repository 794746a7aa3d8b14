"""A fault that one request causes fails that request alone; every sampling field at its float32 extremes
either raises ValueError up front or generates (offline). CPU, tiny random Qwen3."""

import random

import pytest

import nanoinfer.sample.sampler as sampler_module
from nanoinfer import LLM, SamplingParams
from nanoinfer.frontend.output_processor import OutputProcessor

# (field, value): each must raise ValueError naming the field, or complete a generation.
EXTREMES = [
    ("temperature", 0.0),
    ("temperature", 1e-45),
    ("temperature", 1e-5),
    ("temperature", 1.0000001e-5),
    ("temperature", 1e6),
    ("temperature", 1e6 * (1 + 1e-9)),
    ("temperature", 1e308),
    ("temperature", float("inf")),
    ("top_p", 1e-300),
    ("top_p", 7e-46),
    ("top_p", 1.4e-45),
    ("top_p", 1.2e-38),
    ("top_p", 1e-30),
    ("top_p", 1.0),
    ("top_p", 1.0 + 1e-16),
    ("min_p", 1e-300),
    ("min_p", 1.2e-38),
    ("min_p", 1.0),
    ("min_p", 0.0),
    ("top_k", 1),
    ("top_k", (1 << 31) - 1),
    ("top_k", 1 << 63),
    ("presence_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0000001),
    ("frequency_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", -1e308),
    ("repetition_penalty", 1e-6),
    ("repetition_penalty", 1e6),
    ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e300),
    ("seed", -(1 << 63)),
    ("seed", (1 << 64) + 5),
    ("seed", 10**40),
    ("n", 1024),
    ("n", 1025),
    ("max_tokens", 10**30),
    ("min_tokens", 10**30),
    ("logprobs", 20),
    ("logprobs", 21),
]


def _prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


def _all_free(llm):
    stats = llm.engine_stats()
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and not llm.llm_engine.has_unfinished_requests()
    )


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, max_model_len=64)


@pytest.mark.parametrize("field, value", EXTREMES, ids=[f"{f}={v!r}"[:40] for f, v in EXTREMES])
def test_every_field_at_its_extremes_raises_or_completes(llm, field, value):
    kwargs = {"temperature": 0.8, "max_tokens": 4, field: value}
    if field in ("n", "max_tokens"):
        kwargs["max_tokens"] = None if field == "max_tokens" else 2
    if field == "min_tokens":
        kwargs["max_tokens"] = None
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e).split(" ", 1)[0] == field
        return
    out = llm.generate([_prompt(9)], params, use_tqdm=False)[0]
    assert out.finished and out.error is None
    assert all(c.token_ids and c.finish_reason in ("stop", "length") for c in out.outputs)
    assert _all_free(llm)


def test_tiny_top_p_keeps_one_token():
    # Rounding can leave a top-p cut-off of 0 (a value validation lets through in float64 but that is 0
    # in float32): the sampler still keeps the most likely token of each row.
    import torch

    logits = torch.randn(3, 50)
    kept = logits.clone()
    sampler_module.apply_top_k_top_p(kept, [50, 50, 5], [0.0, 1e-45, 0.0])
    assert (kept > -float("inf")).sum(dim=-1).tolist() == [1, 1, 1]
    assert kept.argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()


def _greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_a_request_whose_sampling_raises_fails_alone(llm, monkeypatch):
    prompts = [_prompt(9, 1), _prompt(20, 2), _prompt(5, 3), _prompt(33, 4)]
    others = [_greedy(), _greedy(n=2, max_tokens=6), _greedy(logprobs=2)]
    expected = llm.generate([prompts[0], prompts[2], prompts[3]], others, use_tqdm=False)

    real = sampler_module.apply_top_k_top_p

    def failing_top_p(logits, top_k, top_p):
        if 0.123 in top_p:
            raise FloatingPointError("simulated fault of one request's parameters")
        return real(logits, top_k, top_p)

    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", failing_top_p)
    bad = SamplingParams(temperature=1.0, top_p=0.123, max_tokens=8)
    outputs = llm.generate(prompts, [others[0], bad, others[1], others[2]], use_tqdm=False)
    failed = outputs[1]
    assert failed.finished and "simulated fault" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    for got, want in zip([outputs[0], outputs[2], outputs[3]], expected, strict=True):
        assert got.error is None
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    # Logprobs of another batch shape differ in the last float32 bits only.
    for got, want in zip(outputs[3].outputs[0].logprobs, expected[2].outputs[0].logprobs, strict=True):
        assert list(got) == list(want)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()])
    assert _all_free(llm)


def test_a_request_whose_post_processing_raises_fails_alone(llm, monkeypatch):
    prompts = [_prompt(12, 5), _prompt(7, 6), _prompt(30, 7)]
    good = _greedy(max_tokens=10, stop=["never-occurs"])
    expected = llm.generate([prompts[0], prompts[2]], good, use_tqdm=False)

    real = OutputProcessor._match_stop_string

    def failing_match(completion, text, params):
        if "BOOM" in params.stop:
            raise UnicodeError("simulated fault in one request's stop-string search")
        return real(completion, text, params)

    monkeypatch.setattr(OutputProcessor, "_match_stop_string", staticmethod(failing_match))
    bad = _greedy(max_tokens=10, stop=["BOOM"], n=3)
    outputs = llm.generate(prompts, [good, bad, good], use_tqdm=False)
    assert "simulated fault" in outputs[1].error
    assert [c.finish_reason for c in outputs[1].outputs] == ["error"] * 3
    for got, want in zip([outputs[0], outputs[2]], expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.error is None
    assert _all_free(llm)


def test_a_fault_that_no_request_causes_still_raises(llm, monkeypatch):
    def broken_model(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    engine = llm.llm_engine
    monkeypatch.setattr(engine.engine_core.executor.runner, "_run_model", broken_model)
    with pytest.raises(RuntimeError, match="simulated device failure"):
        llm.generate([_prompt(5)], _greedy(), use_tqdm=False)
    monkeypatch.undo()
    assert _all_free(llm)
    assert llm.generate([_prompt(5)], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
