"""Sampling features end to end on the tiny random Qwen3 (CPU, fp32): seeds, n > 1 with shared prompt
blocks, stop strings / stop tokens / min_tokens, and logprobs checked against transformers."""

import random

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from tests.reference import load_hf_model


def _prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


def _all_free(llm):
    stats = llm.engine_stats()
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and not llm.llm_engine.has_unfinished_requests()
    )


def _generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    return load_hf_model(tiny_qwen3)


# -- seeds ----------------------------------------------------------------------------------------------


def test_seeded_request_is_reproducible_alone_and_in_any_batch(tiny_qwen3, llm):
    prompt = _prompt(21, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = _generate(llm, [prompt], seeded)[0].outputs[0].token_ids
    # Another engine (other engine seed, chunked prefill) with other requests before and after it.
    other = LLM(tiny_qwen3, seed=9, max_num_batched_tokens=32)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = [unseeded, seeded, SamplingParams(temperature=0.7, top_k=20, max_tokens=5), unseeded]
    outputs = _generate(other, [_prompt(30, 2), prompt, _prompt(9, 3), prompt], mixed)
    assert outputs[1].outputs[0].token_ids == alone
    assert outputs[3].outputs[0].token_ids != alone  # same prompt without the seed
    again = _generate(llm, [prompt], seeded)[0].outputs[0].token_ids
    assert again == alone
    different = SamplingParams(temperature=1.0, seed=1235, max_tokens=12, ignore_eos=True)
    assert _generate(llm, [prompt], different)[0].outputs[0].token_ids != alone
    assert _all_free(llm) and _all_free(other)


# -- n > 1 ----------------------------------------------------------------------------------------------


def _max_blocks_used(engine):
    used = 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        stats = engine.stats()
        used = max(used, stats["num_kv_blocks_total"] - stats["num_kv_blocks_free"])
    return used, outputs


def test_n_completions_share_the_prompt_blocks(tiny_qwen3):
    prompt = _prompt(40, seed=4)  # two full blocks of 16, then 8 tokens
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)

    shared = LLM(tiny_qwen3, kvcache_block_size=16)
    shared.llm_engine.add_request("n3", prompt, params)
    used_shared, outputs = _max_blocks_used(shared.llm_engine)
    # Every step returns one output per request, holding all three completions.
    assert all(o.request_id == "n3" and len(o.outputs) == 3 for o in outputs)
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3, "siblings must draw different noise"
    assert not any(o.finished for o in outputs[:-1])
    assert _all_free(shared)

    separate = LLM(tiny_qwen3, kvcache_block_size=16)
    single = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    for i in range(3):
        separate.llm_engine.add_request(f"r{i}", prompt, single)
    used_separate, separate_outputs = _max_blocks_used(separate.llm_engine)
    # Three separate requests admitted together each compute the prompt: 3 x 3 blocks. The siblings
    # share the two full prompt blocks and each own the partial third one: 2 + 3.
    assert (used_shared, used_separate) == (5, 9)
    # Completion 0 uses the request's seed itself, like an n=1 request with that seed.
    first = next(o for o in separate_outputs if o.request_id == "r0" and o.finished)
    assert final.outputs[0].token_ids == first.outputs[0].token_ids
    assert _all_free(separate)


