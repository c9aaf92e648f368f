"""parallel.vocab_argmax: each rank's slice of the logits in, the best token of the whole vocabulary
out, the first of equal best as max over the whole row picks."""

import pytest
import torch

from distributed import run_world
from llama_tp import parallel

SLICE = 5


def whole_rows(world_size: int) -> torch.Tensor:
    """Logits [rows, world_size * SLICE] whose best lies in every kind of place."""
    rows = torch.randn(6, world_size * SLICE, generator=torch.Generator().manual_seed(0))
    rows[0, -1] = 9.0  # the last rank's last column
    rows[1, 1] = 9.0  # rank 0's
    rows[2, [3, SLICE + 2]] = 9.0  # equal best on two ranks: rank 0's, the lower index
    rows[3, [SLICE + 1, SLICE + 4]] = 9.0  # equal best within one rank's slice: the first
    rows[4, [SLICE + 3, 2 * SLICE - 1]] = 9.0  # equal best at the end of rank 1's slice
    rows[5] = -2.0  # all equal: the first column
    return rows


def pick_from_my_slice(world_size: int) -> torch.Tensor:
    rank = parallel.init().rank
    return parallel.vocab_argmax(whole_rows(world_size)[:, rank * SLICE : (rank + 1) * SLICE])


# World size 3 is a second spawned world (tens of seconds): in the full suite only.
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_vocab_argmax_equals_max_over_whole_rows(world_size):
    expected = whole_rows(world_size).max(dim=-1).indices
    assert expected[:4].tolist() == [world_size * SLICE - 1, 1, 3, SLICE + 1]
    for rank, ids in enumerate(run_world(world_size, pick_from_my_slice, world_size)):
        assert ids.dtype == torch.long
        assert torch.equal(ids, expected), f"rank {rank}"
