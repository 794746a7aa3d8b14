"""The decode graphs' step paths on the CPU: ``CudaGraphs`` with each graph replaced by the function it
would capture, run eagerly (the capture itself is CUDA's), so that what a replay computes and how the
model runner feeds and reads the graphs' buffers are checked here. Pure-decode steps then go through
the forward graphs, temperature-only ones through the sampling graphs, and constrained ones through
the masked sampling graphs; every token must be the one the engine samples without graphs."""

from __future__ import annotations

import re

import pytest
import torch

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.executor.cuda_graphs import CudaGraphs, cuda_graph_batch_sizes

pytest.importorskip("triton")  # the sampling graphs' kernels

REGEX = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
PROMPTS = ["hello world", "the quick brown fox", "a", "jumps over the lazy dog again and again"]


class EagerGraph:
    """Stands in for a captured graph: a replay runs the captured function."""

    def __init__(self, run):
        self.run = run
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.run()


class EagerCudaGraphs(CudaGraphs):
    def _record(self, run) -> EagerGraph:
        run()
        return EagerGraph(run)


def _with_eager_graphs(llm: LLM) -> EagerCudaGraphs:
    config = llm.llm_engine.config
    runner = llm.llm_engine.engine_core.executor.runner
    graphs = EagerCudaGraphs(
        runner.model,
        runner.buffers,
        config.hf_config.hidden_size,
        runner.dtype,
        runner.input_batch.step_sampling,
    )
    graphs.capture(cuda_graph_batch_sizes(config.max_num_seqs), config.max_model_len)
    runner.graphs = graphs
    return graphs


def _params() -> list[SamplingParams]:
    constrained = [
        SamplingParams(
            temperature=0.9, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)
        )
        for i in range(3)
    ]
    plain = [
        SamplingParams(temperature=0.0 if i == 0 else 0.8, seed=10 + i, max_tokens=30, ignore_eos=True)
        for i in range(3)
    ]
    return constrained + plain


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graph_paths_sample_the_tokens_of_the_eager_engine(tiny_qwen3, async_scheduling):
    params = _params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    tokens = {}
    for with_graphs in (False, True):
        llm = LLM(tiny_qwen3, device="cpu", async_scheduling=async_scheduling, max_num_seqs=8)
        try:
            graphs = _with_eager_graphs(llm) if with_graphs else None
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[with_graphs] = [o.outputs[0].token_ids for o in outputs]
            texts = [o.outputs[0] for o in outputs]
            stats = llm.llm_engine.stats()
            assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
            if graphs is not None:
                replays = {
                    name: sum(g.replays for g in getattr(graphs, name).values())
                    for name in ("sampling_graphs", "masked_sampling_graphs")
                }
                # Constrained rows sample through the masked graphs until they finish, the others
                # after them through the sampling graphs.
                assert replays["masked_sampling_graphs"] >= 10 and replays["sampling_graphs"] >= 5, replays
        finally:
            llm.close()
    assert tokens[True] == tokens[False]
    for output in texts[:3]:
        if output.finish_reason == "stop":
            assert re.fullmatch(REGEX, output.text), output.text


def _masked_sampling_steps(graphs: CudaGraphs) -> None:
    def new_hidden_states() -> torch.Tensor:
        # The forward graph's output, from which the masked sampling graph computes the logits.
        graphs.output[:4] = torch.randn_like(graphs.output[:4])
        return graphs.model.compute_logits(graphs.output[:4]).argmax(dim=-1)

    s = graphs.sampling
    s.temperature[:4] = 0.0  # greedy: the argmax of what the mask leaves
    only = torch.zeros(3, graphs.mask.shape[1], dtype=torch.int32)
    only[:, 0] = 1 << 5  # token 5 alone
    free = new_hidden_states()
    graphs.mask[:3] = only
    graphs.load_mask(3, torch.tensor([2, 0, 3]))
    assert graphs.replay_masked_sampling(4).tolist() == [5, free[1].item(), 5, 5]
    free = new_hidden_states()
    graphs.mask[:1] = only[:1]
    graphs.load_mask(1, torch.tensor([1]))
    assert graphs.replay_masked_sampling(4).tolist() == [
        free[0].item(),
        5,
        free[2].item(),
        free[3].item(),
    ]
    # Without a row list, mask row i is logits row i; a list in between names its rows again.
    for num_rows, logits_rows in ((2, None), (1, torch.tensor([3])), (3, None)):
        free = new_hidden_states()
        graphs.mask[:num_rows] = only[:num_rows]
        graphs.load_mask(num_rows, logits_rows)
        masked = range(num_rows) if logits_rows is None else logits_rows.tolist()
        assert graphs.replay_masked_sampling(4).tolist() == [
            5 if row in masked else free[row].item() for row in range(4)
        ]
    free = new_hidden_states()
    graphs.load_mask(0, None)
    assert graphs.replay_masked_sampling(4).tolist() == free.tolist()


