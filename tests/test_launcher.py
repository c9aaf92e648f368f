"""llama-tp (llama_tp/parallel/launcher.py): torchrun's options and jobs, with a failing job told in
one line per rank, in rank order, each on its own line, and nothing of torchrun's own."""

import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

import llama_tp
from llama_tp.parallel import launcher
from jobs import LAUNCH, PROJECT_ROOT, alive, rank_pids, subprocess_env, wait_for_log_line
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

LAUNCHER = [sys.executable, "-m", "llama_tp.parallel.launcher"]  # what the llama-tp command runs


def launch(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCHER, *args], cwd=PROJECT_ROOT, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("launcher") / "ckpt"
    return write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")


def test_version_is_the_packages():
    pyproject = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "llama_tp.__version__"}
    assert pyproject["project"]["scripts"]["llama-tp"] == "llama_tp.parallel.launcher:main"
    result = launch("--version")
    assert (result.returncode, result.stdout) == (0, f"llama-tp {llama_tp.__version__}\n")


@pytest.mark.slow  # torchrun jobs
def test_the_jobs_code_is_the_first_rank_to_exit_by_itself():
    """torchrun stops the other ranks once one fails; whichever it saw end first, the job exits with
    the code of the first rank that exited of its own accord (a usage error's 2), not 1."""
    stopped, usage, later = (SimpleNamespace(exitcode=code, timestamp=at) for code, at in ((-15, 10), (2, 11), (3, 12)))
    assert launcher._job_exit_code([stopped, later, usage]) == 2
    assert launcher._job_exit_code([stopped]) == 1


def test_a_mistake_is_one_line_per_rank_in_rank_order(checkpoint):
    result = launch("--nproc_per_node", "3", str(LAUNCH / "text_completion.py"), "--ckpt_dir", str(checkpoint),
                    "--tokenizer_path", str(LLAMA2_TOKENIZER), "--temprature", "0")
    assert result.returncode == 2
    assert result.stderr == "".join(f"llama_tp error on rank {rank}: --temprature: no such option; did you mean "
                                    "--temperature?\n" for rank in range(3))


# A job's own program that fails with a user mistake once its process group exists; at exit, each
# rank says whether it had left the group by then.
LEAVES_ON_A_MISTAKE = """
import atexit, os
import torch.distributed as dist
from llama_tp import parallel
from llama_tp.tools.cli import run

def main():
    parallel.init()
    atexit.register(lambda: os.write(1, f"rank {os.environ['RANK']} left its process group: "
                                        f"{not dist.is_initialized()}\\n".encode()))  # one write: lines stay whole
    raise ValueError("a mistake")

run(main)
"""


def test_a_rank_that_reports_a_mistake_leaves_its_process_group_before_exiting(tmp_path):
    """Left to interpreter exit, gloo's threads can abort the rank ("terminate called without an
    active exception", printed beside the job's one line per rank): the error path leaves the group
    as a finished job does."""
    program = tmp_path / "mistake.py"
    program.write_text(LEAVES_ON_A_MISTAKE)
    result = launch("--nproc_per_node", "2", str(program))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"llama_tp error on rank {rank}: a mistake" for rank in range(2)]
    assert sorted(result.stdout.splitlines()) == [f"rank {rank} left its process group: True" for rank in range(2)]


@pytest.mark.slow
def test_the_demo_at_a_world_size_it_cannot_split_into_is_refused_in_two_lines(tmp_path):
    result = launch("--nproc_per_node", "2", str(LAUNCH / "chat_completion.py"), LLAMA_TP_HOME=str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "llama_tp error on rank 0: the demo model splits over 1 or 3 processes, not 2; run with --nproc_per_node 1 or 3",
        "llama_tp error on rank 1: rank 0 failed while preparing the demo model: the demo model splits over 1 or 3 "
        "processes, not 2; run with --nproc_per_node 1 or 3"]


@pytest.mark.slow
def test_a_job_that_works_runs_as_under_torchrun(checkpoint):
    result = launch("--nproc_per_node", "1", str(LAUNCH / "text_completion.py"), "--ckpt_dir", str(checkpoint),
                    "--tokenizer_path", str(LLAMA2_TOKENIZER), "--temperature", "0", "--max_gen_len", "4",
                    "--max_seq_len", "64")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("==================================") == 4  # the four example prompts
    assert "torch/distributed" not in result.stderr


@pytest.mark.slow
def test_a_busy_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = launch("--nproc_per_node", "1", "--master_port", str(port), str(LAUNCH / "chat_completion.py"))
    assert result.returncode == 1
    assert result.stderr.startswith(f"llama_tp error: torchrun could not open or reach the rendezvous at 127.0.0.1:"
                                    f"{port} (The server socket has failed to listen")
    assert result.stderr.endswith("pass --master_port with a free port (or leave it out on one machine: a free one "
                                  "is chosen)\n")
    assert result.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named(checkpoint, tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import os, signal\nfrom llama_tp import parallel\nfrom llama_tp.tools.cli import run\n\n"
                      "def main():\n    if parallel.init().rank == 1:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
                      "    parallel.gather_objects(None)\n\nrun(main)\n")
    result = launch("--nproc_per_node", "2", str(script), LLAMA_TP_TIMEOUT="20")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "llama_tp error on rank 1: killed by SIGKILL (see its output above)" in lines
    assert "Traceback" not in result.stderr and "torch/distributed" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_is_one_line_per_rank(checkpoint, tmp_path):
    stderr = tmp_path / "stderr.txt"
    job = subprocess.Popen([*LAUNCHER, "--nproc_per_node", "2", str(LAUNCH / "text_completion.py"), "--ckpt_dir",
                            str(checkpoint), "--tokenizer_path", str(LLAMA2_TOKENIZER), "--max_seq_len", "4096",
                            "--max_gen_len", "4000"], cwd=PROJECT_ROOT, env=subprocess_env(),
                           stdout=subprocess.DEVNULL, stderr=stderr.open("w"), start_new_session=True)
    try:
        wait_for_log_line(job, stderr, "Loaded in", 90)
        ranks = list(rank_pids(job.pid).values())
        os.killpg(job.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches its foreground group
        assert job.wait(timeout=60) == 130
    finally:
        for pid in alive([job.pid, *rank_pids(job.pid).values()]):
            os.kill(pid, signal.SIGKILL)
    assert not alive(ranks)
    lines = stderr.read_text().splitlines()
    assert lines[-2:] == [f"llama_tp stopped on rank {rank}: interrupted (Ctrl-C)" for rank in range(2)]
    assert "Traceback" not in stderr.read_text() and "SignalException" not in stderr.read_text()
