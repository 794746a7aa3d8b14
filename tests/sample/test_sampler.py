"""The sampler against straightforward reference implementations of vLLM's definitions (CPU)."""

import math

import numpy as np
import pytest
import torch

import nanoinfer.sample.sampler as sampler_module
from nanoinfer.sample.metadata import SamplingMetadata
from nanoinfer.sample.sampler import Sampler, apply_penalties, apply_top_k_top_p
from nanoinfer.sampling_params import SamplingParams

VOCAB = 10
# A fixed, uneven distribution with a tie (tokens 3 and 4) to exercise the top-k tie rule.
BASE_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.7, 0.2, -0.5, -1.0, -2.0, -3.0])


def _metadata(params, seeds=None, offsets=None, **extra):
    seeds = seeds if seeds is not None else list(range(len(params)))
    offsets = offsets if offsets is not None else [0] * len(params)
    return SamplingMetadata.from_params(params, seeds, offsets, **extra)


def reference_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """vLLM's order, written out plainly: temperature, min_p, top-k (ties kept), top-p."""
    logits = logits.astype(np.float64)
    if p.temperature == 0.0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    logits = logits / p.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.ones(len(logits), dtype=bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_k > 0:
        kth = np.sort(logits)[::-1][min(p.top_k, len(logits)) - 1]
        keep &= logits >= kth
    if p.top_p < 1.0:
        masked = np.where(keep, probs, 0.0)
        masked /= masked.sum()
        order = np.argsort(-masked, kind="stable")
        before = 0.0
        for token in order:
            if before >= p.top_p:
                keep[token] = False
            before += masked[token]
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def _frequencies(sampler, logits_row, params, draws, extra_params=()):
    """Samples ``draws`` tokens for ``params`` in batches that also hold rows with ``extra_params``;
    every row has its own seed, and each batch is another step (noise offset)."""
    per_batch = 2000
    counts = np.zeros(VOCAB)
    for step in range(draws // per_batch):
        params_list = [params] * per_batch + list(extra_params)
        logits = logits_row.expand(len(params_list), VOCAB).clone()
        metadata = _metadata(params_list, offsets=[step] * len(params_list))
        tokens = sampler(logits, metadata).token_ids[:per_batch]
        counts += np.bincount(tokens.numpy(), minlength=VOCAB)
    return counts / counts.sum()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(temperature=1.0, top_k=4),  # the 4th value is tied with the 5th: both kept
    # Cut-offs are chosen away from the tie, where the order among tied tokens would decide.
    SamplingParams(temperature=1.0, top_p=0.55),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.8),  # top-p sees the probabilities left by top-k
    SamplingParams(temperature=1.2, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.75, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize(
    "params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}"
)
def test_sampled_frequencies_match_the_filtered_distribution(params):
    sampler = Sampler()
    # Other rows with other settings share every batch: per-row parameters must not leak.
    others = [SamplingParams(temperature=0.3, top_k=2), SamplingParams(temperature=0.0)]
    freq = _frequencies(sampler, BASE_LOGITS, params, draws=20000, extra_params=others)
    ref = reference_distribution(BASE_LOGITS.numpy(), params)
    assert 0.5 * np.abs(freq - ref).sum() < 0.02, (freq.round(3), ref.round(3))
    assert freq[ref == 0].sum() == 0, "a filtered-out token was sampled"


def test_reference_filters_are_not_trivial():
    # Guards the test above: the cases must actually remove tokens and differ from plain sampling.
    plain = reference_distribution(BASE_LOGITS.numpy(), SamplingParams())
    for params in CASES[2:]:
        ref = reference_distribution(BASE_LOGITS.numpy(), params)
        assert (ref == 0).sum() >= 2 and not np.allclose(ref, plain)
    assert (reference_distribution(BASE_LOGITS.numpy(), SamplingParams(top_k=4)) > 0).sum() == 5


@pytest.mark.parametrize(
    "settings, wide_row",
    [
        # Rows without top-k look for the top-p cut among a few thousand candidates; the flat row's cut
        # lies past them, so it falls back to sorting its whole vocabulary.
        (
            [
                (0, 0.9, "peaked"),
                (0, 0.95, "flat"),
                (5000, 0.5, "peaked"),
                (30, 1.0, "peaked"),
                (100, 0.8, "flat"),
            ],
            1,
        ),
        ([(7, 0.9, "peaked"), (300, 0.6, "flat"), (1, 1.0, "flat")], None),  # all rows with top-k
    ],
)
def test_top_k_top_p_over_a_large_vocabulary(settings, wide_row):
    vocab = 6000
    generator = torch.Generator().manual_seed(4)
    logits = torch.stack(
        [
            torch.randn(vocab, generator=generator) * (3.0 if shape == "peaked" else 0.05)
            for _, _, shape in settings
        ]
    )
    filtered = logits.clone()
    apply_top_k_top_p(filtered, [k if k else vocab for k, _, _ in settings], [p for _, p, _ in settings])
    for row, (k, p, _) in enumerate(settings):
        kept = torch.isfinite(filtered[row]).numpy()
        expected = reference_distribution(logits[row].numpy(), SamplingParams(top_k=k, top_p=p)) > 0
        assert (kept == expected).all(), f"row {row}: kept {kept.sum()}, expected {expected.sum()}"
        assert torch.equal(filtered[row][kept], logits[row][kept])
    if wide_row is not None:
        assert torch.isfinite(filtered[wide_row]).sum() > 4096


def _penalty_history(logits_row):
    """A history in which the row's current favourite was already generated once."""
    return np.array([int(logits_row.argmax())], dtype=np.int64)


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.5)
    empty = np.zeros(0, dtype=np.int64)
    metadata = _metadata(
        [plain, plain, penalized, penalized],
        output_token_ids=[empty, empty, _penalty_history(logits[2]), _penalty_history(logits[3])],
    )
    tokens = Sampler()(logits.clone(), metadata).token_ids.tolist()
    assert tokens[:2] == logits[:2].argmax(-1).tolist()
    for i in (2, 3):
        top = int(logits[i].argmax())
        expected = reference_penalties(logits[i].numpy(), [], [top], 2.0, 0.0, 1.5).argmax()
        assert tokens[i] == expected != top, "penalties apply to greedy rows too"


# -- penalties -------------------------------------------------------------------------------------------


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.copy()
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
        count = output.count(token)
        out[token] -= freq * count
        if count:
            out[token] -= pres
    return out


def test_penalties_match_the_reference():
    rng = np.random.default_rng(0)
    vocab, batch = 40, 12
    logits = torch.from_numpy(rng.normal(size=(batch, vocab)).astype(np.float32))
    params, prompts, outputs, expected = [], [], [], []
    for i in range(batch):
        prompt = rng.integers(0, vocab, size=rng.integers(1, 15)).tolist()
        output = rng.integers(0, vocab, size=rng.integers(0, 20)).tolist()
        # Every 4th row has no penalties.
        rep, freq, pres = (1.0, 0.0, 0.0) if i % 4 == 3 else rng.uniform([0.5, -2, -2], [2.0, 2, 2])
        params.append(
            SamplingParams(
                repetition_penalty=float(rep), frequency_penalty=float(freq), presence_penalty=float(pres)
            )
        )
        prompts.append(np.unique(prompt))
        outputs.append(np.array(output, dtype=np.int64))
        expected.append(reference_penalties(logits[i].numpy(), prompt, output, rep, freq, pres))
    metadata = _metadata(params, output_token_ids=outputs, prompt_token_ids=prompts)
    got = logits.clone()
    apply_penalties(got, metadata.penalties)
    np.testing.assert_allclose(got.numpy(), np.stack(expected), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got.numpy(), logits.numpy())


def test_a_pending_token_counts_like_a_known_one():
    # Async scheduling: the last generated token may still be on the device.
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5], [1.0, -1.0, 2.0, 0.5]])
    params = [SamplingParams(frequency_penalty=0.5)] * 2
    known = _metadata(params, output_token_ids=[np.array([0, 0, 1]), np.array([0, 0, 1])])
    pending = _metadata(params, output_token_ids=[np.array([0, 1]), np.array([0, 0, 1])])
    pending.penalties.pending_token_ids = torch.tensor([0, -1])
    a, b = logits.clone(), logits.clone()
    apply_penalties(a, known.penalties)
    apply_penalties(b, pending.penalties)
    assert a.tolist() == b.tolist() == [[0.0, -1.5, 2.0, 0.5]] * 2


