"""Greedy reference decoding with transformers, the near-tie comparison rule and vLLM's logprob-closeness
rule."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from a transformers model (EOS ignored) and each step's top-1/top-2 logit margin."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, margins = [], []
    for _ in range(max_new_tokens):
        top2 = out.logits[0, -1].float().topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def assert_greedy_match(
    got: list[int], ref: list[int], margins: list[float], near_tie: float = NEAR_TIE
) -> None:
    """Token-for-token equality, except that a divergence at a near-tie ends the comparison."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):  # lengths are compared after
        if a != b:
            assert margins[i] < near_tie, (
                f"diverged at token {i}: got {a}, reference {b} (margin {margins[i]:.3g} is not a near-tie)\n"
                f"got {got}\nref {ref}"
            )
            return
    assert len(got) == len(ref), f"lengths differ: {len(got)} vs {len(ref)}"


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_logprobs_close(a, b):
    """vLLM's rule: the token ids are identical, or at the first position where they differ each side's
    token is among the other side's logprobs there (as many as the requests asked for). Returns the
    number of identical outputs."""
    identical = 0
    for x, y in zip(a, b, strict=True):
        x, y = x.outputs[0], y.outputs[0]
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if tx != ty:
                assert tx in y.logprobs[i] and ty in x.logprobs[i], (i, tx, ty)
                break
        else:
            identical += 1
    return identical
