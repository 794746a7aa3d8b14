"""Tensor-parallel layers against their unsharded equivalents.

The forward passes run on two gloo ranks (spawned processes); loading alone is checked in-process for
more ranks, since building a layer for rank r of N needs no process group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanoinfer.distributed import destroy_process_group, init_process_group, tensor_parallel_scope
from nanoinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

HIDDEN, HEAD_DIM, NUM_HEADS = 32, 8, 4
VOCAB = 37  # odd: the last rank's vocabulary slice is shorter


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "x": randn(5, HIDDEN),
        "col_w": randn(24, HIDDEN),
        "col_b": randn(24),
        "row_w": randn(HIDDEN, 24),
        "row_b": randn(HIDDEN),
        "gate": randn(16, HIDDEN),
        "up": randn(16, HIDDEN),
        "q": randn(NUM_HEADS * HEAD_DIM, HIDDEN),
        "q_b": randn(NUM_HEADS * HEAD_DIM),
        "k2": randn(2 * HEAD_DIM, HIDDEN),
        "v2": randn(2 * HEAD_DIM, HIDDEN),
        "k1": randn(HEAD_DIM, HIDDEN),
        "v1": randn(HEAD_DIM, HIDDEN),
        "k1_b": randn(HEAD_DIM),
        "v1_b": randn(HEAD_DIM),
        "embed": randn(VOCAB, HIDDEN),
        "ids": torch.tensor([0, 1, 18, 19, 20, 36, 5, 36]),
    }


def _load(layer, **named):
    for name, tensor in named.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)


def _qkv_shard_rows(rank: int, size: int, num_kv_heads: int) -> tuple[slice, slice]:
    """Rows of the full q and k/v weights that rank ``rank`` holds."""
    q_per_rank = NUM_HEADS // size * HEAD_DIM
    kv_head = rank * num_kv_heads // size
    kv_per_rank = max(1, num_kv_heads // size) * HEAD_DIM
    kv_start = kv_head * HEAD_DIM if num_kv_heads < size else rank * kv_per_rank
    return slice(rank * q_per_rank, (rank + 1) * q_per_rank), slice(kv_start, kv_start + kv_per_rank)


def _check_forward(rank: int, size: int, store_dir: str) -> None:
    """Runs on every rank: each parallel layer's output against the unsharded computation."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), size)
    init_process_group(store, rank, size, torch.device("cpu"))
    try:
        w = _weights()
        x = w["x"]
        with tensor_parallel_scope(rank, size):
            col = ColumnParallelLinear(HIDDEN, 24, bias=True)
            row = RowParallelLinear(24, HIDDEN, bias=True)
            merged = MergedColumnParallelLinear(HIDDEN, [16, 16])
            qkv2 = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, 2, bias=False)
            qkv1 = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, 1, bias=True)
            embed = VocabParallelEmbedding(VOCAB, HIDDEN)
            head = ParallelLMHead(VOCAB, HIDDEN)
            replicated = ReplicatedLinear(HIDDEN, 24, bias=True)

        # Column: this rank's slice of the output features.
        _load(col, weight=w["col_w"], bias=w["col_b"])
        per = 24 // size
        want = F.linear(x, w["col_w"], w["col_b"])[:, rank * per : (rank + 1) * per]
        torch.testing.assert_close(col(x), want)

        # Row: input split across ranks, all-reduced to the full output (bias added once).
        _load(row, weight=w["row_w"], bias=w["row_b"])
        h = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(
            row(h[:, rank * per : (rank + 1) * per]), F.linear(h, w["row_w"], w["row_b"])
        )

        # Column into row: the Megatron pair equals the two unsharded layers.
        torch.testing.assert_close(
            row(col(x)), F.linear(F.linear(x, w["col_w"], w["col_b"]), w["row_w"], w["row_b"])
        )

        # Merged gate/up: [gate slice, up slice] of this rank.
        merged.weight.weight_loader(merged.weight, w["gate"], 0)
        merged.weight.weight_loader(merged.weight, w["up"], 1)
        half = 16 // size
        rows = slice(rank * half, (rank + 1) * half)
        torch.testing.assert_close(merged(x), torch.cat([x @ w["gate"][rows].T, x @ w["up"][rows].T], dim=-1))

        # QKV with as many KV heads as ranks, and with one KV head replicated on both ranks.
        for layer, k, v, kv_heads, biases in (
            (qkv2, w["k2"], w["v2"], 2, None),
            (qkv1, w["k1"], w["v1"], 1, (w["q_b"], w["k1_b"], w["v1_b"])),
        ):
            for shard_id, tensor in zip("qkv", (w["q"], k, v), strict=True):
                layer.weight.weight_loader(layer.weight, tensor, shard_id)
            if biases is not None:
                for shard_id, tensor in zip("qkv", biases, strict=True):
                    layer.bias.weight_loader(layer.bias, tensor, shard_id)
            q_rows, kv_rows = _qkv_shard_rows(rank, size, kv_heads)
            qb, kb, vb = biases if biases is not None else (None, None, None)
            want = torch.cat(
                [
                    F.linear(x, w["q"][q_rows], None if qb is None else qb[q_rows]),
                    F.linear(x, k[kv_rows], None if kb is None else kb[kv_rows]),
                    F.linear(x, v[kv_rows], None if vb is None else vb[kv_rows]),
                ],
                dim=-1,
            )
            torch.testing.assert_close(layer(x), want)

        # Vocabulary-parallel embedding: every id found on exactly one rank, summed everywhere.
        _load(embed, weight=w["embed"])
        torch.testing.assert_close(embed(w["ids"]), F.embedding(w["ids"], w["embed"]))

        # LM head: full logits on rank 0 (padding columns cut off), None elsewhere.
        _load(head, weight=w["embed"])
        logits = head(x)
        if rank == 0:
            torch.testing.assert_close(logits, x @ w["embed"].T)
        else:
            assert logits is None

        _load(replicated, weight=w["col_w"], bias=w["col_b"])
        torch.testing.assert_close(replicated(x), F.linear(x, w["col_w"], w["col_b"]))
    finally:
        destroy_process_group()


