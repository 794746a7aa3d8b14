"""AsyncLLM: DELTA and CUMULATIVE streams, continuous batching across arrivals, aborts that free KV
blocks wherever the request is, per-request failures, engine-loop crashes, idling without spinning,
shutdown. The tests that take ``llm`` run twice: with the engine on a thread of this process and with
the engine core in a process of its own; the process mode's own cases (a request id reused while the
outputs of its aborted predecessor are on their way, a killed engine process, a failing step, a failed
start, seeds beyond 64 bits) follow at the end."""

import asyncio
import contextlib
import dataclasses
import glob
import os
import re
import signal
import tempfile
import threading
import time

import pytest

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.config import EngineConfig
from nanoinfer.frontend.async_llm import AsyncLLM, EngineDeadError
from nanoinfer.frontend.llm_engine import LLMEngine
from nanoinfer.sampling_params import RequestOutputKind
from tests.engine.core_factories import step_fails_core
from tests.entrypoints.engine_delays import delayed_core

ENGINE_KWARGS = {"device": "cpu", "max_model_len": 256, "num_kvcache_blocks": 64}
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "What is the capital of France?"]


def greedy(max_tokens: int, ignore_eos: bool = True, kind=RequestOutputKind.CUMULATIVE) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, output_kind=kind)


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    """Greedy outputs of the offline engine, one request at a time."""
    with LLM(tiny_qwen3, **ENGINE_KWARGS) as llm:
        return {p: llm.generate([p], greedy(12), use_tqdm=False)[0].outputs[0] for p in PROMPTS}


def process_llm(model: str, core_factory=None, **overrides) -> AsyncLLM:
    """An AsyncLLM with its engine core in a process of its own."""
    config = EngineConfig.from_kwargs(model, **{**ENGINE_KWARGS, **overrides})
    return AsyncLLM.with_engine_process(config, ready_timeout=60, core_factory=core_factory)


@pytest.fixture(scope="module", params=["engine_thread", "engine_process"])
def llm(tiny_qwen3, request):
    """Shared by the tests (each uses request ids of its own), in both modes."""
    llm = make_async_llm(tiny_qwen3) if request.param == "engine_thread" else process_llm(tiny_qwen3)
    yield llm
    llm.shutdown()


def make_async_llm(model: str, on_step=None, **overrides) -> AsyncLLM:
    """An AsyncLLM whose engine calls ``on_step(engine, outputs)`` on the engine thread after each step."""

    def factory() -> LLMEngine:
        engine = LLMEngine.from_kwargs(model, **{**ENGINE_KWARGS, **overrides})
        if on_step is not None:
            step = engine.step

            def step_with_hook():
                outputs = step()
                on_step(engine, outputs)
                return outputs

            engine.step = step_with_hook
        return engine

    return AsyncLLM(factory)


def all_free(stats: dict) -> bool:
    return (
        stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
        and stats["num_running"] == 0
        and stats["num_waiting"] == 0
    )


class Pause:
    """Stops the engine thread after the first step that meets ``condition``, until released."""

    def __init__(self, condition):
        self.condition = condition
        self.paused = threading.Event()
        self.release = threading.Event()

    def __call__(self, engine, outputs) -> None:
        if not self.paused.is_set() and self.condition(engine, outputs):
            self.paused.set()
            self.release.wait(10)

    async def wait(self) -> None:
        assert await asyncio.to_thread(self.paused.wait, 10), "the engine never reached the paused state"


def test_delta_and_cumulative_streams_match_offline(llm, reference):
    async def main():
        for i, prompt in enumerate(PROMPTS):
            # How many pieces the stream comes in depends on how fast this loop reads: the deltas that
            # pile up while it is busy are merged into one (RequestStream). Each piece is new tokens.
            text, ids = "", []
            async for out in llm.generate(prompt, greedy(12, kind=RequestOutputKind.DELTA), f"d{i}"):
                c = out.outputs[0]
                assert c.token_ids
                text += c.text
                ids += c.token_ids
            assert out.finished and c.finish_reason == "length"
            assert ids == reference[prompt].token_ids and text == reference[prompt].text
            previous = []
            async for out in llm.generate(prompt, greedy(12), f"c{i}"):
                c = out.outputs[0]
                assert c.token_ids[: len(previous)] == previous and len(c.token_ids) > len(previous)
                previous = c.token_ids
            assert c.token_ids == reference[prompt].token_ids and c.text == reference[prompt].text
        assert all_free(await llm.get_stats())

    asyncio.run(main())


