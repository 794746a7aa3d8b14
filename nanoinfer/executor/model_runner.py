"""Runs batches on the device: builds the model, owns the KV cache pool, prepares the per-batch
attention metadata, replays CUDA graphs for decode and samples."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from nanoinfer.config import EngineConfig
from nanoinfer.distributed import (
    all_reduce_min,
    connect_store,
    destroy_process_group,
    init_process_group,
    tensor_parallel_scope,
)
from nanoinfer.executor.batch import ModelInput, SamplerOutput, ScheduledRow, StepInputs
from nanoinfer.executor.tp_worker import TensorParallelWorkers
from nanoinfer.layers.attention import AttentionMetadata, create_attention_backend
from nanoinfer.layers.fused import use_compiled_ops
from nanoinfer.layers.sampler import Sampler
from nanoinfer.models.checkpoint import load_weights
from nanoinfer.models.decoder import DecoderForCausalLM
from nanoinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then steps of 16, up to max_num_seqs."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b < cap] + list(range(16, cap + 1, 16))
    if not sizes or sizes[-1] < cap:
        sizes.append(cap)
    return sizes


def prepare_step(batch: ModelInput, block_size: int) -> StepInputs:
    """The step's inputs as host arrays (also what the tensor-parallel workers are sent)."""
    rows = batch.rows
    q_lens = [len(r.token_ids) for r in rows]
    seq_lens = [r.start_pos + n for r, n in zip(rows, q_lens, strict=True)]
    tables = [r.block_table for r in rows]
    if batch.is_prefill:
        input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int64)
        per_row = [np.arange(r.start_pos, n, dtype=np.int64) for r, n in zip(rows, seq_lens, strict=True)]
        positions = np.concatenate(per_row)
        slots = [
            np.asarray(table)[pos // block_size] * block_size + pos % block_size
            if table
            else np.full(len(pos), -1)  # warm-up rows: no cache yet
            for pos, table in zip(per_row, tables, strict=True)
        ]
        slot_mapping = np.concatenate(slots).astype(np.int64, copy=False)
    else:
        # One token per row, at position seq_len - 1. Plain Python beats per-row numpy here.
        input_ids = np.fromiter((r.token_ids[0] for r in rows), np.int64, count=len(rows))
        positions = np.asarray(seq_lens, dtype=np.int64) - 1
        slot_list = [
            table[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for table, n in zip(tables, seq_lens, strict=True)
        ]
        slot_mapping = np.asarray(slot_list, dtype=np.int64)
    block_tables = np.zeros((len(rows), max(1, max(len(t) for t in tables))), dtype=np.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = table
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    sample_rows = [i for i, r in enumerate(rows) if r.sample]
    prompt_jobs = [(i, len(r.prompt_logprob_targets)) for i, r in enumerate(rows) if r.prompt_logprob_targets]
    prompt_logprob_token_index = None
    if prompt_jobs:
        # Each such row's first len(prompt_logprob_targets) tokens, rows in order.
        prompt_logprob_token_index = np.concatenate(
            [query_start_loc[i] + np.arange(count, dtype=np.int64) for i, count in prompt_jobs]
        )
    return StepInputs(
        is_prefill=batch.is_prefill,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=np.asarray(seq_lens, dtype=np.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        sample_token_index=query_start_loc[1:][sample_rows].astype(np.int64) - 1,
        prompt_logprob_token_index=prompt_logprob_token_index,
    )


class ModelRunner:
    """One tensor-parallel rank's model, KV pool and CUDA graphs.

    Rank 0 is built by the engine; with ``tensor_parallel_size > 1`` it starts ranks 1..N-1 itself (see
    :mod:`nanoinfer.executor.tp_worker`), hands them every batch at the start of :meth:`execute`, and
    stops them in :meth:`close`. Workers are built with their ``rank`` and rank 0's ``store_port``.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, store_port: int | None = None):
        self.config = config
        self.rank = rank
        self.tp_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = config.torch_dtype
        self.workers = None  # rank 0's handle on the other ranks
        self.owns_process_group = False  # a worker's own process group
        self.model = None
        self.kv_cache = None
        self.attention_layers = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._start_tensor_parallel(store_port)
            self._build()
        except BaseException:
            # Leaves no worker process or process group behind; the workers are stopped at once (a
            # graceful stop would wait for workers that are stuck in a collective with this rank).
            if self.workers is not None:
                self.workers.stop(graceful=False)
                self.workers = None
            self.close()
            raise

    def _start_tensor_parallel(self, store_port: int | None) -> None:
        if self.tp_size == 1:
            return
        if self.rank == 0:
            if self.device.type == "cuda" and torch.cuda.device_count() < self.tp_size:
                raise ValueError(
                    f"tensor_parallel_size={self.tp_size} needs one GPU per rank, but "
                    f"{torch.cuda.device_count()} are visible"
                )
            self.workers = TensorParallelWorkers(self.config)
            # The workers attach to the channel as soon as they have started: a worker that fails to
            # start is reported here rather than after the rendezvous's timeout.
            self.workers.wait_ready()
            self.workers.init_process_group(self.device)
        else:
            init_process_group(connect_store(store_port, self.tp_size), self.rank, self.tp_size, self.device)
            self.owns_process_group = True

    def _build(self) -> None:
        config = self.config
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device, tensor_parallel_scope(self.rank, self.tp_size):
                self.model = DecoderForCausalLM(config.hf_config, max_position=config.max_model_len)
        finally:
            torch.set_default_dtype(previous_dtype)
        load_weights(self.model, config.model, self.dtype)
        self.model.eval()
        backend = create_attention_backend(config.attention_backend)
        self.attention_layers = self.model.attention_layers()
        for layer in self.attention_layers:
            layer.backend = backend
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)

        # Compiled fused ops go with CUDA graphs: enforce_eager turns both off (as in vLLM).
        self.compiled_ops = self.device.type == "cuda" and not config.enforce_eager
        if self.compiled_ops:
            use_compiled_ops(self.model)

        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim  # this rank's share
        if self.device.type == "cuda":
            self._warmup()
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self._allocate_kv_cache()
        # Every rank captures the same graphs, so collectives inside them pair up on replay.
        if self.device.type == "cuda" and not config.enforce_eager and backend.name == "triton":
            self._capture_cuda_graphs()

    def close(self) -> None:
        """Drops the graphs, stops the tensor-parallel workers (rank 0), leaves the process group, and
        drops the KV pool and the model so their device memory can be reused. Idempotent."""
        # Normally the graphs go first: they hold the communicator's captured collectives, and none may
        # be running as it is freed. After a worker's death the work waiting for it may never finish, so
        # nothing waits for it: the workers are stopped first (with a bounded abort under NCCL).
        if self.workers is not None and not self.workers.healthy:
            self.workers.stop()
            self.workers = None
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        if self.owns_process_group:
            self.owns_process_group = False
            destroy_process_group()
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = None
        self.model = None

    # -- memory ----------------------------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        num_layers = len(self.attention_layers)
        return 2 * num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @torch.inference_mode()
    def _warmup(self) -> None:
        """A worst-case prefill before the KV pool exists, so that the peak activation memory is known."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        # Rows without a block table: their K/V is not written (there is no cache yet).
        params = SamplingParams()
        rows = [ScheduledRow([0] * seq_len, 0, [], True, params) for _ in range(num_seqs)]
        step = prepare_step(ModelInput(True, rows), self.block_size)
        hidden = self._forward(step)
        logits = self.model.compute_logits(hidden[self._to_device(step.sample_token_index)])
        if logits is not None:  # None on tensor-parallel workers: rank 0 samples
            self.sampler.sample_tokens(logits, torch.ones(num_seqs, device=self.device), self.generator)
        torch.cuda.synchronize()

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
        num_layers = len(self.attention_layers)
        shape = (2, num_layers, self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # -- batch preparation -----------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model's hidden states for every token of the step (a decode step replays a CUDA graph)."""
        to_device = self._to_device
        input_ids, positions = to_device(step.input_ids), to_device(step.positions)
        meta = AttentionMetadata(
            is_prefill=step.is_prefill,
            slot_mapping=to_device(step.slot_mapping),
            query_start_loc=to_device(step.query_start_loc),
            seq_lens=to_device(step.seq_lens),
            block_tables=to_device(step.block_tables),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        num_rows = len(step.seq_lens)
        graph_bs = None if step.is_prefill else next((b for b in self.graphs if b >= num_rows), None)
        if graph_bs is not None:
            return self._replay_graph(graph_bs, input_ids, positions, meta)
        return self.model(input_ids, positions, meta)

    # -- execution -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> SamplerOutput:
        """Runs one batch on rank 0; returns one sampled token per row with ``sample`` set, in row order.
        The tensor-parallel workers are handed the step's inputs first (see :meth:`execute_step`)."""
        step = prepare_step(batch, self.block_size)
        if self.workers is None:
            return self._run(step, batch.rows)
        with self.workers.running_step():
            self.workers.send(step)
            return self._run(step, batch.rows)

    @torch.inference_mode()
    def execute_step(self, step: StepInputs) -> None:
        """A tensor-parallel worker's step: the same forward pass and logits as rank 0 (their collectives
        pair up), no sampling."""
        self._run(step, None)

    def _run(self, step: StepInputs, rows: list[ScheduledRow] | None) -> SamplerOutput | None:
        # Every copy to the device before the forward pass: a copy from pageable host memory first waits
        # for the stream, which under tensor parallelism holds collectives that a dead rank never ends.
        prompt_index = sample_index = None
        if step.prompt_logprob_token_index is not None:
            prompt_index = self._to_device(step.prompt_logprob_token_index)
        if len(step.sample_token_index):
            sample_index = self._to_device(step.sample_token_index)
        hidden = self._forward(step)
        # Logits (of prompt positions, then of sampled rows) are collectives under tensor parallelism:
        # every rank computes them; they are None on the workers.
        prompt_logprobs = None
        if prompt_index is not None:
            prompt_logprobs = self.sampler.prompt_logprobs(hidden, prompt_index, self._compute_logits, rows)
        logits = None
        if sample_index is not None:
            logits = self._compute_logits(hidden[sample_index])
        if rows is None:
            return None
        return self.sampler.sample_isolating_faults(
            logits, [r for r in rows if r.sample], self.generator, prompt_logprobs
        )

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.model.compute_logits(hidden)
        if self.workers is not None and self.device.type == "cuda":
            # The sampler reads the logits back, which blocks in CUDA until every collective before
            # them has finished: a dead worker must raise an error instead.
            event = torch.cuda.Event()
            event.record()
            self.workers.wait_for_device(event)
        return logits

    # -- CUDA graphs -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        cfg = self.config
        sizes = cuda_graph_batch_sizes(cfg.max_num_seqs)
        max_bs = sizes[-1]
        dev = self.device
        hidden_size = cfg.hf_config.hidden_size
        self.graph_inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            # One column beyond max_model_len's blocks: decode can need a block a prompt-sized table lacks.
            "block_tables": torch.zeros(max_bs, cfg.max_blocks_per_seq + 1, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "hidden": torch.zeros(max_bs, hidden_size, dtype=self.dtype, device=dev),
        }
        pool = None
        g = self.graph_inputs
        for bs in reversed(sizes):  # largest first so smaller graphs fit in its memory pool
            graph = torch.cuda.CUDAGraph()
            meta = self._graph_metadata(bs)
            # One eager run first: lazy initialisation (kernel compilation) must not be captured.
            g["hidden"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool):
                g["hidden"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        self.graphs = dict(sorted(self.graphs.items()))

    def _graph_metadata(self, bs: int) -> AttentionMetadata:
        g = self.graph_inputs
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=g["slot_mapping"][:bs],
            query_start_loc=g["query_start_loc"][: bs + 1],
            seq_lens=g["seq_lens"][:bs],
            block_tables=g["block_tables"][:bs],
            max_query_len=1,
            max_seq_len=self.config.max_model_len,
        )

    def _replay_graph(self, graph_bs, input_ids, positions, meta) -> torch.Tensor:
        g = self.graph_inputs
        n = input_ids.size(0)
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(-1)
        g["slot_mapping"][:n] = meta.slot_mapping
        g["seq_lens"].zero_()
        g["seq_lens"][:n] = meta.seq_lens
        width = meta.block_tables.size(1)
        g["block_tables"][:n, :width] = meta.block_tables
        self.graphs[graph_bs].replay()
        return g["hidden"][:n]