def _rank1_main(store_dir: str, errors) -> None:
    try:
        _check_forward(1, 2, store_dir)
    except BaseException:
        errors.put(traceback.format_exc())
        raise


def test_parallel_layers_on_two_gloo_ranks(tmp_path):
    # This process is rank 0; one spawned process is rank 1 (one interpreter start instead of two).
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    rank1 = ctx.Process(target=_rank1_main, args=(str(tmp_path), errors), daemon=True)
    rank1.start()
    try:
        _check_forward(0, 2, str(tmp_path))
    finally:
        rank1.join(60)
        if rank1.is_alive():
            rank1.kill()
    assert errors.empty() and rank1.exitcode == 0, errors.get() if not errors.empty() else rank1.exitcode


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qkv_loading_for_four_ranks(num_kv_heads):
    """Each of 4 ranks holds its query heads and the KV head(s) they attend with (replicated when there
    are fewer KV heads than ranks)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN, generator=g)
    k = torch.randn(num_kv_heads * HEAD_DIM, HIDDEN, generator=g)
    v = torch.randn(num_kv_heads * HEAD_DIM, HIDDEN, generator=g)
    group = NUM_HEADS // num_kv_heads  # query heads per KV head
    for rank in range(4):
        with tensor_parallel_scope(rank, 4):
            layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, bias=False)
        for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        assert layer.num_heads == 1 and layer.num_kv_heads == max(1, num_kv_heads // 4)
        q_rows, kv_rows = _qkv_shard_rows(rank, 4, num_kv_heads)
        # The one query head on this rank (head `rank`) uses KV head rank // group.
        assert kv_rows.start == (rank // group) * HEAD_DIM
        torch.testing.assert_close(layer.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))


def test_loading_from_lazy_safetensors_slices(tmp_path):
    """Weight loaders accept safetensors slices and read only this rank's part of them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = _weights()
    path = str(tmp_path / "w.safetensors")
    save_file({k: w[k] for k in ("col_w", "row_w", "row_b", "gate", "up", "q", "k1", "v1", "embed")}, path)
    with safe_open(path, framework="pt") as f, tensor_parallel_scope(1, 2):
        col = ColumnParallelLinear(HIDDEN, 24)
        row = RowParallelLinear(24, HIDDEN, bias=True)
        merged = MergedColumnParallelLinear(HIDDEN, [16, 16])
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, 1, bias=False)
        embed = VocabParallelEmbedding(VOCAB, HIDDEN)
        col.weight.weight_loader(col.weight, f.get_slice("col_w"))
        row.weight.weight_loader(row.weight, f.get_slice("row_w"))
        row.bias.weight_loader(row.bias, f.get_slice("row_b"))
        merged.weight.weight_loader(merged.weight, f.get_slice("gate"), 0)
        merged.weight.weight_loader(merged.weight, f.get_slice("up"), 1)
        for shard_id in "qkv":
            name = {"q": "q", "k": "k1", "v": "v1"}[shard_id]
            qkv.weight.weight_loader(qkv.weight, f.get_slice(name), shard_id)
        embed.weight.weight_loader(embed.weight, f.get_slice("embed"))
    torch.testing.assert_close(col.weight, w["col_w"][12:])
    torch.testing.assert_close(row.weight, w["row_w"][:, 12:])
    torch.testing.assert_close(row.bias, w["row_b"])
    torch.testing.assert_close(merged.weight, torch.cat([w["gate"][8:], w["up"][8:]]))
    torch.testing.assert_close(qkv.weight, torch.cat([w["q"][16:], w["k1"], w["v1"]]))
    # Rank 1 holds ids 19..36 in its 19 rows; the last row is padding and stays zero.
    torch.testing.assert_close(embed.weight[:18], w["embed"][19:])
    assert embed.weight[18].abs().sum() == 0


