"""parallel.all_reduce and all_gather_last_dim through shared memory: the exact sum or concatenation,
the same bits on every rank, call after call."""

import os
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from distributed import rendezvous
from llama_tp import parallel
from llama_tp.kernels import cpu_kernels
from llama_tp.parallel import collectives, shared_memory
from llama_tp.parallel.shared_memory import SharedMemorySum


def _worker(rank: int, environment: dict[str, str], out: str, native: bool) -> None:
    os.environ |= environment | {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
    parallel.init()
    results = []
    for call in range(5):  # both parities of the double buffer, several times
        if rank == 1:
            time.sleep(0.05)  # late: rank 0 must wait for its tensor, not read what its slot held before
        x = torch.full((3, 1, 7), float(rank + 1)) * (call + 1) + torch.arange(7) / 3
        results.append(parallel.all_reduce(x))
    big = torch.ones(SharedMemorySum.CAPACITY + 1) * (rank + 1)  # too big: through gloo
    results.append(parallel.all_reduce(big)[:4])
    for call in range(3):  # gathers interleaved with sums share the call sequence
        results.append(parallel.all_gather_last_dim(torch.full((2, 1, 3), 10.0 * rank + call)))
        results.append(parallel.all_reduce(torch.ones(4)))
    results.append(parallel.all_gather_last_dim(big)[SharedMemorySum.CAPACITY - 1 : SharedMemorySum.CAPACITY + 3])
    assert isinstance(collectives._shared_sum(), SharedMemorySum)
    assert collectives._shared_sum().native == native
    torch.save(results, f"{out}.{rank}")


# The C++ exchange is built with our CPU kernels, so it runs where they do; the Python one anywhere.
EXCHANGES = pytest.mark.parametrize("native", [
    pytest.param(True, id="cpp", marks=pytest.mark.skipif(not cpu_kernels.ON_THIS_CPU, reason="our kernels need AVX-512")),
    pytest.param(False, id="python"),
])


@pytest.mark.slow  # a spawned world of two (tens of seconds)
@EXCHANGES
def test_shared_memory_all_reduce(tmp_path, monkeypatch, native):
    monkeypatch.setenv("LLAMA_TP_CPU_KERNELS", "1" if native else "0")  # read by the spawned processes
    out = str(tmp_path / "sums")
    with rendezvous() as environment:
        mp.start_processes(_worker, args=(environment, out, native), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for call, (a, b) in enumerate(zip(*ranks[:2])):
        assert torch.equal(a, b)  # the same bits on both ranks
        if call < 5:
            torch.testing.assert_close(a, 3.0 * (call + 1) + 2 * torch.arange(7).expand(3, 1, 7) / 3)
    assert ranks[0][5].tolist() == [3.0] * 4
    for call in range(3):
        gathered, summed = ranks[0][6 + 2 * call], ranks[0][7 + 2 * call]
        assert gathered.shape == (2, 1, 6) and summed.tolist() == [2.0] * 4
        assert gathered[0, 0].tolist() == [float(call)] * 3 + [10.0 + call] * 3
    assert ranks[0][12].tolist() == [1.0, 1.0, 2.0, 2.0]  # too big: through gloo, in rank order


def rank_0_of_2_alone(tmp_path, native: bool, timeout_seconds: float) -> SharedMemorySum:
    """Rank 0's end of a fresh buffer that rank 1 never joins."""
    path = tmp_path / "buffer"
    path.write_bytes(b"")
    alone = SharedMemorySum(str(path), rank=0, world_size=2, timeout_seconds=timeout_seconds)
    alone.native = native
    return alone


@EXCHANGES
def test_shared_memory_wait_for_a_missing_rank_times_out_and_lets_other_threads_run(tmp_path, native):
    """Other threads run meanwhile: the launcher watchdog (parallel.group) is one."""
    alone = rank_0_of_2_alone(tmp_path, native, timeout_seconds=0.5)
    ticks, stop = [], threading.Event()

    def tick() -> None:
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 timed out after 0.5 s waiting for the other ranks' tensors"):
            alone(torch.ones(4))
        end = time.monotonic()
    finally:
        stop.set()
        thread.join()
    assert sum(start < t < end for t in ticks) > 10  # about 50 if the thread ran throughout


@EXCHANGES
def test_a_rank_waiting_for_a_killed_one_says_so_at_once(tmp_path, native):
    alone = rank_0_of_2_alone(tmp_path, native, timeout_seconds=30)
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    alone.flags[8 * 1 + 1] = gone.pid  # what rank 1 wrote when it mapped the buffer
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 0 lost rank 1 \\(process {gone.pid} is gone\\) while waiting") as lost:
        alone(torch.ones(4))
    assert time.monotonic() - start < 5
    assert parallel.is_peer_failure(lost.value)
    assert "lost contact with another process of this job" in parallel.describe_peer_failure(lost.value)


def test_a_rank_that_published_the_call_and_ended_since_is_not_lost(tmp_path, monkeypatch):
    """The job's last exchange on a busy machine: rank 0 reads rank 1's flag (not there yet), is
    descheduled, and rank 1 meanwhile publishes, finishes the exchange, ends its job and exits.
    Finding rank 1's process gone, rank 0 must read its flag again rather than call it lost (the
    Python exchange, whose moment of looking is ours to choose; the C++ one reads it the same way)."""
    alone = rank_0_of_2_alone(tmp_path, native=False, timeout_seconds=30)
    gone = subprocess.Popen(["true"])
    gone.wait()
    alone.flags[8 * 1 + 1] = gone.pid

    def published_then_gone(pid: int) -> bool:
        alone.slots[1, 1, :4] = 2.0  # rank 1's tensor for call 1 (parity 1), then its flag
        alone.flags[8 * 1] = 1
        return True

    monkeypatch.setattr(shared_memory, "process_gone", published_then_gone)
    assert alone(torch.ones(4)).tolist() == [3.0] * 4


def test_an_exchange_that_waited_too_long_is_reported_as_a_lost_rank():
    eager = RuntimeError("rank 0 timed out after 600 s waiting for the other ranks' tensors")
    # A compiled step's wrapper replaces the C++ exchange's message with its own.
    compiled = RuntimeError('aoti_torch_call_dispatcher("llama_tp::shared_sum", "", dispatch_vars.data()) '
                            "API call failed at /tmp/torchinductor/x.main.cpp, line 28")
    assert parallel.is_peer_failure(eager) and parallel.is_peer_failure(compiled)
    assert "gave up waiting for the other processes of this job" in parallel.describe_peer_failure(eager)
    assert "lost contact with another process of this job" in parallel.describe_peer_failure(compiled)
    assert not parallel.is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_a_lost_peer_after_the_launcher_died_is_reported_as_the_launchers_death(monkeypatch):
    """torchrun killed: the rank whose watchdog saw it first stops, and another rank, finding that
    peer gone, names the cause rather than the lost peer."""
    from llama_tp.parallel import group

    lost = RuntimeError("rank 0 lost rank 1 (process 20778 is gone) while waiting for the other ranks' tensors")
    monkeypatch.setattr(group, "_launcher", os.getppid())
    assert "lost contact with another process" in parallel.describe_peer_failure(lost)
    monkeypatch.setattr(group, "_launcher", os.getppid() + 1)  # what the ranks were started by is gone
    assert parallel.describe_peer_failure(lost) == f"the launcher (pid {os.getppid() + 1}) is gone; stopping this rank too"


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt even where pytest started with SIGINT ignored, as a shell starts
    its background jobs."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@EXCHANGES
@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_stops_a_rank_waiting_for_the_others(tmp_path, native):
    """A rank stopped by Ctrl-C first never publishes: the others must not wait for it until the timeout."""
    alone = rank_0_of_2_alone(tmp_path, native, timeout_seconds=10)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        alone(torch.ones(4))
    assert time.monotonic() - start < 5
