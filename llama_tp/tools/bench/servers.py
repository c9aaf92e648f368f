"""Servers the serving benchmark starts itself, one at a time so that they never share the cores:
ours (launch/serve.py under torchrun, fp32 or int4) and llama.cpp's own C++ `llama-server` on the
demo model's GGUF (../shared/tools/build-llama-cpp.sh builds it)."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

import httpx

# Loading the demo model (and our kernels' first build) takes a while on 2 busy cores.
START_TIMEOUT_SECONDS = 900
THREADS = len(os.sched_getaffinity(0))  # every core the benchmark may use (`taskset` narrows it), one process
LLAMA_SERVER_CONTEXT = 16384  # -c: shared by its -np slots, 1024 tokens each at 16 clients

LAUNCH_SERVE = Path(__file__).resolve().parents[3] / "launch" / "serve.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ours_command(quantize: str, port: int, max_batch_size: int, options: Sequence[str] = ()) -> list[str]:
    """Our server on the demo model, one process; quantize "fp32" is none; options: more of
    launch/serve.py's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(LAUNCH_SERVE), "--port", str(port), "--max_batch_size", str(max_batch_size), *options]
    return command + ([] if quantize == "fp32" else ["--quantize", quantize])


def llama_server_command(binary: str, gguf: str, port: int, slots: int, context: int = LLAMA_SERVER_CONTEXT) -> list[str]:
    """llama.cpp's server with continuous batching over `slots` clients sharing a context of
    `context` tokens (-c), as the issue ran it."""
    path = Path(binary)
    if path.is_dir():  # the folder build-llama-cpp.sh prints
        path = path / "llama-server"
    if not path.is_file():
        raise FileNotFoundError(f"--llama_server {binary} is not llama.cpp's llama-server binary; build it with "
                                "../shared/tools/build-llama-cpp.sh and pass the path it prints")
    return [str(path), "-m", gguf, "-t", str(THREADS), "-np", str(slots), "-c", str(context),
            "--host", "127.0.0.1", "--port", str(port)]


@contextmanager
def started(name: str, command: list[str], port: int) -> Iterator[str]:
    """Run command until /health answers 200, yield its URL, then stop it (SIGTERM, then SIGKILL)."""
    env = os.environ | {"OMP_NUM_THREADS": str(THREADS)}
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(name, process, url, log)
            print(f"{name}: serving at {url}", flush=True)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(name: str, process: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} exited with code {process.returncode} before answering:\n"
                               f"{log.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{name} did not answer {url}/health within {START_TIMEOUT_SECONDS} s")


def server_for(name: str, port: int, slots: int, llama_server: Optional[str], gguf: str, options: Sequence[str] = (),
               context: int = LLAMA_SERVER_CONTEXT):
    """The context manager that runs server `name` ("ours-fp32", "ours-int4", "llama-server"):
    ours with more options of launch/serve.py, llama-server with a context of `context` tokens."""
    if name == "llama-server":
        if llama_server is None:
            raise ValueError("--peer llama-server needs --llama_server PATH: the llama-server binary (or the folder "
                             "../shared/tools/build-llama-cpp.sh prints)")
        return started(name, llama_server_command(llama_server, gguf, port, slots, context), port)
    return started(name, ours_command(name.removeprefix("ours-"), port, slots, options), port)
