"""The default model end to end: nanoinfer's greedy output on the SmolLM2 GGUF equals transformers'."""

from __future__ import annotations

import os

import pytest
import torch

from nanoinfer import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
# Below this top-2 logit margin the reference itself is a coin toss under float32 reordering.
NEAR_TIE = 1e-4
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences how a CPU cache works.",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    engine = LLM(smollm2_path, device="cpu", dtype="float32", max_model_len=512, num_kvcache_blocks=64)
    yield engine
    engine.close()


@torch.no_grad()
def _reference_greedy(
    model, prompts: list[list[int]], pad_id: int
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy continuations (one left-padded batch, never stopping at EOS) and the top-2 logit
    margin at every step."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    model.generation_config.eos_token_id = None  # compare the full NUM_TOKENS, like ignore_eos
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NUM_TOKENS,
        do_sample=False,
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, width:].tolist()
    top2 = torch.stack(out.logits, dim=1).double().topk(2, dim=-1).values  # [batch, steps, 2]
    return tokens, (top2[..., 0] - top2[..., 1]).tolist()


def test_greedy_output_equals_transformers(llm, smollm2_path):
    from transformers import AutoModelForCausalLM

    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)

    directory, name = os.path.split(smollm2_path)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    expected_tokens, margins = _reference_greedy(reference, prompt_ids, tokenizer.eos_token_id)

    for prompt, output, expected, margin in zip(PROMPTS, outputs, expected_tokens, margins, strict=True):
        ours = output.outputs[0].token_ids
        assert len(ours) == NUM_TOKENS
        mismatch = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=True)) if a != b), None)
        if mismatch is not None:
            assert margin[mismatch] < NEAR_TIE, (
                f"{prompt!r}: token {mismatch} is {ours[mismatch]} but transformers picks "
                f"{expected[mismatch]} (top-2 margin {margin[mismatch]:.3g});\n"
                f"ours         {ours}\ntransformers {expected}"
            )

    # The answer itself, up to the end of the assistant's turn.
    france = outputs[0].outputs[0].token_ids
    answer = france[: france.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in france else france
    assert "Paris" in tokenizer.decode(answer)
