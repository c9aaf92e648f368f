"""Assembling one rank's slice from any number of shards, in memory: checked against torch.chunk."""

import pytest
import torch

from llama_tp.model.args import ModelArgs
from llama_tp.checkpoint.sharding import Piece, assemble_slice, pieces_for, shard_ranges
from meta_shards import meta_shards
from tiny_checkpoint import TINY_LLAMA2, TINY_LLAMA3, full_weights, split_dim

CPU = torch.device("cpu")
VOCAB = 256  # small: these tests check index arithmetic, not numerics
TINY_KV2 = TINY_LLAMA3 | {"n_kv_heads": 2, "vocab_size": VOCAB}  # fewer KV heads than ranks at world size 4
CASES = {  # params, embedding layout, whether shards beyond the KV heads hold copies of whole heads
    "llama2": (TINY_LLAMA2, "dim", True),
    "llama3": (TINY_LLAMA3 | {"vocab_size": VOCAB}, "vocab", True),
    "kv2": (TINY_KV2, "vocab", True),
    "kv2_half_heads": (TINY_KV2, "vocab", False),  # an even split of wk's and wv's rows
}


def test_ranges_and_pieces():
    args = ModelArgs.from_dict(TINY_KV2)  # 8 query heads, 2 KV heads of size 8
    assert shard_ranges("layers.0.attention.wq.weight", 64, args, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert shard_ranges("layers.0.attention.wk.weight", 16, args, 4) == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert pieces_for((8, 40), [(0, 16), (16, 32), (32, 48), (48, 64)], prefer=0) == [
        Piece(0, 8, 8), Piece(1, 0, 16), Piece(2, 0, 8)]
    replicated = [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert pieces_for((0, 16), replicated, prefer=0) == [Piece(0, 0, 8), Piece(2, 0, 8)]
    assert pieces_for((0, 8), replicated, prefer=1) == [Piece(1, 0, 8)]  # its own file when it holds the part


@pytest.mark.parametrize("case", CASES)
def test_every_shard_count_to_every_world_size(case):
    params, layout, head_copies = CASES[case]
    args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
    weights = full_weights(params, VOCAB)
    counts = [n for n in (1, 2, 4, 8) if args.splits_over(n)]
    for n_shards in counts:
        shards = meta_shards(weights, args, layout, n_shards, head_copies)
        for world_size in counts:
            expected = meta_shards(weights, args, layout, world_size)  # loaded as copies of whole heads
            for rank in range(world_size):
                opened = []
                got = assemble_slice(lambda s: opened.append(s) or shards[s], n_shards, args, layout,
                                     rank, world_size, CPU)
                assert got.keys() == expected[rank].keys()
                for name, tensor in expected[rank].items():
                    assert torch.equal(got[name], tensor), (case, n_shards, world_size, rank, name)
                    assert got[name].untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
                assert len(opened) == len(set(opened)), "a shard was opened twice"
                if n_shards == world_size and head_copies:  # half heads: a whole head is in two files
                    assert sorted(set(opened) - {0}) in ([], [rank]), "a rank read another rank's file"


def test_dtype_conversion_and_no_copy_of_whole_tensors():
    params, layout, _ = CASES["llama3"]
    args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
    shards = meta_shards(full_weights(params, VOCAB), args, layout, 2)
    same = assemble_slice(lambda s: shards[s], 2, args, layout, 1, 2, CPU)
    assert same["norm.weight"] is shards[1]["norm.weight"]  # memory-mapped tensors stay mapped, not copied
    fp32 = assemble_slice(lambda s: shards[s], 2, args, layout, 0, 1, CPU, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in fp32.values())
    on_meta = assemble_slice(lambda s: shards[s], 2, args, layout, 0, 1, torch.device("meta"))
    assert {t.device.type for t in on_meta.values()} == {"meta"}  # copies and whole tensors alike


def test_release_gets_each_source_tensor_once_its_piece_is_copied():
    params, layout, _ = CASES["llama3"]
    args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
    shards = meta_shards(full_weights(params, VOCAB), args, layout, 2)
    released = []
    # Two shards merged: each piece of a split tensor is copied, then released; a replicated
    # tensor is taken as it is, and kept.
    assemble_slice(lambda s: shards[s], 2, args, layout, 0, 1, CPU, release=released.append)
    split = [name for name in shards[0] if split_dim(name, layout) is not None]
    assert sorted(map(id, released)) == sorted(id(shards[s][name]) for s in range(2) for name in split)
    released.clear()
    assemble_slice(lambda s: shards[s], 2, args, layout, 1, 2, CPU, release=released.append)
    assert released == []  # every tensor taken as it is
    assemble_slice(lambda s: shards[s], 2, args, layout, 1, 2, CPU, dtype=torch.float64, release=released.append)
    assert sorted(map(id, released)) == sorted(map(id, shards[1].values()))  # converted: each source released


def test_mismatched_shards_are_refused():
    params, layout, _ = CASES["llama3"]
    args = ModelArgs.from_dict(params).with_vocab_size(VOCAB)
    shards = meta_shards(full_weights(params, VOCAB), args, layout, 2)
    shards[1]["layers.1.feed_forward.w2.weight"] = shards[1]["layers.1.feed_forward.w2.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"^1: layers.1.feed_forward.w2.weight is \[64, 111\] where the first shard "
                       r"has \[64, 112\]; the shards do not belong to one checkpoint$"):
        assemble_slice(lambda s: shards[s], 2, args, layout, 0, 1, CPU)
    del shards[1]["layers.1.feed_forward.w2.weight"]
    with pytest.raises(ValueError, match=r"^1: layers.1.feed_forward.w2.weight is no such tensor where the first "
                       r"shard has \[64, 112\]; the shards do not belong to one checkpoint$"):
        assemble_slice(lambda s: shards[s], 2, args, layout, 0, 1, CPU)
    kv2 = ModelArgs.from_dict(TINY_KV2).with_vocab_size(VOCAB)  # params.json says 2 KV heads, shards hold 4
    with pytest.raises(ValueError, match="does not make 2 KV heads of size 8; check that params.json belongs to these shards$"):
        assemble_slice(lambda s: shards[s], 2, kv2, layout, 0, 1, CPU)


def test_world_size_that_cannot_work_names_the_ones_that_do():
    with pytest.raises(ValueError, match="cannot be split over 3 processes.*world sizes that work: 1, 2, 4, 8"):
        ModelArgs.from_dict(TINY_KV2).with_vocab_size(VOCAB).check_model_parallel_size(3)
