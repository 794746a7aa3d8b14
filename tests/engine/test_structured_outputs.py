"""Structured outputs through the engine: on a random tiny model only the constraint can make the output
valid, so every output below being valid is the check. Constrained rows beside unconstrained ones leave
those token for token as they were; bad constraints are rejected naming the field and cost nothing."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable

import pytest

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.engine.core import IDLE_COMPILE_WAIT_S
from nanoinfer.engine.request import EngineRequest
from nanoinfer.sampling_params import RequestOutputKind
from nanoinfer.structured import ReasoningSpan

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["red", "green", "blue", "reddish brown"]
GRAMMAR = 'start: item ("," item){0,3}\nitem: /[0-9]{1,3}/ | "x"'
PROMPTS = ["hello world", "the quick brown fox", "a", "jumps over the lazy dog again and again"]


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert list(value) == list(SCHEMA["properties"])  # all required, in schema order
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert value["role"] in ("admin", "editor", "viewer")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 6 for t in value["tags"])
    assert isinstance(value["active"], bool)


CHECKS = {
    "json": (StructuredOutputsParams(json=SCHEMA), check_schema),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    "grammar": (
        StructuredOutputsParams(grammar=GRAMMAR),
        lambda t: re.fullmatch(r"(?:[0-9]{1,3}|x)(?:,(?:[0-9]{1,3}|x)){0,3}", t) or pytest.fail(t),
    ),
    "json_object": (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
}


# (async_scheduling, num_grammar_processes) of each engine the tests run on.
ENGINE_MODES = {"sync": (False, 0), "async": (True, 0), "async-grammar-processes": (True, 2)}


def _engine(model: str, mode: str) -> LLM:
    async_scheduling, num_grammar_processes = ENGINE_MODES[mode]
    return LLM(
        model,
        device="cpu",
        async_scheduling=async_scheduling,
        num_grammar_processes=num_grammar_processes,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module", params=list(ENGINE_MODES))
def llm(request, tiny_qwen3):
    engine = _engine(tiny_qwen3, request.param)
    yield engine
    engine.close()


def _no_leak(llm: LLM) -> None:
    stats = llm.llm_engine.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0


@pytest.mark.parametrize("kind", list(CHECKS))
def test_outputs_are_valid_across_seeds_and_temperatures(llm, kind):
    constraint, check = CHECKS[kind]
    params = [
        SamplingParams(temperature=t, seed=seed, max_tokens=120, structured_outputs=constraint)
        for t in (0.0, 0.7, 1.5)
        for seed in range(4 if t else 1)
    ]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        if kind == "json_object" and completion.finish_reason == "length":
            # Any object: nothing bounds its keys and strings, which a random model may fill.
            assert completion.text.startswith("{")
            continue
        assert completion.finish_reason == "stop", completion.text
        check(completion.text)
        # EOS ends the constrained output, as it ends any other.
        assert completion.token_ids[-1] == llm.get_tokenizer().eos_token_id
    _no_leak(llm)


def test_unconstrained_rows_are_token_identical_beside_constrained_ones(llm):
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
    ]
    alone = llm.generate(PROMPTS[:3], plain, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=CHECKS[kind][0])
        for i, kind in enumerate(CHECKS)
    ]
    prompts = PROMPTS[:3] + [PROMPTS[3]] * len(constrained)
    mixed = llm.generate(prompts, plain + constrained, use_tqdm=False)
    for before, after in zip(alone, mixed[:3], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for output, kind in zip(mixed[3:], CHECKS, strict=True):
        CHECKS[kind][1](output.outputs[0].text)
    _no_leak(llm)


def test_a_constraint_that_cannot_complete_ends_with_length(llm):
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    completion = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3
    assert completion.text.startswith('{"')
    _no_leak(llm)


@pytest.mark.parametrize(
    "extra", [{"ignore_eos": True}, {"min_tokens": 40}], ids=["ignore_eos", "min_tokens"]
)
def test_a_complete_constraint_ends_the_request_when_eos_cannot_be_sampled(llm, extra):
    constraint = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=50, structured_outputs=constraint, **extra)
    completion = llm.generate(["question"], params, use_tqdm=False)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    _no_leak(llm)


def test_n_completions_and_streaming_deltas_each_follow_the_constraint(llm):
    constraint, check = CHECKS["regex"]
    params = SamplingParams(n=3, temperature=1.2, seed=5, max_tokens=40, structured_outputs=constraint)
    output = llm.generate(["mail"], params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    for completion in output.outputs:
        check(completion.text)
    engine = llm.llm_engine
    delta = SamplingParams(
        temperature=1.0,
        seed=2,
        max_tokens=120,
        structured_outputs=CHECKS["json"][0],
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request("stream", "data", delta)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
    check_schema(text)
    _no_leak(llm)


def test_a_bitmask_buffer_is_refilled_only_after_the_step_that_read_it(llm):
    """On CUDA the bitmask's copy to the device reads its pinned buffer until the device gets to it: each
    bitmask sampled under names that step as its reader, and the next bitmask is taken only after that
    step's tokens were waited for (which the engine has nearly always done by then, so the take waits for
    nothing). Here with fake readers, whose waits are counted."""
    from nanoinfer.executor.model_runner import StepHandle

    core = llm.llm_engine.engine_core
    sample, readers = core.executor.sample, []

    def logged_sample(handle, bitmask):
        sample(handle, bitmask)
        if bitmask is not None:
            readers.append(bitmask.read_by is handle)

    core.executor.sample = logged_sample
    try:
        constraint, check = CHECKS["regex"]
        params = [SamplingParams(seed=i, max_tokens=30, structured_outputs=constraint) for i in range(3)]
        for output in llm.generate(PROMPTS[:3], params, use_tqdm=False):
            check(output.outputs[0].text)
    finally:
        core.executor.sample = sample
    assert len(readers) >= 5 and all(readers), readers
    manager = core.structured_outputs
    manager.finish_pending()
    waits: list[str] = []
    reader = StepHandle(None, None)
    reader._event, reader._wait = "tokens", waits.append  # as on CUDA: a device wait on the tokens' event
    manager._take_buffer([(0, None)]).read_by = reader
    assert waits == []
    manager._take_buffer([(0, None)])
    assert waits == ["tokens"]
    reader.wait()  # waited once: later waits (the step's result) return at once
    assert waits == ["tokens"]
    _no_leak(llm)


def test_constrained_requests_aborted_while_their_sampling_waits_leave_the_others_intact(llm):
    """An abort between steps may hit a request whose step is launched with its sampling deferred (the
    bitmask comes in the next step): the survivors sample what they sample alone; nothing leaks."""
    constraint = CHECKS["json"][0]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=50, structured_outputs=constraint)
        for i in range(4)
    ]
    alone = llm.generate(PROMPTS[:2], params[:2], use_tqdm=False)
    engine = llm.llm_engine
    for step_to_abort in range(5):
        for i, p in enumerate(params):
            engine.add_request(f"s{step_to_abort}-{i}", PROMPTS[i], p)
        for _ in range(step_to_abort):
            engine.step()
        engine.abort_request([f"s{step_to_abort}-{i}" for i in (2, 3)])
        survivors = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    survivors[out.request_id] = out.outputs[0].token_ids
        while engine.engine_core.has_unfinished_requests():
            engine.step()
        assert [survivors[f"s{step_to_abort}-{i}"] for i in (0, 1)] == [o.outputs[0].token_ids for o in alone]
        _no_leak(llm)


def test_constrained_requests_survive_preemption(tiny_qwen3):
    # 8 blocks of 16 tokens for 6 requests that each need 2-3: requests are preempted and recomputed.
    llm = LLM(tiny_qwen3, device="cpu", num_kvcache_blocks=8, kvcache_block_size=16, max_num_seqs=6)
    try:
        constraint, check = CHECKS["json"]
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs=constraint)
            for i in range(6)
        ]
        outputs = llm.generate(["one two three four five six"] * 6, params, use_tqdm=False)
        assert llm.llm_engine.stats()["num_preemptions"] > 0
        for output in outputs:
            completion = output.outputs[0]
            if completion.finish_reason == "stop":
                check(completion.text)
            else:
                assert completion.finish_reason == "length" and completion.text.startswith('{"')
        _no_leak(llm)
    finally:
        llm.close()


THINK, END_THINK = 384, 385  # tiny_thinker's <think> and </think>


@pytest.fixture(scope="module", params=["sync", "async-grammar-processes"])
def thinker_llm(request, tiny_thinker):
    engine = _engine(tiny_thinker, request.param)
    yield engine
    engine.close()


# How each output begins (logit biases steer the random model: the first token allowed with the largest
# bias wins), and whether the prompt opened the reasoning.
REASONING_CASES = {
    "opens_and_closes_its_reasoning": (False, {THINK: 30, END_THINK: 40}),
    "reasons_in_the_reasoning_the_prompt_opened": (True, {END_THINK: 5}),
    "answers_at_once": (False, {93: 30}),  # 93: "{"
}


@pytest.mark.parametrize("case", list(REASONING_CASES))
def test_a_constraint_after_reasoning_leaves_the_reasoning_free(thinker_llm, case):
    opened, bias = REASONING_CASES[case]
    span = ReasoningSpan(THINK, END_THINK, opened=opened)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            logit_bias=bias,
            structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning=span),
        )
        for seed in range(6)
    ]
    reasoned = 0
    for output in thinker_llm.generate(PROMPTS[:3] * 2, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        ids = completion.token_ids
        if case == "answers_at_once":
            assert THINK not in ids and END_THINK not in ids
            answer = completion.text
        else:
            start = 0 if opened else 1  # where the reasoning's text begins
            assert ids[:start] == [THINK] * start
            end = ids.index(END_THINK)
            assert THINK not in ids[end:] and END_THINK not in ids[end + 1 :]
            reasoned += end > start
            answer = completion.text.split("</think>", 1)[1]
        check_schema(answer)
    # The reasoning the prompt opened is free text before the answer (for some seeds).
    assert reasoned > 0 or case != "reasons_in_the_reasoning_the_prompt_opened"
    _no_leak(thinker_llm)


BAD_CONSTRAINTS = [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ({"json": '{"type": '}, "structured_outputs.json is not valid JSON"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"regex": r"(a)\1"}, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": SCHEMA, "regex": REGEX}, "exactly one of"),
]


@pytest.mark.parametrize("fields, message", BAD_CONSTRAINTS)
def test_bad_constraints_are_rejected_naming_the_field_and_the_engine_keeps_serving(llm, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
        llm.generate(["hi"], params, use_tqdm=False)
    _no_leak(llm)
    params = SamplingParams(max_tokens=8, structured_outputs=CHECKS["choice"][0])
    assert llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].text in CHOICES


def test_a_constraint_that_cannot_be_matched_midway_fails_its_request_alone_for_its_input(llm):
    # Its first mask fits the grammar library's limits on this vocabulary (it passes validation); its
    # second token's lexer state does not.
    bad = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="((a{100}){100}){100}")
    )
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed, other = llm.generate(["hi", "hi"], [bad, plain], use_tqdm=False)
    assert failed.invalid_input and failed.outputs[0].finish_reason == "error"
    assert failed.error.startswith("structured_outputs could not be matched: lexer error")
    assert other.error is None and len(other.outputs[0].token_ids) == 8
    _no_leak(llm)


def test_a_constraint_and_allowed_token_ids_that_leave_no_token_fail_the_request_for_its_input(llm):
    digits = StructuredOutputsParams(regex="[0-9]+")
    letters = [t for t in range(3, 300) if llm.get_tokenizer().decode([t]).isalpha()]
    nothing = SamplingParams(max_tokens=8, allowed_token_ids=letters, structured_outputs=digits)
    failed, ok = llm.generate(
        ["hi", "hi"], [nothing, SamplingParams(max_tokens=8, structured_outputs=digits)]
    )
    assert failed.invalid_input and failed.error.startswith("no token is allowed at this step")
    assert ok.error is None and ok.outputs[0].text.isdigit()
    _no_leak(llm)


def test_structured_outputs_must_be_its_params_type():
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def _record_async_order(core, prepared: list, sampled_after: list[int]) -> None:
    executor = core.executor
    prepare, sample = executor.prepare, executor.sample

    def logged_prepare(out):
        prepared.append(out)
        return prepare(out)

    def logged_sample(handle, bitmask):
        own = max(i for i, out in enumerate(prepared) if out is handle.out)
        sampled_after.append(len(prepared) - 1 - own)
        return sample(handle, bitmask)

    executor.prepare, executor.sample = logged_prepare, logged_sample


MIXED_KINDS = ["json", "regex", "grammar", "json"]


def _seeded_mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    """Seeded constrained requests of each kind in MIXED_KINDS, then one unconstrained."""
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=CHECKS[kind][0])
        for i, kind in enumerate(MIXED_KINDS)
    ] + [SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)]
    return [PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params


def test_async_scheduling_samples_a_constrained_step_after_preparing_the_next_and_the_same_tokens(tiny_qwen3):
    """With async scheduling a constrained step's sampling is launched after the next step has been
    prepared (right before that step is launched); seeded requests sample the same tokens as without
    async scheduling."""
    prompts, params = _seeded_mixed_batch()
    token_ids = {}
    prepared: list[object] = []  # the SchedulerOutput of every prepared step, in order
    sampled_after: list[int] = []  # per deferred sampling: how many steps were prepared after its own
    for async_scheduling in (False, True):
        llm = LLM(tiny_qwen3, device="cpu", async_scheduling=async_scheduling, max_num_seqs=8)
        try:
            if async_scheduling:
                _record_async_order(llm.llm_engine.engine_core, prepared, sampled_after)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            token_ids[async_scheduling] = [o.outputs[0].token_ids for o in outputs]
            _no_leak(llm)
        finally:
            llm.close()
    assert token_ids[True] == token_ids[False]
    # Each step's sampling waited for the next step's preparation (0 would be the order of a sync step;
    # the last step has no next one).
    assert sampled_after.count(1) >= 20 and set(sampled_after) <= {0, 1}, sampled_after


def test_the_grammar_processes_feed_and_fill_while_the_forward_pass_runs(tiny_qwen3, monkeypatch):
    """With the grammars in processes of their own (the CUDA default) and async scheduling, a
    constrained step's inputs are copied to the device before the previous step's sampling (which waited
    for its bitmask), and its feeding and fill are sent to the processes once it is launched; the
    engine's process never asks a grammar anything, the outputs stay valid, and the seeded tokens are
    those of a run without async scheduling and with the grammars on the engine's thread."""
    from nanoinfer.structured.backend import LLGuidanceGrammar
    from nanoinfer.structured.xgrammar_backend import XGrammarGrammar

    prompts, params = _seeded_mixed_batch()
    expected = _token_ids(tiny_qwen3, prompts, params, async_scheduling=False)
    asked_here: list[str] = []
    for cls in (LLGuidanceGrammar, XGrammarGrammar):
        for name in ("accept_token", "fill_bitmask", "is_terminated", "is_accepting"):
            original = getattr(cls, name)

            def recorded(self, *args, _original=original, _name=name):
                asked_here.append(_name)
                return _original(self, *args)

            monkeypatch.setattr(cls, name, recorded)
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True, num_grammar_processes=2, max_num_seqs=8)
    try:
        core = llm.llm_engine.engine_core
        launched: list = []  # the steps launched with their sampling deferred
        # Per constrained step: whether its inputs were staged, and whether the step before was constrained.
        staged: list[tuple[bool, bool]] = []
        # Every step call: whether the step it launched deferred its sampling (False: it launched none).
        deferred: list[bool] = []
        filled_in_flight: list[bool] = []
        launch = core.executor.launch
        start_bitmask = core.structured_outputs.start_bitmask

        def logged_launch(out, prepared, defer_sampling=False, staged_inputs=None):
            if defer_sampling:
                launched.append(out)
                staged.append((staged_inputs is not None, bool(deferred) and deferred[-1]))
            deferred.append(defer_sampling)
            return launch(out, prepared, defer_sampling, staged_inputs)

        def logged_start_bitmask(grammars, feeds):
            # The bitmask being started is that of the step just launched, now in flight.
            filled_in_flight.append(bool(launched) and core._in_flight[0] is launched[-1])
            return start_bitmask(grammars, feeds)

        schedule = core.scheduler.schedule

        def logged_schedule():
            out = schedule()
            if out.is_empty:  # nothing is launched: the next step follows none
                deferred.append(False)
            return out

        core.executor.launch = logged_launch
        core.scheduler.schedule = logged_schedule
        core.structured_outputs.start_bitmask = logged_start_bitmask
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        for output, kind in zip(outputs, MIXED_KINDS, strict=False):
            if output.outputs[0].finish_reason == "stop":
                CHECKS[kind][1](output.outputs[0].text)
        assert len(filled_in_flight) >= 20 and all(filled_in_flight), filled_in_flight
        # A constrained step that follows another stages its inputs while that one's bitmask fills (the
        # constrained requests join as their constraints compile, so some follow an unconstrained step).
        assert all(inputs_staged == after_constrained for inputs_staged, after_constrained in staged), staged
        assert sum(inputs_staged for inputs_staged, _ in staged) >= 20, staged
        assert asked_here == []
        assert llm.llm_engine.stats()["structured_mask_steps"] >= 20
        _no_leak(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("num_grammar_processes", [0, 2])
def test_a_constrained_steps_outputs_do_not_wait_for_its_grammars_answers(
    tiny_qwen3, monkeypatch, num_grammar_processes
):
    """With async scheduling a step's constrained tokens are applied (its outputs made) before the
    feeding of those tokens to their grammars is waited for; the answers are checked at the next call,
    which ends a request whose grammar allows only an EOS it cannot sample (ignore_eos) then. In grammar
    processes, that answer is one of the rare results sent on the pipe."""
    from nanoinfer.engine.scheduler import Scheduler
    from nanoinfer.engine.structured_outputs import PendingBitmask, StructuredOutputManager

    llm = LLM(
        tiny_qwen3,
        device="cpu",
        async_scheduling=True,
        num_grammar_processes=num_grammar_processes,
        max_num_seqs=8,
    )
    try:
        core = llm.llm_engine.engine_core
        fed: dict[int, list] = {}  # per pending exchange: (request, its tokens when the feeding started)
        applied_first, waited_first, late = [], [], []
        start_bitmask = StructuredOutputManager.start_bitmask

        def recorded_start(self, grammars, feeds):
            pending = start_bitmask(self, grammars, feeds)
            requests = {id(r.grammar): r for r in core.scheduler.requests.values() if r.grammar is not None}
            fed[id(pending)] = [(requests[id(f.grammar)], requests[id(f.grammar)].num_tokens) for f in feeds]
            starts[id(pending)] = schedules[-1]
            return pending

        wait_advanced = PendingBitmask.wait_advanced

        # Per wait for an exchange's feeding: whether a step was scheduled since the exchange started.
        scheduled_before_wait = []

        def recorded_wait(self):
            feeds = fed.pop(id(self), None)
            if feeds is not None:
                scheduled_before_wait.append(schedules[-1] > starts[id(self)])
            for request, num_tokens in feeds or ():
                (applied_first if request.num_tokens == num_tokens + 1 else waited_first).append(request)
            return wait_advanced(self)

        schedules, starts = [0], {}
        schedule = core.scheduler.schedule

        def counted_schedule():
            schedules.append(schedules[-1] + 1)
            return schedule()

        core.scheduler.schedule = counted_schedule

        apply_late = Scheduler.apply_late_grammar_result

        def recorded_late(self, request_id, grammar, result):
            output = apply_late(self, request_id, grammar, result)
            late.append(output)
            return output

        monkeypatch.setattr(StructuredOutputManager, "start_bitmask", recorded_start)
        monkeypatch.setattr(PendingBitmask, "wait_advanced", recorded_wait)
        monkeypatch.setattr(Scheduler, "apply_late_grammar_result", recorded_late)
        prompts, params = _seeded_mixed_batch()
        choice = StructuredOutputsParams(choice=["yes", "no"])
        params.append(
            SamplingParams(temperature=1.0, seed=1, max_tokens=50, ignore_eos=True, structured_outputs=choice)
        )
        outputs = llm.generate([*prompts, "question"], params, use_tqdm=False)
        assert waited_first == [] and len(applied_first) >= 20
        # The answers are waited for once the next step is scheduled (its inputs made meanwhile).
        assert len(scheduled_before_wait) >= 20 and all(scheduled_before_wait), scheduled_before_wait
        ended = outputs[-1].outputs[0]
        assert ended.text in ("yes", "no") and ended.finish_reason == "stop"
        assert [(o.request_id, o.finish_reason) for o in late if o is not None] == [
            (outputs[-1].request_id, "stop")
        ]
        _no_leak(llm)
    finally:
        llm.close()


def test_the_grammar_processes_drop_the_grammars_of_finished_requests(tiny_qwen3):
    """The keys of finished requests' grammars reach their processes with the next steps (in the step
    board), which drop them: after a second batch, the processes hold that batch's grammars alone."""
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True, num_grammar_processes=2, max_num_seqs=8)
    try:
        regex, check = CHECKS["regex"]
        params = [SamplingParams(seed=i, max_tokens=30, structured_outputs=regex) for i in range(6)]
        for output in llm.generate(PROMPTS[:1] * 6, params, use_tqdm=False):
            check(output.outputs[0].text)
        processes = llm.llm_engine.engine_core.structured_outputs._processes
        assert sum(processes.grammars_held()) >= 2  # the first batch's, as of its last steps
        # Two more requests: one grammar in each process, whose steps carry the first batch's keys.
        for output in llm.generate(PROMPTS[:1] * 2, params[:2], use_tqdm=False):
            check(output.outputs[0].text)
        assert processes.grammars_held() == [1, 1]
        _no_leak(llm)
    finally:
        llm.close()


