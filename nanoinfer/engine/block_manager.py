"""Paged KV memory: a pool of fixed-size blocks with reference counts and a prefix cache.

A full block is identified by a chained hash: xxh64 over the previous block's hash and this block's
token ids, so equal tokens after different prefixes never match. A hit is confirmed by comparing the
tokens (64-bit hashes can collide). Freed blocks keep their hash (lazy invalidation) and can still be
hit until the allocator hands them out for other content.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanoinfer.engine.sequence import Sequence

NO_HASH = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()


def chained_block_hash(token_ids: list[int], prefix_hash: int) -> int:
    h = xxhash.xxh64()
    if prefix_hash != NO_HASH:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: allocation takes the oldest, so recently freed
        # (likely still useful) cached blocks survive longest.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_hashed_blocks: dict[int, int] = {}  # seq_id -> leading blocks already registered
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache lookup -------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``. Only full blocks qualify, and at
        least one token is always left to compute (the model must produce logits for the last one),
        so a block-aligned prompt that is cached whole still recomputes its last block. A sequence
        that needs every prompt position's logits (prompt logprobs) opts out with skip_prefix_cache."""
        if not self.enable_prefix_caching or seq.skip_prefix_cache:
            return []
        matched: list[int] = []
        prefix_hash = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.block_tokens(i)
            prefix_hash = chained_block_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            matched.append(block_id)
        return matched

    def can_allocate(self, seq: Sequence, cached_block_ids: list[int]) -> bool:
        # Cached blocks that someone else holds cost nothing; cached blocks sitting in the free pool
        # still take a free slot when revived.
        shared = sum(1 for b in cached_block_ids if self.blocks[b].ref_count > 0)
        return self.num_free_blocks >= seq.num_blocks - shared

    # -- allocation ----------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # lazy invalidation: the old content is overwritten from now on
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, cached_block_ids: list[int]) -> None:
        """Gives ``seq`` blocks for all its tokens, reusing ``cached_block_ids`` for its prefix."""
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(len(cached_block_ids), seq.num_blocks):
            seq.block_table.append(self._take_free_block())
        num_cached_tokens = len(cached_block_ids) * self.block_size
        seq.num_computed_tokens = num_cached_tokens
        self.num_hashed_blocks[seq.seq_id] = len(cached_block_ids)
        if self.enable_prefix_caching:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += num_cached_tokens

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks are freed first so that, among equally old free blocks, shared prefixes outlive
        # the unique suffixes that follow them.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        self.num_hashed_blocks.pop(seq.seq_id, None)

    def try_append(self, seq: Sequence) -> bool:
        """Gives the token about to be computed for ``seq`` a slot, taking a new block when it starts one;
        False (nothing changed) when that block is needed and none is free."""
        if len(seq.block_table) >= seq.num_blocks:
            return True
        if not self.num_free_blocks:
            return False
        seq.block_table.append(self._take_free_block())
        return True

    # -- prefix cache registration -------------------------------------------------------------------

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks of ``seq`` that became full of computed K/V in this step."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self.num_hashed_blocks.get(seq.seq_id, 0)
        if num_full <= start:  # most decode steps: no block became full
            return
        prefix_hash = self.blocks[seq.block_table[start - 1]].hash if start else NO_HASH
        for i in range(start, num_full):
            tokens = seq.block_tokens(i)
            prefix_hash = chained_block_hash(tokens, prefix_hash)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = prefix_hash, tuple(tokens)
            self.hash_to_block_id[prefix_hash] = block.block_id
        self.num_hashed_blocks[seq.seq_id] = max(start, num_full)
