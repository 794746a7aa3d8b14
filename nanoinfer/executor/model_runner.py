"""Runs steps on the device: builds the model, owns the KV cache pool and the persistent batch, turns a
SchedulerOutput into device inputs, runs the forward pass (a CUDA graph for pure-decode steps), and
samples. Knows nothing of worker processes: under tensor parallelism, rank 0's executor hands the same
StepInputs to every rank (see :mod:`nanoinfer.executor.tp`).

A step is launched without waiting for the device (:meth:`ModelRunner.execute` returns a
:class:`StepHandle`); its sampled tokens stay on the device, where the next step takes its pending
inputs from them, and reach the host when :meth:`StepHandle.result` is called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanoinfer.config import EngineConfig
from nanoinfer.distributed import all_reduce_min, broadcast_from_rank0, tensor_parallel_scope
from nanoinfer.engine.scheduler import RunnerOutput, SchedulerOutput
from nanoinfer.engine.structured_outputs import GrammarBitmask
from nanoinfer.executor.cuda_graphs import (
    CudaGraphs,
    PiecewiseGraphs,
    StepBuffers,
    cuda_graph_batch_sizes,
    piecewise_token_buckets,
)
from nanoinfer.executor.input_batch import InputBatch, StepInputs, StepPlan
from nanoinfer.executor.pinned import PinnedRing
from nanoinfer.kernels.attention_ref import FP8_DTYPE, FP8_MAX
from nanoinfer.kernels.step_inputs_ref import unpack_step_inputs_ref
from nanoinfer.layers.attention import AttentionMetadata, create_attention_backend
from nanoinfer.layers.kernels import triton_kernels, use_kernels
from nanoinfer.models.checkpoint import load_weights
from nanoinfer.models.decoder import DecoderForCausalLM
from nanoinfer.sample.logprobs import LogprobsTensors, TokenLogprobs
from nanoinfer.sample.metadata import SamplingMetadata
from nanoinfer.sample.sampler import Sampler, SamplerOutput, prompt_logprobs
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured.bitmask_ref import apply_token_bitmask_ref

logger = logging.getLogger(__name__)

# The calibration prompts are random; real text may reach larger K/V values than they did.
KV_SCALE_HEADROOM = 2.0
_MIN_KV_SCALE = 1e-6

# Waits until a CUDA event has completed (tensor parallelism replaces it with one that watches workers).
DeviceWait = Callable[[torch.cuda.Event], None]


# The parts of a step's packed inputs that the step reads after they are unpacked (``ModelRunner._pack``).
_STAGED = frozenset(
    (
        "pending_index",
        "pending_source",
        "logits_index",
        "prompt_logprob_index",
        "sample_slots",
        "sample_offsets",
        "prefill_query_start_loc",
    )
)


class StepHandle:
    """A launched step. :meth:`result` waits for its sampled tokens and returns them row for row."""

    def __init__(self, out: SchedulerOutput, plan: StepPlan):
        self.out = out
        self.plan = plan
        self._tokens: torch.Tensor | None = None  # [sampled rows], on the host (pinned) or CPU
        self._event: torch.cuda.Event | None = None  # after which _tokens is filled
        self._wait: DeviceWait | None = None
        # A step whose sampling waits for a grammar bitmask: its logits (None where the masked sampling
        # graph computes them) and sampling inputs, and the batch size of that graph (None: it samples
        # eagerly).
        self.deferred: tuple[torch.Tensor | None, SamplingMetadata] | None = None
        self.deferred_graph_bs: int | None = None
        self.logprobs: LogprobsTensors | None = None
        self.logprob_rows: list[int] = []  # logits rows the logprobs belong to
        self.prompt_logprobs: TokenLogprobs | None = None
        self.failed_rows: dict[int, str] = {}  # logits row -> error

    def wait(self) -> None:
        """Waits until the step's sampled tokens are on the host: every device operation launched before
        them is done too (a grammar bitmask's copy among them)."""
        if self.deferred is not None:
            raise RuntimeError("the step's sampling was deferred and never launched (ModelRunner.sample)")
        if self._wait is not None:
            self._wait(self._event)
            self._wait = None  # waited: later calls return at once

    def result(self) -> RunnerOutput:
        self.wait()
        plan = self.plan
        token_ids = [-1] * len(self.out.scheduled)
        if self._tokens is not None:
            for index, token in zip(plan.sample_rows, self._tokens.tolist(), strict=True):
                token_ids[index] = token
        result = RunnerOutput(token_ids)
        if self.logprobs is not None:
            lists = self.logprobs.to_lists()
            for position, row in enumerate(self.logprob_rows):
                result.logprobs[plan.sample_rows[row]] = lists.slice(position, position + 1)
        if self.prompt_logprobs is not None:
            start = 0
            for index, count in plan.prompt_logprob_rows:
                result.prompt_logprobs[index] = self.prompt_logprobs.slice(start, start + count)
                start += count
        result.failed_rows = {plan.sample_rows[row]: error for row, error in self.failed_rows.items()}
        return result


@dataclass
class StagedInputs:
    """A step's inputs already in the persistent device buffers (all but its pending input tokens), and
    the run :meth:`ModelRunner._route` chose for it."""

    graph_bs: int | None
    bucket: int | None
    views: dict[str, torch.Tensor]  # the device views of the step's index arrays (``_load_inputs``)


class ModelRunner:
    """One tensor-parallel rank's model, KV pool, persistent batch and CUDA graphs."""

    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.tp_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = config.torch_dtype
        # How rank 0 waits for its device work; a tensor-parallel executor watches its workers meanwhile.
        self.device_wait: DeviceWait = torch.cuda.Event.synchronize
        self.model = None
        self.kv_cache = None
        self.attention_layers = []
        self.graphs: CudaGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config = self.config
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device, tensor_parallel_scope(self.rank, self.tp_size):
                self.model = DecoderForCausalLM(config.hf_config, max_position=config.max_model_len)
        finally:
            torch.set_default_dtype(previous_dtype)
        checkpoint_kv_scales = load_weights(self.model, config.model, self.dtype)
        self.model.eval()
        backend = create_attention_backend(config.attention_backend)
        self.attention_layers = self.model.attention_layers()
        for layer in self.attention_layers:
            layer.backend = backend
        # The fused elementwise kernels go with the attention backend: Triton's on CUDA.
        self._unpack_step_inputs = unpack_step_inputs_ref
        if backend.name == "triton":
            use_kernels(self.model, triton_kernels())
            from nanoinfer.kernels.triton_step_inputs import unpack_step_inputs

            self._unpack_step_inputs = unpack_step_inputs
        self.sampler = Sampler()

        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim  # this rank's share
        self.kv_dtype = config.kv_cache_torch_dtype
        if self.device.type == "cuda":
            self._profile_peak_memory()
        if self.kv_dtype == FP8_DTYPE:
            self._set_kv_scales(checkpoint_kv_scales)
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self._allocate_kv_cache()
        self.input_batch = InputBatch(
            config.max_num_seqs, config.max_blocks_per_seq, self.block_size, self.device
        )
        # Sampled tokens on their way to the host; a handle reads its buffer before the ring comes round.
        self.pinned_outputs = PinnedRing(self.device, num_buffers=8)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and backend.name == "triton"
        graph_sizes = cuda_graph_batch_sizes(config.max_num_seqs) if use_graphs else []
        max_rows = max([config.max_num_seqs, *graph_sizes])
        max_tokens = max(config.max_num_batched_tokens, max_rows)
        width = self.input_batch.block_table.shape[1]
        self.buffers = StepBuffers.allocate(max_tokens, max_rows, width, self.device)
        if backend.name == "triton":
            backend.decode_workspace = backend.kernels.DecodeWorkspace.allocate(
                max_rows,
                first.num_heads,
                self.num_kv_heads,
                self.head_dim,
                width * self.block_size,
                self.device,
                cache_dtype=self.kv_dtype,
            )
        if self.device.type == "cuda":
            self._warm_up_kernels()
        # Every rank captures the same graphs, so collectives inside them pair up on replay.
        if use_graphs:
            # Sampling inside the graphs only without tensor parallelism: a worker would have to know
            # which of the two graphs rank 0 replays, so that their collectives pair up.
            sampling = self.input_batch.step_sampling if self.tp_size == 1 else None
            self.graphs = CudaGraphs(
                self.model, self.buffers, config.hf_config.hidden_size, self.dtype, sampling
            )
            self.graphs.capture(graph_sizes, config.max_model_len)
            self.piecewise = PiecewiseGraphs(
                self.model, self.buffers, self.attention_layers, first.num_heads, self.head_dim, self.dtype
            )
            self.piecewise.capture(piecewise_token_buckets(config.max_num_batched_tokens))

    def close(self) -> None:
        """Drops the graphs, the KV pool and the model so their device memory can be reused. Idempotent."""
        if self.graphs is not None:
            self.graphs.clear()
            self.graphs = None
        if self.piecewise is not None:
            self.piecewise.clear()
            self.piecewise = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = None
        self.model = None

    # -- memory ----------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        num_layers = len(self.attention_layers)
        return 2 * num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def _set_kv_scales(self, checkpoint_scales: dict[tuple[int, str], float]) -> None:
        """Per layer, the K and V scales of the FP8 cache: the checkpoint's where it has them, else
        measured by one calibration pass (random prompts, before the cache exists): the largest |k| and
        |v| a layer stores, with headroom, mapped to e4m3's largest value. Values past it are clamped."""
        num_layers = len(self.attention_layers)
        if all((i, kind) in checkpoint_scales for i in range(num_layers) for kind in "kv"):
            scales = [(checkpoint_scales[(i, "k")], checkpoint_scales[(i, "v")]) for i in range(num_layers)]
            source = "the checkpoint"
        else:
            scales = self._calibrate_kv_scales()
            source = f"a calibration pass (headroom {KV_SCALE_HEADROOM}x)"
        for layer, (k_scale, v_scale) in zip(self.attention_layers, scales, strict=True):
            layer.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=self.device)
            layer.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=self.device)
        logger.info(
            "FP8 KV cache: per-layer scales from %s; k in [%.3g, %.3g], v in [%.3g, %.3g]",
            source,
            min(k for k, _ in scales),
            max(k for k, _ in scales),
            min(v for _, v in scales),
            max(v for _, v in scales),
        )

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.seed)
        num_tokens = min(cfg.max_model_len, cfg.max_num_batched_tokens, 2048)
        vocab = cfg.hf_config.vocab_size
        input_ids = torch.randint(0, vocab, (num_tokens,), generator=generator).to(self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            num_decode_rows=0,
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        for layer in self.attention_layers:
            layer.kv_amax = []
        try:
            self.model(input_ids, positions, meta)
            amax = [
                (layer.kv_amax[0][0].item(), layer.kv_amax[0][1].item()) for layer in self.attention_layers
            ]
        finally:
            for layer in self.attention_layers:
                layer.kv_amax = None
        # Under tensor parallelism each rank measures, and keeps scales for, its own heads.
        return [
            (
                max(k * KV_SCALE_HEADROOM / FP8_MAX, _MIN_KV_SCALE),
                max(v * KV_SCALE_HEADROOM / FP8_MAX, _MIN_KV_SCALE),
            )
            for k, v in amax
        ]

    @torch.inference_mode()
    def _profile_peak_memory(self) -> None:
        """A worst-case prefill before the KV pool exists, so that the peak activation memory is known."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        num_tokens = seq_len * num_seqs
        device = self.device
        # K/V is not written: there is no cache yet (attention runs over the batch's own tokens).
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(0, num_tokens + 1, seq_len, dtype=torch.int32, device=device),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=device),
            num_decode_rows=0,
            max_query_len=seq_len,
            max_seq_len=seq_len,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(seq_len, device=device).repeat(num_seqs)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[seq_len - 1 :: seq_len])
        if logits is not None:  # None on tensor-parallel workers: rank 0 samples
            logits.float().log_softmax(dim=-1)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Runs every kernel variant a workload can meet once, before any request: Triton compiles a
        kernel per combination of its compile-time choices (tile sizes by query length, heads per
        program by token count, sampler chunks by batch size), and one met for the first time in the
        middle of a run costs up to a second there. Writes no K/V (every slot is -1)."""
        cfg = self.config
        device = self.device
        max_tokens = cfg.max_num_batched_tokens
        token_counts = sorted(
            {n for n in (1, 8, 16, 17, 64, 256, 1024, 4096) if n <= max_tokens} | {max_tokens}
        )
        for num_tokens in token_counts:
            # One prompt chunk after a cached prefix, beside one decode row: both attention kernels.
            for num_decode in (0, 1):
                self._dummy_step(num_tokens, num_decode)
        # Many decode rows beside a prompt: the decode kernel without splits (a full grid).
        self._dummy_step(cfg.max_num_seqs + 32, cfg.max_num_seqs)
        self.input_batch.warm_up()
        hidden = torch.zeros(1, cfg.hf_config.hidden_size, dtype=self.dtype, device=device)
        sampler_batches = {1, 4, 16, 64, cfg.max_num_seqs}
        # The vocabulary projection runs outside the graphs at the step's exact row count; cuBLAS picks
        # its kernel by shape and loads a kernel on its first use, mid-run (the suspected cause of 8 ms
        # stalls at 17 row counts of the benchmark's ramp-down on the H200), so every count runs once.
        for batch in range(1, cfg.max_num_seqs + 1):
            # A collective under tensor parallelism (every rank joins); None on the workers.
            logits = self.model.compute_logits(hidden.expand(batch, -1).contiguous())
            if logits is None or batch not in sampler_batches:
                continue
            params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)] * batch
            metadata = SamplingMetadata.from_params(params[:batch], list(range(batch)), [0] * batch, device)
            self.sampler(logits, metadata)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def _dummy_step(self, num_tokens: int, num_decode: int) -> None:
        """An eager step of ``num_tokens`` tokens: ``num_decode`` one-token rows, then prompt chunks after
        a one-block cached prefix, each within the context length."""
        device = self.device
        prefix = self.block_size
        longest = max(self.config.max_model_len - prefix, 1)
        num_prefill = max(num_tokens - num_decode, 1)
        q_lens = [1] * num_decode + [min(longest, num_prefill - i) for i in range(0, num_prefill, longest)]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        width = self.input_batch.block_table.shape[1]
        meta = AttentionMetadata(
            slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc.to(device),
            seq_lens=torch.tensor([prefix + n for n in q_lens], dtype=torch.int32, device=device),
            block_tables=torch.zeros(len(q_lens), width, dtype=torch.int32, device=device),
            num_decode_rows=num_decode,
            max_query_len=max(q_lens),
            max_seq_len=prefix + max(q_lens),
        )
        if num_decode > 0:
            meta.prefill_query_start_loc = (query_start_loc[num_decode:] - num_decode).to(device)
        input_ids = torch.zeros(starts[-1], dtype=torch.int64, device=device)
        positions = torch.zeros(starts[-1], dtype=torch.int64, device=device)
        self.model(input_ids, positions, meta)

    def _decide_num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            return cfg.num_kvcache_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            stats = torch.cuda.memory_stats(self.device)
            # Driver-visible usage, plus the activation peak above what is allocated now.
            budget = (
                total * cfg.gpu_memory_utilization
                - (total - free)
                - stats["allocated_bytes.all.peak"]
                + stats["allocated_bytes.all.current"]
            )
        else:
            budget = cfg.cpu_kvcache_space_bytes
        # More blocks than every sequence could fill at full length are never used.
        useful = cfg.max_num_seqs * (cfg.max_blocks_per_seq + 1)
        num_blocks = min(int(budget) // self.kv_block_bytes, useful)
        if self.tp_size > 1:
            # Every rank must address the same pool: take the smallest (before the check, so that all
            # ranks raise together rather than one leaving the others in a collective).
            num_blocks = all_reduce_min(num_blocks, self.device)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (budget {int(budget)} bytes, one block needs "
                f"{self.kv_block_bytes}); raise gpu_memory_utilization / cpu_kvcache_space_bytes or "
                "lower max_num_batched_tokens"
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        """Each layer's K and V caches are [num_blocks, block_size, num_kv_heads, head_dim] views (every
        kernel takes their strides). An FP8 pool stores each kv head's slots of a block together
        ([block, head, slot, dim]): a decode program, which reads one kv head, then reads 2 KiB runs
        instead of 128-byte rows 1 KiB apart (H200, Qwen3-0.6B shape: FP8 decode attention 209.8 -> 197.6
        us at batch 256 x 1024, 66.1 -> 63.6 at 64 x 1024; bf16 unchanged at 252.0 / 250.9, so bf16
        keeps the token-major layout; docs/benchmarks.md, run 38)."""
        num_layers = len(self.attention_layers)
        head_major = self.kv_dtype == FP8_DTYPE
        slots = (self.num_kv_heads, self.block_size) if head_major else (self.block_size, self.num_kv_heads)
        shape = (2, num_layers, self.num_kv_blocks, *slots, self.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            k_cache, v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if head_major:
                k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
            layer.k_cache, layer.v_cache = k_cache, v_cache

    # -- a step ----------------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> tuple[StepInputs, StepPlan]:
        """Rank 0: the step's inputs (what every rank runs) and its row bookkeeping."""
        return self.input_batch.prepare(out)

    @torch.inference_mode()
    def stage(self, step: StepInputs, plan: StepPlan | None) -> StagedInputs:
        """Copies a step's inputs into the persistent device buffers, all but its pending input tokens
        (those are the sampled tokens of the step before it, gathered by :meth:`execute`). Done before
        that step's sampling is launched, it takes the copy off the path from one step's tokens to the
        next step's forward pass. Safe only while that sampling reads none of these buffers, as a
        deferred sampling does: its logits (or the forward graph's output) and its sampling inputs were
        made when its step was launched."""
        graph_bs, bucket = self._route(step)
        return StagedInputs(graph_bs, bucket, self._load_inputs(step, plan, graph_bs, bucket))

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        step: StepInputs,
        plan: StepPlan,
        defer_sampling: bool = False,
        staged_inputs: StagedInputs | None = None,
    ) -> StepHandle:
        """Rank 0: launches the step (forward, logits, sampling) and returns without waiting for it.
        ``defer_sampling``: stops after the logits; :meth:`sample` launches the rest. ``staged_inputs``:
        the step's :meth:`stage`, done earlier."""
        if staged_inputs is None:
            staged_inputs = self.stage(step, plan)
        graph_bs, bucket, staged = staged_inputs.graph_bs, staged_inputs.bucket, staged_inputs.views
        self._gather_pending_inputs(step, staged)
        handle = StepHandle(out, plan)
        batch = self.input_batch
        num_tokens = len(step.input_ids)
        # Every token samples (a pure-decode step): the logits rows are the hidden rows, in order.
        every_token_samples = len(step.logits_index) == num_tokens
        metadata = None
        if len(step.logits_index):
            input_ids = self.buffers.input_ids
            last_inputs = input_ids[:num_tokens] if every_token_samples else input_ids[staged["logits_index"]]
            metadata = batch.sampling_metadata(
                out, plan, last_inputs, staged["sample_slots"], staged["sample_offsets"]
            )
            # Known now, so that the next step can be prepared before this one's sampling is launched.
            scheduled = out.scheduled
            batch.previous_sample_row = {scheduled[i].request_id: j for j, i in enumerate(plan.sample_rows)}
        # The sampling graphs sample their rows in order: every row must sample (a one-token prompt
        # chunk that is not its prompt's last has one query token too, and samples nothing).
        samples_in_graph = (
            graph_bs is not None
            and every_token_samples
            and metadata is not None
            and metadata.temperature_only
        )
        if (
            samples_in_graph
            and self.graphs.sampling_graphs
            and not defer_sampling
            and step.prompt_logprob_index is None
        ):
            tokens = self.graphs.replay_and_sample(graph_bs)[:num_tokens]
            self._take_tokens(handle, SamplerOutput(tokens), {})
            return handle
        hidden = self._run_model(step, staged, graph_bs, bucket)
        if step.prompt_logprob_index is not None:
            targets, num_top = self._prompt_logprob_targets(out, plan)
            handle.prompt_logprobs = prompt_logprobs(
                hidden, staged["prompt_logprob_index"], targets, num_top, self._compute_logits
            )
        if metadata is None:
            return handle
        if defer_sampling and samples_in_graph and self.graphs.masked_sampling_graphs:
            # The masked sampling graph computes the logits from the forward graph's output, which
            # nothing replaces before the sampling is launched.
            handle.deferred = (None, metadata)
            handle.deferred_graph_bs = graph_bs
            return handle
        logits = self._compute_logits(hidden if every_token_samples else hidden[staged["logits_index"]])
        if defer_sampling:
            handle.deferred = (logits, metadata)
        else:
            self._sample(handle, logits, metadata)
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle, bitmask: GrammarBitmask | None) -> None:
        """Rank 0: launches the sampling of a step executed with ``defer_sampling``; the disallowed
        tokens of the bitmask's rows get -inf first. Other rows are untouched."""
        if handle.deferred is None:
            raise RuntimeError("sample() needs a step executed with defer_sampling=True")
        (logits, metadata), handle.deferred = handle.deferred, None
        graph_bs, handle.deferred_graph_bs = handle.deferred_graph_bs, None
        if bitmask is not None:
            # Its buffer is refilled only once this step's tokens are on the host (the copy to the device
            # comes before them).
            bitmask.read_by = handle
        if graph_bs is not None:
            self._sample_in_graph(handle, graph_bs, bitmask)
            return
        if bitmask is not None and bitmask.rows:
            rows = self._logits_rows(handle, bitmask)
            masks = bitmask.upload(self.device)
            if logits.device.type == "cuda":
                from nanoinfer.structured.triton_bitmask import apply_token_bitmask

                apply_token_bitmask(logits, masks, self._to_device(rows))
            else:
                apply_token_bitmask_ref(logits, masks, rows.tolist())
        self._sample(handle, logits, metadata)

    def _sample_in_graph(self, handle: StepHandle, graph_bs: int, bitmask: GrammarBitmask | None) -> None:
        """A deferred pure-decode step of temperature-only rows: its hidden states are in the forward
        graph's output, its bitmask goes to the graphs' mask buffer, one replay computes the logits and
        samples."""
        graphs = self.graphs
        if bitmask is not None and bitmask.rows:
            bitmask.upload(self.device, out=graphs.mask)
            num_rows = len(bitmask.rows)
            if handle.plan.sample_rows[:num_rows] == bitmask.rows:
                # Bitmask row i is logits row i (a batch of constrained requests alone): no row list.
                graphs.load_mask(num_rows, None)
            else:
                graphs.load_mask(num_rows, self._to_device(self._logits_rows(handle, bitmask)))
        else:
            graphs.load_mask(0, None)
        tokens = graphs.replay_masked_sampling(graph_bs)[: len(handle.plan.sample_rows)]
        self._take_tokens(handle, SamplerOutput(tokens), {})

    @staticmethod
    def _logits_rows(handle: StepHandle, bitmask: GrammarBitmask) -> np.ndarray:
        """The logits row of each of the bitmask's rows."""
        logits_row = {index: j for j, index in enumerate(handle.plan.sample_rows)}
        return np.array([logits_row[index] for index in bitmask.rows], dtype=np.int64)

    def _sample(self, handle: StepHandle, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        self._take_tokens(handle, *self.sampler.sample_isolating_faults(logits, metadata))

    def _take_tokens(self, handle: StepHandle, sampled: SamplerOutput, failed: dict[int, str]) -> None:
        """The step's sampled tokens: the next step's inputs, and on their way to the host."""
        batch = self.input_batch
        # A failed row's token (-1) must not become the next step's input, which it still is (its
        # request ends only when this step's result is read).
        batch.previous_sampled = sampled.token_ids.clamp_min(0) if failed else sampled.token_ids
        handle._tokens, handle._event = self.pinned_outputs.to_host(sampled.token_ids)
        handle._wait = self.device_wait if handle._event is not None else None
        handle.failed_rows = failed
        if sampled.logprobs is not None:
            handle.logprobs = sampled.logprobs
            handle.logprob_rows = sampled.logprob_rows

    @torch.inference_mode()
    def execute_worker_step(self, step: StepInputs) -> None:
        """A tensor-parallel worker's step: the same forward pass and logits as rank 0 (their collectives
        pair up), no sampling."""
        staged_inputs = self.stage(step, None)
        staged = staged_inputs.views
        self._gather_pending_inputs(step, staged)
        hidden = self._run_model(step, staged, staged_inputs.graph_bs, staged_inputs.bucket)
        if step.prompt_logprob_index is not None:
            prompt_logprobs(hidden, staged["prompt_logprob_index"], [], [], self._compute_logits)
        if len(step.logits_index):
            self._compute_logits(hidden[staged["logits_index"]])

    def _prompt_logprob_targets(self, out: SchedulerOutput, plan: StepPlan) -> tuple[list[int], list[int]]:
        batch = self.input_batch
        targets: list[int] = []
        num_top: list[int] = []
        for index, count in plan.prompt_logprob_rows:
            row = out.scheduled[index]
            targets += row.prompt_logprob_targets
            num_top += [int(batch.num_prompt_logprobs[batch.slot_of[row.request_id]])] * count
        return targets, num_top

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return self.input_batch.to_device(array)

    def _route(self, step: StepInputs) -> tuple[int | None, int | None]:
        """The decode graph the step replays (a pure-decode step), else the piecewise graphs' token
        bucket it runs in; (None, None): eager."""
        num_rows = len(step.seq_lens)
        if self.graphs is not None and step.num_decode_rows == num_rows:
            graph_bs = self.graphs.batch_size_for(num_rows)
            if graph_bs is not None:
                return graph_bs, None
        if self.piecewise is not None:
            return None, self.piecewise.bucket_for(len(step.input_ids))
        return None, None

    def _load_inputs(
        self, step: StepInputs, plan: StepPlan | None, graph_bs: int | None, bucket: int | None
    ) -> dict:
        """Fills the persistent step buffers (block-table rows included, pending input tokens not: see
        :meth:`_gather_pending_inputs`) for the run that :meth:`_route` chose (padded to its graph's
        rows or bucket's tokens); returns the device views of the step's index arrays (with ``plan``,
        rank 0's sampling rows too)."""
        num_tokens, num_rows = len(step.input_ids), len(step.seq_lens)
        packed, parts = self._pack(step, graph_bs or bucket or num_tokens, graph_bs or num_rows, plan)
        self._unpack_step_inputs(packed, parts, num_rows, self.buffers, self.input_batch.block_table)
        staged = {name: packed[at : at + size] for name, (at, size) in parts.items() if name in _STAGED}
        if "prefill_query_start_loc" in staged:
            staged["prefill_query_start_loc"] = staged["prefill_query_start_loc"].to(torch.int32)
        return staged

    def _gather_pending_inputs(self, step: StepInputs, staging: dict) -> None:
        """The step's input tokens that the previous step sampled, from where its sampling left them
        (rank 0), to every rank."""
        if not len(step.pending_index):
            return
        b = self.buffers
        if self.rank == 0:
            sampled = self.input_batch.previous_sampled
            b.input_ids[staging["pending_index"]] = sampled[staging["pending_source"]]
        if self.tp_size > 1:
            broadcast_from_rank0(b.input_ids[: len(step.input_ids)])

    def _run_model(
        self, step: StepInputs, staging: dict, graph_bs: int | None, bucket: int | None
    ) -> torch.Tensor:
        """The model's hidden states for every token of the step (a pure-decode step replays a graph)."""
        b = self.buffers
        num_tokens, num_rows = len(step.input_ids), len(step.seq_lens)
        if graph_bs is not None:
            return self.graphs.replay(graph_bs)[:num_rows]
        num_decode = step.num_decode_rows
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:num_tokens],
            query_start_loc=b.query_start_loc[: num_rows + 1],
            seq_lens=b.seq_lens[:num_rows],
            block_tables=b.block_tables[:num_rows],
            num_decode_rows=num_decode,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        if 0 < num_decode < num_rows:
            meta.prefill_query_start_loc = staging["prefill_query_start_loc"]
        if bucket is not None:
            return self.piecewise.run(bucket, meta, num_tokens)
        return self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], meta)

    def _pack(
        self, step: StepInputs, padded_tokens: int, padded_rows: int, plan: StepPlan | None
    ) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
        """The step's host arrays as one int64 array on the device (one host-to-device copy; with ``plan``
        it also carries rank 0's sampling rows' slots and noise offsets) and where each lies in it, as
        (start, size); graph padding rows write nothing and have no context."""
        num_tokens, num_rows = len(step.input_ids), len(step.seq_lens)
        num_decode = step.num_decode_rows
        parts = {
            "input_ids": (step.input_ids, padded_tokens, 0),
            "positions": (step.positions, padded_tokens, 0),
            "slot_mapping": (step.slot_mapping, padded_tokens, -1),
            "query_start_loc": (step.query_start_loc, padded_rows + 1, num_tokens),
            "seq_lens": (step.seq_lens, padded_rows, 0),
            "row_slots": (step.row_slots, padded_rows, 0),
            "table_cols": (step.table_cols, len(step.table_cols), 0),
            "table_block_ids": (step.table_block_ids, len(step.table_block_ids), 0),
            "table_row_starts": (step.table_row_starts, len(step.table_row_starts), 0),
            "pending_index": (step.pending_index, len(step.pending_index), 0),
            "pending_source": (step.pending_source, len(step.pending_source), 0),
            "logits_index": (step.logits_index, len(step.logits_index), 0),
        }
        if step.prompt_logprob_index is not None:
            parts["prompt_logprob_index"] = (step.prompt_logprob_index, len(step.prompt_logprob_index), 0)
        if plan is not None:
            parts["sample_slots"] = (plan.sample_slots, len(plan.sample_slots), 0)
            parts["sample_offsets"] = (plan.sample_offsets, len(plan.sample_offsets), 0)
        if 0 < num_decode < num_rows:
            prefill_starts = step.query_start_loc[num_decode:] - num_decode
            parts["prefill_query_start_loc"] = (prefill_starts, len(prefill_starts), 0)
        total = sum(size for _, size, _ in parts.values())
        host_array = np.empty(total, dtype=np.int64)
        places = {}
        offset = 0
        for name, (array, size, pad) in parts.items():
            n = len(array)
            host_array[offset : offset + n] = array
            host_array[offset + n : offset + size] = pad
            places[name] = (offset, size)
            offset += size
        return self.input_batch.to_device(host_array), places

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.model.compute_logits(hidden)
        if self.tp_size > 1 and self.rank == 0 and self.device.type == "cuda":
            # The sampler may read device values back, which blocks in CUDA until every collective
            # before them has finished: a dead worker must raise an error instead.
            event = torch.cuda.Event()
            event.record()
            self.device_wait(event)
        return logits
