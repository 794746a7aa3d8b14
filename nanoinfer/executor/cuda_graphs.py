"""CUDA graphs of the model's forward pass for pure-decode batches (one query token per row).

One graph per batch size in :func:`cuda_graph_batch_sizes`; a batch of B rows replays the smallest graph
of at least B rows, its extra rows padded (no K/V write, context length 0). The graphs read their inputs
from the model runner's persistent step buffers, so a replay needs no copies beyond filling those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from nanoinfer.executor.input_batch import SamplingBuffers
from nanoinfer.layers.attention import AttentionMetadata


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then steps of 16, up to max_num_seqs."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4, 8) if b < cap] + list(range(16, cap + 1, 16))
    if not sizes or sizes[-1] < cap:
        sizes.append(cap)
    return sizes


@dataclass
class StepBuffers:
    """The device tensors a forward pass reads, sized for the largest step; a step fills a prefix."""

    input_ids: torch.Tensor  # int64 [max tokens]
    positions: torch.Tensor  # int64 [max tokens]
    slot_mapping: torch.Tensor  # int64 [max tokens]
    query_start_loc: torch.Tensor  # int32 [max rows + 1]
    seq_lens: torch.Tensor  # int32 [max rows]
    block_tables: torch.Tensor  # int32 [max rows, max blocks]

    @classmethod
    def allocate(cls, max_tokens: int, max_rows: int, table_width: int, device: torch.device) -> StepBuffers:
        return cls(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(max_rows + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_rows, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_rows, table_width, dtype=torch.int32, device=device),
        )

    def decode_metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            num_decode_rows=batch_size,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )


class CudaGraphs:
    """Per batch size, a graph of the forward pass (hidden states into ``output``) and, with ``sampling``
    (the step's sampling rows' temperature, seed and offset buffers), a second one that also computes
    the logits and samples every row by temperature alone into ``tokens``: a step whose rows use no
    filter, penalty or logprobs replays that one and launches nothing else.

    With ``sampling``, also a third graph per batch size for such a step with structured-outputs rows,
    whose sampling waits for their bitmask: it computes the logits of the forward graph's ``output``
    (so the step replays the first graph and nothing else until then), applies the bitmask in ``mask``
    (row i is the bitmask of logits row ``mask_rows[i]``; rows past the step's constrained ones allow
    every token) and samples as the second one does. The step writes its bitmask with :meth:`load_mask`
    before :meth:`replay_masked_sampling`; eagerly the logits and this sampling are a GEMM, three Triton
    launches and a handful of tensor operations."""

    def __init__(
        self,
        model: nn.Module,
        buffers: StepBuffers,
        hidden_size: int,
        dtype: torch.dtype,
        sampling: SamplingBuffers | None = None,
    ):
        self.model = model
        self.buffers = buffers
        self.sampling = sampling
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.masked_sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        rows, device = buffers.seq_lens.shape[0], buffers.seq_lens.device
        self.output = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        # The masked sampling graphs' inputs, allocated by capture once the logits' width is known.
        self.mask: torch.Tensor | None = None  # int32 [rows, ceil(vocab / 32)]
        self.mask_rows: torch.Tensor | None = None  # int64 [rows]
        self._mask_rows_in_use = 0  # mask rows [0, this) may allow less than every token
        self._mask_rows_identity = False  # mask_rows[i] == i for every row
        self._pool = None  # the graphs' shared memory pool, from the first capture

    @torch.inference_mode()
    def capture(self, sizes: list[int], max_model_len: int) -> None:
        b = self.buffers
        b.query_start_loc.copy_(torch.arange(len(b.query_start_loc), dtype=torch.int32))
        self._pool = None
        for bs in reversed(sizes):  # largest first so smaller graphs fit in its memory pool
            meta = b.decode_metadata(bs, max_model_len)
            self.graphs[bs] = self._record(partial(self._forward, bs, meta))
            if self.sampling is not None:
                self.sampling_graphs[bs] = self._record(partial(self._forward_and_sample, bs, meta))
                self.masked_sampling_graphs[bs] = self._record(partial(self._mask_and_sample, bs))
        self.graphs = dict(sorted(self.graphs.items()))

    def _record(self, run: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """A CUDA graph of ``run``, in the graphs' shared memory pool. One eager run first: lazy
        initialisation (kernel compilation, the masked sampling inputs) must not be captured."""
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self._pool):
            run()
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize()
        return graph

    def _forward(self, bs: int, meta: AttentionMetadata) -> None:
        b = self.buffers
        self.output[:bs] = self.model(b.input_ids[:bs], b.positions[:bs], meta)

    def _forward_and_sample(self, bs: int, meta: AttentionMetadata) -> None:
        b = self.buffers
        logits = self.model.compute_logits(self.model(b.input_ids[:bs], b.positions[:bs], meta))
        if self.mask is None:  # the first (eager) run of the largest batch size
            self._allocate_mask_inputs(logits.shape[1])
        self._sample_into_tokens(logits, bs)

    def _sample_into_tokens(self, logits: torch.Tensor, bs: int) -> None:
        """The inverse-CDF draw (argmax at temperature 0) of ``bs`` logits rows into ``tokens``."""
        from nanoinfer.kernels.triton_sampling import inverse_cdf_sample

        s = self.sampling
        inverse_cdf_sample(logits, s.temperature[:bs], s.seeds[:bs], s.offsets[:bs], out=self.tokens[:bs])

    def _allocate_mask_inputs(self, vocab_size: int) -> None:
        rows, device = self.tokens.shape[0], self.tokens.device
        self.mask = torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
        self.mask_rows = torch.zeros(rows, dtype=torch.int64, device=device)

    def _mask_and_sample(self, bs: int) -> None:
        from nanoinfer.structured.triton_bitmask import apply_token_bitmask

        logits = self.model.compute_logits(self.output[:bs])
        apply_token_bitmask(logits, self.mask[:bs], self.mask_rows[:bs])
        self._sample_into_tokens(logits, bs)

    def load_mask(self, num_rows: int, logits_rows: torch.Tensor | None) -> None:
        """The next masked sampling replay's bitmask: ``mask[:num_rows]`` is already written (by the
        caller's copy), row i for logits row ``logits_rows[i]`` (a device tensor), or for logits row i
        when ``logits_rows`` is None (every row of a fully constrained batch: nothing to copy after the
        first such step); later rows are reset to allow every token (then the logits row they name, any
        row of the buffer, is left as it is)."""
        if num_rows and logits_rows is None:
            if not self._mask_rows_identity:
                self.mask_rows.copy_(torch.arange(len(self.mask_rows), device=self.mask_rows.device))
                self._mask_rows_identity = True
        elif num_rows:
            self.mask_rows[:num_rows].copy_(logits_rows)
            self._mask_rows_identity = False
        if num_rows < self._mask_rows_in_use:
            self.mask[num_rows : self._mask_rows_in_use].fill_(-1)
        self._mask_rows_in_use = num_rows

    def replay_masked_sampling(self, batch_size: int) -> torch.Tensor:
        """The sampled tokens [batch_size] (padding rows' too) of the masked sampling graph."""
        self.masked_sampling_graphs[batch_size].replay()
        return self.tokens[:batch_size]

    def batch_size_for(self, num_rows: int) -> int | None:
        """The graph a pure-decode batch of ``num_rows`` rows replays, or None (run eagerly)."""
        return next((bs for bs in self.graphs if bs >= num_rows), None)

    def replay(self, batch_size: int) -> torch.Tensor:
        self.graphs[batch_size].replay()
        return self.output[:batch_size]

    def replay_and_sample(self, batch_size: int) -> torch.Tensor:
        """The sampled tokens [batch_size] (padding rows' too) of the graph that also samples."""
        self.sampling_graphs[batch_size].replay()
        return self.tokens[:batch_size]

    def clear(self) -> None:
        self.graphs.clear()
        self.sampling_graphs.clear()
        self.masked_sampling_graphs.clear()


def piecewise_token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts with piecewise graphs: powers of two from 16 up to the step's token budget."""
    sizes = []
    size = 16
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_batched_tokens)
    return sizes