def test_single_rank_layers_equal_unsharded():
    w = _weights()
    col = ColumnParallelLinear(HIDDEN, 24, bias=True)
    _load(col, weight=w["col_w"], bias=w["col_b"])
    torch.testing.assert_close(col(w["x"]), F.linear(w["x"], w["col_w"], w["col_b"]))
    row = RowParallelLinear(24, HIDDEN, bias=True)
    _load(row, weight=w["row_w"], bias=w["row_b"])
    h = torch.randn(3, 24)
    torch.testing.assert_close(row(h), F.linear(h, w["row_w"], w["row_b"]))
    head = ParallelLMHead(VOCAB, HIDDEN)
    _load(head, weight=w["embed"])
    torch.testing.assert_close(head(w["x"]), w["x"] @ w["embed"].T)


def test_layers_built_outside_a_scope_are_unsharded():
    with tensor_parallel_scope(1, 2):
        sharded = ColumnParallelLinear(HIDDEN, 24)
    whole = ColumnParallelLinear(HIDDEN, 24)
    assert sharded.weight.shape == (12, HIDDEN) and whole.weight.shape == (24, HIDDEN)
    assert (whole.tp_rank, whole.tp_size) == (0, 1)


def test_shape_errors():
    w = _weights()
    with pytest.raises(ValueError, match="output features"), tensor_parallel_scope(0, 2):
        ColumnParallelLinear(HIDDEN, 25)
    with pytest.raises(ValueError, match="attention heads"), tensor_parallel_scope(0, 3):
        QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, 1, bias=False)
    col = ColumnParallelLinear(HIDDEN, 24)
    with pytest.raises(ValueError, match="does not match"):
        col.weight.weight_loader(col.weight, w["col_w"][:, :16])  # would broadcast silently with copy_
    with pytest.raises(ValueError, match="has no rows"), tensor_parallel_scope(1, 2):
        short = ColumnParallelLinear(HIDDEN, 24)
        short.weight.weight_loader(short.weight, w["col_w"][:20])
    embed = VocabParallelEmbedding(VOCAB, HIDDEN)
    with pytest.raises(ValueError, match="vocab_size"):
        embed.weight.weight_loader(embed.weight, w["embed"][:30])
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, 2, bias=False)
    with pytest.raises(ValueError, match="unknown qkv shard"):
        qkv.weight.weight_loader(qkv.weight, w["q"], "x")
