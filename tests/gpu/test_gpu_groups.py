"""NCCL set-up on GPUs: backend, each rank's own GPU, every group's timeout, host objects on gloo,
vocab_argmax with ties across ranks, and leaving cleanly."""

import pytest
import torch

from distributed import run_world
from gpu_workers import argmax_of_my_slice
from process_groups import expected_timeout, joined_with_timeout


@pytest.mark.gpus(2)
def test_nccl_on_each_ranks_own_gpu_with_the_timeout_everywhere_and_objects_on_gloo():
    for rank, seen in enumerate(run_world(2, joined_with_timeout, 123)):
        assert seen["default_backend"] == "nccl" and seen["device"] == f"cuda:{rank}"
        assert len(seen["timeouts"]) >= 4, seen["timeouts"]  # the default, gloo's and fairscale's
        assert set(seen["timeouts"].values()) == {expected_timeout(123)}, seen["timeouts"]
        assert seen["object_backends"] and set(seen["object_backends"]) == {"gloo"}
        assert seen["gathered"] == [{"rank": 0}, {"rank": 1}] and seen["sent"] == "from rank 0"
        assert seen["quiet"] == (None, 0) and seen["news"] == [0, 1]


@pytest.mark.gpus(2)
def test_vocab_argmax_ties_pick_the_lowest_id_across_gpus():
    rows = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    rows[0, [3, 7]] = 9.0  # equal best on both ranks: rank 0's
    rows[1, [6, 9]] = 9.0  # equal best within rank 1's slice: the first
    rows[2] = -1.0  # all equal: the first column
    expected = rows.max(dim=-1).indices.tolist()
    assert run_world(2, argmax_of_my_slice, rows, 5) == [expected, expected]
