"""One-token attention that reads each row's own blocks of the cache, up to the row's own position.

A decoding step of several rows (a server's batch) attends each row to the blocks its block table
names (kv_cache.py), each row at its own position. PyTorch's FlexAttention reads them through a
block mask made on the device from the rows' tables and positions: every block before the one
holding a row's position whole, that one up to the position, nothing else. So a step reads what
the rows hold, not max_seq_len positions a row, and has fixed shapes whatever the rows' lengths,
with no host sync, as a step replayed as one CUDA graph needs (step_graphs.py).
"""

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .kv_cache import BLOCK_POSITIONS

# The narrowest heads FlexAttention's compiled kernels take (every published Llama's are 64 or wider).
MIN_HEAD_DIM = 16


class StepMasks:
    """The block masks of one-token steps of up to max_rows rows, over pools of pool_positions.

    The compiled kernels read only the blocks a mask lists for each row; the rule it applies
    within them (FlexAttention's mask_mod, which FlexAttention applies everywhere when it runs
    eagerly, so it says all) sees a place where the row's table holds its block, up to the row's
    position. It reads each row's position and each pool block's place in the row's table from
    tensors kept for the life of the caches: a rule that closes over the same tensors every step
    is the same function to the compiler (no recompiles). (Listing a row's blocks before its
    position's as whole ones, to which no rule applies, fails in FlexAttention's CPU code.)"""

    def __init__(self, max_rows: int, pool_positions: int, device: torch.device):
        self.pool_positions = pool_positions
        self.pool_blocks = pool_positions // BLOCK_POSITIONS
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        # [max_rows, pool blocks]: each block's place in the row's table (pool_blocks: not the row's)
        self.block_places = torch.zeros(max_rows, self.pool_blocks, dtype=torch.long, device=device)
        self.rule = _up_to_own_position(self.positions, self.block_places)

    def block_mask(self, tables: torch.Tensor, positions: torch.Tensor) -> BlockMask:
        """The mask of a step whose rows [bsz] have these block tables [bsz, blocks a row] and sit at
        these positions: each row reads its blocks up to its position's, and sees them up to the
        position."""
        bsz, row_blocks = tables.shape
        self.positions[:bsz].copy_(positions)
        places = torch.arange(row_blocks, device=tables.device).expand(bsz, -1)
        # A table's unused entries repeat its last block: the block's first place is its own.
        self.block_places[:bsz].fill_(self.pool_blocks).scatter_reduce_(1, tables, places, "amin")
        # A mask's lists of blocks span the pool (FlexAttention sizes the keys it reads by them):
        # each row's blocks up to its position's, the rest never read.
        blocks = tables.new_zeros(bsz, self.pool_blocks, dtype=torch.int32)
        blocks[:, :row_blocks] = tables
        seen = (positions // BLOCK_POSITIONS + 1).to(torch.int32)
        return BlockMask.from_kv_blocks(seen[:, None, None], blocks[:, None, None], BLOCK_SIZE=BLOCK_POSITIONS,
                                        mask_mod=self.rule, seq_lengths=(1, self.pool_positions), compute_q_blocks=False)


def _up_to_own_position(positions: torch.Tensor, block_places: torch.Tensor) -> Callable:
    def sees(row, head, query, place):  # place: a position of the pool
        in_row = block_places[row, place // BLOCK_POSITIONS] * BLOCK_POSITIONS + place % BLOCK_POSITIONS
        return in_row <= positions[row]

    return sees


def attend_own_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """The attention of one query a row, q [bsz, heads, 1, head_dim], to its own positions in the
    pools of keys and values [1, kv heads, positions, head_dim], as block_mask says:
    [bsz, heads, 1, head_dim]. Every row reads the one pool (FlexAttention's batch of one
    key-value sequence for all queries) through its own blocks."""
    # q is a view of the rotated queries and keys, which FlexAttention's CPU code cannot read: a copy
    # (contiguous() is no copy where every other dimension is 1)
    return flex_attention(q.clone(), keys, values, block_mask=block_mask, enable_gqa=q.shape[1] != keys.shape[1])