def _token_ids(
    model: str, prompts: list[str], params: list[SamplingParams], **engine_kwargs
) -> list[list[int]]:
    llm = LLM(model, device="cpu", max_num_seqs=8, **engine_kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


def test_a_dead_grammar_process_fails_its_own_requests_alone_and_is_started_again(tiny_qwen3, monkeypatch):
    """One of two grammar processes killed mid-run: the requests whose grammars it held end with an
    error, the others' outputs stay valid, the unconstrained one gets the tokens it gets alone, no block
    leaks, and the next constrained requests get a new process. An invalid constraint is the compile's
    ValueError."""
    from nanoinfer.engine.grammar_process import GrammarProcesses

    prompts, params = _seeded_mixed_batch()
    alone = _token_ids(tiny_qwen3, prompts[-1:], params[-1:])
    keys: list[int] = []
    compile_grammar = GrammarProcesses.compile

    def logged_compile(self, key, constraint):
        keys.append(key)
        return compile_grammar(self, key, constraint)

    monkeypatch.setattr(GrammarProcesses, "compile", logged_compile)
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True, num_grammar_processes=2, max_num_seqs=8)
    try:
        core = llm.llm_engine.engine_core
        launch = core.executor.launch
        launches = []

        def launch_then_kill(out, prepared, defer_sampling=False, staged_inputs=None):
            launches.append(out)
            if len(launches) == 2:  # the first decoding step: no request has ended yet
                core.structured_outputs._processes.processes[0]._process.kill()
            return launch(out, prepared, defer_sampling, staged_inputs)

        core.executor.launch = launch_then_kill
        outputs = llm.generate(prompts, params, use_tqdm=False)
        core.executor.launch = launch
        processes = core.structured_outputs._processes
        in_killed = [key % 2 == 0 for key in keys]
        assert len(keys) == len(MIXED_KINDS) and any(in_killed) and not all(in_killed), keys
        for output, kind, killed in zip(outputs, MIXED_KINDS, in_killed, strict=False):
            completion = output.outputs[0]
            if killed:
                assert completion.finish_reason == "error", completion
            elif completion.finish_reason == "stop":
                CHECKS[kind][1](completion.text)
        assert [o.outputs[0].token_ids for o in outputs[-1:]] == alone
        _no_leak(llm)
        regex, check = CHECKS["regex"]
        again = llm.generate(prompts[:2], [SamplingParams(max_tokens=40, structured_outputs=regex)] * 2)
        for output in again:
            check(output.outputs[0].text)
        assert core.structured_outputs._processes is processes and all(p.alive for p in processes.processes)
        # Past the frontend's validation, an invalid constraint fails its request alone, for its input.
        bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
        core.add_request(EngineRequest("bad", [1, 2, 3], bad, seed=0))
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step().outputs
        assert [(o.request_id, o.finish_reason, o.invalid_input) for o in outputs] == [("bad", "error", True)]
        assert "regex" in outputs[0].error
        _no_leak(llm)
    finally:
        llm.close()


