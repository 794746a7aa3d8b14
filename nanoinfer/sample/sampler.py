"""Batched sampling with vLLM's semantics, over a SamplingMetadata: one vectorized pass over the batch.

Order (vLLM's): the logit controls (allowed_token_ids, bad_words, logit_bias), min_tokens masking, then
the repetition / frequency / presence penalties, then greedy rows take the argmax; the others divide by
their temperature, drop tokens below min_p, keep their top-k and then their top-p, and draw from the
filtered softmax by its inverse CDF (one uniform per row).
Each step is skipped when no row of the batch uses it: a batch of plain temperature (or greedy) rows
runs the temperature-only path (two kernels on CUDA) only.

The uniform comes from a counter-based generator keyed by (the row's seed, the number of tokens it has
generated): no state to keep or free, and a request draws the same tokens whether it runs alone or in
any batch, after a preemption too, on any device (given the same logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanoinfer.kernels import sampling_ref
from nanoinfer.sample.logprobs import LogprobsTensors, TokenLogprobs, gather_logprobs
from nanoinfer.sample.metadata import LogitControls, PenaltyInputs, SamplingMetadata

# Candidates for the top-p cut of rows without top-k: it almost always falls among the most likely
# few thousand tokens, and finding those is several times cheaper than sorting a 150k vocabulary.
_TOP_P_CANDIDATES = 4096
# Positions per compute_logits call when computing prompt logprobs: bounds the [positions, vocab] fp32
# temporaries (about 150 MiB each for a 150k vocabulary) whatever the prompt chunk length.
PROMPT_LOGPROB_CHUNK = 256


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [rows], on the logits' device
    logprobs: LogprobsTensors | None = None  # for the rows with num_logprobs >= 0, in row order
    logprob_rows: list[int] | None = None


def sample_temperature_only(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature-only sampling of every row: argmax for greedy rows, the inverse CDF of softmax(logits
    / T) for the others. On CUDA two kernels (one pass over the logits, then one chunk per row)."""
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    if logits.device.type == "cuda":
        from nanoinfer.kernels import triton_sampling

        return triton_sampling.inverse_cdf_sample(
            logits, metadata.temperature, metadata.seeds, metadata.offsets
        )
    return sampling_ref.inverse_cdf_sample_ref(logits, metadata.temperature, metadata.seeds, metadata.offsets)


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """One token per row of ``logits`` ([rows, vocab])."""
        if metadata.temperature_only:
            return SamplerOutput(sample_temperature_only(logits, metadata))
        return self._sample_full(logits, metadata)

    def sample_isolating_faults(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[SamplerOutput, dict[int, str]]:
        """:meth:`__call__`, except that when the batch raises, each row is sampled alone, so that a row
        whose parameters trip an error fails alone (returned with its error; its token is -1) and the
        others get their tokens. An error that no row can escape (the device failing) is raised."""
        try:
            return self(logits, metadata), {}
        except Exception as batch_error:
            error = batch_error
        tokens = torch.full((metadata.num_rows,), -1, dtype=torch.int64, device=logits.device)
        failed: dict[int, str] = {}
        pieces: list[tuple[int, LogprobsTensors]] = []
        for i in range(metadata.num_rows):
            try:
                alone = self(logits[i : i + 1], metadata.select([i]))
            except Exception as e:
                failed[i] = f"{type(e).__name__}: {e}"
                continue
            tokens[i] = alone.token_ids[0]
            if alone.logprobs is not None:
                pieces.append((i, alone.logprobs))
        # A failed device fails the simplest work too: then nothing here is the rows' fault.
        torch.ones(1, device=logits.device).add_(1).item()
        if not failed:
            raise error  # the batch failed although every row alone succeeds: not attributable
        output = SamplerOutput(tokens)
        if pieces:
            output.logprob_rows = [i for i, _ in pieces]
            output.logprobs = _concat_logprobs([p for _, p in pieces])
        return output, failed

    def _sample_full(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        device = logits.device
        # A private fp32 copy: the steps below work in place.
        logits = logits.to(torch.float32, copy=True)
        logprob_rows = None
        raw_logprobs = None
        if metadata.num_logprobs is not None:
            logprob_rows = np.flatnonzero(metadata.num_logprobs >= 0).tolist()
            raw = logits if len(logprob_rows) == metadata.num_rows else logits[logprob_rows]
            raw_logprobs = raw.log_softmax(dim=-1)
        if metadata.logit_controls is not None:
            apply_logit_controls(logits, metadata.logit_controls)
        if metadata.banned is not None:
            row_index = torch.tensor([i for i, ids in metadata.banned for _ in ids], device=device)
            token_index = torch.tensor([t for _, ids in metadata.banned for t in ids], device=device)
            logits[row_index, token_index] = -float("inf")
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)

        tokens = logits.argmax(dim=-1) if metadata.all_greedy else self._sample_random(logits, metadata)
        output = SamplerOutput(tokens)
        if logprob_rows is not None:
            chosen = tokens[logprob_rows] if len(logprob_rows) < metadata.num_rows else tokens
            num_top = metadata.num_logprobs[logprob_rows].tolist()
            output.logprobs = gather_logprobs(raw_logprobs, chosen, num_top)
            output.logprob_rows = logprob_rows
        return output

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        device = logits.device
        temperature = metadata.temperature
        # Greedy rows divide by 1 to stay finite, and min_p keeps their argmax.
        logits.div_(torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, torch.from_numpy(metadata.min_p.astype(np.float32)).to(device))
        vocab = logits.size(1)
        top_k = metadata.top_k if metadata.top_k is not None else np.zeros(metadata.num_rows, np.int64)
        top_p = metadata.top_p if metadata.top_p is not None else np.ones(metadata.num_rows)
        uses_filter = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
        uses_filter &= ~metadata.greedy
        if uses_filter.any():
            filter_rows = np.flatnonzero(uses_filter)
            k = [int(top_k[i]) if 0 < top_k[i] < vocab else vocab for i in filter_rows]
            p = [float(top_p[i]) for i in filter_rows]
            if len(filter_rows) == metadata.num_rows:
                apply_top_k_top_p(logits, k, p)
            else:
                index = torch.from_numpy(filter_rows).to(device)
                selected = logits[index]
                apply_top_k_top_p(selected, k, p)
                logits[index] = selected
        # The logits are divided already: the draw is at temperature 1 (and the argmax at 0).
        return sampling_ref.inverse_cdf_sample_ref(
            logits, (temperature > 0).to(torch.float32), metadata.seeds, metadata.offsets
        )


def _concat_logprobs(pieces: list[LogprobsTensors]) -> LogprobsTensors:
    width = max((p.top_token_ids.shape[1] if p.top_token_ids is not None else 0) for p in pieces)
    top_ids = top_values = None
    if width:
        device = pieces[0].token_ids.device
        top_ids = torch.zeros(len(pieces), width, dtype=torch.int64, device=device)
        top_values = torch.zeros(len(pieces), width, dtype=torch.float32, device=device)
        for i, p in enumerate(pieces):
            if p.top_token_ids is not None:
                top_ids[i, : p.top_token_ids.shape[1]] = p.top_token_ids[0]
                top_values[i, : p.top_logprobs.shape[1]] = p.top_logprobs[0]
    return LogprobsTensors(
        torch.cat([p.token_ids for p in pieces]),
        torch.cat([p.logprobs for p in pieces]),
        torch.cat([p.ranks for p in pieces]),
        top_ids,
        top_values,
        [n for p in pieces for n in p.num_top],
    )


# -- prompt logprobs ---------------------------------------------------------------------------------------


def prompt_logprobs(
    hidden: torch.Tensor,
    token_index: torch.Tensor,
    targets: list[int],
    num_top: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
) -> TokenLogprobs | None:
    """Logprobs of the prompt tokens ``targets`` that follow the positions ``token_index`` of ``hidden``,
    with ``num_top[i]`` top tokens each. ``compute_logits`` is a collective under tensor parallelism, so
    every rank calls this on the same positions; tensor-parallel workers (whose compute_logits gives
    None) pass no targets and get None."""
    pieces: list[TokenLogprobs] = []
    for begin in range(0, len(token_index), PROMPT_LOGPROB_CHUNK):
        end = begin + PROMPT_LOGPROB_CHUNK
        logits = compute_logits(hidden[token_index[begin:end]])
        if logits is None:  # a worker: it joins the collective, rank 0 gets the logits
            continue
        chosen = torch.tensor(targets[begin:end], device=hidden.device)
        logprobs = logits.float().log_softmax(dim=-1)
        pieces.append(gather_logprobs(logprobs, chosen, num_top[begin:end]).to_lists())
    if not pieces:
        return None
    merged = pieces[0]
    for piece in pieces[1:]:
        merged.extend(piece)
    return merged


# -- the steps, as functions of tensors (also used directly by the tests) --------------------------------


def _flat_indices(rows_of_ids: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token for every token id of every row: indices into a flattened [rows, vocab]. The
    row offsets are expanded on the device: only the ids themselves cross over."""
    ids = torch.from_numpy(np.concatenate(rows_of_ids).astype(np.int64, copy=False)).to(device)
    lengths = torch.tensor([len(r) for r in rows_of_ids]).to(device)
    offsets = torch.arange(len(rows_of_ids), device=device) * vocab
    return ids + offsets.repeat_interleave(lengths, output_size=len(ids))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInputs) -> None:
    """vLLM's penalties, in place: the repetition penalty over prompt and output tokens (positive logits
    divided by it, negative ones multiplied), then minus frequency_penalty times each token's count in
    the output and minus presence_penalty for each token present in it. Rows with neutral values are
    unchanged."""
    device = logits.device
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    outputs = penalties.output_token_ids
    if any(len(o) for o in outputs):
        index = _flat_indices(outputs, vocab, device)
        # Atomic adds of whole numbers: exact, so the order does not matter.
        counts.view(-1).index_add_(0, index, torch.ones(len(index), dtype=torch.float32, device=device))
    pending = penalties.pending_token_ids
    if pending is not None:
        has_pending = pending >= 0
        rows = torch.arange(num_rows, device=device)[has_pending]
        counts[rows, pending[has_pending]] += 1.0
    present = counts > 0
    if (penalties.repetition != 1.0).any():
        seen = present.clone()
        prompts = [p if p is not None else np.zeros(0, np.int64) for p in penalties.prompt_token_ids]
        if any(len(p) for p in prompts):
            seen.view(-1)[_flat_indices(prompts, vocab, device)] = True
        penalty = torch.from_numpy(penalties.repetition).to(device).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if (penalties.frequency != 0.0).any():
        logits -= torch.from_numpy(penalties.frequency).to(device).unsqueeze(1) * counts
    if (penalties.presence != 0.0).any():
        logits -= torch.from_numpy(penalties.presence).to(device).unsqueeze(1) * present


def apply_logit_controls(logits: torch.Tensor, controls: LogitControls) -> None:
    """vLLM's per-request logit processors, in place, on the listed rows only: allowed_token_ids (every
    other token to -inf), bad_words (a word's last token to -inf where the generated tokens end with
    the rest of it) and logit_bias (added). A handful of tensor operations for the whole batch; the
    Python work is per row and per bad word, never per vocabulary entry."""
    device = logits.device
    vocab = logits.size(1)
    flat = logits.view(-1)
    allowed = [
        (row, c.allowed_token_ids)
        for row, c in zip(controls.rows, controls.per_row, strict=True)
        if c.allowed_token_ids is not None
    ]
    if allowed:
        disallowed = torch.ones(len(allowed), vocab, dtype=torch.bool, device=device)
        kept = torch.cat([ids + i * vocab for i, (_, ids) in enumerate(allowed)])
        disallowed.view(-1)[kept] = False
        index = torch.tensor([row for row, _ in allowed], device=device)
        logits[index] = logits[index].masked_fill_(disallowed, -float("inf"))
    banned = _bad_word_bans(controls, vocab)
    if banned is not None:
        positions, required, pending_rows = banned
        positions = torch.from_numpy(positions).to(device)
        ban = torch.full(positions.shape, -float("inf"), device=device)
        if required is not None:
            # A word whose prefix ends with the still-unknown last token: banned where that token is it.
            needed = torch.from_numpy(required).to(device)
            actual = controls.pending_token_ids[torch.from_numpy(pending_rows).to(device)]
            ban = torch.where((needed < 0) | (actual == needed), ban, torch.zeros_like(ban))
        # Accumulating adds of -inf and 0: repeated positions and their order change nothing.
        flat.index_put_((positions,), ban, accumulate=True)
    biased = [
        (row, c)
        for row, c in zip(controls.rows, controls.per_row, strict=True)
        if c.bias_token_ids is not None
    ]
    if biased:
        positions = torch.cat([c.bias_token_ids + row * vocab for row, c in biased])
        flat.index_add_(0, positions, torch.cat([c.bias_values for _, c in biased]))


def _bad_word_bans(
    controls: LogitControls, vocab: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray] | None:
    """The logits positions (row * vocab + token) bad_words ban this step. When a row's last generated
    token is still on the device, a word that needs it is a conditional ban: ``required`` holds the
    token it must be (-1: none needed) and ``pending_rows`` the row whose pending token decides."""
    positions: list[int] = []
    required: list[int] = []
    pending_rows: list[int] = []
    for row, c, known, pending in zip(
        controls.rows, controls.per_row, controls.output_token_ids, controls.last_token_pending, strict=True
    ):
        for word in c.bad_words or ():
            prefix = word[:-1]
            needed = -1
            if pending and len(prefix):
                needed = int(prefix[-1])
                prefix = prefix[:-1]
            tail = known[len(known) - len(prefix) :] if len(prefix) else prefix
            if len(tail) == len(prefix) and np.array_equal(tail, prefix):
                positions.append(row * vocab + int(word[-1]))
                required.append(needed)
                pending_rows.append(row)
    if not positions:
        return None
    if all(r < 0 for r in required):
        return np.array(positions, dtype=np.int64), None, np.zeros(0, dtype=np.int64)
    return (
        np.array(positions, dtype=np.int64),
        np.array(required, dtype=np.int64),
        np.array(pending_rows, dtype=np.int64),
    )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops (in place) tokens whose probability is below min_p times the row's largest:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p). min_p == 0 gives -inf: keeps all."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, -float("inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """In place, row by row: keeps the top-k tokens, then among those the smallest most-likely set whose
    probability (renormalized over what is left) reaches top_p; a top_k equal to the vocabulary size or
    a top_p of 1 leaves that part off. The cut is a logit value: tokens tied with the last kept one are
    kept too, so the result never depends on how a sort orders ties."""
    num_rows, vocab = logits.shape
    with_top_k = [k < vocab for k in top_k]
    if all(with_top_k):
        width = max(top_k)  # every kept set lies within its row's top-k
    else:
        width = min(
            vocab, max([_TOP_P_CANDIDATES] + [k for k, used in zip(top_k, with_top_k, strict=True) if used])
        )
    cutoff, complete = _cutoffs(logits, width, top_k, top_p)
    if width < vocab and not all(with_top_k) and not bool(complete.all()):
        # Rare: a top-p set larger than the candidates. Those rows sort their whole vocabulary.
        rows = complete.logical_not().nonzero().squeeze(1)
        row_list = rows.tolist()
        cutoff[rows] = _cutoffs(
            logits[rows], vocab, [top_k[i] for i in row_list], [top_p[i] for i in row_list]
        )[0]
    logits.masked_fill_(logits < cutoff, -float("inf"))


def _cutoffs(
    logits: torch.Tensor, width: int, top_k: list[int], top_p: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest logit each row keeps, found among its ``width`` largest, and whether it was found
    there (False: the row's top-p set extends past them)."""
    device = logits.device
    vocab = logits.size(1)
    if width < vocab:
        values = logits.topk(width, dim=-1).values
    else:
        values = logits.sort(dim=-1, descending=True).values
    k = torch.tensor(top_k, dtype=torch.long).to(device).unsqueeze(1)
    positions = torch.arange(width, device=device)
    values.masked_fill_(positions >= k, -float("inf"))
    keep_count = k.clamp(max=width)
    complete = torch.ones(len(top_k), dtype=torch.bool, device=device)
    if any(p < 1.0 for p in top_p):
        # Rows without top-p get a bound no cumulative probability reaches (rounding can make a
        # cumulative sum touch 1.0 before the last token).
        p = torch.tensor([q if q < 1.0 else 2.0 for q in top_p], dtype=torch.float32).to(device).unsqueeze(1)
        has_k = k < vocab
        # Top-p sees the distribution left by min_p and top-k: with a top-k all of it is among the
        # candidates, without one the rest of the vocabulary counts too.
        if all(k_value < vocab for k_value in top_k):
            normalizer = values.logsumexp(dim=-1, keepdim=True)
        else:
            normalizer = torch.where(
                has_k, values.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True)
            )
        probs = (values - normalizer).exp_()
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        # The most likely token has nothing before it, so a row keeps at least one token; the clamp
        # holds that even where rounding leaves the cut-off at 0 or a row's mass is not finite.
        keep_count = ((mass_before < p) & (positions < k)).sum(dim=-1, keepdim=True).clamp_min_(1)
        complete = (has_k | (keep_count < width)).squeeze(1) if width < vocab else complete
    return values.gather(1, keep_count - 1), complete
