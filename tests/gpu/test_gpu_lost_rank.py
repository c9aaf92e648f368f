"""Two ranks on ONE GPU through gloo (LLAMA_TP_BACKEND=gloo: NCCL refuses two ranks on one GPU):
they decode what one process decodes, compiled without CUDA graphs (which cannot hold gloo's
collectives); and when one is killed with SIGKILL, the other ends with our one line within
LLAMA_TP_TIMEOUT, never a hang: mid-generation (its own collectives notice), and while it waits on
its GPU behind a kernel that never ends, as a GPU waits inside a CUDA graph's all-reduce (the peer
watchdog ends it). Each rank is a plain process: no launcher stops the survivor for it."""

import os
import signal
import time
from pathlib import Path

import pytest

from distributed import run_world
from gpu_workers import greedy
from jobs import plain_ranks, wait_for_text
from test_interrupts import TEXT, args_for
from test_peer_watchdog import LOST, STUCK_RANK, WATCHDOGS_WORDS, seconds_to_end
from tiny_checkpoint import TINY_LLAMA2, full_weights, write_checkpoint

TIMEOUT = 20  # LLAMA_TP_TIMEOUT in the jobs that lose a rank
START_LIMIT = 120  # seconds for two ranks to start CUDA and load a tiny model


@pytest.fixture
def one_gpu_through_gloo(monkeypatch) -> None:
    """Every rank of the jobs started here on this machine's first GPU, talking through gloo."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    monkeypatch.setenv("LLAMA_TP_BACKEND", "gloo")


def test_two_ranks_on_one_gpu_decode_what_one_process_decodes(checkpoints, tokenizer_path, one_gpu_through_gloo):
    one = run_world(1, greedy, str(checkpoints["llama3", 1]), tokenizer_path, "fp32")
    two = run_world(2, greedy, str(checkpoints["llama3", 2]), tokenizer_path, "fp32", True)  # compiled
    assert two == one * 2


def test_a_rank_killed_mid_generation_ends_the_other_with_our_message(tmp_path, one_gpu_through_gloo):
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    script = [str(TEXT), *args_for(ckpt), "--compile", "false"]  # eager: decoding starts at once
    with plain_ranks(script, tmp_path, LLAMA_TP_TIMEOUT=str(TIMEOUT)) as ranks:
        wait_for_text(ranks, [tmp_path / "rank0.err"], "Loaded in", START_LIMIT)
        time.sleep(1.0)  # decoding by now: thousands of steps to go
        os.kill(ranks[1].pid, signal.SIGKILL)
        seconds = seconds_to_end(ranks[0], 2 * TIMEOUT)
    stderr = (tmp_path / "rank0.err").read_text()
    assert ranks[0].returncode == 1 and seconds < TIMEOUT, (seconds, stderr)
    assert stderr.count("llama_tp error") == 1 and LOST in stderr, stderr
    assert f'File "{TEXT}"' not in stderr, stderr  # no traceback of the script


def test_a_rank_waiting_on_its_gpu_ends_when_another_is_killed(tmp_path: Path, one_gpu_through_gloo):
    with plain_ranks([STUCK_RANK, "--wait", "gpu"], tmp_path, LLAMA_TP_TIMEOUT=str(TIMEOUT)) as ranks:
        wait_for_text(ranks, [tmp_path / "rank0.out", tmp_path / "rank1.out"], "ready", START_LIMIT)
        time.sleep(1.0)  # rank 0 waits for its kernel by now
        os.kill(ranks[1].pid, signal.SIGKILL)
        seconds = seconds_to_end(ranks[0], 2 * TIMEOUT)
    stderr = (tmp_path / "rank0.err").read_text()
    assert ranks[0].returncode == 1 and seconds < TIMEOUT, (seconds, stderr)
    assert stderr.count("llama_tp error") == 1 and LOST in stderr and WATCHDOGS_WORDS in stderr, stderr
