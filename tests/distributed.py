"""Run a function on N processes that form a torch.distributed job, as torchrun would set them up."""

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

from llama_tp import parallel


@contextmanager
def rendezvous() -> Iterator[dict[str, str]]:
    """The rendezvous environment for one world's ranks, as torchrun's agent gives it: a store on a
    port the OS chose at bind time, held by this process until the world has ended, which every
    rank joins as a client (TORCHELASTIC_USE_AGENT_STORE). No rank binds a port that another job
    may have taken since it was found free."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def run_world(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) on every rank of a fresh world; returns each rank's result, in rank order."""
    with rendezvous() as environment, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world_size, environment, fn, args, results), nprocs=world_size, join=True)
        return [results[rank] for rank in range(world_size)]


def _worker(rank: int, world_size: int, environment: dict[str, str], fn: Callable, args: tuple, results) -> None:
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    results[rank] = fn(*args)
    # As the launch scripts do: a rank left to interpreter exit can tear its gloo threads down while
    # another still talks to it, and dies with SIGABRT ("terminate called without an active exception").
    parallel.leave()
