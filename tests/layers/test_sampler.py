"""The sampler against straightforward reference implementations of vLLM's definitions (CPU)."""

import math

import numpy as np
import pytest
import torch

from nanoinfer.executor.batch import ScheduledRow
from nanoinfer.layers.sampler import Sampler, apply_penalties, apply_top_k_top_p
from nanoinfer.sampling_params import SamplingParams

VOCAB = 10
# A fixed, uneven distribution with a tie (tokens 3 and 4) to exercise the top-k tie rule.
BASE_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.7, 0.2, -0.5, -1.0, -2.0, -3.0])


def _row(params, seed=None, num_output_tokens=0, **extra):
    return ScheduledRow([0], 0, [], True, params, seed=seed, num_output_tokens=num_output_tokens, **extra)


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


def _frequencies(sampler, logits_row, params, draws, seed=0, extra_rows=()):
    """Samples ``draws`` tokens for ``params`` in batches that also hold ``extra_rows`` (other params)."""
    generator = torch.Generator().manual_seed(seed)
    per_batch = 2000
    counts = np.zeros(VOCAB)
    for _ in range(draws // per_batch):
        rows = [_row(params)] * per_batch + list(extra_rows)
        logits = logits_row.expand(len(rows), VOCAB).clone()
        tokens = sampler(logits, rows, generator).token_ids[:per_batch]
        counts += np.bincount(tokens, minlength=VOCAB)
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
    others = [_row(SamplingParams(temperature=0.3, top_k=2)), _row(SamplingParams(temperature=0.0))]
    freq = _frequencies(sampler, BASE_LOGITS, params, draws=20000, extra_rows=others)
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


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    plain = [_row(SamplingParams(temperature=0.0)) for _ in range(2)]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.5)
    penalized = [_row(params, **_penalty_fields(logits[i])) for i in (2, 3)]
    tokens = Sampler()(logits.clone(), plain + penalized).token_ids
    assert tokens[:2] == logits[:2].argmax(-1).tolist()
    for i in (2, 3):
        top = int(logits[i].argmax())
        expected = reference_penalties(logits[i].numpy(), [], [top], 2.0, 0.0, 1.5).argmax()
        assert tokens[i] == expected != top, "penalties apply to greedy rows too"


def _penalty_fields(logits_row):
    """Penalty history in which the row's current favourite was already generated once."""
    top = int(logits_row.argmax())
    return {"penalty_output_ids": np.array([top]), "penalty_prompt_ids": np.array([], dtype=np.int64)}


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
    rows, expected = [], []
    penalized = [i for i in range(batch) if i % 4 != 3]  # every 4th row has no penalties
    for i in range(batch):
        prompt = rng.integers(0, vocab, size=rng.integers(1, 15)).tolist()
        output = rng.integers(0, vocab, size=rng.integers(0, 20)).tolist()
        rep, freq, pres = (1.0, 0.0, 0.0) if i not in penalized else rng.uniform([0.5, -2, -2], [2.0, 2, 2])
        params = SamplingParams(
            repetition_penalty=float(rep), frequency_penalty=float(freq), presence_penalty=float(pres)
        )
        rows.append(
            _row(
                params,
                penalty_prompt_ids=np.unique(prompt),
                penalty_output_ids=np.array(output, dtype=np.int64),
            )
        )
        expected.append(reference_penalties(logits[i].numpy(), prompt, output, rep, freq, pres))
    got = logits.clone()
    apply_penalties(got, [rows[i] for i in penalized], penalized)
    np.testing.assert_allclose(got.numpy(), np.stack(expected), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got.numpy(), logits.numpy())


def test_only_one_penalty_kind():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    params = SamplingParams(frequency_penalty=0.5)
    row = _row(params, penalty_prompt_ids=None, penalty_output_ids=np.array([0, 0, 1]))
    apply_penalties(logits, [row], [0])
    assert logits.tolist() == [[0.0, -1.5, 2.0, 0.5]]


# -- seeds, min_tokens, logprobs ------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=7)
    sampler = Sampler()

    def draw(batch_rows, step):
        rows = [_row(params, seed=7, num_output_tokens=step)] + batch_rows
        batch_logits = torch.cat([logits, torch.randn(len(batch_rows), 1000)])
        return sampler(batch_logits, rows, torch.Generator().manual_seed(step + 100)).token_ids[0]

    alone = [draw([], step) for step in range(20)]
    crowded = [draw([_row(SamplingParams(temperature=0.7))] * 5, step) for step in range(20)]
    assert alone == crowded
    assert len(set(alone)) > 10, "the noise must advance with the step"
    other_seed = [
        sampler(logits, [_row(SamplingParams(seed=8), seed=8, num_output_tokens=s)]).token_ids[0]
        for s in range(20)
    ]
    assert other_seed != alone


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(4, 8)
    logits[:, 5] = 50.0  # the "EOS" would win every draw
    banned = _row(SamplingParams(temperature=1.0, min_tokens=3), banned_token_ids=[5, 6])
    greedy_banned = _row(SamplingParams(temperature=0.0, min_tokens=3), banned_token_ids=[5])
    free = _row(SamplingParams(temperature=1.0))
    for _ in range(20):
        tokens = Sampler()(logits.clone(), [banned, greedy_banned, free, free]).token_ids
        assert tokens[0] not in (5, 6) and tokens[1] != 5 and tokens[2] == 5


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(3))
    rows = [
        _row(
            SamplingParams(temperature=0.5, logprobs=3, top_k=5, repetition_penalty=1.5),
            **_penalty_fields(logits[0]),
        ),
        _row(SamplingParams(temperature=1.0)),
        _row(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = Sampler()(logits.clone(), rows)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprob_rows == [0, 2]  # the middle row did not ask
    chosen = [out.token_ids[0], out.token_ids[2]]
    assert out.logprobs.token_ids == chosen
    for position, i in enumerate((0, 2)):
        token = out.token_ids[i]
        assert math.isclose(out.logprobs.logprobs[position], float(reference[i, token]), abs_tol=1e-5)
        assert out.logprobs.ranks[position] == int((reference[i] >= reference[i, token]).sum())
    top = reference[0].topk(3)
    assert out.logprobs.top_token_ids[0] == top.indices.tolist()
    np.testing.assert_allclose(out.logprobs.top_logprobs[0], top.values.numpy(), atol=1e-5)
    assert out.logprobs.top_token_ids[1] == []


def test_temperature_only_batches_take_the_short_path(monkeypatch):
    sampler = Sampler()
    called = []
    monkeypatch.setattr(sampler, "_sample_full", lambda *a: called.append(1))
    logits = torch.randn(3, 20)
    rows = [_row(SamplingParams(temperature=t)) for t in (0.0, 0.7, 1.0)]
    tokens = sampler(logits, rows, torch.Generator().manual_seed(0)).token_ids
    assert not called and tokens[0] == int(logits[0].argmax())


def test_cpu_noise_is_exponential():
    # The CPU draws Exp(1) as -log(U): its mean, tail and range must be those of Exp(1).
    from nanoinfer.layers.sampler import _fill_exponential

    noise = _fill_exponential(torch.empty(400_000), torch.Generator().manual_seed(0))
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs((noise > 2.0).float().mean().item() - math.exp(-2.0)) < 0.002
    assert noise.min().item() > 0.0
