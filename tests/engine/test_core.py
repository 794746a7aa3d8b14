"""The engine core end to end on the tiny model (CPU): async scheduling gives the same tokens as sync
scheduling through everything that ends or interrupts a request, DELTA outputs add up to the final
ones, decodes keep going while a long prompt is chunked, and nothing leaks."""

import dataclasses
import random

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.sampling_params import RequestOutputKind

KWARGS = {"device": "cpu", "max_model_len": 256}


def _prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(length)]


def _all_free(llm):
    stats = llm.engine_stats()
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and not llm.llm_engine.has_unfinished_requests()
        and not llm.llm_engine.engine_core.has_unfinished_requests()
    )


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    """(sync, async) engine pairs: a roomy pool, and a 24-block pool that forces preemptions."""
    roomy = [LLM(tiny_qwen3, async_scheduling=a, **KWARGS) for a in (False, True)]
    tight = [
        LLM(tiny_qwen3, async_scheduling=a, num_kvcache_blocks=24, max_num_batched_tokens=64, **KWARGS)
        for a in (False, True)
    ]
    assert (
        not roomy[0].llm_engine.engine_core.async_scheduling
        and roomy[1].llm_engine.engine_core.async_scheduling
    )
    yield {"roomy": roomy, "tight": tight}
    for llm in roomy + tight:
        llm.close()


def _workload():
    """Greedy and seeded requests that end by max_tokens, stop strings, stop tokens and n > 1."""
    prompts = [_prompt(n, seed) for seed, n in enumerate((5, 17, 33, 60, 9, 120, 2, 48))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e", "a"]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=6, n=3, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[100, 200, 300], ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=18, logprobs=2),
        SamplingParams(temperature=0.7, seed=8, max_tokens=12, min_tokens=4, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, n=2, max_tokens=16, presence_penalty=0.5, ignore_eos=True),
    ]
    return prompts, params


def _summary(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_async_scheduling_gives_the_same_tokens(engines, pool):
    prompts, params = _workload()
    sync, asynchronous = engines[pool]
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asynchronous.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(expected)
    assert any(c.finish_reason == "stop" for out in expected for c in out.outputs)
    if pool == "tight":
        assert (
            sync.engine_stats()["num_preemptions"] > 0 and asynchronous.engine_stats()["num_preemptions"] > 0
        )
    assert _all_free(sync) and _all_free(asynchronous)


def test_unseeded_sampling_is_reproducible_across_scheduling_modes(tiny_qwen3):
    # Requests without a seed get one from the engine's seed, in arrival order.
    prompts = [_prompt(20, 30 + i) for i in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for asynchronous in (False, True):
        with LLM(tiny_qwen3, async_scheduling=asynchronous, seed=3, **KWARGS) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_delta_outputs_add_up_to_the_final_outputs(engines, asynchronous):
    llm = engines["roomy"][int(asynchronous)]
    engine = llm.llm_engine
    prompts, params = _workload()
    final = {str(i): out for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False))}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"d{i}", prompt, dataclasses.replace(p, output_kind=RequestOutputKind.DELTA))
    texts, tokens, logprobs, finished = {}, {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                key = (out.request_id[1:], c.index)
                assert key not in finished, "nothing follows a completion's final delta"
                texts[key] = texts.get(key, "") + c.text
                tokens[key] = tokens.get(key, []) + c.token_ids
                if c.logprobs is not None:
                    logprobs[key] = logprobs.get(key, []) + c.logprobs
                if c.finish_reason is not None:
                    finished[key] = (c.finish_reason, c.stop_reason)
    for request_id, out in final.items():
        for c in out.outputs:
            key = (request_id, c.index)
            assert (texts[key], tokens[key], finished[key]) == (
                c.text,
                c.token_ids,
                (c.finish_reason, c.stop_reason),
            )
            if c.logprobs is not None:
                assert [list(lp) for lp in logprobs[key]] == [list(lp) for lp in c.logprobs]
    assert _all_free(llm)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_decodes_gain_a_token_every_step_while_a_long_prompt_is_chunked(tiny_qwen3, asynchronous):
    with LLM(tiny_qwen3, async_scheduling=asynchronous, max_num_batched_tokens=32, **KWARGS) as llm:
        engine = llm.llm_engine
        decode = SamplingParams(
            temperature=0.0, max_tokens=60, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        engine.add_request("a", _prompt(6, 1), decode)
        engine.add_request("b", _prompt(9, 2), decode)
        while not engine.step():  # both prompts fit in one step; with async, outputs come a step later
            pass
        engine.add_request("long", _prompt(200, 3), dataclasses.replace(decode, max_tokens=1))
        long_done = False
        steps = 0
        while not long_done:
            outputs = {o.request_id: o for o in engine.step()}
            # Every step: one new token for each decoding request, whatever the prompt's chunk does.
            assert {rid: len(outputs[rid].outputs[0].token_ids) for rid in ("a", "b")} == {"a": 1, "b": 1}
            long_done = "long" in outputs and outputs["long"].finished
            steps += 1
        # 200 prompt tokens, 30 per step beside the two decodes (plus, with async, the step in flight).
        assert 7 <= steps <= 8
        engine.abort_request(["a", "b"])
        while engine.engine_core.has_unfinished_requests():
            engine.step()
        assert _all_free(llm)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rows_of_requests_that_ended_while_idle_are_freed(tiny_qwen3, asynchronous):
    # The model runner frees a row when the next step that runs reports its request gone.
    with LLM(tiny_qwen3, async_scheduling=asynchronous, max_num_seqs=2, **KWARGS) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for round_ in range(4):
            engine.add_request(f"a{round_}", _prompt(5, round_), params)
            engine.add_request(f"b{round_}", _prompt(7, round_), params)
            engine.step()
            engine.step()
            engine.abort_request([f"a{round_}", f"b{round_}"])
            while engine.engine_core.has_unfinished_requests():
                engine.step()  # nothing left to schedule: the aborts wait for the next step that runs
        out = llm.generate([_prompt(9, 9)] * 2, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in out)
        assert _all_free(llm)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_aborts_at_any_point_leak_nothing(engines, asynchronous):
    llm = engines["tight"][int(asynchronous)]
    engine = llm.llm_engine
    prompts, params = _workload()
    expected = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    for step_to_abort in range(6):
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"x{step_to_abort}-{i}", prompt, p)
        for _ in range(step_to_abort):
            engine.step()
        # Abort all but the first two, wherever they are (waiting, mid-prefill, decoding, in flight).
        engine.abort_request([f"x{step_to_abort}-{i}" for i in range(2, len(prompts))])
        survivors = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    survivors[out.request_id] = out
        while engine.engine_core.has_unfinished_requests():
            engine.step()
        assert _summary([survivors[f"x{step_to_abort}-{i}"] for i in range(2)]) == _summary(expected)
        assert _all_free(llm)
