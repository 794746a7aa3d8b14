from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence, SequenceStatus
from nanoinfer.sampling_params import SamplingParams

BS = 4


def _make(num_blocks=16, max_seqs=8, budget=64):
    return Scheduler(BlockManager(num_blocks, BS), max_seqs, budget)


def _seq(n, start=0):
    return Sequence(list(range(start, start + n)), SamplingParams(), BS)


def _run_step(sched, out, sampled_token=1):
    """Plays the engine's part: advance, and append a token to sequences that finished their prompt."""
    for seq in sched.postprocess(out.seqs):
        seq.append_token(sampled_token)


def test_prefill_respects_token_budget_and_chunks_only_the_first():
    sched = _make(budget=10)
    a, b = _seq(8), _seq(8, 100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.is_prefill and out.seqs == [a]  # b (8 tokens) does not fit in the remaining 2
    assert a.num_scheduled_tokens == 8
    _run_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [b]


def test_long_prompt_is_chunked_across_steps():
    sched = _make(budget=3)
    a = _seq(8)
    sched.add(a)
    chunks = []
    while a.status != SequenceStatus.RUNNING or a.num_completion_tokens == 0:
        out = sched.schedule()
        assert out.is_prefill
        chunks.append(a.num_scheduled_tokens)
        _run_step(sched, out)
    assert chunks == [3, 3, 2]
    assert a.num_completion_tokens == 1
    # Chunking splits computation, not memory: all blocks were allocated up front.
    assert len(a.block_table) == 2


def test_max_num_seqs_caps_running():
    sched = _make(max_seqs=2)
    seqs = [_seq(3, 10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == seqs[:2]
    _run_step(sched, out)
    out = sched.schedule()
    assert not out.is_prefill and out.seqs == seqs[:2]


def test_decode_preempts_latest_arrival_and_requeues_it_first():
    sched = _make(num_blocks=2, max_seqs=4)
    a, b = _seq(4), _seq(4, 50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b]
    _run_step(sched, out)
    # Each now has 5 tokens: the 5th needs a second block, but the pool is empty.
    out = sched.schedule()
    assert not out.is_prefill and out.seqs == [a]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert b.status == SequenceStatus.WAITING


def test_preempted_sequence_recomputes_its_generated_tokens():
    sched = _make(num_blocks=2, max_seqs=4)
    a, b = _seq(4), _seq(4, 50)
    sched.add(a)
    sched.add(b)
    _run_step(sched, sched.schedule())
    _run_step(sched, sched.schedule())  # b preempted, a decodes
    sched.finish(a, "length")
    out = sched.schedule()
    assert out.is_prefill and out.seqs == [b]
    assert b.num_scheduled_tokens == b.num_tokens == 5  # prompt + the token it had generated


def test_abort_frees_blocks_from_anywhere():
    sched = _make(budget=2)
    a = _seq(8)
    sched.add(a)
    sched.schedule()  # mid chunked prefill, holding blocks
    assert sched.block_manager.num_free_blocks < 16
    sched.abort(a)
    assert sched.block_manager.num_free_blocks == 16
    assert not sched.has_unfinished()