def _started(processes) -> bool:
    """Whether every grammar process is ready, reading what they sent (the engine reads it when it next
    polls for compiles, which it does not while none is running); pausing 2 ms before it answers no."""
    for process in processes:
        process.read_available()
    if all(process.ready for process in processes):
        return True
    time.sleep(0.002)
    return False


def _run_until(engine, finished: dict, done: Callable[[], bool], max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if done():
            return
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"not done after {max_steps} steps: {sorted(finished)}")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_compiling_constraint_holds_up_neither_the_engine_nor_the_requests_behind_it(
    tiny_qwen3, monkeypatch, async_scheduling
):
    """The engine's compile of a constraint runs on a thread while its request waits: an unconstrained
    request that arrived after it runs to its end meanwhile, one aborted while its constraint compiles
    leaves nothing behind, and the compiled request's output follows its constraint."""
    llm = LLM(
        tiny_qwen3, device="cpu", async_scheduling=async_scheduling, num_grammar_processes=0, max_num_seqs=8
    )
    release = threading.Event()
    try:
        engine = llm.llm_engine
        compiler = engine.engine_core.structured_outputs.compiler
        compile_grammar = compiler.compile
        compiled_on: list[str] = []

        def held_compile(params, validate=False):
            if not validate:  # the engine's compile (the frontend's validation comes first)
                compiled_on.append(threading.current_thread().name)
                assert release.wait(60)
            return compile_grammar(params, validate)

        monkeypatch.setattr(compiler, "compile", held_compile)
        # As for a constraint the frontend's validation did not compile here (the engine in a process of
        # its own): the engine compiles it anew.
        monkeypatch.setattr(compiler, "is_kept", lambda params: False)
        regex, check = CHECKS["regex"]
        constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=regex)
        engine.add_request("constrained", PROMPTS[0], constrained)
        engine.add_request("aborted", PROMPTS[1], constrained)
        engine.add_request("free", PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
        finished: dict = {}
        _run_until(engine, finished, lambda: "free" in finished)
        assert list(finished) == ["free"] and len(finished["free"].outputs[0].token_ids) == 12
        # With nothing to run but compiles, a step waits a little for them instead of spinning.
        started = time.perf_counter()
        for _ in range(6):
            assert engine.step() == []
        assert time.perf_counter() - started >= 5 * 0.8 * IDLE_COMPILE_WAIT_S
        assert engine.abort_request("aborted")
        release.set()
        _run_until(engine, finished, lambda: not engine.has_unfinished_requests())
        assert sorted(finished) == ["constrained", "free"]
        completion = finished["constrained"].outputs[0]
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":
            check(completion.text)
        assert compiled_on and all(name.startswith("nanoinfer-grammar-compile") for name in compiled_on)
        _no_leak(llm)
        # A constraint the frontend's validation compiled in this process gets its matcher at once.
        monkeypatch.undo()
        calls: list[tuple[bool, str]] = []

        def recorded_compile(params, validate=False):
            calls.append((validate, threading.current_thread().name))
            return compile_grammar(params, validate)

        monkeypatch.setattr(compiler, "compile", recorded_compile)
        output = llm.generate(PROMPTS[3], constrained, use_tqdm=False)[0].outputs[0]
        assert output.finish_reason in ("stop", "length")
        here = threading.current_thread().name
        assert calls == [(True, here), (False, here)]  # the frontend's validation, then the engine's
    finally:
        release.set()
        llm.close()


def test_the_grammar_processes_start_and_compile_while_the_engine_steps(tiny_qwen3):
    """The first constrained request starts the grammar processes without waiting for them (seconds:
    the unconstrained request runs meanwhile), and constraints that arrive while others decode compile
    beside the steps; every output follows its constraint and nothing leaks."""
    llm = LLM(tiny_qwen3, device="cpu", async_scheduling=True, num_grammar_processes=2, max_num_seqs=8)
    try:
        engine = llm.llm_engine
        manager = engine.engine_core.structured_outputs
        kinds = ["json", "regex", "choice", "grammar", "json_object"]

        def add(i: int) -> None:
            params = SamplingParams(
                temperature=1.0, seed=i, max_tokens=60, structured_outputs=CHECKS[kinds[i]][0]
            )
            engine.add_request(f"c{i}", PROMPTS[i % len(PROMPTS)], params)

        add(0)
        engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
        processes = manager._processes.processes
        assert not any(process.ready for process in processes)  # add_request did not wait for them
        finished: dict = {}
        _run_until(engine, finished, lambda: "free" in finished)
        assert "c0" not in finished
        # Later constraints arrive while c0 decodes: their compiles' answers share the pipes with steps.
        _run_until(engine, finished, lambda: _started(processes), max_steps=30_000)
        for i in range(1, len(kinds)):
            add(i)
            for _ in range(3):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        _run_until(engine, finished, lambda: not engine.has_unfinished_requests())
        assert sorted(finished) == sorted(["free"] + [f"c{i}" for i in range(len(kinds))])
        for i, kind in enumerate(kinds):
            completion = finished[f"c{i}"].outputs[0]
            assert completion.finish_reason in ("stop", "length"), completion
            if completion.finish_reason == "stop":
                CHECKS[kind][1](completion.text)
        assert not manager.has_compiling()
        _no_leak(llm)
    finally:
        llm.close()


def test_a_servers_engine_starts_its_grammar_processes_with_itself(tiny_qwen3, monkeypatch):
    """AsyncLLM's engine starts its grammar processes as it builds itself, so that its first constrained
    request does not wait for them; a process ready long before the first poll is taken as ready (not as
    one that failed to start in time), and one still starting is closed at once."""
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine import grammar_process
    from nanoinfer.frontend.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(tiny_qwen3, device="cpu", num_grammar_processes=1, max_num_seqs=4)
    starting = LLMEngine(config, start_grammar_processes=True)
    started = time.perf_counter()
    starting.close()
    assert time.perf_counter() - started < 4.0  # no wait for a process that does not read its pipe yet

    engine = LLMEngine(config, start_grammar_processes=True)
    try:
        manager = engine.engine_core.structured_outputs
        assert manager._processes is not None  # before any request
        (process,) = manager._processes.processes
        assert process.connection.poll(120)  # its ready message, unread: nothing has polled yet
        monkeypatch.setattr(grammar_process, "START_TIMEOUT_S", 0.0)  # the request comes much later
        constraint, check = CHECKS["regex"]
        params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=constraint)
        engine.add_request("c", PROMPTS[0], params)
        finished: dict = {}
        _run_until(engine, finished, lambda: not engine.has_unfinished_requests())
        completion = finished["c"].outputs[0]
        assert completion.finish_reason in ("stop", "length"), completion
        if completion.finish_reason == "stop":
            check(completion.text)
        stats = engine.stats()
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    finally:
        engine.close()


