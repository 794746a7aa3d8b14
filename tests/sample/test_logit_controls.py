"""vLLM's logit_bias, allowed_token_ids and bad_words: SamplingParams validation, the sampler step against
plain reference implementations (CPU, and CUDA when present), rows that set none left token for token as
they were, fault isolation, and end to end through the engine (with async scheduling too, where the last
generated token is still on the device when bad_words are matched)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import nanoinfer.sample.sampler as sampler_module
from nanoinfer import LLM, SamplingParams
from nanoinfer.sample.metadata import SamplingMetadata
from nanoinfer.sample.sampler import Sampler, apply_logit_controls

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 50


def _metadata(params, device="cpu", offsets=None, **extra) -> SamplingMetadata:
    offsets = offsets if offsets is not None else [0] * len(params)
    return SamplingMetadata.from_params(params, list(range(len(params))), offsets, device=device, **extra)


def _with_bad_words(params: SamplingParams, words: list[list[int]]) -> SamplingParams:
    """bad_words given as token sequences directly (what update_from_tokenizer makes of strings)."""
    return dataclasses.replace(params, bad_words=["w"] * len(words), bad_words_token_ids=words)


# -- SamplingParams ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {True: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {5: "1"}}, "logit_bias values"),
        ({"logit_bias": [5]}, "logit_bias must be None or a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words must be None or a list of strings that are not blank"),
        ({"bad_words": [3]}, "bad_words"),
    ],
)
def test_bad_values_are_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_normalization_and_clone():
    p = SamplingParams(logit_bias={3: 1, 4: -100}, allowed_token_ids=(1, 2), bad_words="oops")
    assert p.logit_bias == {3: 1.0, 4: -100.0} and isinstance(p.logit_bias[3], float)
    assert p.allowed_token_ids == [1, 2] and p.bad_words == ["oops"]
    assert p.uses_logit_controls and not p.temperature_only and p.needs_output_token_ids
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams(logit_bias={5: 1.0}).needs_output_token_ids
    copy = p.clone()
    assert copy == p and copy is not p
    copy.logit_bias[3] = 7.0
    copy.bad_words.append("more")
    assert p.logit_bias[3] == 1.0 and p.bad_words == ["oops"]


def test_bad_words_tokenized_with_and_without_a_leading_space(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    p = SamplingParams(bad_words=["Paris", " capital"])
    p.update_from_tokenizer(tokenizer)
    expected = []
    for text in ("Paris", " Paris", "capital", " capital"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids not in expected:
            expected.append(ids)
    assert p.bad_words_token_ids == expected
    assert tokenizer.encode(" Paris", add_special_tokens=False) != tokenizer.encode("Paris")
    p = SamplingParams()
    p.update_from_tokenizer(tokenizer)
    assert p.bad_words_token_ids is None


# -- the sampler step against references ------------------------------------------------------------------


def _reference(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """The three controls written out per row, in plain Python."""
    out = logits.clone().double()
    vocab = logits.shape[1]
    for row, (p, history) in enumerate(zip(params, outputs, strict=True)):
        if p.allowed_token_ids is not None:
            for token in range(vocab):
                if token not in p.allowed_token_ids:
                    out[row, token] = -float("inf")
        for word in p.bad_words_token_ids or []:
            prefix = word[:-1]
            if not prefix or history[len(history) - len(prefix) :] == prefix:
                out[row, word[-1]] = -float("inf")
        for token, bias in (p.logit_bias or {}).items():
            out[row, token] += bias
    return out


def _random_controls(rng: random.Random) -> SamplingParams:
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["logit_bias"] = {
            rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))
        }
    if rng.random() < 0.4:
        kwargs["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 20))
    params = SamplingParams(**kwargs)
    if rng.random() < 0.6:
        # Short words over a small alphabet, so that their prefixes do match the histories.
        words = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 4))]
        params = _with_bad_words(params, words)
    return params


@pytest.mark.parametrize("device", DEVICES)
def test_controls_match_the_reference_on_random_batches(device):
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        rows = rng.randrange(1, 7)
        params = [_random_controls(rng) for _ in range(rows)]
        outputs = [[rng.randrange(4) for _ in range(rng.randrange(0, 6))] for _ in range(rows)]
        logits = torch.randn(rows, VOCAB, generator=generator)
        metadata = _metadata(params, device, output_token_ids=[np.array(o, dtype=np.int64) for o in outputs])
        expected = _reference(logits, params, outputs)
        got = logits.to(device)
        if metadata.logit_controls is not None:
            apply_logit_controls(got, metadata.logit_controls)
        torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_pending_last_token_matches_bad_words_like_a_known_one(device):
    # Async scheduling: the last generated token may still be on the device.
    rng = random.Random(1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        rows = rng.randrange(1, 6)
        params = [_with_bad_words(SamplingParams(), [[rng.randrange(4) for _ in range(rng.randrange(1, 4))]
                                                     for _ in range(3)]) for _ in range(rows)]  # fmt: skip
        outputs = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(rows)]
        pending = [rng.random() < 0.6 for _ in range(rows)]
        logits = torch.randn(rows, VOCAB, generator=generator)
        known = _metadata(params, device, output_token_ids=[np.array(o) for o in outputs])
        split = _metadata(
            params,
            device,
            output_token_ids=[np.array(o[:-1] if p else o) for o, p in zip(outputs, pending, strict=True)],
            last_token_pending=pending,
            pending_token_ids=torch.tensor(
                [o[-1] if p else -1 for o, p in zip(outputs, pending, strict=True)], device=device
            ),
        )
        a, b = logits.to(device), logits.to(device)
        apply_logit_controls(a, known.logit_controls)
        apply_logit_controls(b, split.logit_controls)
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_controls_are_untouched_token_for_token(device):
    generator = torch.Generator().manual_seed(2)
    plain = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=1.3),
    ]
    controlled = [
        SamplingParams(temperature=1.0, logit_bias={3: 50.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[7, 8]),
        _with_bad_words(SamplingParams(temperature=0.8), [[1], [2, 3]]),
    ]
    sampler = Sampler()
    history = [np.array([2, 3, 2], dtype=np.int64)] * 7
    for step in range(20):
        logits = torch.randn(len(plain), VOCAB, generator=generator).to(device)
        extra = torch.randn(len(controlled), VOCAB, generator=generator).to(device)
        alone = sampler(logits.clone(), _metadata(plain, device, [step] * 4, output_token_ids=history[:4]))
        mixed_params = plain + controlled
        mixed = sampler(
            torch.cat([logits, extra]), _metadata(mixed_params, device, [step] * 7, output_token_ids=history)
        )
        assert mixed.token_ids[:4].tolist() == alone.token_ids.tolist()
        tokens = mixed.token_ids[4:].tolist()
        assert tokens[1] in (7, 8) and tokens[2] not in (1, 3)
    # The one-pass path of a plain temperature row draws what the general path draws for it.
    logits = torch.randn(1, VOCAB, generator=generator).to(device)
    fast = sampler(logits.clone(), _metadata(plain[:1], device))
    general = sampler(torch.cat([logits, logits]), _metadata([plain[0], controlled[0]], device))
    assert int(fast.token_ids[0]) == int(general.token_ids[0])


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_follow_the_controlled_distribution(device):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, VOCAB, generator=generator)
    params = SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3, 4], logit_bias={1: 1.0})
    draws = 4000
    metadata = _metadata([params] * draws, device)
    tokens = Sampler()(logits.expand(draws, VOCAB).clone().to(device), metadata).token_ids.cpu().numpy()
    reference = logits[0, [1, 2, 3, 4]].double() + torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    expected = torch.softmax(reference, dim=0).numpy()
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts.sum() == counts[1:5].sum()
    np.testing.assert_allclose(counts[1:5] / draws, expected, atol=0.03)
    # Greedy rows take the argmax of the biased logits.
    greedy = SamplingParams(temperature=0.0, logit_bias={int(logits[0].argmin()): 100.0})
    token = Sampler()(logits.clone().to(device), _metadata([greedy], device)).token_ids
    assert int(token[0]) == int(logits[0].argmin())


def test_select_keeps_each_rows_controls():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={9: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[4]),
    ]
    metadata = _metadata(params)
    picked = metadata.select([2, 0, 1])
    assert picked.logit_controls.rows == [0, 2]
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 1.0
    assert Sampler()(logits, picked).token_ids.tolist() == [4, 0, 9]
    assert metadata.select([0]).logit_controls is None


def test_a_failing_row_fails_alone(monkeypatch):
    real = sampler_module._bad_word_bans

    def failing(controls, vocab):
        if any(w[-1] == 13 for c in controls.per_row for w in c.bad_words or ()):
            raise ArithmeticError("simulated")
        return real(controls, vocab)

    monkeypatch.setattr(sampler_module, "_bad_word_bans", failing)
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 1.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        _with_bad_words(SamplingParams(temperature=0.0), [[13]]),
        _with_bad_words(SamplingParams(temperature=0.0), [[0]]),
    ]
    out, failed = Sampler().sample_isolating_faults(logits, _metadata(params))
    assert list(failed) == [1] and "simulated" in failed[1]
    assert out.token_ids.tolist() == [5, -1, 1]


# -- end to end ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    engine = LLM(tiny_qwen3, device="cpu", max_model_len=128, num_kvcache_blocks=64)
    yield engine
    engine.close()


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPT = [5, 17, 42, 9, 100]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_logit_bias_and_allowed_token_ids_end_to_end(llm):
    forced = dataclasses.replace(GREEDY, logit_bias={77: 100.0})
    assert _tokens(llm, [PROMPT], forced) == [[77] * 12]
    allowed = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, allowed_token_ids=[30, 31, 32])
    assert set(_tokens(llm, [PROMPT], allowed)[0]) <= {30, 31, 32}
    # The other requests of the batch get exactly what they get alone.
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)
    alone = _tokens(llm, [PROMPT, PROMPT], [GREEDY, sampled])
    together = _tokens(llm, [PROMPT, PROMPT, PROMPT, PROMPT], [GREEDY, forced, sampled, allowed])
    assert together[0] == alone[0] and together[2] == alone[1]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_restrictions_that_exclude_every_token_fail_the_request_for_its_input(llm, greedy):
    # Before min_tokens, EOS (the one allowed token) is banned: nothing is left. Such a row's logits are
    # all -inf and the sampler still takes a token (id 0), which used to come out as the output.
    eos = llm.get_tokenizer().eos_token_id
    nothing = SamplingParams(
        temperature=0.0 if greedy else 1.0, max_tokens=8, min_tokens=2, allowed_token_ids=[eos]
    )
    failed, other = llm.generate([PROMPT, PROMPT], [nothing, GREEDY], use_tqdm=False)
    assert failed.invalid_input and failed.error.startswith("no token is allowed at this step")
    assert failed.outputs[0].token_ids == [] and failed.outputs[0].finish_reason == "error"
    assert other.error is None and other.outputs[0].token_ids == _tokens(llm, [PROMPT], GREEDY)[0]
    stats = llm.llm_engine.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


def test_token_ids_outside_the_vocabulary_are_rejected_at_add(llm):
    vocab = llm.llm_engine.config.hf_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias token ids must be in \\[0, {vocab}\\)"):
        llm.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids token ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[1, vocab + 5]), use_tqdm=False)


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_end_to_end_with_and_without_async_scheduling(tiny_qwen3, llm):
    tokenizer = llm.get_tokenizer()
    plain = _tokens(llm, [PROMPT], GREEDY)[0]
    # A two-token word the model generates greedily, which tokenizes back to those two tokens.
    word = next(
        text
        for i in range(len(plain) - 1)
        if tokenizer.encode(text := tokenizer.decode(plain[i : i + 2]), add_special_tokens=False)
        == plain[i : i + 2]
        and text.strip()
    )
    banned = dataclasses.replace(GREEDY, bad_words=[word])
    probe = banned.clone()
    probe.update_from_tokenizer(tokenizer)
    got = _tokens(llm, [PROMPT], banned)[0]
    assert got != plain
    assert not any(_contains(got, seq) for seq in probe.bad_words_token_ids)
    async_llm = LLM(tiny_qwen3, device="cpu", max_model_len=128, num_kvcache_blocks=64, async_scheduling=True)
    try:
        assert _tokens(async_llm, [PROMPT, PROMPT], [banned, GREEDY]) == [got, plain]
    finally:
        async_llm.close()
