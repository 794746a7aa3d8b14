"""The KV block pool and prefix cache: allocate_slots, free, chained hashes, lazy invalidation."""

from nanoinfer.engine.kv_cache_manager import NO_HASH, KVCacheManager, chained_block_hash
from nanoinfer.engine.request import EngineRequest, Request
from nanoinfer.sampling_params import SamplingParams

BS = 4


def _request(tokens, request_id="r"):
    return Request(EngineRequest(request_id, list(tokens), SamplingParams(), seed=0), 0)


def _admit(kv, request):
    """What the scheduler does for a whole prompt: prefix lookup, then slots for the rest."""
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - len(cached) * BS, cached)
    return cached


def _compute_all(kv, request):
    """After the step ran: every scheduled token's K/V is in the cache."""
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_hash_chain_depends_on_prefix():
    a = chained_block_hash([8, 9, 10, 7], chained_block_hash([1, 2, 3, 4], NO_HASH))
    b = chained_block_hash([8, 9, 10, 7], chained_block_hash([11, 12, 13, 14], NO_HASH))
    assert a != b
    assert a == chained_block_hash([8, 9, 10, 7], chained_block_hash([1, 2, 3, 4], NO_HASH))


def test_allocate_and_free_restore_pool():
    kv = KVCacheManager(8, BS)
    request = _request(range(10))  # 3 blocks
    _admit(kv, request)
    assert len(request.block_ids) == 3 and kv.num_free_blocks == 5
    kv.free(request)
    assert kv.num_free_blocks == 8 and request.block_ids == [] and request.num_computed_tokens == 0


def test_slots_are_allocated_as_tokens_are_scheduled():
    kv = KVCacheManager(8, BS)
    request = _request(range(10))
    assert kv.allocate_slots(request, 3) and len(request.block_ids) == 1  # a first chunk of 3 tokens
    request.num_computed_tokens = 3
    assert kv.allocate_slots(request, 2) and len(request.block_ids) == 2  # positions 3 and 4
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3) and len(request.block_ids) == 2  # positions 5-7: same block
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 1) and len(request.block_ids) == 3


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(2, BS)
    request = _request(range(12))
    assert not kv.allocate_slots(request, 12)
    assert request.block_ids == [] and kv.num_free_blocks == 2
    assert kv.allocate_slots(request, 8) and kv.num_free_blocks == 0


def test_prefix_hit_shares_blocks_with_refcount():
    kv = KVCacheManager(8, BS)
    a = _request([1, 2, 3, 4, 5, 6, 7], "a")
    _admit(kv, a)
    _compute_all(kv, a)  # registers only the first (full) block
    b = _request([1, 2, 3, 4, 8, 9, 10], "b")
    cached = _admit(kv, b)
    assert cached == [a.block_ids[0]] and b.block_ids[0] == a.block_ids[0]
    assert b.num_computed_tokens == BS
    assert kv.blocks[a.block_ids[0]].ref_count == 2
    kv.free(a)
    assert kv.blocks[b.block_ids[0]].ref_count == 1
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_last_partial_block_is_never_cached_and_one_token_is_left():
    kv = KVCacheManager(8, BS)
    a = _request(range(8), "a")  # exactly two blocks
    _admit(kv, a)
    _compute_all(kv, a)
    kv.free(a)
    # Both blocks are cached, but the last must be recomputed to produce logits.
    assert len(kv.find_cached_prefix(_request(range(8), "b"))) == 1
    assert len(kv.find_cached_prefix(_request(range(9), "c"))) == 2


def test_only_blocks_of_known_tokens_are_published():
    # With async scheduling the last computed token may be one the host does not know yet.
    kv = KVCacheManager(8, BS)
    a = _request([1, 2, 3, 4, 5, 6, 7], "a")
    _admit(kv, a)
    a.num_computed_tokens = 8  # the 8th token is being computed, its id still on the device
    kv.cache_full_blocks(a)
    assert a.num_cached_blocks == 1
    a.append_token(8)
    kv.cache_full_blocks(a)
    assert a.num_cached_blocks == 2
    b = _request([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert kv.find_cached_prefix(b) == a.block_ids[:2]


def test_lazy_invalidation_keeps_freed_blocks_hittable_until_reused():
    kv = KVCacheManager(2, BS)
    a = _request([1, 2, 3, 4, 5], "a")
    _admit(kv, a)
    _compute_all(kv, a)
    first_block = a.block_ids[0]
    kv.free(a)
    b = _request([1, 2, 3, 4, 6], "b")
    assert kv.find_cached_prefix(b) == [first_block]  # freed, but still valid
    # A free cached block still occupies a free slot when revived.
    _admit(kv, b)
    kv.free(b)
    # Fill the pool with other content: the old hash disappears when its block is reused.
    _admit(kv, _request([9] * 8, "c"))
    assert kv.find_cached_prefix(_request([1, 2, 3, 4, 7], "d")) == []


def test_revived_cached_blocks_count_against_the_free_pool():
    kv = KVCacheManager(2, BS)
    a = _request([1, 2, 3, 4, 5], "a")
    _admit(kv, a)
    _compute_all(kv, a)
    kv.free(a)
    b = _request([1, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # hits a's first block, needs two more
    cached = kv.find_cached_prefix(b)
    assert cached and not kv.allocate_slots(b, b.num_tokens - BS, cached)
    assert b.block_ids == [] and kv.num_free_blocks == 2


def test_hash_collision_falls_back_to_miss():
    kv = KVCacheManager(4, BS)
    a = _request([1, 2, 3, 4, 5], "a")
    _admit(kv, a)
    _compute_all(kv, a)
    # Simulate a 64-bit collision: another block's tokens registered under the same hash.
    h = kv.blocks[a.block_ids[0]].hash
    kv.blocks[a.block_ids[0]].token_ids = (9, 9, 9, 9)
    assert kv.hash_to_block_id[h] == a.block_ids[0]
    assert kv.find_cached_prefix(_request([1, 2, 3, 4, 6], "b")) == []


def test_reusing_a_block_does_not_drop_a_newer_owner_of_its_hash():
    kv = KVCacheManager(4, BS)
    a, b = _request([1, 2, 3, 4, 5], "a"), _request([1, 2, 3, 4, 6], "b")
    _admit(kv, a)
    _admit(kv, b)  # same content computed twice in one step: both register the same hash
    _compute_all(kv, a)
    _compute_all(kv, b)
    owner = kv.hash_to_block_id[kv.blocks[b.block_ids[0]].hash]
    assert owner == b.block_ids[0]
    kv.free(a)
    kv.free(b)
    # The allocator reuses a's old block first; b's entry for the hash must survive that.
    _admit(kv, _request([7, 7, 7], "c"))
    assert kv.find_cached_prefix(_request([1, 2, 3, 4, 9], "d")) == [owner]


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    a = _request([1, 2, 3, 4, 5], "a")
    _admit(kv, a)
    _compute_all(kv, a)
    assert kv.find_cached_prefix(_request([1, 2, 3, 4, 5], "b")) == []
