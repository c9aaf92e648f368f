"""Running a launch script as a world-size-2 job in tests: under torchrun, or forked from a warm process.

torchrun pays for importing torch in the launcher and in every rank (about 4 seconds a job on
this machine); the forked runner imports llama_tp once in a multiprocessing fork server and
starts each rank from it with torchrun's environment, so a table of mistakes stays cheap. It
also asks more than torchrun does: nobody kills the other ranks when one fails, so each rank
must stop by itself.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from distributed import rendezvous

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LAUNCH = PROJECT_ROOT / "launch"
# Imported once by the fork server, so forked ranks start in milliseconds.
WARM_MODULES = ["fire", "llama_tp", "llama_tp.tools.cli", "llama_tp.generation"]


@dataclass
class Job:
    returncodes: list[int]  # one per rank; torchrun's own exit code for torchrun jobs
    stderr: list[str]  # one per rank; torchrun's whole stderr for torchrun jobs
    stdout: str
    seconds: float


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child python: this checkout's llama_tp first, one thread per rank."""
    env = {key: value for key, value in os.environ.items() if key != "LLAMA_TP_DEBUG"}
    path = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))  # the caller's after ours
    return env | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"} | extra


def torchrun_command(script: Path, args: list[str], nproc: int = 2, launcher: tuple[str, ...] = ()) -> list[str]:
    """launcher: more of torchrun's own options."""
    # --standalone: the rendezvous binds a port the OS chooses, and the ranks join its store
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            *launcher, str(script), *args]


def run_torchrun(script: Path, args: list[str], timeout: float, **env: str) -> Job:
    """Run script under torchrun at world size 2; a job still running after timeout is killed."""
    start = time.perf_counter()
    result = subprocess.run(
        torchrun_command(script, args), cwd=PROJECT_ROOT, env=subprocess_env(**env),
        capture_output=True, text=True, timeout=timeout,
    )
    return Job([result.returncode], [result.stderr], result.stdout, time.perf_counter() - start)


def run_forked(script: Path, args: list[str], timeout: float, world_size: int = 2,
               started: Optional[list[int]] = None, **env: str) -> Job:
    """Run script as world_size ranks forked from a warm server, with torchrun's environment.

    started: the ranks to start (all by default); the others never turn up.
    """
    context = _fork_server()
    with rendezvous() as environment:
        return _run_ranks(context, script, args, timeout, world_size, started, env | environment)


def _run_ranks(context, script: Path, args: list[str], timeout: float, world_size: int,
               started: Optional[list[int]], env: dict[str, str]) -> Job:
    started = list(range(world_size)) if started is None else started
    logs = [Path(os.environ.get("TMPDIR", "/tmp")) / f"llama_tp_rank{r}_{os.getpid()}_{env['MASTER_PORT']}.log"
            for r in started]
    ranks = [
        context.Process(target=_rank_main, args=(str(script), args, rank, world_size, str(log), env))
        for rank, log in zip(started, logs)
    ]
    for log in logs:
        log.write_text("")  # so a rank that never started reads as silent
    start = time.perf_counter()
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(max(0.0, timeout - (time.perf_counter() - start)))
    seconds = time.perf_counter() - start
    for rank in ranks:
        if rank.is_alive():  # a hang: the test fails on the exit code, but leave nothing behind
            rank.kill()
            rank.join()
    stderr = [log.read_text() for log in logs]
    for log in logs:
        log.unlink()
    return Job([rank.exitcode for rank in ranks], stderr, "", seconds)


_context = None


def _fork_server():
    global _context
    if _context is None:
        # The server inherits this sys.path: make it import this checkout's llama_tp.
        if str(PROJECT_ROOT) not in sys.path:
            sys.path.insert(0, str(PROJECT_ROOT))
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(WARM_MODULES)
    return _context


def _rank_main(script: str, args: list[str], rank: int, world_size: int, log: str, env: dict[str, str]) -> None:
    """One rank, as torchrun would start it: its environment, argv, and stderr to a file."""
    import torch  # already imported by the fork server

    torch.set_num_threads(1)
    os.environ.pop("LLAMA_TP_DEBUG", None)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    stream = open(log, "a")
    os.dup2(stream.fileno(), 2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def start_torchrun(script: Path, args: list[str], stderr_path: Path, launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start a world-size-2 torchrun job in its own session (so a signal can go to its group);
    launcher: more of torchrun's own options."""
    return subprocess.Popen(
        torchrun_command(script, args, launcher=launcher), cwd=PROJECT_ROOT, env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=stderr_path.open("w"), text=True, start_new_session=True,
    )


@contextmanager
def plain_ranks(args: list[str], folder: Path, world_size: int = 2, **env: str) -> Iterator[list[subprocess.Popen]]:
    """`python args` as world_size ranks, each a process of its own with torchrun's environment and
    no launcher that would stop the others when one dies (as for ranks on other hosts); rank N's
    stdout and stderr go to folder/rankN.out and .err. Whatever still runs at the end is killed."""
    ranks: list[subprocess.Popen] = []
    with rendezvous() as environment:
        try:
            for rank in range(world_size):
                place = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                             LOCAL_WORLD_SIZE=str(world_size))
                ranks.append(subprocess.Popen(
                    [sys.executable, *args], cwd=PROJECT_ROOT, env=subprocess_env(**environment, **env, **place),
                    stdout=(folder / f"rank{rank}.out").open("w"), stderr=(folder / f"rank{rank}.err").open("w"),
                ))
            yield ranks
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                rank.wait()


def wait_for_text(ranks: list[subprocess.Popen], paths: list[Path], text: str, timeout: float) -> None:
    """Wait until each of paths holds text; fail if a rank ends first or it takes longer."""
    deadline = time.monotonic() + timeout
    while not all(text in path.read_text() for path in paths):
        ended = [rank.args for rank in ranks if rank.poll() is not None]
        assert not ended, f"a rank ended before writing {text!r}: " + " ".join(
            path.read_text() for path in paths[0].parent.glob("rank*.err"))
        assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        time.sleep(0.1)


def wait_for_log_line(job: subprocess.Popen, stderr_path: Path, text: str, timeout: float) -> None:
    """Wait until the job's stderr (where the library logs) holds text; fail if it ends or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in stderr_path.read_text():
            return
        if job.poll() is not None:
            raise AssertionError(f"the job ended (exit {job.returncode}) before logging {text!r}")
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {timeout} s")


def alive(pids: list[int]) -> list[int]:
    """The pids in pids that are still running (not gone, not a zombie)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone
            continue
        if state != "Z":
            running.append(pid)
    return running


def http_process(rank: int) -> Optional[int]:
    """The pid of the HTTP process a serving rank 0 started (serve/http_process.py), if it runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == rank and b"spawn_main" in command:
            return int(entry.name)
    return None


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the workers a torchrun launcher started."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parent == launcher:
            for variable in environ:
                if variable.startswith(b"RANK="):
                    ranks[int(variable[5:])] = int(entry.name)
    return ranks
