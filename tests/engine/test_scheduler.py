"""The unified scheduler on its own (no model): one token budget, running requests first, any prompt
chunked, preemption of the latest arrival, and async scheduling's pending tokens."""

from nanoinfer.engine.kv_cache_manager import KVCacheManager
from nanoinfer.engine.request import EngineRequest, RequestStatus
from nanoinfer.engine.scheduler import RunnerOutput, Scheduler
from nanoinfer.sampling_params import SamplingParams

BS = 4


def _make(num_blocks=16, max_seqs=8, budget=64, max_model_len=1000):
    return Scheduler(KVCacheManager(num_blocks, BS), max_seqs, budget, max_model_len)


def _add(sched, request_id, n, start=0, **params):
    params.setdefault("max_tokens", 100)
    params.setdefault("ignore_eos", True)
    engine_request = EngineRequest(
        request_id, list(range(start, start + n)), SamplingParams(**params), seed=0
    )
    return sched.add_request(engine_request)


def _run(sched, out, token=1):
    """Plays the model runner's part: every sampling row samples ``token``."""
    tokens = [token if row.samples else -1 for row in out.scheduled]
    return sched.update_from_output(out, RunnerOutput(tokens))


def _tokens(out):
    return {row.request_id: row.num_tokens for row in out.scheduled}


def test_prompts_are_chunked_under_one_budget_any_of_them():
    sched = _make(budget=10)
    _add(sched, "a", 8)
    _add(sched, "b", 8, 100)
    out = sched.schedule()
    assert _tokens(out) == {"a": 8, "b": 2}  # b starts in the same step, as a chunk
    _run(sched, out)
    out = sched.schedule()
    # Running requests first: a decodes (1 token), b continues its prompt (6 left).
    assert _tokens(out) == {"a": 1, "b": 6}
    assert [row.samples for row in out.scheduled] == [True, True]


