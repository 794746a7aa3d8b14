"""Batched sampling: greedy rows take the argmax, the others Gumbel-max at their own temperature."""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.executor.batch import ScheduledRow


class Sampler(nn.Module):
    def forward(
        self, logits: torch.Tensor, rows: list[ScheduledRow], generator: torch.Generator | None = None
    ) -> list[int]:
        """One token per row of ``logits`` ([batch, vocab]), with each row's sampling parameters."""
        temperatures = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        return self.sample_tokens(logits, temperatures.to(logits.device), generator).tolist()

    @staticmethod
    def sample_tokens(
        logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        is_greedy = temperatures == 0
        # Dividing by 1 on greedy rows keeps the sampled branch finite; their result is discarded.
        scaled = logits / torch.where(is_greedy, torch.ones_like(temperatures), temperatures).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        # argmax(p / E) with E ~ Exp(1) is a draw from p (the Gumbel-max trick without logs).
        noise = torch.empty_like(probs).exponential_(1, generator=generator).clamp_min_(1e-10)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)
