"""The peer watchdog (parallel/watchdog.py) on the CPU: a rank waiting where no timeout reaches it,
as a GPU waits inside a CUDA graph's all-reduce, ends with our one line when another rank is
killed or stopped; a rank whose own collectives notice the loss says so once, in its own words;
ranks that leave the job together stop watching together. Each rank is a plain process with no
launcher to stop it (as on another host): it has to end by itself. tests/gpu does the same on a GPU."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import PROJECT_ROOT, plain_ranks, wait_for_text

pytestmark = pytest.mark.slow  # two processes a test

STUCK_RANK = str(PROJECT_ROOT / "tests" / "stuck_rank.py")
TIMEOUT = 10  # LLAMA_TP_TIMEOUT in these jobs
START_LIMIT = 60  # seconds for two ranks to import torch and meet on a busy machine
LOST = "llama_tp error on rank 0: lost contact with another process of this job"
WATCHDOGS_WORDS = "this rank's GPU would wait for it forever"


def seconds_to_end(rank: subprocess.Popen, limit: float) -> float:
    """How long the rank takes to exit, failing (the rank then killed) past limit."""
    start = time.monotonic()
    try:
        rank.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank still running {limit} s after its peer was lost: a hang")
    return time.monotonic() - start


def lose_rank_1(tmp_path: Path, wait: str, how: signal.Signals) -> tuple[subprocess.Popen, float, str]:
    """Rank 0 waits as `wait` says; rank 1 gets the signal `how` once both are ready. Rank 0's
    seconds to end, and its stderr."""
    with plain_ranks([STUCK_RANK, "--wait", wait], tmp_path, LLAMA_TP_TIMEOUT=str(TIMEOUT)) as ranks:
        wait_for_text(ranks, [tmp_path / "rank0.out", tmp_path / "rank1.out"], "ready", START_LIMIT)
        os.kill(ranks[1].pid, how)
        seconds = seconds_to_end(ranks[0], 3 * TIMEOUT)
    return ranks[0], seconds, (tmp_path / "rank0.err").read_text()


def test_a_killed_rank_ends_a_rank_that_waits_where_no_timeout_reaches(tmp_path):
    rank, seconds, stderr = lose_rank_1(tmp_path, "lock", signal.SIGKILL)
    assert rank.returncode == 1 and seconds < TIMEOUT, (seconds, stderr)  # the meeting fails at once
    assert stderr.count("llama_tp error") == 1 and LOST in stderr and WATCHDOGS_WORDS in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_a_stopped_rank_ends_it_after_the_timeout(tmp_path):
    rank, seconds, stderr = lose_rank_1(tmp_path, "lock", signal.SIGSTOP)
    assert rank.returncode == 1 and seconds < 2 * TIMEOUT, (seconds, stderr)
    expected = f"llama_tp error on rank 0: heard nothing from another process of this job for {TIMEOUT} s"
    assert stderr.count("llama_tp error") == 1 and expected in stderr and "set LLAMA_TP_TIMEOUT" in stderr, stderr


def test_a_rank_whose_collectives_notice_the_loss_says_so_once_itself(tmp_path):
    rank, seconds, stderr = lose_rank_1(tmp_path, "collectives", signal.SIGKILL)
    assert rank.returncode == 1 and seconds < TIMEOUT, (seconds, stderr)
    assert stderr.count("llama_tp error") == 1 and LOST in stderr, stderr
    assert WATCHDOGS_WORDS not in stderr, stderr  # the script's own message (cli.run), not the watchdog's


def test_ranks_that_leave_together_stop_watching_together(tmp_path):
    with plain_ranks([STUCK_RANK, "--wait", "none", "--linger", "2"], tmp_path, LLAMA_TP_TIMEOUT=str(TIMEOUT),
                     ) as ranks:
        wait_for_text(ranks, [tmp_path / "rank0.out", tmp_path / "rank1.out"], "ready", START_LIMIT)
        for rank in ranks:
            seconds_to_end(rank, 3 * TIMEOUT)
    for number, rank in enumerate(ranks):
        stderr = (tmp_path / f"rank{number}.err").read_text()
        assert rank.returncode == 0 and "llama_tp error" not in stderr and "Traceback" not in stderr, stderr


def test_ranks_that_end_without_leaving_wait_for_each_other(tmp_path):
    """A program of one's own that never calls parallel.leave: rank 1, still at work seconds after
    rank 0 has ended, is not taken for lost; they leave together as the interpreter exits."""
    with plain_ranks([STUCK_RANK, "--wait", "none", "--linger", "8", "--leave", "false"], tmp_path,
                     LLAMA_TP_TIMEOUT=str(TIMEOUT)) as ranks:
        wait_for_text(ranks, [tmp_path / "rank0.out", tmp_path / "rank1.out"], "ready", START_LIMIT)
        for rank in ranks:
            seconds_to_end(rank, 3 * TIMEOUT)
    for number, rank in enumerate(ranks):
        stderr = (tmp_path / f"rank{number}.err").read_text()
        assert rank.returncode == 0 and "llama_tp error" not in stderr, stderr


def test_a_rank_that_ends_on_a_bug_ends_the_others_without_waiting_for_them(tmp_path):
    with plain_ranks([STUCK_RANK, "--wait", "lock", "--crash_rank", "1"], tmp_path,
                     LLAMA_TP_TIMEOUT=str(TIMEOUT)) as ranks:
        wait_for_text(ranks[:1], [tmp_path / "rank0.out"], "ready", START_LIMIT)
        assert seconds_to_end(ranks[1], 3 * TIMEOUT) < TIMEOUT  # gone at once, its traceback printed
        seconds = seconds_to_end(ranks[0], 3 * TIMEOUT)
    stderr = (tmp_path / "rank0.err").read_text()
    assert "RuntimeError: a bug on this rank" in (tmp_path / "rank1.err").read_text()
    assert ranks[0].returncode == 1 and seconds < TIMEOUT and LOST in stderr, (seconds, stderr)
