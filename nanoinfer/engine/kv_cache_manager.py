"""Paged KV memory: a pool of fixed-size blocks with reference counts and a prefix cache.

A full block is identified by a chained hash: xxh64 over the previous block's hash and this block's
token ids, so equal tokens after different prefixes never match. A hit is confirmed by comparing the
tokens (64-bit hashes can collide). Freed blocks keep their hash (lazy invalidation) and can still be
hit until the allocator hands them out for other content.

Blocks are allocated as tokens are scheduled (:meth:`KVCacheManager.allocate_slots`), so a prompt being
prefilled in chunks holds only the blocks of its computed chunks.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanoinfer.engine.request import Request

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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: allocation takes the oldest, so recently freed
        # (likely still useful) cached blocks survive longest.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup -------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of ``request``. Only full blocks qualify, and at
        least one token is always left to compute (the model must produce logits for the last one),
        so a block-aligned prompt that is cached whole still recomputes its last block."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return []
        matched: list[int] = []
        prefix_hash = NO_HASH
        for i in range((request.num_tokens - 1) // self.block_size):
            tokens = request.block_tokens(i, self.block_size)
            prefix_hash = chained_block_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            matched.append(block_id)
        return matched

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

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_block_ids: list[int] | None = None
    ) -> bool:
        """Gives ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones, first
        taking ``cached_block_ids`` (its prefix-cache hit, on admission) as its leading blocks. Returns
        False, changing nothing, when the free pool is too small."""
        if not cached_block_ids:
            # Every step of every running request: kept to the fewest operations (this path alone was
            # a tenth of the host's step time at batch 256, benchmarks/host_overhead.py).
            needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
            needed -= len(request.block_ids)
            if needed > 0:
                if needed > len(self.free_block_ids):
                    return False
                self._append_free_blocks(request, needed)
            return True
        cached = cached_block_ids
        # Cached blocks that someone else holds cost nothing; those in the free pool take a free slot.
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        num_computed = request.num_computed_tokens + len(cached) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(cached)
        if max(needed, 0) + revived > self.num_free_blocks:
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        request.num_computed_tokens = num_computed
        request.num_cached_blocks = len(cached)
        self._append_free_blocks(request, needed)
        return True

    def _append_free_blocks(self, request: Request, count: int) -> None:
        for _ in range(count):
            request.block_ids.append(self._take_free_block())

    def record_prefix_query(self, request: Request) -> None:
        """Counts an admission's prompt in the hit-rate statistics (after its prefix lookup)."""
        if self.enable_prefix_caching:
            self.queried_tokens += request.num_tokens
            self.hit_tokens += request.num_computed_tokens

    def free(self, request: Request) -> None:
        # Tail blocks are freed first so that, among equally old free blocks, shared prefixes outlive
        # the unique suffixes that follow them.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        request.block_ids.clear()
        request.num_computed_tokens = 0
        request.num_cached_blocks = 0

    # -- prefix cache registration -------------------------------------------------------------------

    def cache_full_blocks(self, request: Request) -> None:
        """Publishes the blocks of ``request`` that are full of computed K/V of known tokens. A block
        being written by a step still running is published too: every later step runs after it."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:  # most decode steps: no block became full
            return
        prefix_hash = self.blocks[request.block_ids[start - 1]].hash if start else NO_HASH
        for i in range(start, num_full):
            tokens = request.block_tokens(i, self.block_size)
            prefix_hash = chained_block_hash(tokens, prefix_hash)
            block = self.blocks[request.block_ids[i]]
            block.hash, block.token_ids = prefix_hash, tuple(tokens)
            self.hash_to_block_id[prefix_hash] = block.block_id
        request.num_cached_blocks = num_full