def test_n_completions_logprobs_and_stops_match_offline(tiny_qwen3, llm):
    # Stop strings that this seed's completions contain (checked below), so that they cut the text.
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=10, logprobs=2, stop=["+S", "b"])
    with LLM(tiny_qwen3, **ENGINE_KWARGS) as offline:
        expected = offline.generate([PROMPTS[0]], params, use_tqdm=False)[0]

    async def main():
        texts, token_ids, logprobs, last = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}, {}
        delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        async for out in llm.generate(PROMPTS[0], delta, "n2"):
            for c in out.outputs:
                texts[c.index] += c.text
                token_ids[c.index] += c.token_ids
                logprobs[c.index] += c.logprobs
                last[c.index] = c
        # The completions a stop string ended were dropped by the core as well.
        for _ in range(100):
            if all_free(await llm.get_stats()):
                break
            await asyncio.sleep(0.01)
        assert all_free(await llm.get_stats())
        return out, texts, token_ids, logprobs, last

    final, texts, token_ids, logprobs, last = asyncio.run(main())
    assert final.finished
    assert all(c.stop_reason in ("+S", "b") for c in expected.outputs)  # a stop string did cut something
    for want in expected.outputs:
        i = want.index
        assert (texts[i], token_ids[i], last[i].finish_reason, last[i].stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        # With the core in another process, a stopped sibling may run a few more steps before its abort
        # arrives: batch shapes then differ from the offline run's, and float32 logits by rounding.
        assert len(logprobs[i]) == len(want.logprobs)
        for got, expected_position in zip(logprobs[i], want.logprobs, strict=True):
            assert got.keys() == expected_position.keys()
            for token_id, lp in got.items():
                reference = expected_position[token_id]
                assert (lp.rank, lp.decoded_token) == (reference.rank, reference.decoded_token)
                assert lp.logprob == pytest.approx(reference.logprob, rel=1e-5, abs=1e-5)
        assert last[i].cumulative_logprob == pytest.approx(want.cumulative_logprob)


def test_requests_join_a_running_batch(tiny_qwen3, reference):
    batch_sizes = []
    llm = make_async_llm(tiny_qwen3, on_step=lambda engine, outputs: batch_sizes.append(len(outputs)))

    async def late(prompt, i, delay_tokens, first_stream):
        # Wait until the first request has produced some tokens, then join.
        while len(first_stream) < delay_tokens:
            await asyncio.sleep(0.001)
        return await collect(prompt, i)

    async def collect(prompt, i, sink=None):
        async for out in llm.generate(prompt, greedy(12), f"r{i}"):
            if sink is not None:
                sink.append(out)
        return out.outputs[0]

    async def main():
        first_outputs = []
        results = await asyncio.gather(
            collect(PROMPTS[0], 0, first_outputs),
            late(PROMPTS[1], 1, 3, first_outputs),
            late(PROMPTS[2], 2, 5, first_outputs),
        )
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.token_ids == reference[prompt].token_ids
        assert all_free(await llm.get_stats())

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert max(batch_sizes) >= 2  # the late requests decoded in the same steps as the first one


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine_thread", "engine_process"])
def test_a_constraint_is_validated_beside_the_steps_and_the_other_requests(
    tiny_qwen3, reference, engine_process
):
    """A constrained request is validated (its constraint compiled; the first one builds the grammar
    compiler) on a thread of its own: a text request that arrives meanwhile is tokenized and runs to its
    end while that validation is held, and the constrained request completes afterwards."""
    llm = process_llm(tiny_qwen3) if engine_process else make_async_llm(tiny_qwen3)
    driver = llm._driver
    processor = driver._input_processor if engine_process else driver._engine.input_processor
    compiler = processor.structured_outputs.compiler
    compile_grammar = compiler.compile
    validating, release = threading.Event(), threading.Event()

    def held_compile(params, validate=False):
        if validate:
            validating.set()
            assert release.wait(30)
        return compile_grammar(params, validate)

    compiler.compile = held_compile

    async def constrained() -> object:
        params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"))
        return (await _drain(llm.generate(PROMPTS[1], params, "constrained")))[-1].outputs[0]

    async def main():
        task = asyncio.create_task(constrained())
        assert await asyncio.to_thread(validating.wait, 10)
        free = (await _drain(llm.generate(PROMPTS[0], greedy(12), "free")))[-1]
        assert free.outputs[0].token_ids == reference[PROMPTS[0]].token_ids
        assert not task.done()
        release.set()
        completion = await task
        assert completion.finish_reason == "stop" and re.fullmatch("[a-z]{3}", completion.text), completion
        assert all_free(await llm.get_stats())

    try:
        asyncio.run(main())
    finally:
        release.set()
        llm.shutdown()


def test_abort_while_running_frees_blocks(llm):
    async def main():
        stream = await llm.add_request("a", PROMPTS[0], greedy(200))
        first = await stream.__anext__()
        assert first.outputs[0].token_ids and not first.finished
        stats = await llm.get_stats()
        assert stats["num_running"] == 1 and stats["num_kv_blocks_free"] < stats["num_kv_blocks_total"]
        llm.abort("a")
        assert all_free(await llm.get_stats())
        outputs = [out async for out in stream]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        # Closing generate() early aborts as well...
        async with contextlib.aclosing(llm.generate(PROMPTS[1], greedy(200), "b")) as outputs:
            async for _ in outputs:
                break
        assert all_free(await llm.get_stats())
        # ...and so does a plain break, once asyncio finalizes the abandoned generator.
        async for _ in llm.generate(PROMPTS[1], greedy(200), "c"):
            break
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all_free(await llm.get_stats()):
                break
        assert all_free(await llm.get_stats())

    asyncio.run(main())


def test_abort_while_waiting(tiny_qwen3):
    llm = make_async_llm(tiny_qwen3, max_num_seqs=1)

    async def main():
        running = await llm.add_request("running", PROMPTS[0], greedy(200))
        await running.__anext__()
        waiting = await llm.add_request("waiting", PROMPTS[1], greedy(5))
        stats = await llm.get_stats()
        assert stats["num_running"] == 1 and stats["num_waiting"] == 1
        waiting.abort()
        stats = await llm.get_stats()
        assert stats["num_waiting"] == 0 and stats["num_running"] == 1
        running.abort()
        assert all_free(await llm.get_stats())

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_abort_mid_chunked_prefill(tiny_qwen3):
    def mid_prefill(engine, outputs):
        stats = engine.stats()
        return not outputs and stats["num_kv_blocks_free"] < stats["num_kv_blocks_total"]

    pause = Pause(mid_prefill)
    llm = make_async_llm(tiny_qwen3, on_step=pause, max_num_batched_tokens=16)
    prompt = list(range(10, 130))  # 120 tokens: 8 prefill chunks of 16

    async def main():
        stream = await llm.add_request("long", prompt, greedy(4))
        await pause.wait()
        llm.abort("long")  # queued while the engine thread is paused: runs before the next step
        pause.release.set()
        outputs = [out async for out in stream]
        assert len(outputs) == 1
        assert outputs[0].outputs[0].finish_reason == "abort" and outputs[0].outputs[0].token_ids == []
        assert all_free(await llm.get_stats())

    try:
        asyncio.run(main())
    finally:
        pause.release.set()
        llm.shutdown()


def test_bad_request_fails_alone(llm, reference):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("too-long", list(range(10, 300)), greedy(4))
        with pytest.raises(ValueError, match="empty"):
            async for _ in llm.generate([], greedy(4), "empty"):
                pass
        stream = await llm.add_request("dup", PROMPTS[0], greedy(12))
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("dup", PROMPTS[1], greedy(4))
        outputs = [out async for out in stream]
        assert outputs[-1].outputs[0].token_ids == reference[PROMPTS[0]].token_ids
        assert llm.is_healthy
        assert all_free(await llm.get_stats())

    asyncio.run(main())


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine_thread", "engine_process"])
def test_engine_crash_fails_every_request(tiny_qwen3, engine_process):
    def crash_on_third_step(engine, outputs, calls=[0]):  # noqa: B006 (a counter shared by the calls)
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated device failure")

    if engine_process:
        llm = process_llm(tiny_qwen3, core_factory=step_fails_core("simulated device failure"))
    else:
        llm = make_async_llm(tiny_qwen3, on_step=crash_on_third_step)
    deaths = []
    llm.on_engine_dead(deaths.append)

    async def consume(i):
        async for _ in llm.generate(PROMPTS[i], greedy(50), f"r{i}"):
            pass

    async def main():
        results = await asyncio.gather(consume(0), consume(1), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "simulated device failure" in str(results[0])
        assert not llm.is_healthy and "simulated device failure" in str(llm.error) and llm.crashed
        with pytest.raises(EngineDeadError):
            await llm.add_request("after", PROMPTS[0], greedy(4))
        assert (await llm.get_stats())["num_kv_blocks_total"] == ENGINE_KWARGS["num_kvcache_blocks"]

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert deaths == [llm.error]
    # A callback registered after the crash runs at once.
    late = []
    llm.on_engine_dead(late.append)
    assert late == [llm.error]


def test_idle_engine_thread_blocks(tiny_qwen3):
    polls = [0]

    def factory():
        engine = LLMEngine.from_kwargs(tiny_qwen3, **ENGINE_KWARGS)
        has_unfinished = engine.has_unfinished_requests

        def counted():
            polls[0] += 1
            return has_unfinished()

        engine.has_unfinished_requests = counted
        return engine

    llm = AsyncLLM(factory)
    try:
        asyncio.run(_drain(llm.generate(PROMPTS[0], greedy(4), "r")))
        before = polls[0]
        time.sleep(0.3)
        assert polls[0] - before <= 2
    finally:
        llm.shutdown()


async def _drain(outputs):
    return [out async for out in outputs]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine_thread", "engine_process"])
def test_shutdown_fails_pending_requests(tiny_qwen3, engine_process):
    llm = process_llm(tiny_qwen3) if engine_process else make_async_llm(tiny_qwen3)
    deaths = []
    llm.on_engine_dead(deaths.append)

    async def main():
        stream = await llm.add_request("r", PROMPTS[0], greedy(200))
        await stream.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("r2", PROMPTS[0], greedy(4))
        stats = await llm.get_stats()  # the last stats the engine reported
        assert stats["num_kv_blocks_total"] == ENGINE_KWARGS["num_kvcache_blocks"]

    asyncio.run(main())
    assert not llm.crashed and not deaths
    if engine_process:
        assert _exited(llm.engine_pid)
        llm.shutdown()  # idempotent
    else:
        assert not llm._driver.thread.is_alive()


def test_failed_engine_start_raises(tmp_path):
    with pytest.raises(Exception, match="config"):
        AsyncLLM.from_kwargs(str(tmp_path), device="cpu")
    with pytest.raises(Exception, match="config"):
        AsyncLLM.from_kwargs(str(tmp_path), device="cpu", engine_process=True)


def test_slow_consumer_gets_merged_deltas(llm, reference):
    """DELTA outputs that pile up while the consumer is busy arrive as one output carrying all of them."""

    async def main():
        stream = await llm.add_request("slow", PROMPTS[0], greedy(12, kind=RequestOutputKind.DELTA))
        await asyncio.sleep(0.5)  # the engine finishes meanwhile
        outputs = [out async for out in stream]
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].outputs[0].token_ids == reference[PROMPTS[0]].token_ids
        assert outputs[0].outputs[0].text == reference[PROMPTS[0]].text

    asyncio.run(main())


# -- the engine core in a process of its own --------------------------------------------------------------


def _exited(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _socket_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nanoinfer-*")))


def test_reused_request_id_never_gets_its_predecessors_outputs(tiny_qwen3, reference):
    """The outputs of an aborted request that are still on their way when a new request takes its id are
    dropped: they belong to a different core request."""
    llm = process_llm(tiny_qwen3, core_factory=delayed_core(0.005))

    async def main():
        for round_index in range(5):
            first = await llm.add_request("same", PROMPTS[1], greedy(200, kind=RequestOutputKind.DELTA))
            await first.__anext__()
            first.abort()
            second = llm.generate(PROMPTS[0], greedy(12, kind=RequestOutputKind.DELTA), "same")
            token_ids = [t async for out in second for t in out.outputs[0].token_ids]
            assert token_ids == reference[PROMPTS[0]].token_ids, round_index
        assert all_free(await llm.get_stats())

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_killed_engine_process_fails_every_stream_at_once(tiny_qwen3):
    dirs = _socket_dirs()
    llm = process_llm(tiny_qwen3, core_factory=delayed_core(0.005))
    deaths = []
    llm.on_engine_dead(deaths.append)

    async def consume(stream):
        async for _ in stream:
            pass

    async def main():
        streams = [await llm.add_request(f"k{i}", PROMPTS[i], greedy(200)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        killed_at = time.monotonic()
        os.kill(llm.engine_pid, signal.SIGKILL)
        results = await asyncio.gather(*(consume(s) for s in streams), return_exceptions=True)
        assert time.monotonic() - killed_at < 1.0
        assert all(isinstance(r, EngineDeadError) and "SIGKILL" in str(r) for r in results), results
        assert not llm.is_healthy and llm.crashed and deaths == [llm.error]
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await llm.add_request("after", PROMPTS[0], greedy(4))
        llm.abort("k0")  # a no-op now
        assert (await llm.get_stats())["num_kv_blocks_total"] == ENGINE_KWARGS["num_kvcache_blocks"]

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert _exited(llm.engine_pid) and _socket_dirs() <= dirs


def test_seeds_beyond_64_bits_sample_as_their_low_64_bits(tiny_qwen3, llm):
    """Any integer is a seed; the engine process gets its 64 bits (all that the sampling uses)."""
    huge = SamplingParams(temperature=1.0, seed=10**30 + 3, max_tokens=8, ignore_eos=True, n=2)
    low = dataclasses.replace(huge, seed=(10**30 + 3) % (1 << 64) - (1 << 64))

    async def completions(params, request_id):
        outputs = [out async for out in llm.generate(PROMPTS[0], params, request_id)]
        return [c.token_ids for c in outputs[-1].outputs]

    async def main():
        return await completions(huge, "huge-seed"), await completions(low, "low-seed")

    huge_ids, low_ids = asyncio.run(main())
    assert huge_ids == low_ids and huge_ids[0] != huge_ids[1]
