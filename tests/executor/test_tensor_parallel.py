"""Tensor parallelism on the CPU (gloo): TP=2 gives the greedy tokens of TP=1 and of transformers (with an
FP8 KV cache, tokens close to TP=1's under vLLM's logprob-closeness rule), and the worker processes never
outlive the engine (close, garbage collection, interpreter exit, a killed worker)."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from nanoinfer import LLM, SamplingParams
from nanoinfer.distributed import check_tensor_parallel_size
from nanoinfer.executor.tp.channel import NAME_PREFIX
from tests.fixtures import build_model
from tests.reference import assert_greedy_match, check_logprobs_close, hf_greedy, load_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prompts(lengths, seed, vocab=380):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _workers(llm: LLM) -> list:
    return list(llm.llm_engine.engine_core.executor.workers.processes)


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


def _our_segments(pid: int | None = None) -> list[str]:
    prefix = f"{NAME_PREFIX}_{pid if pid is not None else os.getpid()}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


# pytest's capture manager, for _hang_guard's last words (set for every test of this module).
_capture_manager = None


@pytest.fixture(autouse=True)
def _keep_capture_manager(request):
    global _capture_manager
    _capture_manager = request.config.pluginmanager.getplugin("capturemanager")


def _dump_threads_and_exit(seconds: float) -> None:
    # With pytest's capture suspended: otherwise the tracebacks go to its capture file, which is lost
    # when the process exits.
    with _capture_manager.global_and_fixture_disabled():
        print(f"\n_hang_guard: still running after {seconds} s; every thread's traceback:", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
    os._exit(1)


@contextmanager
def _hang_guard(seconds: float):
    """A hang fails the run loudly (tracebacks of every thread on the terminal, then exit) instead of
    blocking CI. faulthandler's own timer, which needs no GIL, is the backstop should a thread hold it
    (its tracebacks then go to pytest's capture file)."""
    timer = threading.Timer(seconds, _dump_threads_and_exit, args=(seconds,))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Rank 0 (this process) and the worker each get one thread: on a small CI machine, two processes
    with a thread per core would oversubscribe it and slow every collective down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_kv1(tmp_path_factory) -> str:
    """4 query heads sharing 1 KV head: at TP=2 each rank holds a replica of it."""
    return build_model(str(tmp_path_factory.mktemp("tiny_kv1")), num_key_value_heads=1, seed=3)


def _assert_logprobs_close(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None or g is None:  # a position without logprobs (e.g. a prompt token read from the cache)
            assert g is w
            continue
        assert g.keys() == w.keys()
        for token, logprob in w.items():
            assert g[token].rank == logprob.rank
            assert g[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


def _check_against(outputs, references) -> None:
    for out, (ref, margins) in zip(outputs, references, strict=True):
        assert_greedy_match(out.outputs[0].token_ids, ref, margins)


def test_tp2_matches_tp1_and_transformers_through_chunking_prefix_hits_and_preemption(tiny_qwen3):
    # 7 blocks of 16 tokens for 4 sequences of ~40 + 12 tokens: preemption; a budget of 10 tokens per
    # step: chunked prefill; the second round repeats the prompts: prefix-cache hits.
    engine_args = dict(kvcache_block_size=16, num_kvcache_blocks=7, max_num_batched_tokens=10)
    base = _prompts([36], seed=6)[0]
    prompts = [base + [i + 3] * (i + 1) for i in range(4)]
    hf = load_hf_model(tiny_qwen3)
    references = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]

    # Logprobs and prompt logprobs: logits of extra positions, computed on every rank (a collective).
    with_logprobs = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    with LLM(tiny_qwen3, **engine_args) as llm:
        tp1 = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.generate(prompts, GREEDY, use_tqdm=False)  # the same history as the TP=2 engine below
        tp1_logprobs = llm.generate(prompts[:2], with_logprobs, use_tqdm=False)
    with _hang_guard(120), LLM(tiny_qwen3, tensor_parallel_size=2, **engine_args) as llm:
        workers = _workers(llm)
        for round_index in range(2):
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            _check_against(outputs, references)
            assert [o.outputs[0].token_ids for o in outputs] == tp1
            if round_index == 1:
                assert all(o.num_cached_tokens > 0 for o in outputs)
        for got, want in zip(
            llm.generate(prompts[:2], with_logprobs, use_tqdm=False), tp1_logprobs, strict=True
        ):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            _assert_logprobs_close(got.outputs[0].logprobs, want.outputs[0].logprobs)
            assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
            _assert_logprobs_close(got.prompt_logprobs, want.prompt_logprobs)
        stats = llm.engine_stats()
        assert stats["num_preemptions"] > 0
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] == 7
        assert not _our_segments()  # unlinked as soon as the worker attached
    assert not any(p.is_alive() for p in workers)
    assert not _our_segments()


def test_tp2_with_one_kv_head_replicated(tiny_kv1):
    hf = load_hf_model(tiny_kv1)
    prompts = _prompts([1, 5, 15, 16, 17, 40, 100], seed=1)
    with _hang_guard(120), LLM(tiny_kv1, tensor_parallel_size=2, kvcache_block_size=16) as llm:
        workers = _workers(llm)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        _check_against(outputs, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts])
        # A second batch sharing a 40-token prefix reuses its 2 full blocks.
        shared = prompts[5]
        second = [shared + [7, 8], shared[:35] + [9]]
        outputs = llm.generate(second, GREEDY, use_tqdm=False)
        _check_against(outputs, [hf_greedy(hf, p, GREEDY.max_tokens) for p in second])
        assert [o.num_cached_tokens for o in outputs] == [32, 32]
    # close() (from the context manager) joined the worker and removed everything.
    assert [p.exitcode for p in workers] == [0]
    assert not _our_segments()


