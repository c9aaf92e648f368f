"""A first run killed while our C++ kernels compile must not leave every later run waiting: the next
one finds torch's lock left behind, takes it over, builds, and answers."""

import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs import PROJECT_ROOT, subprocess_env
from llama_tp.kernels import cpu_kernels


def test_a_lock_held_by_a_live_process_is_waited_for_and_one_left_by_a_dead_one_removed(tmp_path, caplog):
    (tmp_path / "lock").write_text("")  # torch's lock, as a builder leaves it while it works
    holder = open(tmp_path / "llama_tp.lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)  # that builder is alive
    entered = threading.Event()

    def build() -> None:
        with cpu_kernels._build_lock(tmp_path):
            entered.set()

    caplog.set_level(logging.INFO, "llama_tp")
    waiter = threading.Thread(target=build)
    waiter.start()
    time.sleep(0.5)
    assert not entered.is_set() and (tmp_path / "lock").exists()  # a live build is never taken over
    assert caplog.messages == [f"waiting for another process that is building llama_tp's CPU kernels in {tmp_path}"]
    holder.close()  # the builder died (its kernel lock went with it) and left torch's lock behind
    waiter.join(5)
    assert entered.is_set() and not (tmp_path / "lock").exists()
    assert caplog.messages[1] == f"removing {tmp_path / 'lock'}, left by a kernel build that was stopped half-way"



# Builds the kernels, then answers with one of them against torch's.
BUILD_AND_ANSWER = """
import torch
from llama_tp.kernels import cpu_kernels
x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
ours = cpu_kernels.rms_norm(x, weight, 1e-5)
print("answer matches torch's:", torch.allclose(ours, torch.nn.functional.rms_norm(x, (64,), weight, 1e-5), atol=1e-5))
"""


def start_build(extensions: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD_AND_ANSWER], cwd=PROJECT_ROOT,
                            env=subprocess_env(TORCH_EXTENSIONS_DIR=str(extensions), LLAMA_TP_LOG="info"),
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True, start_new_session=True)


@pytest.mark.slow  # two builds of the kernels, about a minute each on 2 cores
@pytest.mark.skipif(not cpu_kernels.ON_THIS_CPU, reason="needs AVX-512 and a C++ compiler (our kernels)")
def test_a_build_killed_half_way_is_taken_over_by_the_next_run(tmp_path):
    folder = tmp_path / "extensions" / "llama_tp_cpu_kernels"
    first = start_build(tmp_path / "extensions", tmp_path / "first.log")
    deadline = time.monotonic() + 120
    while not (folder / "lock").exists():  # torch's lock: the build has begun
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    time.sleep(3)  # compiling: the C++ takes far longer than this
    os.killpg(first.pid, signal.SIGKILL)  # the script, ninja and the compilers, as a killed terminal would
    first.wait()
    assert "building llama_tp's CPU kernels (llama_tp_cpu_kernels)" in (tmp_path / "first.log").read_text()
    assert (folder / "lock").exists() and not (folder / "llama_tp_cpu_kernels.so").exists()

    second = start_build(tmp_path / "extensions", tmp_path / "second.log")
    try:
        stdout, _ = second.communicate(timeout=600)
    finally:
        if second.poll() is None:  # a hang, as before the fix: fail, leaving nothing behind
            os.killpg(second.pid, signal.SIGKILL)
    log = (tmp_path / "second.log").read_text()
    assert second.returncode == 0, log
    assert stdout == "answer matches torch's: True\n"
    assert f"removing {folder / 'lock'}, left by a kernel build that was stopped half-way" in log
    assert "building llama_tp's CPU kernels (llama_tp_cpu_kernels)" in log and "built llama_tp's CPU kernels" in log
    assert not (folder / "lock").exists()

    third = start_build(tmp_path / "extensions", tmp_path / "third.log")  # built: loaded, not built again
    assert third.communicate(timeout=120)[0] == "answer matches torch's: True\n"
    assert "build" not in (tmp_path / "third.log").read_text()
