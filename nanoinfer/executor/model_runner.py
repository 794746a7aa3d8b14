"""Runs batches on the device: builds the model, owns the KV cache pool, prepares the per-batch
attention metadata, replays CUDA graphs for decode and samples."""

from __future__ import annotations

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
from nanoinfer.executor.batch import ModelInput, SamplerOutput
from nanoinfer.executor.tp_worker import TensorParallelWorkers, WorkerBatch, slim_model_input
from nanoinfer.layers.attention import AttentionMetadata, create_attention_backend
from nanoinfer.layers.fused import use_compiled_ops
from nanoinfer.layers.sampler import Sampler
from nanoinfer.models.checkpoint import load_weights
from nanoinfer.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then steps of 16, up to max_num_seqs."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b < cap] + list(range(16, cap + 1, 16))
    if not sizes or sizes[-1] < cap:
        sizes.append(cap)
    return sizes


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
        # The graphs first: they hold the communicator's captured collectives. None may be running as
        # it is freed (unless a rank has died: then work may never finish, and waiting would hang).
        if self.device.type == "cuda" and (self.workers is None or self.workers.healthy):
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
        rows = [[0] * seq_len for _ in range(num_seqs)]
        input_ids = torch.zeros(seq_len * num_seqs, dtype=torch.long, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        meta = self._metadata(True, [list(range(seq_len))] * num_seqs, [[]] * num_seqs, rows)
        hidden = self.model(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
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

    def _metadata(self, is_prefill, positions_per_row, block_tables, token_rows) -> AttentionMetadata:
        bs = self.block_size
        q_lens = [len(t) for t in token_rows]
        seq_lens = [p[-1] + 1 if p else 0 for p in positions_per_row]
        if not is_prefill:
            # Decode: one token per row, at position seq_len - 1. Plain Python beats per-row numpy here.
            slot_list = [
                table[(n - 1) // bs] * bs + (n - 1) % bs
                for table, n in zip(block_tables, seq_lens, strict=True)
            ]
            slot_array = np.asarray(slot_list, dtype=np.int64)
        else:
            slots = []
            for pos, table in zip(positions_per_row, block_tables, strict=True):
                if table:
                    pos_arr = np.asarray(pos)
                    slots.append(np.asarray(table)[pos_arr // bs] * bs + pos_arr % bs)
                else:  # warm-up rows: no cache yet
                    slots.append(np.full(len(pos), -1))
            slot_array = np.concatenate(slots).astype(np.int64)
        width = max(1, max(len(t) for t in block_tables))
        table_arr = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            table_arr[i, : len(t)] = t
        dev = self.device
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=torch.from_numpy(slot_array).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table_arr).to(dev, non_blocking=True),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )

    # -- execution -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ModelInput | WorkerBatch) -> SamplerOutput:
        """Runs one batch; returns one sampled token per row with ``sample`` set, in row order (on rank 0;
        other ranks sample nothing). Rank 0 first hands the batch to the tensor-parallel workers."""
        if self.workers is not None:
            self.workers.send(slim_model_input(batch))
        rows = batch.rows
        positions_per_row = [range(r.start_pos, r.start_pos + len(r.token_ids)) for r in rows]
        token_ids = [t for r in rows for t in r.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        flat_positions = [p for ps in positions_per_row for p in ps]
        positions = torch.tensor(flat_positions, dtype=torch.long, device=self.device)
        tables, token_rows = [r.block_table for r in rows], [r.token_ids for r in rows]
        meta = self._metadata(batch.is_prefill, positions_per_row, tables, token_rows)

        graph_bs = next((b for b in self.graphs if b >= len(rows)), None) if not batch.is_prefill else None
        if graph_bs is not None:
            hidden = self._replay_graph(graph_bs, input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)

        sample_rows = [i for i, r in enumerate(rows) if r.sample]
        # Like compute_logits below, prompt logprobs (logits of prompt positions) run on every
        # tensor-parallel rank; both give None on the workers.
        prompt_logprobs = self.sampler.prompt_logprobs(hidden, rows, self.model.compute_logits)
        logits = None
        if sample_rows:
            last_token_index = meta.query_start_loc[1:] - 1
            index = last_token_index[torch.tensor(sample_rows, device=self.device)]
            logits = self.model.compute_logits(hidden[index])
        # logits is None when no row samples, and on tensor-parallel workers (rank 0 samples).
        return self.sampler(logits, [rows[i] for i in sample_rows], self.generator, prompt_logprobs)

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
