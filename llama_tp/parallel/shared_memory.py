"""All-reduce and all-gather of float32 tensors between the processes of one x86 host, through shared memory.

gloo's loopback TCP takes about 250 us per all-reduce, and decoding one token makes two per
layer; a sum through a shared buffer takes tens of microseconds in Python, a few in C++
(shared_memory.cpp, built with our CPU kernels where they run). parallel.all_reduce decides when
to use it and sets it up.
"""

import os
import tempfile
import time
from pathlib import Path

import torch

from ..kernels import cpu_kernels


class SharedMemorySum:
    """All-reduce (and all-gather) of float32 tensors between processes of one host through a shared buffer.

    Each rank's flag line also holds its process id, so that a rank waiting for one that was
    killed says so at once instead of at the timeout.

    Each call has a sequence number: a rank writes its tensor into its slot of the buffer for that
    number's parity, publishes the number in its flag, waits until every flag reaches it, and sums
    (or concatenates) the slots in rank order (so every rank gets the same bits). A rank can only
    reach the next call of the same parity once every rank has published the call in between,
    that is, has finished reading this one: two buffers are enough. Used on x86 only, whose total
    store order shows the other ranks a rank's data before its flag, and its flag before they read
    the data.

    Where our CPU kernels run, the exchange is theirs (torch.ops.llama_tp.shared_sum and
    shared_gather), which compiled decoding steps call as they are; elsewhere it is Python's.
    """

    CAPACITY = 2**18  # floats per slot: a decode step's activations; prompts beyond go through gloo

    def __init__(self, path: str, rank: int, world_size: int, timeout_seconds: float):
        flags_bytes = 64 * world_size  # one cache line per rank's flag
        total = flags_bytes + 2 * world_size * self.CAPACITY * 4
        # Made outside inference mode even when the first exchange comes from inside it, so that a
        # later exchange outside it (the serving loop of a rank without our kernels) may write it.
        with torch.inference_mode(False):
            self.buffer = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            self.slots = self.buffer[flags_bytes:].view(torch.float32).view(2, world_size, self.CAPACITY)
        # Flags are read and written as Python ints through a memoryview: a tensor op per poll
        # costs microseconds, and a decode step makes two exchanges per layer.
        self.flags = memoryview(self.buffer[:flags_bytes].numpy()).cast("q")  # rank r's flag at [8 * r]
        self.slot_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.rank, self.world_size, self.timeout_seconds = rank, world_size, timeout_seconds
        self.flags[8 * rank + 1] = os.getpid()
        self.native = cpu_kernels.ON_THIS_CPU
        if self.native:
            cpu_kernels.load()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x."""
        if self.native:
            return torch.ops.llama_tp.shared_sum(x, *self.native_args())
        return self._exchange(x).sum(dim=0).view_as(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side in rank order: [..., world_size * n]."""
        if self.native:
            return torch.ops.llama_tp.shared_gather(x, *self.native_args())
        slots = self._exchange(x)  # world_size, numel
        return torch.cat([slot.view_as(x) for slot in slots], dim=-1)

    def native_args(self) -> tuple:
        """What shared_sum and shared_gather take after x."""
        return self.buffer, self.rank, self.world_size, self.CAPACITY, self.timeout_seconds

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish x and wait for every rank's: [world_size, x.numel()], valid until the call after next."""
        call = self.flags[8 * self.rank] + 1  # the flag counts this rank's calls, whichever code made them
        slots, mine = self._views(call % 2, x.numel())
        mine.copy_(x.reshape(-1))
        self.flags[8 * self.rank] = call
        deadline = None
        for rank in range(self.world_size):
            polls = 0
            while self.flags[8 * rank] < call:
                os.sched_yield()  # the other ranks may need this core to get here
                deadline = deadline or time.monotonic() + self.timeout_seconds
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rank {self.rank} timed out after {self.timeout_seconds:g} s waiting for the other ranks' tensors"
                    )
                polls += 1
                # gone, and still not published (it may have published and ended since the loop's read)
                if polls % 1000 == 0 and process_gone(self.flags[8 * rank + 1]) and self.flags[8 * rank] < call:
                    raise RuntimeError(f"rank {self.rank} lost rank {rank} (process {self.flags[8 * rank + 1]} is "
                                       "gone) while waiting for the other ranks' tensors")
        return slots

    def _views(self, parity: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's slot [world_size, numel] for this parity, and this rank's; made once per size."""
        views = self.slot_views.get((parity, numel))
        if views is None:
            with torch.inference_mode(False):  # plain views, as the buffer is (__init__)
                slots = self.slots[parity, :, :numel]
                views = self.slot_views[parity, numel] = (slots, slots[self.rank])
        return views


def process_gone(pid: int) -> bool:
    """Whether process pid has ended (or was killed): gone, or a zombie its launcher has not reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


def new_buffer_path() -> str:
    """A fresh file for the buffer, in RAM (/dev/shm) where there is one."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    handle = tempfile.NamedTemporaryFile(prefix="llama_tp_allreduce_", dir=directory, delete=False)
    handle.close()
    return handle.name


def is_exchange_timeout(error: BaseException) -> bool:
    """Whether error is an exchange that waited too long for another rank: ours in Python or C++,
    or a compiled step's call of the C++ one, whose wrapper keeps only its own message."""
    text = str(error)
    return "waiting for the other ranks' tensors" in text or "llama_tp::shared_" in text
