"""The KV cache's blocks: taken, shared by prefix, cached when their sequences end, and handed out
again least recently used first."""

from hypothesis import given, strategies as st

from llama_tp.engine.blocks import BlockPool, block_keys

BLOCK = 4


def test_keys_name_whole_prefixes_of_full_blocks():
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(keys) == 2  # the partial third block has no key
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK) == keys
    assert block_keys([1, 2, 3, 4, 0, 6, 7, 8], BLOCK)[0] == keys[0]
    assert block_keys([1, 2, 3, 4, 0, 6, 7, 8], BLOCK)[1] != keys[1]
    # the same tokens after another start are another prefix
    assert block_keys([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)[1] != keys[1]


def test_a_prompt_starts_from_the_blocks_that_hold_its_prefix_and_shares_them():
    pool = BlockPool(6)
    first = pool.take(3)
    keys = block_keys(list(range(10)), BLOCK)
    for block, key in zip(first, keys):
        pool.name(block, key)
    shared = pool.cached_prefix(block_keys(list(range(8)) + [99, 98], BLOCK))
    assert shared == first[:2] and pool.holders[first[0]] == 2
    assert pool.cached_prefix(block_keys([5] * 8, BLOCK)) == []


def test_released_named_blocks_stay_cached_until_none_is_free_then_go_least_recently_used_first():
    pool = BlockPool(4)
    a = pool.take(2)
    for block, key in zip(a, block_keys(list(range(8)), BLOCK)):
        pool.name(block, key)
    b = pool.take(2)  # unnamed
    pool.release(a)
    pool.release(b)
    assert pool.available == 4 and pool.held == 0 and len(pool.cached) == 2
    assert sorted(pool.take(2)) == sorted(b)  # free blocks first: the cached prefix survives
    assert pool.cached_prefix(block_keys(list(range(8)), BLOCK)) == a
    pool.release(a)
    taken = pool.take(1)
    assert taken == [a[1]]  # the deeper block of the prefix goes first
    assert pool.cached_prefix(block_keys(list(range(8)), BLOCK)) == [a[0]]  # its start still serves
    assert pool.take(1) is None and pool.held == 4  # b, the block taken, and the shared start


@given(st.lists(st.tuples(st.sampled_from(["take", "share", "release"]), st.integers(0, 3)), max_size=40))
def test_no_block_is_ever_held_and_handed_out_again(operations):
    pool, sequences = BlockPool(8), []
    for operation, size in operations:
        if operation == "take":
            blocks = pool.take(size)
            if blocks is not None:
                held = {b for sequence in sequences for b in sequence}
                assert not held & set(blocks)
                prompt = list(range(size * BLOCK))
                for block, key in zip(blocks, block_keys(prompt, BLOCK)):
                    pool.name(block, key)
                sequences.append(blocks)
        elif operation == "share":
            sequences.append(pool.cached_prefix(block_keys(list(range(size * BLOCK)), BLOCK)))
        elif sequences:
            pool.release(sequences.pop(size % len(sequences)))
        counts = [0] * 8
        for sequence in sequences:
            for block in sequence:
                counts[block] += 1
        assert counts == pool.holders
        assert pool.held == sum(1 for count in counts if count)


def test_forgetting_frees_the_cached_blocks_and_their_names():
    pool = BlockPool(3)
    keys = block_keys([1, 2, 3, 4], BLOCK)
    blocks = pool.take(2)
    pool.name(blocks[0], keys[0])
    pool.release(blocks)
    pool.forget()
    assert not pool.cached and len(pool.free) == 3 and pool.cached_prefix(keys) == []


def test_an_engine_gone_gives_back_every_block_its_sequences_held():
    pool = BlockPool(3)
    keys = block_keys([1, 2, 3, 4], BLOCK)
    first = pool.take(2)
    pool.name(first[0], keys[0])
    assert pool.cached_prefix(keys) == first[:1]  # held twice
    pool.release_all()
    assert pool.held == 0 and list(pool.cached) == first[:1]
