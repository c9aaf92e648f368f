"""The offline benchmark's schedule: the sides take turns, and each side's runs sum into one figure."""

import pytest

from llama_tp.tools.bench.offline import alternating, dialogs, main, summed


def test_the_sides_take_turns_so_that_drift_weighs_on_both():
    assert alternating(1) == ["script", "server"]
    assert alternating(2) == ["script", "server", "server", "script"]
    assert alternating(3) == ["script", "server", "server", "script", "script", "server"]


def test_a_side_is_its_tokens_over_its_seconds_not_the_mean_of_its_rates():
    side = summed([{"seconds": 10.0, "output_tokens": 1000}, {"seconds": 30.0, "output_tokens": 1000}])
    assert side == {"seconds": 40.0, "output_tokens": 2000, "output_tokens_per_s": pytest.approx(50.0)}


def test_the_dialogs_mix_short_and_long_answers():
    jobs = dialogs(16)
    assert len({job[0]["content"] for job in jobs}) == 16
    assert jobs[0][0]["content"].startswith("Answer in one word:")
    assert jobs[6][0]["content"].startswith("Explain in about 150 words:")


def test_refuses_no_rounds_before_loading_anything():
    with pytest.raises(ValueError, match="--rounds 0"):
        main(rounds=0, ckpt_dir="/nonexistent", tokenizer_path="/nonexistent")
