from nanoinfer.engine.block_manager import NO_HASH, BlockManager, chained_block_hash
from nanoinfer.engine.sequence import Sequence
from nanoinfer.sampling_params import SamplingParams

BS = 4


def _seq(tokens):
    return Sequence(tokens, SamplingParams(), BS)


def _compute_all(bm, seq):
    """What the scheduler does after a prefill step: every token's K/V is now in the cache."""
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)


def test_hash_chain_depends_on_prefix():
    a = chained_block_hash([8, 9, 10, 7], chained_block_hash([1, 2, 3, 4], NO_HASH))
    b = chained_block_hash([8, 9, 10, 7], chained_block_hash([11, 12, 13, 14], NO_HASH))
    assert a != b
    assert a == chained_block_hash([8, 9, 10, 7], chained_block_hash([1, 2, 3, 4], NO_HASH))


def test_allocate_and_free_restore_pool():
    bm = BlockManager(8, BS)
    seq = _seq(list(range(10)))  # 3 blocks
    assert bm.can_allocate(seq, bm.match_prefix(seq))
    bm.allocate(seq, [])
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hit_shares_blocks_with_refcount():
    bm = BlockManager(8, BS)
    a = _seq([1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a, bm.match_prefix(a))
    _compute_all(bm, a)  # registers only the first (full) block
    b = _seq([1, 2, 3, 4, 8, 9, 10])
    cached = bm.match_prefix(b)
    assert cached == [a.block_table[0]]
    bm.allocate(b, cached)
    assert b.num_computed_tokens == BS
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.deallocate(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.deallocate(b)
    assert bm.num_free_blocks == 8


def test_last_partial_block_is_never_cached_and_one_token_is_left():
    bm = BlockManager(8, BS)
    a = _seq(list(range(8)))  # exactly two blocks
    bm.allocate(a, [])
    _compute_all(bm, a)
    bm.deallocate(a)
    again = _seq(list(range(8)))
    # Both blocks are cached, but the last must be recomputed to produce logits.
    assert len(bm.match_prefix(again)) == 1
    longer = _seq(list(range(9)))
    assert len(bm.match_prefix(longer)) == 2


def test_lazy_invalidation_keeps_freed_blocks_hittable_until_reused():
    bm = BlockManager(2, BS)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a, [])
    _compute_all(bm, a)
    first_block = a.block_table[0]
    bm.deallocate(a)
    b = _seq([1, 2, 3, 4, 6])
    assert bm.match_prefix(b) == [first_block]  # freed, but still valid
    # A free cached block still occupies a free slot when revived.
    assert bm.can_allocate(b, [first_block])
    bm.allocate(b, [first_block])
    bm.deallocate(b)
    # Fill the pool with other content: the old hash disappears when its block is reused.
    c = _seq([9, 9, 9, 9, 9, 9, 9, 9])
    bm.allocate(c, [])
    assert bm.match_prefix(_seq([1, 2, 3, 4, 7])) == []


def test_hash_collision_falls_back_to_miss():
    bm = BlockManager(4, BS)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a, [])
    _compute_all(bm, a)
    # Simulate a 64-bit collision: another block's tokens registered under the same hash.
    h = bm.blocks[a.block_table[0]].hash
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    assert bm.hash_to_block_id[h] == a.block_table[0]
    assert bm.match_prefix(_seq([1, 2, 3, 4, 6])) == []


def test_reusing_a_block_does_not_drop_a_newer_owner_of_its_hash():
    bm = BlockManager(4, BS)
    a, b = _seq([1, 2, 3, 4, 5]), _seq([1, 2, 3, 4, 6])
    bm.allocate(a, [])
    bm.allocate(b, [])  # same content computed twice in one step: both register the same hash
    _compute_all(bm, a)
    _compute_all(bm, b)
    owner = bm.hash_to_block_id[bm.blocks[b.block_table[0]].hash]
    assert owner == b.block_table[0]
    bm.deallocate(a)
    bm.deallocate(b)
    # The allocator reuses a's old block first; b's entry for the hash must survive that.
    c = _seq([7, 7, 7])
    bm.allocate(c, [])
    assert bm.match_prefix(_seq([1, 2, 3, 4, 9])) == [owner]


def test_decode_appends_a_block_only_at_a_block_boundary():
    bm = BlockManager(3, BS)
    seq = _seq([1, 2, 3, 4])
    bm.allocate(seq, [])
    seq.num_computed_tokens = 4
    seq.append_token(5)  # token 5 sits at position 4: a new block is needed to compute it
    assert bm.try_append(seq)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    seq.append_token(6)
    assert bm.try_append(seq)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    seq.append_token(7)
    seq.append_token(8)
    seq.append_token(9)  # position 8 starts a third block: the pool (3 blocks) has one left
    assert bm.try_append(seq) and len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    for token in (10, 11, 12, 13):
        seq.append_token(token)  # position 12: a fourth block, and none is free
    assert not bm.try_append(seq) and len(seq.block_table) == 3


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a, [])
    _compute_all(bm, a)
    assert bm.match_prefix(_seq([1, 2, 3, 4, 5])) == []
