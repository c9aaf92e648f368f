"""The KV cache's blocks: taken, shared by prefix, cached when their sequences end, and handed out
again least recently used first."""

from hypothesis import given, strategies as st

from llama_tp.engine.blocks import BlockPool, block_keys

BLOCK = 4


def name_blocks(pool: BlockPool, blocks: list[int], tokens: list[int]) -> None:
    """Name each block the next full block of tokens, as the scheduler does once they are filled."""
    parent = b""
    for index, block in enumerate(blocks[: len(tokens) // BLOCK]):
        parent = pool.name(block, parent, tokens[index * BLOCK : (index + 1) * BLOCK])


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
    name_blocks(pool, first, list(range(10)))
    shared = pool.cached_prefix(block_keys(list(range(8)) + [99, 98], BLOCK))
    assert shared == first[:2] and pool.holders[first[0]] == 2
    assert pool.cached_prefix(block_keys([5] * 8, BLOCK)) == []


def test_released_named_blocks_stay_cached_until_none_is_free_then_go_least_recently_used_first():
    pool = BlockPool(4)
    a = pool.take(2)
    name_blocks(pool, a, list(range(8)))
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
                name_blocks(pool, blocks, list(range(size * BLOCK)))
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
        assert {block for runs in pool.runs.values() for block in runs} == set(pool.key_of)  # what is compared is named


def test_forgetting_frees_the_cached_blocks_and_their_names():
    pool = BlockPool(3)
    keys = block_keys([1, 2, 3, 4], BLOCK)
    blocks = pool.take(2)
    name_blocks(pool, blocks, [1, 2, 3, 4])
    pool.release(blocks)
    pool.forget()
    assert not pool.cached and len(pool.free) == 3 and pool.cached_prefix(keys) == []
    assert pool.longest_start(b"", [1, 2, 3]) == (None, 0)


def test_an_engine_gone_gives_back_every_block_its_sequences_held():
    pool = BlockPool(3)
    keys = block_keys([1, 2, 3, 4], BLOCK)
    first = pool.take(2)
    name_blocks(pool, first, [1, 2, 3, 4])
    assert pool.cached_prefix(keys) == first[:1]  # held twice
    pool.release_all()
    assert pool.held == 0 and list(pool.cached) == first[:1]


def test_a_prompt_finds_the_named_block_after_its_shared_ones_that_holds_most_of_its_next_tokens():
    """A chat template's system turn, shorter than a block, then another question: the start a
    prompt can copy from a block that another sequence filled after the same parent."""
    pool = BlockPool(4)
    a, b, c = pool.take(3)
    name_blocks(pool, [a], [1, 2, 3, 4])
    name_blocks(pool, [b], [1, 2, 9, 9])
    parent = pool.name(c, pool.key_of[a], [1, 2, 3, 5])  # after a: another parent
    assert pool.longest_start(b"", [1, 2, 3, 7]) == (a, 3)
    assert pool.longest_start(b"", [1, 2, 9]) == (b, 3)
    assert pool.longest_start(b"", [1, 5]) in ((a, 1), (b, 1))
    assert pool.longest_start(b"", [8, 2, 3]) == (None, 0)
    assert pool.longest_start(b"", [1, 2, 3, 7], shortest=4) == (None, 0)  # 3 is too short a start to copy
    assert pool.longest_start(pool.key_of[a], [1, 2, 3, 4]) == (c, 3) and parent == pool.key_of[c]
    pool.release([c, b, a])  # cached, a the least recently used
    assert pool.longest_start(b"", [1, 2, 3]) == (a, 3)  # a is used: now the most recently
    free = pool.free[-1]
    assert pool.take(2) == [free, b]  # the free block, then the least recently used: b, forgotten
    assert pool.longest_start(b"", [1, 2, 9]) == (a, 2)
