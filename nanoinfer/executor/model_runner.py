"""Runs batches on the device: builds the model, owns the KV cache pool, prepares the per-batch
attention metadata, replays CUDA graphs for decode and samples."""

from __future__ import annotations

import logging

import numpy as np
import torch

from nanoinfer.config import EngineConfig
from nanoinfer.executor.batch import ModelInput
from nanoinfer.layers.attention import AttentionMetadata, create_attention_backend
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
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.dtype = config.torch_dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        hf = config.hf_config

        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                self.model = DecoderForCausalLM(hf, max_position=config.max_model_len)
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

        first = self.attention_layers[0]
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        if self.device.type == "cuda":
            self._warmup()
        self.num_kv_blocks = self._decide_num_kv_blocks()
        self._allocate_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.device.type == "cuda" and not config.enforce_eager and backend.name == "triton":
            self._capture_cuda_graphs()

    def close(self) -> None:
        """Drops the graphs, the KV pool and the model so their device memory can be reused."""
        self.graphs.clear()
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
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache (budget {int(budget)} bytes, one block needs "
                f"{self.kv_block_bytes}); raise gpu_memory_utilization / cpu_kvcache_space_bytes or "
                "lower max_num_batched_tokens"
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        shape = (2, len(self.attention_layers), self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # -- batch preparation -----------------------------------------------------------------------------

    def _metadata(self, is_prefill, positions_per_row, block_tables, token_rows) -> AttentionMetadata:
        bs = self.block_size
        q_lens = [len(t) for t in token_rows]
        seq_lens = [p[-1] + 1 if p else 0 for p in positions_per_row]
        slots = []
        for pos, table in zip(positions_per_row, block_tables):
            if table:
                pos_arr = np.asarray(pos)
                slots.append(np.asarray(table)[pos_arr // bs] * bs + pos_arr % bs)
            else:  # warm-up rows: no cache yet
                slots.append(np.full(len(pos), -1))
        width = max(1, max(len(t) for t in block_tables))
        table_arr = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            table_arr[i, : len(t)] = t
        dev = self.device
        return AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table_arr).to(dev, non_blocking=True),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )

    # -- execution -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> list[int]:
        """Runs one batch; returns one sampled token per row with ``sample`` set, in row order."""
        rows = batch.rows
        positions_per_row = [range(r.start_pos, r.start_pos + len(r.token_ids)) for r in rows]
        token_ids = [t for r in rows for t in r.token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor([p for ps in positions_per_row for p in ps], dtype=torch.long, device=self.device)
        meta = self._metadata(batch.is_prefill, positions_per_row, [r.block_table for r in rows], [r.token_ids for r in rows])

        graph_bs = next((b for b in self.graphs if b >= len(rows)), None) if not batch.is_prefill else None
        if graph_bs is not None:
            hidden = self._replay_graph(graph_bs, input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)

        sample_rows = [i for i, r in enumerate(rows) if r.sample]
        if not sample_rows:
            return []
        last_token_index = meta.query_start_loc[1:] - 1
        index = last_token_index[torch.tensor(sample_rows, device=self.device)]
        logits = self.model.compute_logits(hidden[index])
        if logits is None:  # tensor-parallel worker: rank 0 samples
            return []
        return self.sampler(logits, [rows[i] for i in sample_rows], self.generator)

    # -- CUDA graphs -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        sizes = cuda_graph_batch_sizes(self.config.max_num_seqs)
        max_bs = sizes[-1]
        dev = self.device
        hidden_size = self.config.hf_config.hidden_size
        self.graph_inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            # One column beyond max_model_len's blocks: decode can need a block a prompt-sized table lacks.
            "block_tables": torch.zeros(max_bs, self.config.max_blocks_per_seq + 1, dtype=torch.int32, device=dev),
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
