"""Batched sampling with vLLM's semantics, in one vectorized pass over the whole batch.

Order (vLLM's): min_tokens masking, then the repetition / frequency / presence penalties, then greedy
rows take the argmax; the others divide by their temperature, drop tokens below min_p, keep their
top-k and then their top-p, and draw with the exponential race argmax(p / E), E ~ Exp(1) (the
Gumbel-max trick without logs). Each step is skipped when no row of the batch uses it, so a batch of
plain temperature requests pays for a softmax and one noise draw only.

Rows with a seed draw their noise from a generator seeded with (seed, number of tokens generated so
far): no state to keep between steps or to free, and the same request gives the same tokens whether it
runs alone or in any batch (given the same logits), after a preemption too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanoinfer.executor.batch import SamplerOutput, ScheduledRow, TokenLogprobs
from nanoinfer.sampling_params import derive_seed

# Candidates for the top-p cut of rows without top-k: it almost always falls among the most likely
# few thousand tokens, and finding those is several times cheaper than sorting a 150k vocabulary.
_TOP_P_CANDIDATES = 4096
# Positions per compute_logits call when computing prompt logprobs: bounds the [positions, vocab] fp32
# temporaries (about 150 MiB each for a 150k vocabulary) whatever the prompt chunk length.
_PROMPT_LOGPROB_CHUNK = 256


def _fill_exponential(noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fills ``noise`` in place with Exp(1) draws. On CUDA ``exponential_`` is one kernel; on the CPU it
    is about 5x slower than -log(U), U ~ Uniform[0, 1) (the same distribution): 17.7 against 3.4 ms for
    16 x 49,152 logits."""
    if noise.device.type == "cuda":
        return noise.exponential_(1, generator=generator)
    return noise.uniform_(generator=generator).log_().neg_()