def test_long_prompt_is_chunked_across_steps_and_allocates_as_it_goes():
    sched = _make(budget=3)
    a = _add(sched, "a", 8)
    chunks = []
    while a.num_output_tokens == 0:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_tokens)
        assert len(a.block_ids) == -(-a.num_computed_tokens // BS)  # only the computed chunks' blocks
        _run(sched, out)
    assert chunks == [3, 3, 2]


def test_decodes_gain_a_token_every_step_while_a_prompt_is_chunked():
    sched = _make(num_blocks=200, budget=32)
    decoding = [_add(sched, "d0", 5), _add(sched, "d1", 7, 50)]
    _run(sched, sched.schedule())  # both prompts in one step
    long = _add(sched, "long", 400, 200)
    steps = 0
    while long.num_output_tokens == 0:
        before = [r.num_tokens for r in decoding]
        out = sched.schedule()
        assert _tokens(out)["long"] == min(30, 400 - long.num_computed_tokens + _tokens(out)["long"])
        _run(sched, out)
        assert [r.num_tokens for r in decoding] == [n + 1 for n in before]
        steps += 1
    assert steps == 14  # 400 prompt tokens in chunks of 30 beside the two decodes


def test_max_num_seqs_caps_running():
    sched = _make(max_seqs=2)
    for i in range(3):
        _add(sched, f"r{i}", 3, 10 * i)
    out = sched.schedule()
    assert _tokens(out) == {"r0": 3, "r1": 3}
    _run(sched, out)
    assert _tokens(sched.schedule()) == {"r0": 1, "r1": 1}


def test_running_request_preempts_the_latest_arrival_which_is_requeued_first():
    sched = _make(num_blocks=2, max_seqs=4)
    _add(sched, "a", 4)
    b = _add(sched, "b", 4, 50)
    _run(sched, sched.schedule())
    # Each now has 5 tokens: the 5th needs a second block, but the pool is empty.
    out = sched.schedule()
    assert _tokens(out) == {"a": 1}
    # The model runner drops the preempted request's row in this very step.
    assert sched.num_preemptions == 1 and out.finished_request_ids == ["b"]
    assert list(sched.waiting) == [b] and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.status == RequestStatus.WAITING


def test_preempted_request_recomputes_its_generated_tokens():
    sched = _make(num_blocks=2, max_seqs=4)
    a = _add(sched, "a", 4, max_tokens=2)
    _add(sched, "b", 4, 50)
    _run(sched, sched.schedule())
    _run(sched, sched.schedule())  # b preempted, a decodes its 2nd token and finishes
    assert a.is_finished and a.finish_reason == "length"
    out = sched.schedule()
    assert _tokens(out) == {"b": 5}  # prompt + the token it had generated
    assert "b" in out.new_requests and out.scheduled[0].samples


def test_abort_frees_blocks_from_anywhere():
    sched = _make(budget=2)
    _add(sched, "a", 8)
    sched.schedule()  # mid chunked prefill, holding blocks
    assert sched.kv.num_free_blocks < 16
    sched.abort_requests(["a", "unknown"])
    assert sched.kv.num_free_blocks == 16
    assert not sched.has_unfinished_requests()


def test_stop_token_eos_and_max_tokens():
    sched = _make()
    eos = EngineRequest("e", [1, 2, 3], SamplingParams(max_tokens=10), seed=0, eos_token_ids=(7,))
    sched.add_request(eos)
    _add(sched, "s", 3, max_tokens=10, stop_token_ids=[7])
    _add(sched, "m", 3, max_tokens=2, min_tokens=1, stop_token_ids=[7])
    outputs = {o.request_id: o for o in _run(sched, sched.schedule(), token=7)}
    assert (outputs["e"].finish_reason, outputs["e"].stop_reason) == ("stop", None)
    assert (outputs["s"].finish_reason, outputs["s"].stop_reason) == ("stop", 7)
    assert outputs["m"].finish_reason is None  # min_tokens holds it
    outputs = {o.request_id: o for o in _run(sched, sched.schedule(), token=7)}
    assert outputs["m"].finish_reason == "stop"
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 16


def test_async_scheduling_schedules_on_a_pending_token():
    sched = _make()
    a = _add(sched, "a", 6, max_tokens=3)
    first = sched.schedule()  # the prompt: samples token 1
    second = sched.schedule()  # before the first step's token is known
    row = second.scheduled[0]
    assert (row.num_tokens, row.start_pos, row.last_token_pending, row.token_ids) == (1, 6, True, [])
    assert a.num_pending == 2 and a.num_output_tokens == 2
    _run(sched, first, token=11)
    third = sched.schedule()
    assert third.scheduled[0].last_token_pending and third.scheduled[0].start_pos == 7
    # Three tokens are sampled or on their way: max_tokens is reached, nothing more is scheduled.
    assert sched.schedule().is_empty
    _run(sched, second, token=12)
    outputs = _run(sched, third, token=13)
    assert a.is_finished and a.token_ids[6:] == [11, 12, 13] and outputs[0].finish_reason == "length"


def test_a_row_of_a_request_finished_meanwhile_is_dropped():
    sched = _make()
    _add(sched, "a", 6, max_tokens=5, stop_token_ids=[9])
    first = sched.schedule()
    second = sched.schedule()
    assert [o.new_token_ids for o in _run(sched, first, token=9)] == [[9]]  # stops on 9
    assert _run(sched, second, token=4) == []  # its extra row's token is dropped
    assert sched.kv.num_free_blocks == 16


def test_follower_waits_for_its_leaders_prompt():
    sched = _make(budget=64)
    leader = EngineRequest("r#0", list(range(9)), SamplingParams(max_tokens=4), seed=0)
    follower = EngineRequest("r#1", list(range(9)), SamplingParams(max_tokens=4), seed=1, leader_id="r#0")
    sched.add_request(leader)
    sched.add_request(follower)
    out = sched.schedule()
    assert _tokens(out) == {"r#0": 9}
    _run(sched, out)
    out = sched.schedule()
    # The leader's two full prompt blocks are now cached: the follower computes the rest only.
    assert _tokens(out) == {"r#0": 1, "r#1": 1}
    assert sched.requests["r#1"].num_cached_prompt_tokens == 8
