"""The KV cache's pools seen as rows, for tests that compare what cache rows hold."""

import torch

from llama_tp.model.kv_cache import BLOCK_POSITIONS


def by_row(pool: torch.Tensor, model) -> torch.Tensor:
    """A layer's pool [1, kv heads, positions, head_dim] as [cache rows, kv heads, positions a row,
    head_dim] (a view of the rows' own runs, before the scratch block), as long as every row holds
    the run of blocks it starts with."""
    rows = model.max_batch_size
    assert all(model.block_tables.in_own_run[:rows])
    row_positions = model.block_tables.blocks_per_row * BLOCK_POSITIONS
    return pool[0, :, : rows * row_positions].unflatten(1, (rows, row_positions)).transpose(0, 1)