def _exponential_noise(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # Clamped: an exact 0 would turn a zero probability into 0/0 = NaN, which argmax picks.
    return _fill_exponential(torch.empty_like(probs), generator).clamp_min_(1e-10)


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def forward(
        self,
        logits: torch.Tensor | None,
        rows: list[ScheduledRow],
        generator: torch.Generator | None = None,
        prompt_logprobs: dict[int, TokenLogprobs] | None = None,
    ) -> SamplerOutput:
        """One token per row of ``logits`` ([batch, vocab]), with each row's sampling parameters.

        ``logits`` is None when there is nothing to sample (or on a tensor-parallel worker); the
        output then carries only ``prompt_logprobs``.
        """
        if logits is None:
            return SamplerOutput([], prompt_logprobs=prompt_logprobs or {})
        if all(r.params.temperature_only for r in rows):
            temperatures = [r.params.temperature for r in rows]
            tokens = self.sample_tokens(
                logits,
                torch.tensor(temperatures, dtype=torch.float32).to(logits.device),
                generator,
                num_greedy=temperatures.count(0.0),
            )
            output = SamplerOutput(tokens.tolist())
        else:
            output = self._sample_full(logits, rows, generator)
        output.prompt_logprobs = prompt_logprobs or {}
        return output

    def sample_isolating_faults(
        self,
        logits: torch.Tensor | None,
        rows: list[ScheduledRow],
        generator: torch.Generator | None = None,
        prompt_logprobs: dict[int, TokenLogprobs] | None = None,
    ) -> SamplerOutput:
        """:meth:`forward`, except that when the batch raises, each row is sampled alone, so that a row
        whose parameters trip an error fails alone (``failed_rows``) and the others get their tokens.
        An error that no row can escape (the device itself failing) is raised."""
        try:
            return self(logits, rows, generator, prompt_logprobs)
        except Exception as error:
            if logits is None:
                raise
            batch_error = error
        token_ids: list[int] = []
        failed: dict[int, str] = {}
        logprobs: TokenLogprobs | None = None
        logprob_rows: list[int] = []
        for i, row in enumerate(rows):
            try:
                alone = self(logits[i : i + 1], [row], generator)
            except Exception as e:
                failed[i] = f"{type(e).__name__}: {e}"
                token_ids.append(-1)
                continue
            token_ids.append(alone.token_ids[0])
            if alone.logprobs is not None:
                if logprobs is None:
                    logprobs = alone.logprobs
                else:
                    logprobs.extend(alone.logprobs)
                logprob_rows.append(i)
        # A failed device fails the simplest work too: then nothing here is the rows' fault.
        torch.ones(1, device=logits.device).add_(1).item()
        if not failed:
            raise batch_error  # the batch failed although every row alone succeeds: not attributable
        return SamplerOutput(token_ids, logprobs, logprob_rows, prompt_logprobs or {}, failed)

    @staticmethod
    def sample_tokens(
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        generator: torch.Generator | None = None,
        num_greedy: int | None = None,
    ) -> torch.Tensor:
        """Temperature-only sampling of every row (temperature 0: argmax). ``num_greedy``, the number
        of greedy rows when the caller knows it, lets all-greedy and no-greedy batches skip work."""
        if num_greedy == len(logits):
            return logits.argmax(dim=-1)
        if num_greedy == 0:
            # Low-precision logits divided by fp32 temperatures give fp32 in one kernel.
            probs = (logits / temperatures.unsqueeze(1)).softmax(dim=-1)
            return probs.div_(_exponential_noise(probs, generator)).argmax(dim=-1)
        greedy = logits.argmax(dim=-1)
        is_greedy = temperatures == 0
        # Dividing by 1 on greedy rows keeps the sampled branch finite; their result is discarded.
        scaled = logits / torch.where(is_greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
        probs = scaled.softmax(dim=-1)
        sampled = probs.div_(_exponential_noise(probs, generator)).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)

    # -- the general path ------------------------------------------------------------------------------

    def _sample_full(
        self, logits: torch.Tensor, rows: list[ScheduledRow], generator: torch.Generator | None
    ) -> SamplerOutput:
        device = logits.device
        params = [r.params for r in rows]
        # A private fp32 copy: the steps below work in place.
        logits = logits.to(torch.float32, copy=True)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw = logits if len(logprob_rows) == len(rows) else logits[logprob_rows]
            raw_logprobs = raw.log_softmax(dim=-1)

        banned = [(i, r.banned_token_ids) for i, r in enumerate(rows) if r.banned_token_ids]
        if banned:
            row_index = torch.tensor([i for i, ids in banned for _ in ids], device=device)
            token_index = torch.tensor([t for _, ids in banned for t in ids], device=device)
            logits[row_index, token_index] = -float("inf")
        penalty_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalty_rows:
            apply_penalties(logits, [rows[i] for i in penalty_rows], penalty_rows)

        is_greedy = [p.greedy for p in params]
        if all(is_greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, rows, is_greedy, generator)
        output = SamplerOutput(tokens.tolist())
        if logprob_rows:
            chosen = tokens[logprob_rows] if len(logprob_rows) < len(rows) else tokens
            output.logprobs = gather_logprobs(
                raw_logprobs, chosen, [params[i].logprobs for i in logprob_rows]
            )
            output.logprob_rows = logprob_rows
        return output

    def _sample_random(
        self,
        logits: torch.Tensor,
        rows: list[ScheduledRow],
        is_greedy: list[bool],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in rows]
        any_greedy = any(is_greedy)
        greedy_tokens = logits.argmax(dim=-1) if any_greedy else None
        # Greedy rows divide by 1 to stay finite; their sampled token is discarded.
        temperatures = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
        logits.div_(temperatures.to(device).unsqueeze(1))
        if any(p.min_p > 0.0 for p in params):
            apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=torch.float32).to(device))
        vocab = logits.size(1)
        filter_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if filter_rows:
            top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in filter_rows]
            top_p = [params[i].top_p for i in filter_rows]
            if len(filter_rows) == len(rows):
                apply_top_k_top_p(logits, top_k, top_p)
            else:
                index = torch.tensor(filter_rows, device=device)
                selected = logits[index]
                apply_top_k_top_p(selected, top_k, top_p)
                logits[index] = selected
        probs = logits.softmax(dim=-1)
        noise = self._noise(probs, rows, is_greedy, generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        if any_greedy:
            return torch.where(torch.tensor(is_greedy, device=device), greedy_tokens, sampled)
        return sampled

    def _noise(
        self,
        probs: torch.Tensor,
        rows: list[ScheduledRow],
        is_greedy: list[bool],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        seeded = [(i, r) for i, r in enumerate(rows) if r.seed is not None and not is_greedy[i]]
        if not seeded:
            return _exponential_noise(probs, generator)
        noise = torch.empty_like(probs)
        if len(seeded) < len(rows):
            _fill_exponential(noise, generator)  # seeded rows are overwritten below
        seeded_generator = self._seeded_generators.get(probs.device)
        if seeded_generator is None:
            seeded_generator = torch.Generator(device=probs.device)
            self._seeded_generators[probs.device] = seeded_generator
        for i, row in seeded:
            seeded_generator.manual_seed(derive_seed(row.seed, row.num_output_tokens))
            _fill_exponential(noise[i], seeded_generator)
        return noise.clamp_min_(1e-10)

    # -- prompt logprobs -------------------------------------------------------------------------------

    def prompt_logprobs(
        self,
        hidden: torch.Tensor,
        token_index: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
        rows: list[ScheduledRow] | None,
    ) -> dict[int, TokenLogprobs] | None:
        """Logprobs of the prompt tokens that follow each row's first positions (rows with
        ``prompt_logprob_targets``), as a dict from row index to its positions' logprobs.

        ``token_index`` picks those positions out of ``hidden``: each such row's first
        ``len(prompt_logprob_targets)`` tokens, rows in order. ``compute_logits`` is a collective under
        tensor parallelism, so every rank calls it on the same positions; the workers pass no ``rows``
        (they only join the collectives) and get None.
        """
        jobs = [(i, r) for i, r in enumerate(rows) if r.prompt_logprob_targets] if rows is not None else []
        targets = [t for _, r in jobs for t in r.prompt_logprob_targets]
        num_top = [r.params.prompt_logprobs for _, r in jobs for _ in r.prompt_logprob_targets]
        pieces: list[TokenLogprobs] = []
        for begin in range(0, len(token_index), _PROMPT_LOGPROB_CHUNK):
            end = begin + _PROMPT_LOGPROB_CHUNK
            logits = compute_logits(hidden[token_index[begin:end]])
            if rows is None:  # a worker: it joins the collective, rank 0 gets the logits
                continue
            chosen = torch.tensor(targets[begin:end], device=hidden.device)
            pieces.append(gather_logprobs(logits.float().log_softmax(dim=-1), chosen, num_top[begin:end]))
        if rows is None:
            return None
        merged = pieces[0]
        for piece in pieces[1:]:
            merged.extend(piece)
        result = {}
        offset = 0
        for i, row in jobs:
            count = len(row.prompt_logprob_targets)
            result[i] = merged.slice(offset, offset + count)
            offset += count
        return result


# -- the steps, as functions of tensors (also used directly by the tests) --------------------------------


def _flat_indices(rows_of_ids: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """row * vocab + token for every token id of every row: indices into a flattened [rows, vocab]. The
    row offsets are expanded on the device: only the ids themselves cross over."""
    ids = torch.from_numpy(np.concatenate(rows_of_ids).astype(np.int64, copy=False)).to(device)
    lengths = torch.tensor([len(r) for r in rows_of_ids]).to(device)
    offsets = torch.arange(len(rows_of_ids), device=device) * vocab
    return ids + offsets.repeat_interleave(lengths, output_size=len(ids))


def apply_penalties(logits: torch.Tensor, rows: list[ScheduledRow], row_index: list[int]) -> None:
    """vLLM's penalties, in place on ``logits[row_index]``: the repetition penalty over prompt and output
    tokens (positive logits divided by it, negative ones multiplied), then minus frequency_penalty times
    each token's count in the output and minus presence_penalty for each token present in it."""
    device = logits.device
    num_rows, vocab = len(rows), logits.size(1)
    whole_batch = num_rows == logits.size(0)
    selected = logits if whole_batch else logits[row_index]
    empty = np.zeros(0, dtype=np.int64)
    outputs = [r.penalty_output_ids if r.penalty_output_ids is not None else empty for r in rows]
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    if any(len(o) for o in outputs):
        index = _flat_indices(outputs, vocab, device)
        # Atomic adds of whole numbers: exact, so the order does not matter.
        counts.view(-1).index_add_(0, index, torch.ones(len(index), dtype=torch.float32, device=device))
    present = counts > 0
    params = [r.params for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = present.clone()
        prompts = [r.penalty_prompt_ids if r.penalty_prompt_ids is not None else empty for r in rows]
        if any(len(p) for p in prompts):
            seen.view(-1)[_flat_indices(prompts, vocab, device)] = True
        penalty = (
            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32).to(device).unsqueeze(1)
        )
        penalized = torch.where(selected > 0, selected / penalty, selected * penalty)
        selected = torch.where(seen, penalized, selected)
    if any(p.frequency_penalty != 0.0 for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32).to(device)
        selected = selected - frequency.unsqueeze(1) * counts
    if any(p.presence_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32).to(device)
        selected = selected - presence.unsqueeze(1) * present
    if whole_batch:
        logits.copy_(selected)
    else:
        logits[torch.tensor(row_index, device=device)] = selected


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


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> TokenLogprobs:
    """Row i of ``logprobs`` ([rows, vocab]) is position i of the result: the chosen token's logprob and
    rank, and the top ``num_top[i]`` tokens. One device-to-host copy per kind of result."""
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    max_top = max(num_top)
    top_ids: list[list[int]] = [[] for _ in num_top]
    top_values: list[list[float]] = [[] for _ in num_top]
    if max_top:
        top = logprobs.topk(max_top, dim=-1)
        all_values, all_ids = top.values.tolist(), top.indices.tolist()
        top_ids = [ids[:n] for ids, n in zip(all_ids, num_top, strict=True)]
        top_values = [values[:n] for values, n in zip(all_values, num_top, strict=True)]
    return TokenLogprobs(
        token_ids=chosen.tolist(),
        logprobs=chosen_logprobs.squeeze(1).tolist(),
        ranks=ranks.tolist(),
        top_token_ids=top_ids,
        top_logprobs=top_values,
    )