def test_only_one_penalty_kind():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    metadata = _metadata([SamplingParams(frequency_penalty=0.5)], output_token_ids=[np.array([0, 0, 1])])
    apply_penalties(logits, metadata.penalties)
    assert logits.tolist() == [[0.0, -1.5, 2.0, 0.5]]


# -- seeds, min_tokens, logprobs ------------------------------------------------------------------------


def test_rows_draw_their_own_noise_whatever_else_is_batched():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()

    def draw(other_rows, step, seed=7):
        batch_params = [params] + [SamplingParams(temperature=0.7)] * other_rows
        batch_logits = torch.cat([logits, torch.randn(other_rows, 1000)])
        metadata = _metadata(
            batch_params, seeds=[seed] + [99] * other_rows, offsets=[step] * (1 + other_rows)
        )
        return int(sampler(batch_logits, metadata).token_ids[0])

    alone = [draw(0, step) for step in range(20)]
    crowded = [draw(5, step) for step in range(20)]
    assert alone == crowded
    assert len(set(alone)) > 10, "the noise must advance with the step"
    assert [draw(0, step, seed=8) for step in range(20)] != alone
    # The general path (a filter on another row) draws the same noise for this row.
    filtered = _metadata([params, SamplingParams(temperature=1.0, top_k=3)], seeds=[7, 1], offsets=[4, 4])
    assert int(sampler(torch.cat([logits, logits]), filtered).token_ids[0]) == alone[4]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(4, 8)
    logits[:, 5] = 50.0  # the "EOS" would win every draw
    params = [
        SamplingParams(temperature=1.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0),
    ]
    for step in range(20):
        metadata = _metadata(params, offsets=[step] * 4, banned_token_ids=[[5, 6], [5], [], []])
        tokens = Sampler()(logits.clone(), metadata).token_ids.tolist()
        assert tokens[0] not in (5, 6) and tokens[1] != 5 and tokens[2] == 5


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.5, logprobs=3, top_k=5, repetition_penalty=1.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    empty = np.zeros(0, dtype=np.int64)
    metadata = _metadata(params, output_token_ids=[_penalty_history(logits[0]), empty, empty])
    out = Sampler()(logits.clone(), metadata)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprob_rows == [0, 2]  # the middle row did not ask
    lists = out.logprobs.to_lists()
    tokens = out.token_ids.tolist()
    assert lists.token_ids == [tokens[0], tokens[2]]
    for position, i in enumerate((0, 2)):
        token = tokens[i]
        assert math.isclose(lists.logprobs[position], float(reference[i, token]), abs_tol=1e-5)
        assert lists.ranks[position] == int((reference[i] >= reference[i, token]).sum())
    top = reference[0].topk(3)
    assert lists.top_token_ids[0] == top.indices.tolist()
    np.testing.assert_allclose(lists.top_logprobs[0], top.values.numpy(), atol=1e-5)
    assert lists.top_token_ids[1] == []


def test_temperature_only_batches_take_the_one_pass_path(monkeypatch):
    sampler = Sampler()
    called = []
    monkeypatch.setattr(sampler, "_sample_full", lambda *a: called.append(1))
    logits = torch.randn(3, 20)
    metadata = _metadata([SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0)])
    tokens = sampler(logits, metadata).token_ids
    assert not called and int(tokens[0]) == int(logits[0].argmax())


def test_a_failing_row_fails_alone(monkeypatch):
    real = sampler_module.apply_top_k_top_p

    def failing(logits, top_k, top_p):
        if 0.25 in top_p:
            raise ArithmeticError("simulated")
        return real(logits, top_k, top_p)

    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", failing)
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.25),
        SamplingParams(top_p=0.5, logprobs=1),
    ]
    out, failed = Sampler().sample_isolating_faults(logits, _metadata(params))
    assert list(failed) == [1] and "simulated" in failed[1]
    tokens = out.token_ids.tolist()
    assert tokens[1] == -1 and tokens[0] == int(logits[0].argmax())
    alone = Sampler()(logits[2:], _metadata(params[2:], seeds=[2]))
    assert tokens[2] == int(alone.token_ids[0]) and out.logprob_rows == [2]