@dataclass
class _AttentionCall:
    """One attention layer's call between two pieces: what it reads besides the step's metadata."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class _SplitAtAttention:
    """Stands in for the attention backend while a forward pass is captured: each attention call ends the
    graph being captured and starts the next one; the call itself is recorded, to run eagerly between
    the replays. The layer writes its queries straight into the static query buffer (a copy there costs
    a strided pass over every prompt token's queries, per layer)."""

    name = "piecewise-capture"

    def __init__(self, capture: _PieceCapture):
        self.capture = capture

    def attend(self, query, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, out=None):
        return self.capture.split(query, _AttentionCall(k_cache, v_cache, scale, k_scale, v_scale))

    def query_destination(self, num_tokens: int) -> torch.Tensor:
        return self.capture.query_buffer[:num_tokens]


class _PieceCapture:
    def __init__(self, pool, query_buffer: torch.Tensor, output_buffer: torch.Tensor):
        self.pool = pool
        self.query_buffer = query_buffer
        self.output_buffer = output_buffer
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()
        self.pieces.append(self.graph)
        self.graph = None

    def split(self, query: torch.Tensor, call: _AttentionCall) -> torch.Tensor:
        num_tokens = query.shape[0]
        if query.data_ptr() != self.query_buffer.data_ptr():  # a layer that ignored query_destination
            self.query_buffer[:num_tokens].copy_(query)
        self.end()
        self.calls.append(call)
        self.begin()
        return self.output_buffer[:num_tokens]


class PiecewiseGraphs:
    """CUDA graphs of the forward pass for steps that are not pure decode (prompt chunks, and prompt
    chunks beside decoding rows): eagerly such a step launches some 300 kernels from Python, which
    took longer than the GPU ran them. Per token-count bucket, the forward pass is captured in pieces,
    cut at every attention call; a step replays the pieces of the smallest bucket that holds its tokens
    (the extra tokens write no K/V) and runs each attention call eagerly in between, on the step's real
    rows (its grid depends on them)."""

    def __init__(
        self,
        model: nn.Module,
        buffers: StepBuffers,
        attention_layers: list,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ):
        self.model = model
        self.buffers = buffers
        self.attention_layers = attention_layers
        max_tokens = buffers.input_ids.shape[0]
        device = buffers.input_ids.device
        # Shared by every layer and bucket: one step at a time, one layer at a time.
        self.query_buffer = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.output_buffer = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.buckets: dict[int, tuple[list[torch.cuda.CUDAGraph], list[_AttentionCall], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, token_counts: list[int]) -> None:
        b = self.buffers
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        backends = [layer.backend for layer in self.attention_layers]
        for num_tokens in reversed(token_counts):  # largest first: the smaller ones fit in its memory
            # The captured kernels read only the slots (the K/V store); attention is not captured.
            meta = AttentionMetadata(
                slot_mapping=b.slot_mapping[:num_tokens],
                query_start_loc=b.query_start_loc[:1],
                seq_lens=b.seq_lens[:0],
                block_tables=b.block_tables[:0],
                num_decode_rows=0,
                max_query_len=0,
                max_seq_len=0,
            )
            capture = _PieceCapture(pool, self.query_buffer, self.output_buffer)
            for layer in self.attention_layers:
                layer.backend = _SplitAtAttention(capture)
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(stream):
                    capture.begin()
                    hidden = self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], meta)
                    capture.end()
            finally:
                for layer, backend in zip(self.attention_layers, backends, strict=True):
                    layer.backend = backend
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.buckets[num_tokens] = (capture.pieces, capture.calls, hidden)
        self.buckets = dict(sorted(self.buckets.items()))

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((size for size in self.buckets if size >= num_tokens), None)

    def run(self, bucket: int, meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
        """The step's hidden states: the bucket's pieces, with the attention calls on ``meta`` (the
        step's real rows and tokens) between them. The step's inputs are in the static buffers."""
        pieces, calls, hidden = self.buckets[bucket]
        query, out = self.query_buffer[:num_tokens], self.output_buffer[:num_tokens]
        backends = [layer.backend for layer in self.attention_layers]
        for i, piece in enumerate(pieces):
            piece.replay()
            if i < len(calls):
                call = calls[i]
                backends[i].attend(
                    query, call.k_cache, call.v_cache, meta, call.scale, call.k_scale, call.v_scale, out=out
                )
        return hidden[:num_tokens]

    def clear(self) -> None:
        self.buckets.clear()