def test_masked_sampling_mask_rows_reset_when_fewer_rows_are_constrained(tiny_qwen3):
    """load_mask's rows past the step's constrained ones allow every token again: a row constrained in
    one step samples freely in the next once it is not listed."""
    llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=8)
    try:
        with torch.inference_mode():
            _masked_sampling_steps(_with_eager_graphs(llm))
    finally:
        llm.close()


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "constrained"])
def test_one_token_prompt_chunks_beside_decoding_rows_sample_outside_the_sampling_graphs(
    tiny_qwen3, constrained
):
    """A token budget of 4 for 4 sequences: three decoding rows leave one token to a fourth request's
    prompt, whose one-token chunk does not sample. Such a step has one query token per row and replays
    the forward graph, but its logits rows are not its rows, so it samples outside the sampling graphs;
    the tokens are the engine's without graphs."""
    regex = StructuredOutputsParams(regex=REGEX) if constrained else None
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True, structured_outputs=regex)
        for i in range(6)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] + " again" * i for i in range(6)]
    tokens = {}
    for with_graphs in (False, True):
        llm = LLM(tiny_qwen3, device="cpu", max_num_seqs=4, max_num_batched_tokens=4)
        try:
            if with_graphs:
                _with_eager_graphs(llm)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[with_graphs] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.close()
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_sampling_feature_through_the_graph_paths_matches_the_engine_without_graphs(
    tiny_qwen3, async_scheduling
):
    """Filters, penalties, logprobs, min_tokens, n > 1, prefix hits and preemption (a pool of 12 blocks
    for 6 requests) through the forward graphs (the general sampler after them) and the sampling
    graphs: the tokens and logprobs of the engine without graphs."""
    shared = "the same long prefix of the prompt, repeated for the prefix cache " * 2
    params = [
        SamplingParams(temperature=0.7, top_p=0.8, seed=1, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.6, repetition_penalty=1.3, presence_penalty=0.5, seed=3, max_tokens=20),
        SamplingParams(temperature=0.0, logprobs=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=16, min_tokens=8),
        SamplingParams(temperature=0.8, seed=6, max_tokens=24, ignore_eos=True),
    ]
    prompts = [shared + p for p in ("one", "two", "three", "four", "five", "six")]
    results = {}
    for with_graphs in (False, True):
        llm = LLM(
            tiny_qwen3,
            device="cpu",
            async_scheduling=async_scheduling,
            max_num_seqs=8,
            num_kvcache_blocks=12,
            enable_prefix_caching=True,
        )
        try:
            if with_graphs:
                _with_eager_graphs(llm)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results[with_graphs] = [[(c.token_ids, c.logprobs or []) for c in o.outputs] for o in outputs]
            stats = llm.llm_engine.stats()
            assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
            if with_graphs:
                assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
        finally:
            llm.close()
    # A graph runs its padded batch size of rows, so the CPU's matrix products may round the logits
    # differently in the last bits: the tokens are identical, the logprobs equal to float32 rounding.
    for graphed, eager in zip(results[True], results[False], strict=True):
        for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(graphed, eager, strict=True):
            assert tokens == eager_tokens
            assert len(logprobs) == len(eager_logprobs)
            for position, eager_position in zip(logprobs, eager_logprobs, strict=True):
                assert position.keys() == eager_position.keys()
                for token_id, entry in position.items():
                    assert entry.rank == eager_position[token_id].rank
                    assert entry.logprob == pytest.approx(eager_position[token_id].logprob, abs=1e-5)
