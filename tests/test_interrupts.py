"""Ctrl-C, a killed rank and a killed launcher end a torchrun job within seconds, leaving no process.

Each test starts torchrun in its own session, as a terminal would, and signals it mid-job. Note
that torchrun starts every rank in a session of its own: Ctrl-C reaches the ranks only through
torchrun, which forwards the signal to them.
"""

import os
import signal
import time
from pathlib import Path

import pytest
from jobs import LAUNCH, alive, rank_pids, start_torchrun, wait_for_log_line
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

pytestmark = pytest.mark.slow  # torchrun jobs signalled mid-run

TEXT = LAUNCH / "text_completion.py"
# Thousands of decode steps: the job is still generating when the signal comes.
LONG_RUN = ["--max_seq_len", "4096", "--max_gen_len", "4000"]
START_LIMIT = 60  # seconds for torchrun to start two ranks and load a tiny model on a busy machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("interrupts") / "ckpt"
    return write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")


def args_for(ckpt: Path) -> list[str]:
    return ["--ckpt_dir", str(ckpt), "--tokenizer_path", str(LLAMA2_TOKENIZER), *LONG_RUN]


def started(job, stderr: Path, timeout: float = START_LIMIT) -> list[int]:
    """Wait until the job has loaded the model; return its ranks' pids."""
    wait_for_log_line(job, stderr, "Loaded in", timeout)
    return list(rank_pids(job.pid).values())


def ended_within(job, ranks: list[int], seconds: float) -> float:
    """Wait for torchrun and its ranks to end; return how long that took."""
    start = time.monotonic()
    try:
        job.wait(timeout=seconds)
        while alive(ranks) and time.monotonic() - start < seconds:
            time.sleep(0.1)
    finally:
        leftovers = alive([job.pid, *ranks])
        for pid in leftovers:  # clean up before failing: never leave processes running
            os.kill(pid, signal.SIGKILL)
        job.wait()
        job.stdout.close()
    assert not leftovers, f"processes left behind: {leftovers}"
    return time.monotonic() - start


def test_ctrl_c_during_generation_stops_every_rank(checkpoint: Path, tmp_path: Path):
    stderr = tmp_path / "stderr.txt"
    job = start_torchrun(TEXT, args_for(checkpoint), stderr)
    ranks = started(job, stderr)
    time.sleep(0.5)
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert ended_within(job, ranks, 15) < 15
    assert job.returncode != 0
    text = stderr.read_text()
    for rank in (0, 1):
        assert f"llama_tp stopped on rank {rank}: interrupted (Ctrl-C)" in text, text
    assert not rank_traceback(text), text


def test_ctrl_c_while_a_rank_waits_on_its_shard_stops_every_rank(checkpoint: Path, tmp_path: Path):
    """Rank 1's shard is a pipe nobody writes: it hangs in open() as on a stalled network disk,
    while rank 0 has loaded and waits for rank 1 in the agreement."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "params.json").write_text((checkpoint / "params.json").read_text())
    os.link(checkpoint / "consolidated.00.pth", ckpt / "consolidated.00.pth")
    os.mkfifo(ckpt / "consolidated.01.pth")
    stderr = tmp_path / "stderr.txt"
    job = start_torchrun(TEXT, args_for(ckpt), stderr)
    deadline = time.monotonic() + START_LIMIT
    while len(rank_pids(job.pid)) < 2 or not _blocked_on_fifo(rank_pids(job.pid)[1]):
        assert time.monotonic() < deadline and job.poll() is None, stderr.read_text()
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGINT)
    assert ended_within(job, list(rank_pids(job.pid).values()), 15) < 15
    text = stderr.read_text()
    assert "llama_tp stopped on rank 1: interrupted (Ctrl-C)" in text, text
    assert "llama_tp stopped on rank 0: interrupted (Ctrl-C)" in text or "llama_tp error on rank 0" in text, text
    assert not rank_traceback(text), text


def test_a_killed_rank_ends_the_job(checkpoint: Path, tmp_path: Path):
    stderr = tmp_path / "stderr.txt"
    # torchrun looks at its ranks every 3 s, not every 0.1 s: rank 0 notices the lost peer itself
    # (its next collective fails at once) before torchrun could stop it, and must say so.
    job = start_torchrun(TEXT, args_for(checkpoint), stderr, launcher=("--monitor-interval", "3"))
    ranks = started(job, stderr)
    time.sleep(0.5)
    os.kill(rank_pids(job.pid)[1], signal.SIGKILL)
    assert ended_within(job, ranks, 60) < 60
    assert job.returncode != 0
    text = stderr.read_text()
    assert "llama_tp error on rank 0: lost contact with another process of this job" in text, text
    assert "Signal 9 (SIGKILL)" in text, text
    assert not rank_traceback(text), text


def test_a_killed_launcher_leaves_no_rank_behind(checkpoint: Path, tmp_path: Path):
    stderr = tmp_path / "stderr.txt"
    job = start_torchrun(TEXT, args_for(checkpoint), stderr)
    ranks = started(job, stderr)
    os.kill(job.pid, signal.SIGKILL)  # torchrun gets no chance to stop its ranks
    assert ended_within(job, ranks, 15) < 15
    text = stderr.read_text()
    for rank in (0, 1):
        assert f"llama_tp error on rank {rank}: the launcher (pid {job.pid}) is gone" in text, text


def rank_traceback(stderr: str) -> bool:
    """Whether a rank printed a traceback (torchrun prints its own, which never runs the script)."""
    return f'File "{TEXT}"' in stderr


def _blocked_on_fifo(pid: int) -> bool:
    """Whether the process sleeps in open() of a pipe (the kernel's wait channel for FIFOs)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("fifo_open", "wait_for_partner")
    except OSError:
        return False
