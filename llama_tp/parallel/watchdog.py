"""Ending a GPU rank whose job has lost another rank, where no timeout would: a read-back waiting
on a step whose all-reduce, captured in a CUDA graph, waits for a process that is gone.

NCCL's own watchdog never sees such a collective: ProcessGroupNCCL hands its watchdog only the
collectives launched outside a capture (`enqueue = ... capture_status == CaptureStatus::None`),
and a graph's replay launches none. Blocking wait (TORCH_NCCL_BLOCKING_WAIT) acts only in
Work.wait, which a replay has none of, and would make every eager collective wait for the GPU.
So each rank of a GPU job runs a thread that meets the others once a second in a one-number
all-reduce on a gloo group of its own. A rank that dies closes its connections and the meeting
fails at once; one that is stopped, or whose host is gone, misses it, which fails after
LLAMA_TP_TIMEOUT. The thread then gives the main thread a moment to report the failure itself
(a gloo collective fails at once too); if it does not, the thread prints our one line, hands it
to torchrun and ends the process, which frees the GPU with it.

The thread never calls CUDA: an event query from another thread during a graph capture spoils
the capture (torch makes captures wait for NCCL's own queries, CUDAGraph::inc_pending_event_queries).
Nor does it abort NCCL's communicators: ncclCommAbort can hang itself (torch's default error
handling, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, skips it for that reason), and a process that exits
needs none. NCCL's own handling stays as it is for eager collectives.
"""

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

MEETING_SECONDS = 1.0  # how often the ranks meet
LONGEST_GRACE_SECONDS = 3.0  # how long a rank's own work may take to report a lost peer first

# The folder where, under llama-tp, each rank leaves its line for the launcher to print (launcher.py).
FAILURE_LINES = "LLAMA_TP_FAILURE_LINES"

_reported = threading.Event()  # this rank has reported its own failure: the watchdog keeps quiet


def global_rank() -> int:
    """This process's rank in the job, before or after the process group exists."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def report_failure(message: str) -> None:
    """Say message, this rank's one line on why it stops: on stderr, or, under llama-tp (launcher.py),
    to the launcher, which prints every rank's in rank order once they have all ended. torchrun
    gets it too, for its failure summary (instead of a link to its docs); the peer watchdog then
    leaves the reporting to this rank's own message."""
    _reported.set()
    lines = os.environ.get(FAILURE_LINES)
    if lines and os.path.isdir(lines):
        (Path(lines) / str(global_rank())).write_text(message)
    else:  # line and newline in one write (print makes two): unbuffered, another rank's could come between
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The layout torchrun's own @record writes; the summary prints py_callstack as "traceback".
        details = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(error_file, "w") as file:
            json.dump({"message": {"message": message, "extraInfo": details}}, file)


class PeerWatch:
    """The thread that meets the other ranks on `group` until they all leave, and ends this
    process if one of them is lost."""

    def __init__(self, group: Any, rank: int, world_size: int, timeout_seconds: float):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout_seconds = timeout_seconds
        self.grace_seconds = min(LONGEST_GRACE_SECONDS, timeout_seconds / 2)
        self.leaving = threading.Event()
        self.thread = threading.Thread(target=self._meet, name="llama_tp-peer-watchdog", daemon=True)
        self.thread.start()

    def _meet(self) -> None:
        while True:
            leaving = torch.tensor([int(self.leaving.is_set())])
            try:
                dist.all_reduce(leaving, group=self.group)
            except RuntimeError as error:  # gloo's errors and DistError alike
                self._lost(error)
                return
            if leaving.item() == self.world_size:
                return  # every rank is leaving the job: nothing left to watch
            self.leaving.wait(MEETING_SECONDS)

    def _lost(self, error: RuntimeError) -> None:
        if _reported.wait(self.grace_seconds) or self.leaving.is_set():
            return  # this rank says so itself, or is leaving anyway
        report_failure(f"llama_tp error on rank {self.rank}: {self.describe(error)}")
        os._exit(1)

    def describe(self, error: RuntimeError) -> str:
        """What the failed meeting means for the user, in one line."""
        detail = next(iter(str(error).strip().splitlines()), type(error).__name__)
        if "timed out" in detail.lower() or "timeout" in detail.lower():
            return (
                f"heard nothing from another process of this job for {self.timeout_seconds:g} s (it may be "
                "stopped, or its host unreachable), and this rank's GPU would wait for it forever; set "
                f"LLAMA_TP_TIMEOUT to wait longer. torch.distributed reported: {detail}"
            )
        return (
            "lost contact with another process of this job, which failed or was stopped (see its message "
            "above, or the launcher's summary), and this rank's GPU would wait for it forever. "
            f"torch.distributed reported: {detail}"
        )


_watch: Optional[PeerWatch] = None


def watch_peers(group: Any, rank: int, world_size: int, timeout_seconds: float) -> None:
    """Start this rank's peer watchdog on `group`, a gloo group of its own that every rank made
    together."""
    global _watch
    _watch = PeerWatch(group, rank, world_size, timeout_seconds)
    atexit.register(_leave_at_exit)


def stop_watching() -> bool:
    """Stop the peer watchdog, at the meeting where every rank is leaving (parallel.leave), before
    its group is destroyed: whether every rank came to it (or none was watched)."""
    global _watch
    if _watch is None:
        return True
    _watch.leaving.set()
    _watch.thread.join(_watch.timeout_seconds + MEETING_SECONDS)
    every_rank_left = not _watch.thread.is_alive()
    _watch = None
    return every_rank_left


def _leave_at_exit() -> None:
    """A program that ends without parallel.leave (one of the user's own) leaves with the other
    ranks here, so that a rank still at work, writing its answers, is not taken for lost; unless
    it ends on an error (reported, or a traceback), which the others are to see at once. Once all
    have met, the groups go too: left to the interpreter's exit, gloo's threads could abort the
    process (SIGABRT, "terminate called without an active exception"; failures.leave)."""
    if not _reported.is_set() and getattr(sys, "last_exc", getattr(sys, "last_value", None)) is None:
        if stop_watching() and dist.is_initialized():
            dist.destroy_process_group()
