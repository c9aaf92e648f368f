"""Attention of one token a row, and of a verifying pass's few, through FlexAttention's block masks
(block_attention.py, the GPU's whole steps), run eagerly on CPU: each row reads its own blocks,
scattered over the pools by its table, each token up to its position, and in Llama 4's chunked
layers only its own chunk's positions; against scaled_dot_product_attention on each token's
positions gathered through its row's table. And the blocks a mask lists, which a GPU's kernels read."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp.model.block_attention import StepMasks, attend_own_blocks
from llama_tp.model.kv_cache import BLOCK_POSITIONS, places

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def scattered(rows: int, blocks_per_row: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables [rows, blocks a row], no row's blocks in order, over a pool with blocks to spare."""
    blocks = rows * blocks_per_row + 2
    return torch.randperm(blocks, generator=generator)[: rows * blocks_per_row].view(rows, blocks_per_row), blocks


def expected(q: torch.Tensor, pools: torch.Tensor, tables: torch.Tensor, positions: list[int], chunk) -> torch.Tensor:
    """Each token's attention to its row's positions up to its own (from its chunk's first, with
    chunk): q [rows, heads, width, head_dim], row r's tokens from positions[r] on."""
    outs = torch.empty_like(q)
    for row, first_position in enumerate(positions):
        for token in range(q.shape[2]):
            position = first_position + token
            first = position // chunk * chunk if chunk is not None else 0
            where = places(tables[row : row + 1], torch.arange(first, position + 1)[None])[0]
            keys, values = (pool[0][:, where][None] for pool in pools)  # 1, kv heads, seen, head_dim
            outs[row, :, token] = F.scaled_dot_product_attention(q[row : row + 1, :, token : token + 1], keys, values,
                                                                 enable_gqa=True)[0, :, 0]
    return outs


# Chunks of whole blocks, of a block and a half (a chunk's first position inside a block) and within
# a block; rows before, at and after a chunk's first position, in the first block and far on.
# Rows of one token, and of four (a verifying pass's: some rows' tokens in two blocks or two chunks).
@pytest.mark.parametrize("chunk", [None, 64, 96, 8])
@pytest.mark.parametrize("width", [1, 4])
def test_each_row_reads_its_own_scattered_blocks_up_to_its_position_and_within_its_chunk(chunk, width):
    generator = torch.Generator().manual_seed(0)
    positions = [0, 7, 63, 64, 95, 96, 100, 191, 200, 252]
    tables, blocks = scattered(len(positions), 4, generator)
    pools = torch.randn(2, 1, KV_HEADS, blocks * BLOCK_POSITIONS, HEAD_DIM, generator=generator)
    q = torch.randn(len(positions), HEADS, width, HEAD_DIM, generator=generator) * 3
    masks = StepMasks(len(positions) + 2, blocks * BLOCK_POSITIONS, torch.device("cpu"), chunk)
    position_ids = torch.tensor(positions)
    mask = masks.block_mask(tables, position_ids, width)
    if chunk is not None:
        mask = masks.chunk_block_mask(tables, position_ids, width)
    got = attend_own_blocks(q, pools[0], pools[1], mask)
    torch.testing.assert_close(got, expected(q, pools, tables, positions, chunk), atol=1e-5, rtol=0)


def test_a_chunks_mask_lists_only_the_blocks_from_its_chunks_first_position_on():
    """What the GPU's kernels read: a row at position 200 with chunks of 128 reads the blocks of
    positions 128-200 (its table's third and fourth), not the two before."""
    tables = torch.tensor([[7, 2, 5, 0]])
    masks = StepMasks(1, 8 * BLOCK_POSITIONS, torch.device("cpu"), chunk=128)
    masks.block_mask(tables, torch.tensor([200]))
    mask = masks.chunk_block_mask(tables, torch.tensor([200]))
    assert mask.kv_num_blocks.flatten().tolist() == [2]
    assert mask.kv_indices.flatten()[:2].tolist() == [5, 0]


def test_a_rows_tokens_read_the_blocks_up_to_its_last_tokens():
    """A verifying pass's row of 4 tokens from position 62 reads the blocks of positions 0-65 (its
    table's first two), one token there the first alone; with chunks of 128, a row from position
    126 reads from its first token's chunk on, up to its last token's block."""
    tables = torch.tensor([[7, 2, 5, 0]])
    masks = StepMasks(1, 8 * BLOCK_POSITIONS, torch.device("cpu"), chunk=128)
    assert masks.block_mask(tables, torch.tensor([62])).kv_num_blocks.flatten().tolist() == [1]
    mask = masks.block_mask(tables, torch.tensor([62]), width=4)
    assert mask.kv_num_blocks.flatten().tolist() == [2] and mask.kv_indices.flatten()[:2].tolist() == [7, 2]
    masks.block_mask(tables, torch.tensor([126]), width=4)
    mask = masks.chunk_block_mask(tables, torch.tensor([126]), width=4)
    assert mask.kv_num_blocks.flatten().tolist() == [3] and mask.kv_indices.flatten()[:3].tolist() == [7, 2, 5]


def test_a_prompt_rows_padding_reads_no_block_past_its_own_tokens():
    """A whole step's prompt row of 64 tokens whose own are fewer (the rest padding) reads the blocks
    up to its last own token's: from position 100 with 20 of its own, those of positions 0-119 (its
    table's first two), where all 64 would reach a third; with chunks of 128, from position 120 with
    5 of its own, its chunk's blocks up to position 124's."""
    tables = torch.tensor([[7, 2, 5, 0]])
    masks = StepMasks(1, 8 * BLOCK_POSITIONS, torch.device("cpu"), chunk=128)
    assert masks.block_mask(tables, torch.tensor([100]), width=64).kv_num_blocks.flatten().tolist() == [3]
    mask = masks.block_mask(tables, torch.tensor([100]), width=64, lengths=torch.tensor([20]))
    assert mask.kv_num_blocks.flatten().tolist() == [2] and mask.kv_indices.flatten()[:2].tolist() == [7, 2]
    masks.block_mask(tables, torch.tensor([120]), width=64, lengths=torch.tensor([5]))
    mask = masks.chunk_block_mask(tables, torch.tensor([120]), width=64, lengths=torch.tensor([5]))
    assert mask.kv_num_blocks.flatten().tolist() == [2] and mask.kv_indices.flatten()[:2].tolist() == [7, 2]
