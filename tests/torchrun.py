"""Running launch scripts under torchrun from tests: the project's own copy, a free port, a time limit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


def environment() -> dict[str, str]:
    """This checkout first on the path (before the caller's PYTHONPATH, which may hold the
    dependencies), one thread per process (the test machine is small)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", LLAMA_TP_TIMEOUT="60")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def torchrun_command(nproc: int, *extra: str) -> list[str]:
    # --standalone: the rendezvous binds a port the OS chooses, and the ranks join its store
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *extra]


def run_script(script: str, nproc: int, *args: str, timeout: float = 120, stdin: "str | None" = None,
               env: "dict[str, str] | None" = None) -> subprocess.CompletedProcess:
    """Run launch/<script> under torchrun (env: more environment); fail with its output if it does not exit 0."""
    command = torchrun_command(nproc, str(LAUNCH / script), *args)
    result = subprocess.run(command, cwd=ROOT, env=environment() | (env or {}), input=stdin, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def one_thread():
    """Sampling and tiny models are many small ops: on a small shared machine threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
