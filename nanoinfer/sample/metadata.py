"""What the sampler needs of a batch, as arrays: one row per sampled sequence.

The hot fields (temperatures, seeds, noise offsets) are device tensors gathered from the model runner's
persistent batch; the optional ones are host arrays (numpy), present only when some row uses them, so a
batch of plain temperature requests carries nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanoinfer.sampling_params import SamplingParams


@dataclass
class PenaltyInputs:
    presence: np.ndarray  # float32 [rows]
    frequency: np.ndarray
    repetition: np.ndarray
    # Per row: the generated token ids the host knows, and the distinct prompt ids (repetition penalty).
    output_token_ids: list[np.ndarray]
    prompt_token_ids: list[np.ndarray | None]
    # Per row: the token the previous step sampled for it, when the host does not know it yet (async
    # scheduling), else -1; counted on the device with the others.
    pending_token_ids: torch.Tensor | None = None


@dataclass
class RowLogitControls:
    """One request's logit_bias, allowed_token_ids and bad_words, made once when it takes its batch slot
    (the id and bias tensors on the device)."""

    bias_token_ids: torch.Tensor | None = None  # int64 [k]
    bias_values: torch.Tensor | None = None  # float32 [k]
    allowed_token_ids: torch.Tensor | None = None  # int64 [m]: the only tokens it may sample
    bad_words: list[np.ndarray] | None = None  # each an int64 token-id sequence

    @classmethod
    def from_params(
        cls,
        params: SamplingParams,
        device: torch.device | str = "cpu",
        to_device: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> RowLogitControls | None:
        """None when the request sets none of them. ``to_device`` copies a host array to the device
        (default: a plain copy to ``device``)."""
        if not params.uses_logit_controls:
            return None
        if to_device is None:

            def to_device(array: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(array).to(device)

        controls = cls()
        if params.logit_bias:
            controls.bias_token_ids = to_device(np.fromiter(params.logit_bias, np.int64))
            controls.bias_values = to_device(np.fromiter(params.logit_bias.values(), np.float32))
        if params.allowed_token_ids:
            controls.allowed_token_ids = to_device(np.unique(np.array(params.allowed_token_ids, np.int64)))
        if params.bad_words_token_ids:
            controls.bad_words = [np.array(w, dtype=np.int64) for w in params.bad_words_token_ids]
        return controls


@dataclass
class LogitControls:
    """The logit controls of the rows that have them; the other rows are left as they are."""

    rows: list[int]
    per_row: list[RowLogitControls]
    # Per listed row: the generated token ids the host knows (bad_words match their tail), and whether
    # the last generated token is still on the device (async scheduling).
    output_token_ids: list[np.ndarray]
    last_token_pending: list[bool]
    # Per row of the batch: the previous step's token where the host does not know it yet, else -1.
    pending_token_ids: torch.Tensor | None = None

    def select(self, rows: list[int]) -> LogitControls | None:
        """The controls of some batch rows, renumbered in the given order (None if none has any)."""
        where = {row: i for i, row in enumerate(self.rows)}
        keep = [(new, where[row]) for new, row in enumerate(rows) if row in where]
        if not keep:
            return None
        pending = None
        if self.pending_token_ids is not None:
            index = torch.tensor(rows, device=self.pending_token_ids.device)
            pending = self.pending_token_ids[index]
        return LogitControls(
            rows=[new for new, _ in keep],
            per_row=[self.per_row[i] for _, i in keep],
            output_token_ids=[self.output_token_ids[i] for _, i in keep],
            last_token_pending=[self.last_token_pending[i] for _, i in keep],
            pending_token_ids=pending,
        )


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [rows] on the device; 0: greedy
    greedy: np.ndarray  # bool [rows]
    seeds: torch.Tensor  # int64 [rows] on the device: each row's noise seed
    offsets: torch.Tensor  # int64 [rows] on the device: tokens the row generated before this one
    top_k: np.ndarray | None = None  # int64 [rows]; 0: off
    top_p: np.ndarray | None = None  # float64 [rows]; 1: off
    min_p: np.ndarray | None = None  # float64 [rows]; 0: off
    penalties: PenaltyInputs | None = None
    # Rows below min_tokens: (row, the token ids they may not sample yet).
    banned: list[tuple[int, list[int]]] | None = None
    # Top logprobs per row (-1: none); None when no row asks for logprobs.
    num_logprobs: np.ndarray | None = None
    # logit_bias, allowed_token_ids and bad_words; None when no row sets any.
    logit_controls: LogitControls | None = None

    @property
    def num_rows(self) -> int:
        return len(self.greedy)

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

    @property
    def temperature_only(self) -> bool:
        """No row uses a filter, penalty, banned token, logit control or logprobs: every row's token is
        the inverse-CDF draw (or, at temperature 0, the argmax) of its logits."""
        return (
            self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.penalties is None
            and self.banned is None
            and self.num_logprobs is None
            and self.logit_controls is None
        )

    def select(self, rows: list[int]) -> SamplingMetadata:
        """The metadata of some rows only (in the given order); features those rows do not use are off."""
        index = torch.tensor(rows, device=self.temperature.device)
        n = len(rows)
        penalties = self.penalties
        empty = np.zeros(0, dtype=np.int64)
        banned = dict(self.banned or [])

        def pick(array: np.ndarray | None, neutral: float, dtype) -> np.ndarray:
            return array[rows] if array is not None else np.full(n, neutral, dtype=dtype)

        pending = penalties.pending_token_ids if penalties is not None else None
        return SamplingMetadata.from_arrays(
            temperature=self.temperature[index],
            seeds=self.seeds[index],
            offsets=self.offsets[index],
            top_k=pick(self.top_k, 0, np.int64),
            top_p=pick(self.top_p, 1.0, np.float64),
            min_p=pick(self.min_p, 0.0, np.float64),
            presence=pick(penalties.presence if penalties else None, 0.0, np.float32),
            frequency=pick(penalties.frequency if penalties else None, 0.0, np.float32),
            repetition=pick(penalties.repetition if penalties else None, 1.0, np.float32),
            output_token_ids=[penalties.output_token_ids[r] for r in rows] if penalties else [empty] * n,
            prompt_token_ids=[penalties.prompt_token_ids[r] for r in rows] if penalties else [None] * n,
            banned_token_ids=[banned.get(r, []) for r in rows],
            num_logprobs=pick(self.num_logprobs, -1, np.int64),
            pending_token_ids=pending[index] if pending is not None else None,
            greedy=self.greedy[rows],
            logit_controls=self.logit_controls.select(rows) if self.logit_controls is not None else None,
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        num_output_tokens: list[int],
        device: torch.device | str = "cpu",
        output_token_ids: list[np.ndarray] | None = None,
        prompt_token_ids: list[np.ndarray | None] | None = None,
        banned_token_ids: list[list[int]] | None = None,
        last_token_pending: list[bool] | None = None,
        pending_token_ids: torch.Tensor | None = None,
    ) -> SamplingMetadata:
        """Metadata built straight from each row's parameters (the model runner gathers the same from
        its persistent batch instead). bad_words need their token ids (``update_from_tokenizer``) and,
        like penalties, ``output_token_ids``; ``pending_token_ids`` (one per row, -1: none) stands for
        the last generated token of the rows ``last_token_pending`` marks."""
        rows = len(params)
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        empty = np.zeros(0, dtype=np.int64)
        controls = [RowLogitControls.from_params(p, device) for p in params]
        with_controls = [i for i, c in enumerate(controls) if c is not None]
        logit_controls = None
        if with_controls:
            outputs = output_token_ids or [empty] * rows
            pending_flags = last_token_pending or [False] * rows
            logit_controls = LogitControls(
                rows=with_controls,
                per_row=[controls[i] for i in with_controls],
                output_token_ids=[outputs[i] for i in with_controls],
                last_token_pending=[pending_flags[i] for i in with_controls],
                pending_token_ids=pending_token_ids,
            )
        return cls.from_arrays(
            temperature=torch.from_numpy(temperature).to(device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            offsets=torch.tensor(num_output_tokens, dtype=torch.int64, device=device),
            top_k=np.array([p.top_k if p.top_k > 0 else 0 for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float64),
            min_p=np.array([p.min_p for p in params], dtype=np.float64),
            presence=np.array([p.presence_penalty for p in params], dtype=np.float32),
            frequency=np.array([p.frequency_penalty for p in params], dtype=np.float32),
            repetition=np.array([p.repetition_penalty for p in params], dtype=np.float32),
            output_token_ids=output_token_ids or [empty] * rows,
            prompt_token_ids=prompt_token_ids or [None] * rows,
            banned_token_ids=banned_token_ids or [[] for _ in range(rows)],
            num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params]),
            pending_token_ids=pending_token_ids,
            logit_controls=logit_controls,
        )

    @classmethod
    def from_arrays(
        cls,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,
        top_k: np.ndarray,
        top_p: np.ndarray,
        min_p: np.ndarray,
        presence: np.ndarray,
        frequency: np.ndarray,
        repetition: np.ndarray,
        output_token_ids: list[np.ndarray],
        prompt_token_ids: list[np.ndarray | None],
        banned_token_ids: list[list[int]],
        num_logprobs: np.ndarray,
        pending_token_ids: torch.Tensor | None = None,
        greedy: np.ndarray | None = None,
        logit_controls: LogitControls | None = None,
    ) -> SamplingMetadata:
        """Leaves out (None) every optional feature no row uses. ``greedy`` defaults to temperature == 0
        (read on the host: pass it when the temperatures are on the device)."""
        if greedy is None:
            greedy = temperature.cpu().numpy() == 0.0
        uses_penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        banned = [(i, ids) for i, ids in enumerate(banned_token_ids) if ids]
        random = ~greedy
        return cls(
            temperature=temperature,
            greedy=greedy,
            seeds=seeds,
            offsets=offsets,
            # Filters never change a greedy row's argmax: they are left off there (as vLLM does).
            top_k=top_k if (top_k[random] > 0).any() else None,
            top_p=top_p if (top_p[random] < 1.0).any() else None,
            min_p=min_p if (min_p[random] > 0.0).any() else None,
            penalties=(
                PenaltyInputs(
                    presence, frequency, repetition, output_token_ids, prompt_token_ids, pending_token_ids
                )
                if uses_penalties
                else None
            ),
            banned=banned or None,
            num_logprobs=num_logprobs if (num_logprobs >= 0).any() else None,
            logit_controls=logit_controls,
        )