def test_compile_answers_between_a_steps_replies_are_kept_for_the_poll():
    """The engine reads a grammar process's pipe in order; a compile's answer read while it waits for a
    step's unusual results is kept for the next poll, and the step's replies (on the pipe and in the
    board) are still its own."""
    from nanoinfer.engine.grammar_process import StepBoard, _GrammarProcess

    class Pipe:
        def __init__(self, messages):
            self.messages = list(messages)

        def recv(self):
            return self.messages.pop(0)

        def poll(self, timeout=0):
            return bool(self.messages)

    class Posted:
        def acquire(self, timeout=None):
            return True

    process = _GrammarProcess.__new__(_GrammarProcess)
    process.connection = Pipe(
        [
            ("compiled", 7, None, False),
            {1: ("not allowed", False, False)},
            ("compiled", 8, "structured_outputs.regex is invalid", True),
            ("compiled", 9, None, False),
        ]
    )
    process.alive, process.ready, process.released = True, True, []
    process.compiling, process._compiled, process._replies, process._unsent = {7, 8, 9}, [], deque(), []
    process.index, process._board = 1, StepBoard.allocate(4, 2)
    process._fed = process._filled = Posted()
    process._board.replies[1, :2] = (1, 250_000_000)
    assert process.wait_fed() == {1: ("not allowed", False, False)}
    assert process.wait_filled() == 0.25
    process._board.replies[1, 0] = 0
    assert process.wait_fed() == {}  # nothing unusual: the pipe is not read
    process.read_available()
    compiled = process.take_compiled()
    assert [(c.key, c.error, c.invalid_input) for c in compiled] == [
        (7, None, False),
        (8, "structured_outputs.regex is invalid", True),
        (9, None, False),
    ]
    assert compiled[0].grammar.key == 7 and compiled[1].grammar is None
    assert process.compiling == set() and process.take_compiled() == []


def test_a_script_without_a_main_guard_gets_an_error_that_says_so(tiny_qwen3, tmp_path):
    """A grammar process starts by importing the main script; one that runs the engine at its top level
    gets an error naming the guard, not a hang."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from nanoinfer import LLM, SamplingParams, StructuredOutputsParams\n"
        f"llm = LLM({tiny_qwen3!r}, device='cpu', num_grammar_processes=1)\n"
        "constraint = StructuredOutputsParams(regex='[a-z]{3}')\n"
        "llm.generate(['hi'], SamplingParams(max_tokens=5, structured_outputs=constraint), use_tqdm=False)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert 'if __name__ == "__main__":' in run.stderr, run.stderr[-2000:]