def test_n_greedy_and_abort(tiny_qwen3):
    llm = LLM(tiny_qwen3, kvcache_block_size=16)
    out = _generate(llm, [_prompt(40, 5)], SamplingParams(n=2, temperature=0.0, max_tokens=4))[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids and len(out.outputs) == 2
    engine = llm.llm_engine
    engine.add_request("a", _prompt(40, 6), SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    engine.step()  # the first completion's prompt; the others are admitted now
    engine.step()
    assert engine.abort_request("a") and not engine.has_unfinished_requests()
    assert _all_free(llm)


# -- stop strings, stop tokens, min_tokens -------------------------------------------------------------


def _greedy_reference(llm, prompt, max_tokens=40):
    out = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0]


def _multi_token_stop_string(tokenizer, tokens):
    """A 3-character string of the greedy text that spans a token boundary, and the number of tokens
    after which its first occurrence is complete."""
    texts = [tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    full = texts[-1]
    for i in range(2, len(tokens)):
        before, after = texts[i], texts[i + 1]
        if not after.startswith(before) or len(before) < 2 or len(after) == len(before):
            continue
        stop = before[-2:] + after[len(before)]
        if all(c.isascii() and c.isprintable() for c in stop):
            first_end = next(j for j in range(len(texts)) if stop in texts[j])
            return stop, first_end, full
    raise AssertionError("no printable token boundary in the greedy output; change the prompt")


def test_stop_string_across_tokens(llm):
    prompt = _prompt(12, seed=8)
    reference = _greedy_reference(llm, prompt)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(reference.token_ids).rstrip("\ufffd") == reference.text
    stop, num_tokens, full = _multi_token_stop_string(tokenizer, reference.token_ids)
    cut = full.index(stop)
    base = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    # A stop string that never matches next to the real one: the earliest match wins either way.
    out = _generate(llm, [prompt], SamplingParams(stop=["\x00never\x00", stop], **base))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == full[:cut] and out.token_ids == reference.token_ids[:num_tokens]
    kept = _generate(llm, [prompt], SamplingParams(stop=stop, include_stop_str_in_output=True, **base))[0]
    assert kept.outputs[0].text == full[: cut + len(stop)]
    # Before min_tokens the stop string does not count.
    late = _generate(llm, [prompt], SamplingParams(stop=stop, min_tokens=num_tokens, **base))[0].outputs[0]
    assert len(late.token_ids) > num_tokens and late.text.startswith(full[: cut + len(stop)])
    assert _all_free(llm)


def test_streamed_text_never_shrinks(llm):
    prompt = _prompt(12, seed=8)
    reference = _greedy_reference(llm, prompt)
    stop, _, _ = _multi_token_stop_string(llm.get_tokenizer(), reference.token_ids)
    engine = llm.llm_engine
    engine.add_request("stream", prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=stop))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    # The tail that could start a stop string is held back while running, so no text is taken back.
    assert all(texts[-1].startswith(t) for t in texts)
    assert stop not in texts[-1] and len(texts) > 2


def test_stop_token_ids(llm):
    prompt = _prompt(10, seed=9)
    reference = _greedy_reference(llm, prompt, max_tokens=12)
    tokens = reference.token_ids
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(tokens[:i]).rstrip("\ufffd") for i in range(len(tokens) + 1)]
    # A stop token that adds visible text and did not occur before.
    k = next(
        i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and len(texts[i + 1]) > len(texts[i])
    )
    base = dict(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[k]])
    out = _generate(llm, [prompt], SamplingParams(**base))[0].outputs[0]
    assert out.token_ids == tokens[: k + 1] and (out.finish_reason, out.stop_reason) == ("stop", tokens[k])
    # The stop token's text is left out unless include_stop_str_in_output.
    assert out.text == texts[k]
    kept = _generate(llm, [prompt], SamplingParams(include_stop_str_in_output=True, **base))[0].outputs[0]
    assert kept.text == texts[k + 1]
    # min_tokens masks the stop token: it cannot be among the first min_tokens tokens.
    held = _generate(llm, [prompt], SamplingParams(min_tokens=k + 2, **base))[0].outputs[0]
    assert tokens[k] not in held.token_ids[: k + 2] and len(held.token_ids) >= k + 2
    assert held.token_ids[:k] == tokens[:k]


def test_eos_and_min_tokens(tiny_qwen3):
    llm = LLM(tiny_qwen3)
    prompt = _prompt(10, seed=10)
    tokens = _greedy_reference(llm, prompt, max_tokens=8).token_ids
    eos = tokens[2]
    llm.llm_engine.input_processor.eos_token_ids = (eos,)  # as if the model's EOS were the third greedy token
    out = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == tokens[:3] and (out.finish_reason, out.stop_reason) == ("stop", None)
    held = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5))[0].outputs[0]
    assert eos not in held.token_ids[:5] and held.token_ids[:2] == tokens[:2]
    sampled = SamplingParams(temperature=1.0, max_tokens=8, min_tokens=6, seed=3)
    for out in _generate(llm, [prompt] * 4, sampled):
        assert eos not in out.outputs[0].token_ids[:6]
    assert _all_free(llm)


