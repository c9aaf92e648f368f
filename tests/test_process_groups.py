"""Every process group llama_tp and fairscale make waits LLAMA_TP_TIMEOUT, not torch's defaults
(NCCL's 10 minutes, gloo's 30), host objects travel over gloo, and an exchange with nothing
to say pickles nothing."""

import pytest

from distributed import run_world
from process_groups import expected_timeout, joined_with_timeout


@pytest.mark.slow  # a spawned world of two
def test_every_group_carries_the_timeout_and_objects_ride_gloo():
    ranks = run_world(2, joined_with_timeout, 123)
    for rank, seen in enumerate(ranks):
        # the default group and fairscale's model-parallel and data-parallel ones, at the least
        assert len(seen["timeouts"]) >= 3, seen["timeouts"]
        assert set(seen["timeouts"].values()) == {expected_timeout(123)}, seen["timeouts"]
        assert seen["object_backends"] and set(seen["object_backends"]) == {"gloo"}
        assert seen["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert seen["sent"] == "from rank 0"
        assert seen["device"] == "cpu" and seen["default_backend"] == "gloo"
        assert seen["quiet"] == (None, 0)  # no rank had news: no pickles
        assert seen["news"] == [0, 1]  # one rank had: everyone's
