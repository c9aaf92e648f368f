"""Attention of a few tokens a row that reads each row's own blocks of the cache, up to each token's position.

A decoding step of several rows (a server's batch) attends each row to the blocks its block table
names (kv_cache.py), each row at its own position; a verifying pass of speculation feeds each row
a few tokens, at the positions after it. PyTorch's FlexAttention reads them through a block mask
made on the device from the rows' tables and positions: every block before the one holding a
row's last token whole, that one up to the token, nothing else; each token sees the positions up
to its own. So a step reads what the rows hold, not max_seq_len positions a row, and has fixed
shapes whatever the rows' lengths, with no host sync, as a step replayed as one CUDA graph needs
(step_graphs.py).
"""

from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .kv_cache import BLOCK_POSITIONS

# The narrowest heads FlexAttention's compiled kernels take (every published Llama's are 64 or wider).
MIN_HEAD_DIM = 16


class StepMasks:
    """The block masks of steps of up to max_rows rows (a few tokens each), over pools of pool_positions.

    The compiled kernels read only the blocks a mask lists for each row; the rule it applies
    within them (FlexAttention's mask_mod, which FlexAttention applies everywhere when it runs
    eagerly, so it says all) sees a place where the row's table holds its block, up to the query's
    position (the row's first token's, plus the query's place among the row's tokens). It reads each
    row's first position and each pool block's place in the row's table from
    tensors kept for the life of the caches: a rule that closes over the same tensors every step
    is the same function to the compiler (no recompiles). (Listing a row's blocks before its
    position's as whole ones, to which no rule applies, fails in FlexAttention's CPU code.)

    chunk: Llama 4's chunked layers see only the positions of their own chunk of this many
    (chunk_block_mask), the model's other layers every position up to their own."""

    def __init__(self, max_rows: int, pool_positions: int, device: torch.device, chunk: Optional[int] = None):
        self.pool_positions = pool_positions
        self.pool_blocks = pool_positions // BLOCK_POSITIONS
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        # [max_rows, pool blocks]: each block's place in the row's table (pool_blocks: not the row's)
        self.block_places = torch.zeros(max_rows, self.pool_blocks, dtype=torch.long, device=device)
        self.rule = _up_to_own_position(self.positions, self.block_places)
        self.chunk = chunk
        self.chunk_rule = _within_own_chunk(self.positions, self.block_places, chunk) if chunk is not None else None

    def block_mask(self, tables: torch.Tensor, positions: torch.Tensor, width: int = 1,
                   lengths: Optional[torch.Tensor] = None) -> BlockMask:
        """The mask of a step whose rows [bsz] have these block tables [bsz, blocks a row] and feed
        width tokens from these positions: each row reads its blocks up to its last token's, and
        each token sees them up to its own position. lengths [bsz]: each row's own tokens, the rest
        of its width padding (whose blocks it need not read); None: all width of them."""
        bsz, row_blocks = tables.shape
        self.positions[:bsz].copy_(positions)
        places = torch.arange(row_blocks, device=tables.device).expand(bsz, -1)
        # A table's unused entries repeat its last block: the block's first place is its own.
        self.block_places[:bsz].fill_(self.pool_blocks).scatter_reduce_(1, tables, places, "amin")
        # A mask's lists of blocks span the pool (FlexAttention sizes the keys it reads by them):
        # each row's blocks up to its position's, the rest never read.
        seen = (_last_position(positions, width, lengths) // BLOCK_POSITIONS + 1).to(torch.int32)
        return self._mask(tables, seen, width, self.rule)

    def chunk_block_mask(self, tables: torch.Tensor, positions: torch.Tensor, width: int = 1,
                         lengths: Optional[torch.Tensor] = None) -> BlockMask:
        """After block_mask with the same rows, their mask in chunked layers: each row reads its
        blocks from the one that holds its first token's chunk's first position up to its last
        token's, and each token sees its own chunk's positions up to its own."""
        row_blocks = tables.shape[1]
        first = positions // self.chunk * self.chunk // BLOCK_POSITIONS  # bsz: the chunk's first block's place
        places = (torch.arange(row_blocks, device=tables.device) + first[:, None]).clamp(max=row_blocks - 1)
        seen = (_last_position(positions, width, lengths) // BLOCK_POSITIONS + 1 - first).to(torch.int32)
        return self._mask(tables.gather(1, places), seen, width, self.chunk_rule)  # tables from the chunk's block on

    def _mask(self, tables: torch.Tensor, seen: torch.Tensor, width: int, rule: Callable) -> BlockMask:
        """The block mask of rows of width queries reading the first seen [bsz] blocks of tables
        [bsz, blocks], under rule (the queries, fewer than a block, are one block of queries)."""
        bsz, row_blocks = tables.shape
        blocks = tables.new_zeros(bsz, self.pool_blocks, dtype=torch.int32)
        blocks[:, :row_blocks] = tables
        return BlockMask.from_kv_blocks(seen[:, None, None], blocks[:, None, None], BLOCK_SIZE=BLOCK_POSITIONS,
                                        mask_mod=rule, seq_lengths=(width, self.pool_positions), compute_q_blocks=False)


def _last_position(positions: torch.Tensor, width: int, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """Each row's last own token's position [bsz], for rows of width tokens from positions."""
    return positions + (width if lengths is None else lengths) - 1


def _up_to_own_position(positions: torch.Tensor, block_places: torch.Tensor) -> Callable:
    def sees(row, head, query, place):  # query: the token's place among its row's; place: a position of the pool
        in_row = block_places[row, place // BLOCK_POSITIONS] * BLOCK_POSITIONS + place % BLOCK_POSITIONS
        return in_row <= positions[row] + query

    return sees


def _within_own_chunk(positions: torch.Tensor, block_places: torch.Tensor, chunk: int) -> Callable:
    def sees(row, head, query, place):  # query: the token's place among its row's; place: a position of the pool
        in_row = block_places[row, place // BLOCK_POSITIONS] * BLOCK_POSITIONS + place % BLOCK_POSITIONS
        position = positions[row] + query
        return (in_row <= position) & (in_row // chunk == position // chunk)

    return sees


def attend_own_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """The attention of a few queries a row, q [bsz, heads, width, head_dim], to their own
    positions in the pools of keys and values [1, kv heads, positions, head_dim], as block_mask
    says: [bsz, heads, width, head_dim]. Every row reads the one pool (FlexAttention's batch of
    one key-value sequence for all queries) through its own blocks."""
    # q is a view of the rotated queries and keys, which FlexAttention's CPU code cannot read: a copy
    # (contiguous() is no copy where every other dimension is 1)
    return flex_attention(q.clone(), keys, values, block_mask=block_mask, enable_gqa=q.shape[1] != keys.shape[1])
