"""One-token attention that reads each row's cache only up to the row's own position.

A decoding step of several rows (a server's batch) attends to the cache rows the rows hold, each
at its own position. Run over the whole cache under a mask, a step would read every row's
max_seq_len keys and values whatever the rows hold: 8.6 GB a step for 16 rows of 1024 positions of
the Llama-2-7B shape, beside 13.5 GB of weights. Here PyTorch's FlexAttention skips every block of
positions past a row's end, told by a block mask made from the rows' positions on the device (no
host sync, so that a step replays as one CUDA graph: step_graphs.py) with fixed shapes whatever
the rows' lengths.
"""

from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Positions a block of the mask covers: FlexAttention's own default, which its kernels are tuned for.
BLOCK_POSITIONS = 128
# The narrowest heads FlexAttention's compiled kernels take (every published Llama's are 64 or wider).
MIN_HEAD_DIM = 16


class RowEnds:
    """The last position each cache row's query sees this step, [cache rows] on the device, kept in
    one tensor for the life of the caches: the mask's rule reads it, and a rule that closes over
    the same tensor every step is the same function to the compiler (no recompiles).

    chunk: Llama 4's chunked layers see only the positions of their own chunk of this many
    (their mask: chunk_block_mask), the model's other layers every position up to their own."""

    def __init__(self, cache_rows: int, cache_positions: int, window: Optional[int], device: torch.device,
                 chunk: Optional[int] = None):
        """cache_positions: the caches' length, a whole number of blocks."""
        self.ends = torch.zeros(cache_rows, dtype=torch.long, device=device)
        self.cache_positions = cache_positions
        self.blocks = cache_positions // BLOCK_POSITIONS
        self.block_ids = torch.arange(self.blocks, dtype=torch.int32, device=device).expand(cache_rows, 1, 1, self.blocks)
        self.rule = _window_rule(self.ends, window) if window is not None else _causal_rule(self.ends)
        self.chunk = chunk
        self.chunk_rule = _chunk_rule(self.ends, chunk) if chunk is not None else None
        self.taking_part = torch.zeros_like(self.ends, dtype=torch.bool)

    def block_mask(self, slots: torch.Tensor, positions: torch.Tensor) -> BlockMask:
        """The mask of a step whose rows [bsz] sit in cache rows slots at positions: each of those
        cache rows sees its positions up to its own, the rest nothing (no block at all)."""
        self.ends.zero_().index_copy_(0, slots, positions)
        self.taking_part.zero_().index_fill_(0, slots, True)
        blocks = torch.where(self.taking_part, self.ends // BLOCK_POSITIONS + 1, 0).to(torch.int32)
        return self._mask(blocks, self.block_ids, self.rule)

    def chunk_block_mask(self) -> BlockMask:
        """After block_mask, the same step's mask for chunked layers: each row reads the blocks of
        its own chunk only, from the one that holds the chunk's first position."""
        first = (self.ends // self.chunk * self.chunk // BLOCK_POSITIONS).to(torch.int32)  # cache rows
        blocks = torch.where(self.taking_part, self.ends // BLOCK_POSITIONS + 1 - first, 0).to(torch.int32)
        ids = (self.block_ids + first[:, None, None, None]).clamp(max=self.blocks - 1)
        return self._mask(blocks, ids, self.chunk_rule)

    def _mask(self, blocks: torch.Tensor, ids: torch.Tensor, rule: Callable) -> BlockMask:
        return BlockMask.from_kv_blocks(blocks[:, None, None], ids, BLOCK_SIZE=(BLOCK_POSITIONS, BLOCK_POSITIONS),
                                        mask_mod=rule, seq_lengths=(1, self.cache_positions), compute_q_blocks=False)


def _causal_rule(ends: torch.Tensor) -> Callable:
    def sees(row, head, query, position):
        return position <= ends[row]

    return sees


def _window_rule(ends: torch.Tensor, window: int) -> Callable:
    def sees(row, head, query, position):
        return (position <= ends[row]) & (position > ends[row] - window)

    return sees


def _chunk_rule(ends: torch.Tensor, chunk: int) -> Callable:
    def sees(row, head, query, position):
        return (position <= ends[row]) & (position // chunk == ends[row] // chunk)

    return sees


def attend_cache_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                      block_mask: BlockMask) -> torch.Tensor:
    """The attention of one query a row, q [bsz, heads, 1, head_dim], to the rows' own cache rows
    (slots [bsz]) in keys and values [cache rows, kv heads, positions, head_dim], as block_mask
    says: [bsz, heads, 1, head_dim]. FlexAttention's batch is the cache's rows, so each query is
    placed in its cache row's place (rows outside the step have no blocks: nothing is read for them)."""
    every_row = q.new_zeros(keys.shape[0], *q.shape[1:]).index_copy_(0, slots, q)
    out = flex_attention(every_row, keys, values, block_mask=block_mask, enable_gqa=q.shape[1] != keys.shape[1])
    return out.index_select(0, slots)
