"""Each layer's keys and values in blocks of positions, which blocks hold each cache row's
positions (block tables), and where a pass's tokens sit in them.

The keys and values of every cache row share one pool a layer, in blocks of BLOCK_POSITIONS
positions; a row's positions are found through its block table (BlockTables). Blocks need not
follow one another, so a row holds the blocks its tokens fill and two rows can hold the same ones
(the engine hands them out: engine/blocks.py). The pool's last block is scratch: a table's entries
past the blocks its row holds name it, so that a pass's padding, and guesses that run past a row's
blocks, land where no row reads. Until a table is given, cache row r holds its own run of blocks,
r's after r - 1's, as a cache of max_batch_size rows of max_seq_len positions would, where the pool
has room for it, and a batch of consecutive rows reads its keys and values in place (CacheRows.run).
"""

from typing import Mapping, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from ..kernels import cpu_kernels

# Positions in a block: a block is one part of our CPU kernel's attention (a task of its own for
# a long context) and one of FlexAttention's blocks on a GPU.
BLOCK_POSITIONS = 64

# Eagerly, a step of up to this many tokens a row attends through our CPU kernel, token after
# token as in steps of their own (guesses to verify, a short chunk of prompt); longer prompts
# through torch's flash attention, which takes many queries at a time.
MAX_KERNEL_STEP_TOKENS = 16


# A block table's entry for a block its sequence gave back, being wholly before the sliding window
# of every token it has yet to feed (engine/scheduler.py): read as the scratch block, which the
# window's mask hides.
NO_BLOCK = -1


