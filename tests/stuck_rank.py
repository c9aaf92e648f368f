"""One rank of a job for the peer watchdog's tests (test_peer_watchdog.py, tests/gpu): it joins,
says "ready" on stdout, then waits as `wait` says:

- "gpu": for a read-back behind a kernel that never ends, as a GPU waits inside a CUDA graph's
  all-reduce for a rank that is gone (no timeout reaches it);
- "lock": for a lock nobody releases, the same wait on the CPU;
- "collectives": in gloo collectives, which notice a lost rank themselves;
- "none": not at all; rank N lingers N x `linger` seconds, then leaves the job as the scripts do
  (`leave`), or ends without leaving it, as a program of one's own may.

Rank `crash_rank` instead ends on a bug (an uncaught error) once every rank is ready.

On the CPU, where parallel.init watches no peers (every wait there has its timeout), it starts
the peer watchdog itself, on a gloo group of its own as parallel.init makes it on GPUs.
"""

import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from llama_tp import parallel
from llama_tp.parallel import watchdog
from llama_tp.tools.cli import run


def main(wait: str, linger: float = 0.0, leave: bool = True, crash_rank: Optional[int] = None):
    """Join the job, say "ready", then wait as `wait` says (see the module's docstring)."""
    placement = parallel.init()
    if placement.device.type == "cpu":
        timeout = parallel.collective_timeout()
        watchdog.watch_peers(dist.new_group(backend="gloo", timeout=timeout), placement.rank,
                             placement.world_size, timeout.total_seconds())
    parallel.broadcast_object(None)  # every rank is up
    print("ready", flush=True)
    if placement.rank == crash_rank:
        raise RuntimeError("a bug on this rank")
    if wait == "gpu":
        tensor = torch.zeros(1, device=placement.device)
        torch.cuda._sleep(1 << 62)  # spins for decades
        (tensor + 1).tolist()
    elif wait == "lock":
        threading.Event().wait()
    elif wait == "collectives":
        while True:
            parallel.broadcast_object(None)
            time.sleep(0.05)
    time.sleep(placement.rank * linger)
    if not leave:
        sys.exit(0)  # past cli.run's parallel.leave


if __name__ == "__main__":
    run(main)
