"""What the sampler needs of a batch, as arrays: one row per sampled sequence.

The hot fields (temperatures, seeds, noise offsets) are device tensors gathered from the model runner's
persistent batch; the optional ones are host arrays (numpy), present only when some row uses them, so a
batch of plain temperature requests carries nothing else.
"""

from __future__ import annotations

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

    @property
    def num_rows(self) -> int:
        return len(self.greedy)

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())

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
    ) -> SamplingMetadata:
        """Metadata built straight from each row's parameters (the model runner gathers the same from
        its persistent batch instead)."""
        rows = len(params)
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        empty = np.zeros(0, dtype=np.int64)
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
        )
