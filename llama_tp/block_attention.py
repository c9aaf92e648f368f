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

    Each row's position is kept in one tensor for the life of the caches: the rule that masks a
    row's last block reads it there, and a rule that closes over the same tensor every step is the
    same function to the compiler (no recompiles)."""

    def __init__(self, max_rows: int, pool_positions: int, device: torch.device):
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.pool_positions = pool_positions
        self.rule = _up_to_own_position(self.positions)

    def block_mask(self, tables: torch.Tensor, positions: torch.Tensor) -> BlockMask:
        """The mask of a step whose rows [bsz] have these block tables [bsz, blocks a row] and sit at
        these positions: each row sees its blocks before its position's whole (no rule to apply),
        and its position's block up to the position."""
        bsz = len(positions)
        self.positions[:bsz].copy_(positions)
        whole = positions // BLOCK_POSITIONS  # blocks before the position's own
        last = tables.gather(1, whole[:, None])  # bsz, 1: the block that holds the position
        one = torch.ones(bsz, 1, 1, dtype=torch.int32, device=positions.device)
        return BlockMask.from_kv_blocks(one, last.to(torch.int32)[:, None, None], whole.to(torch.int32)[:, None, None],
                                        tables.to(torch.int32)[:, None, None], BLOCK_SIZE=BLOCK_POSITIONS,
                                        mask_mod=self.rule, seq_lengths=(1, self.pool_positions),
                                        compute_q_blocks=False)


def _up_to_own_position(positions: torch.Tensor) -> Callable:
    def sees(row, head, query, place):  # place: in the pool; only the row's last block is asked about
        return place % BLOCK_POSITIONS <= positions[row] % BLOCK_POSITIONS

    return sees


def attend_own_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """The attention of one query a row, q [bsz, heads, 1, head_dim], to its own positions in the
    pools of keys and values [1, kv heads, positions, head_dim], as block_mask says:
    [bsz, heads, 1, head_dim]. Every row reads the one pool (FlexAttention's batch of one
    key-value sequence for all queries) through its own blocks."""
    return flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=q.shape[1] != keys.shape[1])
