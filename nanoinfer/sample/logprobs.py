"""Logprobs as plain lists, and their computation from a [rows, vocab] log-softmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """Logprobs at consecutive positions: one position for a sampled token, several for a chunk of
    prompt. Logprobs are the log-softmax of the model's raw logits (before penalties, temperature and
    filters), as vLLM returns by default."""

    token_ids: list[int]  # the sampled (or actual prompt) token at each position
    logprobs: list[float]
    ranks: list[int]  # 1 + the number of other tokens at least as likely
    top_token_ids: list[list[int]]  # the position's top-N, most likely first (empty lists when N == 0)
    top_logprobs: list[list[float]]

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_token_ids += other.top_token_ids
        self.top_logprobs += other.top_logprobs

    def slice(self, start: int, end: int) -> TokenLogprobs:
        return TokenLogprobs(
            self.token_ids[start:end],
            self.logprobs[start:end],
            self.ranks[start:end],
            self.top_token_ids[start:end],
            self.top_logprobs[start:end],
        )


@dataclass
class LogprobsTensors:
    """The same on the device, before the host reads it: filled in by the sampler's step, read after."""

    token_ids: torch.Tensor  # [rows]
    logprobs: torch.Tensor  # [rows]
    ranks: torch.Tensor  # [rows]
    top_token_ids: torch.Tensor | None  # [rows, max N]
    top_logprobs: torch.Tensor | None
    num_top: list[int]

    def to_lists(self) -> TokenLogprobs:
        top_ids: list[list[int]] = [[] for _ in self.num_top]
        top_values: list[list[float]] = [[] for _ in self.num_top]
        if self.top_token_ids is not None:
            all_ids, all_values = self.top_token_ids.tolist(), self.top_logprobs.tolist()
            top_ids = [ids[:n] for ids, n in zip(all_ids, self.num_top, strict=True)]
            top_values = [values[:n] for values, n in zip(all_values, self.num_top, strict=True)]
        return TokenLogprobs(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
            top_token_ids=top_ids,
            top_logprobs=top_values,
        )


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> LogprobsTensors:
    """Row i of ``logprobs`` ([rows, vocab]) is position i of the result: the chosen token's logprob and
    rank, and the top ``num_top[i]`` tokens. Stays on the device."""
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)
    max_top = max(num_top)
    top_ids = top_values = None
    if max_top:
        top = logprobs.topk(max_top, dim=-1)
        top_ids, top_values = top.indices, top.values
    return LogprobsTensors(chosen, chosen_logprobs.squeeze(1), ranks, top_ids, top_values, num_top)