def test_tp2_with_fp8_kv_stays_close_to_tp1_and_leaks_nothing(tiny_qwen3):
    # Each rank calibrates the scales of its own KV heads and stores them in its own FP8 pool.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = _prompts([5, 20, 40, 63, 90, 12], seed=2)
    repeated = [prompts[4] + [5, 6]]  # a prefix hit on the 90-token prompt's full blocks
    engine_args = dict(kvcache_block_size=16, num_kvcache_blocks=64)
    with LLM(tiny_qwen3, **engine_args) as llm:
        expected = llm.generate(prompts + repeated, params, use_tqdm=False)
    fp8_args = dict(engine_args, tensor_parallel_size=2, kv_cache_dtype="fp8")
    with _hang_guard(120), LLM(tiny_qwen3, **fp8_args) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        got += llm.generate(repeated, params, use_tqdm=False)
        assert got[-1].num_cached_tokens >= 16
        stats = llm.engine_stats()
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert check_logprobs_close(expected, got) >= 3


def test_engines_side_by_side_and_garbage_collection(tiny_qwen3):
    with _hang_guard(90):
        llm = LLM(tiny_qwen3, tensor_parallel_size=2)
        pids = [p.pid for p in _workers(llm)]
        tp2 = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        # A single-process engine next to it is built unsharded and agrees with it.
        with LLM(tiny_qwen3) as single:
            assert single.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tp2
        # A second tensor-parallel engine in this process is refused before it starts anything.
        children = set(mp.active_children())
        with pytest.raises(RuntimeError, match="close the other tensor-parallel engine first"):
            LLM(tiny_qwen3, tensor_parallel_size=2)
        assert set(mp.active_children()) == children
        # Dropping the engine without close() stops its worker and frees its process group...
        del llm
        gc.collect()
        assert _wait_gone(pids) == []
        # ...so a new tensor-parallel engine can start in this process.
        with LLM(tiny_qwen3, tensor_parallel_size=2) as llm:
            assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == tp2
    assert not _our_segments()


# A process that starts a TP=2 engine, generates, prints its own pid and the worker's, then ends as
# ``{ending}`` says.
_TP_SCRIPT = """
import os
import signal
import sys

from nanoinfer import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    workers = llm.llm_engine.engine_core.executor.workers.processes
    print(os.getpid(), " ".join(str(p.pid) for p in workers), flush=True)
{ending}
"""


def _run_tp_script(model: str, tmp_path, ending: str) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """Runs :data:`_TP_SCRIPT`; returns the finished process, its pid and the worker pids it printed."""
    script = tmp_path / "tp_script.py"
    script.write_text(_TP_SCRIPT.format(ending=ending))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), model], capture_output=True, text=True, timeout=120, env=env
    )
    parent, *pids = [int(p) for p in proc.stdout.split()]
    return proc, parent, pids