def test_max_tokens_none_runs_to_max_model_len(tiny_qwen3):
    llm = LLM(tiny_qwen3, max_model_len=24)
    out = _generate(llm, [_prompt(20)], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_skip_special_tokens_reaches_the_detokenizer(llm):
    engine = llm.llm_engine
    engine.add_request("special", [5, 6], SamplingParams(skip_special_tokens=False, max_tokens=1))
    detokenizer = engine.output_processor.requests["special"].completions[0].detokenizer
    assert detokenizer.skip_special_tokens is False
    while engine.has_unfinished_requests():
        engine.step()


# -- logprobs -------------------------------------------------------------------------------------------


@torch.no_grad()
def _hf_logprobs(hf_model, token_ids):
    return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def cpu_llm(tiny_qwen3):
    # fp32 on the CPU matches transformers to 1e-4 (on a GPU the attention kernels' TF32 dots do not).
    return LLM(tiny_qwen3, device="cpu")


def _check_position(entry, token, reference_row, num_top):
    """``entry`` holds ``token`` and the top ``num_top`` of ``reference_row`` with their logprobs/ranks."""
    top = reference_row.topk(num_top)
    assert list(entry)[0] == token
    assert set(entry) == {token, *top.indices.tolist()}
    for token_id, logprob in entry.items():
        assert abs(logprob.logprob - float(reference_row[token_id])) < 1e-4
        assert logprob.rank == int((reference_row > reference_row[token_id]).sum()) + 1
        assert logprob.decoded_token is not None


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_logprobs_match_transformers(cpu_llm, hf_model, sampling):
    prompt = _prompt(25, seed=11 if sampling == "greedy" else 14)
    extra = dict(temperature=0.0) if sampling == "greedy" else dict(temperature=0.6, top_k=8, seed=5)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=3, **extra)
    out = _generate(cpu_llm, [prompt], params)[0]
    completion = out.outputs[0]
    reference = _hf_logprobs(hf_model, prompt + completion.token_ids)
    # Raw logprobs: the model's own distribution, not the temperature / top-k processed one.
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        _check_position(entry, token, reference[len(prompt) - 1 + j], 5)
    expected_sum = sum(float(reference[len(prompt) - 1 + j, t]) for j, t in enumerate(completion.token_ids))
    assert abs(completion.cumulative_logprob - expected_sum) < 1e-3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        _check_position(out.prompt_logprobs[i], prompt[i], reference[i - 1], 3)


def test_logprobs_zero_and_none(llm):
    prompt = _prompt(8, seed=12)
    out = _generate(llm, [prompt, prompt], [SamplingParams(logprobs=0, prompt_logprobs=0), SamplingParams()])
    assert [len(e) for e in out[0].outputs[0].logprobs] == [1] * 16
    assert all(len(e) == 1 for e in out[0].prompt_logprobs[1:])
    assert out[1].outputs[0].logprobs is None and out[1].outputs[0].cumulative_logprob is None
    assert out[1].prompt_logprobs is None


def test_prompt_logprobs_over_chunked_prefill_and_prefix_hits(tiny_qwen3, hf_model):
    llm = LLM(tiny_qwen3, kvcache_block_size=16, max_num_batched_tokens=16, device="cpu")
    prompt = _prompt(45, seed=13)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    _generate(llm, [prompt], plain)  # puts the prompt's two full blocks in the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    out = _generate(llm, [prompt, prompt], [params, plain])
    reference = _hf_logprobs(hf_model, prompt)
    # Like vLLM, a prompt_logprobs request skips the prefix cache: every position is computed.
    assert out[0].num_cached_tokens == 0 and out[1].num_cached_tokens == 32
    for i in range(1, len(prompt)):
        _check_position(out[0].prompt_logprobs[i], prompt[i], reference[i - 1], 2)
    assert _all_free(llm)


def test_logprobs_of_ids_the_tokenizer_lacks(tmp_path):
    # The model's vocabulary is larger than the tokenizer's (padding ids): such ids among the top
    # logprobs, or sampled, decode to "" instead of failing the step.
    from tests.fixtures import build_model

    llm = LLM(build_model(str(tmp_path / "padded"), vocab_size=512), device="cpu")
    num_tokenizer_ids = len(llm.get_tokenizer())
    out = _generate(
        llm, [_prompt(12, seed=14)], SamplingParams(max_tokens=8, logprobs=20, prompt_logprobs=20)
    )
    entries = out[0].outputs[0].logprobs + out[0].prompt_logprobs[1:]
    padded = [lp for e in entries for token_id, lp in e.items() if token_id >= num_tokenizer_ids]
    assert padded, "no padding id among the top logprobs: the test would not exercise them"
    assert all(lp.decoded_token == "" for lp in padded)
    assert _all_free(llm)