def blocks_for(positions: int) -> int:
    """The blocks that hold this many positions."""
    return -(-positions // BLOCK_POSITIONS)


class CacheRows(NamedTuple):
    """Where a forward pass's tokens sit in the KV caches, and which cached positions each one sees.

    Meta's schedule runs a batch as cache rows 0, 1, ... all at one position; a server's batch
    (continuous batching) holds rows anywhere in the cache, each at its own position.
    """

    slots: torch.Tensor  # [bsz] int64: each row's cache row
    positions: torch.Tensor  # [1 or bsz, seqlen] int64: each token's position (1: the same in every row)
    rotary: torch.Tensor  # [1 or bsz, seqlen, head_dim // 2, 2]: the cos and sin of each token's angles
    end: int  # keys and values below this position are read (the farthest row's end)
    # [1 or bsz, 1, seqlen, end] which of them each query sees; None: a prompt from position 0
    # (causal), or one token a row with every row at the same position (all below end).
    mask: Optional[torch.Tensor]
    tables: torch.Tensor  # [bsz, blocks a row] int64: each row's block table
    # The pool position of the first row's position 0, where the rows are consecutive cache rows
    # holding runs of blocks one after another (BlockTables.run_start): their positions are then
    # a view of the pools, [bsz, positions a row] from there. Else None.
    run: Optional[int]
    # [bsz] each row's first position, where an eager step attends through our kernel
    # (step_through_kernel; rotary is contiguous then); else None.
    kernel_starts: Optional[torch.Tensor]
    # Where one token a row reads only its own blocks (Transformer.decode_step, block_attention.py):
    # which blocks each row sees; mask and end are unused then.
    block_mask: Optional[BlockMask] = None
    # Llama 4's chunked layers (Attention.chunked): mask and block_mask for them, each query seeing
    # only its own chunk's positions; None where chunks hide nothing (mask and block_mask then serve).
    chunk_mask: Optional[torch.Tensor] = None
    chunk_block_mask: Optional[BlockMask] = None
    # [bsz, seqlen] the pool positions each token's keys and values go to, where some tokens are
    # padding, not their row's (a whole step's prompt rows: Transformer.mixed_step), which go to
    # the scratch block; None: every token's own position, through tables and positions.
    write_places: Optional[torch.Tensor] = None


class BlockTables:
    """Which blocks of the pools hold each cache row's positions, in order: [cache rows, blocks a
    row] int64 on the device, and the same lists on the host (which decide, without asking the
    device, whether rows can be read in place)."""

    def __init__(self, rows: int, blocks_per_row: int, pool_blocks: int, device: torch.device):
        self.blocks_per_row = blocks_per_row
        self.scratch = pool_blocks - 1
        self.host = [self._own_run(row) for row in range(rows)]
        self.tables = torch.tensor(self.host, dtype=torch.long, device=device)
        self.in_own_run = [self._fits(row) for row in range(rows)]  # whether a row holds the run it starts with

    def give(self, row: int, blocks: Sequence[int]) -> None:
        """Row's positions from now on in blocks (its first positions', then the next's, ...); its
        other entries the scratch block (never read)."""
        self.give_all({row: blocks})

    def give_all(self, changes: Mapping[int, Sequence[int]]) -> None:
        """give() for several rows at once: one copy to the device for all of them (a step's).
        An entry NO_BLOCK (a block given back behind a sliding window) names the scratch block."""
        if not changes:
            return
        rows = list(changes)
        for row, blocks in changes.items():
            table = [self.scratch if block == NO_BLOCK else block for block in blocks]
            table += [self.scratch] * (self.blocks_per_row - len(blocks))
            self.host[row] = table
            self.in_own_run[row] = self._fits(row) and table == self._own_run(row)
        tables = torch.tensor([self.host[row] for row in rows], dtype=torch.long)
        self.tables[torch.tensor(rows, device=self.tables.device)] = tables.to(self.tables.device)

    def _own_run(self, row: int) -> list[int]:
        """The blocks a row starts with: the row's own run, after the row before's (scratch where
        the pool has no room for it)."""
        if not self._fits(row):
            return [self.scratch] * self.blocks_per_row
        return list(range(row * self.blocks_per_row, (row + 1) * self.blocks_per_row))

    def _fits(self, row: int) -> bool:
        return (row + 1) * self.blocks_per_row <= self.scratch

    def of(self, slots: Sequence[int], slot_ids: torch.Tensor) -> torch.Tensor:
        """The rows' tables [bsz, blocks a row] (slot_ids: slots on the device)."""
        first = slots[0]
        if list(slots) == list(range(first, first + len(slots))):
            return self.tables[first : first + len(slots)]
        return self.tables.index_select(0, slot_ids)

    def run_start(self, slots: Sequence[int]) -> Optional[int]:
        """The pool position of slots[0]'s position 0, where the slots are consecutive rows each in
        its own run of blocks (one after another, then): their positions are a view of the pools."""
        first = slots[0]
        if all(slot == first + index and self.in_own_run[slot] for index, slot in enumerate(slots)):
            return first * self.blocks_per_row * BLOCK_POSITIONS
        return None


def block_positions(blocks: Sequence[int], device: torch.device) -> torch.Tensor:
    """Every pool position of these blocks, block after block: [len(blocks) * BLOCK_POSITIONS]."""
    starts = torch.tensor(blocks, dtype=torch.long, device=device)[:, None] * BLOCK_POSITIONS
    return (starts + torch.arange(BLOCK_POSITIONS, device=device)).flatten()


def places(tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where positions [1 or bsz, seqlen] of rows with these block tables [bsz, blocks a row] sit in
    a pool's positions: [bsz, seqlen]."""
    positions = positions.expand(len(tables), -1)
    return tables.gather(1, positions // BLOCK_POSITIONS) * BLOCK_POSITIONS + positions % BLOCK_POSITIONS


class KVCache(nn.Module):
    """One layer's keys and values: pools [1, local kv heads, blocks * BLOCK_POSITIONS, head_dim],
    every block's positions one after another (the one sequence FlexAttention reads for every row)."""

    def __init__(self, blocks: int, n_kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                 kernel_fits: bool = True):
        super().__init__()
        shape = (1, n_kv_heads, blocks * BLOCK_POSITIONS, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        for buffer in (self.k, self.v):
            # A compiled step (CUDA graphs above all) then writes the cache in place, never a copy.
            torch._dynamo.mark_static_address(buffer)
        # Whether one new token attends through our CPU kernel (attention_kernel.cpp): fp32, and
        # heads a whole number of its registers wide, and attention of the kind it computes
        # (kernel_fits: no sliding window or chunks, as it reads each row from position 0, and
        # rotary embeddings in every layer). Decided here, not at every layer's step.
        self.kernel_attends = (cpu_kernels.decoding_kernels_run_on(device) and dtype == torch.float32
                               and head_dim % cpu_kernels.ATTENTION_LANES == 0 and kernel_fits)
        self.register_buffer("heads", torch.arange(n_kv_heads, device=device), persistent=False)
        self.register_buffer("first", torch.zeros(1, dtype=torch.long, device=device), persistent=False)

    def write(self, rows: CacheRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [bsz, heads, seqlen, head_dim] at the rows' positions."""
        if rows.run is not None and len(rows.positions) == 1 and not torch.compiler.is_compiling():
            # Eagerly the cheapest write (6 us against index_put_'s 21 for one token).
            for pool, new in ((self.k, k), (self.v, v)):
                self._rows_in_place(pool, rows, len(k)).index_copy_(2, rows.positions[0], new.transpose(0, 1))
            return
        # Indexed from the pool itself, not through a view of it (self.k[0]): compiled, a write
        # through a view copies the whole pool twice (17 ms a step of a 7B with a 16 GiB pool on an H200).
        written = places(rows.tables, rows.positions) if rows.write_places is None else rows.write_places
        where = (self.first, self.heads[:, None], written.flatten()[None, :])
        self.k.index_put_(where, k.transpose(0, 1).flatten(1, 2))  # heads, bsz * seqlen, head_dim
        self.v.index_put_(where, v.transpose(0, 1).flatten(1, 2))

    def copy_positions(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """The keys and values at pool positions sources [n] written again at targets [n] (the
        blocks a beam copies before writing a block its siblings share: block_positions)."""
        for pool in (self.k, self.v):
            pool[0].index_copy_(1, targets, pool[0].index_select(1, sources))

    def read(self, rows: CacheRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values at positions [0, rows.end): [bsz, heads, end, head_dim]."""
        if rows.run is not None:
            return tuple(self._rows_in_place(pool, rows, len(rows.slots))[:, :, : rows.end].transpose(0, 1)
                         for pool in (self.k, self.v))
        where = places(rows.tables, torch.arange(rows.end, device=rows.tables.device)[None])  # bsz, end
        return self.k[0][:, where].transpose(0, 1), self.v[0][:, where].transpose(0, 1)  # gathered: copies

    def _rows_in_place(self, pool: torch.Tensor, rows: CacheRows, bsz: int) -> torch.Tensor:
        """The positions of rows held in one run of the pool (rows.run): [heads, bsz, positions a row, head_dim]."""
        row_positions = rows.tables.shape[1] * BLOCK_POSITIONS
        return pool[0, :, rows.run : rows.run + bsz * row_positions].unflatten(1, (bsz, row_positions))


def step_through_kernel(seqlen: int, cache: KVCache) -> bool:
    """Whether an eager step of seqlen tokens a row attends through our CPU kernel."""
    return seqlen <= MAX_KERNEL_STEP_TOKENS and cache.kernel_attends