def test_interpreter_exit_stops_workers(tiny_qwen3, tmp_path):
    proc, parent, pids = _run_tp_script(
        tiny_qwen3, tmp_path, "    # Exits with the engine open: the exit hook must stop the worker."
    )
    assert proc.returncode == 0, proc.stderr
    assert len(pids) == 1
    assert _wait_gone(pids) == []
    assert not _our_segments(parent)
    assert "leaked" not in proc.stderr  # no resource-tracker warnings (shared memory, semaphores)


class _Event:
    """Stands in for a CUDA event: ``query()`` says whether the work before it has finished."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_worker_exits_when_rank0_is_killed(tiny_qwen3, tmp_path):
    proc, _, pids = _run_tp_script(
        tiny_qwen3,
        tmp_path,
        "    os.kill(os.getpid(), signal.SIGKILL)  # no exit hook runs: the worker must notice by itself",
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(pids) == 1
    assert _wait_gone(pids) == []


def test_killed_idle_worker_raises_instead_of_hanging(tiny_qwen3):
    with _hang_guard(90):
        llm = LLM(tiny_qwen3, tensor_parallel_size=2)
        workers = llm.llm_engine.engine_core.executor.workers
        (worker,) = _workers(llm)
        workers.wait_for_device(_Event(done=True))  # healthy workers, finished work: returns
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        # Rank 0 waiting for GPU work that a dead worker's collective keeps from finishing (NCCL): the
        # wait ends with the worker's error, promptly.
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) exited with code -9"):
            workers.wait_for_device(_Event(done=False))
        assert time.monotonic() - start < 1
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) exited with code -9"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
        llm.close()
    assert not _our_segments()


def test_nccl_watchdog_ends_the_process_when_rank0_stays_stuck(tiny_qwen3, monkeypatch):
    """The watchdog's last resort, run on gloo with the abort and the exit stubbed: a worker dies while
    rank 0 is inside a step and stays there (as when blocked inside NCCL)."""
    import nanoinfer.executor.tp.workers as tp_worker

    aborts, exits = [], []
    monkeypatch.setattr(tp_worker, "start_abort", lambda: aborts.append(time.monotonic()))
    monkeypatch.setattr(tp_worker, "ABORT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(tp_worker.os, "_exit", lambda status: exits.append((status, time.monotonic())))
    with _hang_guard(90):
        llm = LLM(tiny_qwen3, tensor_parallel_size=2)
        workers = llm.llm_engine.engine_core.executor.workers
        (worker,) = _workers(llm)
        workers._start_nccl_watchdog()
        with workers.running_step():
            os.kill(worker.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not exits and time.monotonic() < deadline:
                time.sleep(0.05)
        llm.close()
    assert len(aborts) == 1
    assert [status for status, _ in exits] == [1]
    assert 0.3 <= exits[0][1] - aborts[0] < 5


def test_worker_killed_mid_generation_raises_instead_of_hanging(tiny_qwen3):
    prompts = _prompts([30] * 8, seed=9)
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with _hang_guard(90):
        llm = LLM(tiny_qwen3, tensor_parallel_size=2, max_model_len=512)
        (worker,) = _workers(llm)
        killer = threading.Timer(0.5, os.kill, args=(worker.pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) exited"):
            llm.generate(prompts, long_run, use_tqdm=False)
        assert time.monotonic() - start < 10
        killer.join()
        llm.close()
    assert not worker.is_alive()
    assert not _our_segments()


def test_unsplittable_model_fails_before_any_process_starts(tiny_qwen3):
    children = set(mp.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the number of attention heads"):
        LLM(tiny_qwen3, tensor_parallel_size=3)
    assert set(mp.active_children()) == children
    assert not _our_segments()


@pytest.mark.parametrize(
    "heads, kv_heads, inter, size, error",
    [
        (6, 3, 64, 2, "key/value heads"),
        (4, 2, 66, 4, "intermediate size"),
        (8, 8, 64, 3, "attention heads"),
    ],
)
def test_tensor_parallel_size_checks(heads, kv_heads, inter, size, error):
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter)
    with pytest.raises(ValueError, match=error):
        check_tensor_parallel_size(cfg, size)


def test_tensor_parallel_size_checks_accept_replicated_kv_heads():
    from types import SimpleNamespace

    for kv_heads, size in ((1, 2), (2, 4), (8, 2), (8, 8)):
        cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=kv_heads, intermediate_size=64)
        check_tensor_parallel_size(cfg, size)
