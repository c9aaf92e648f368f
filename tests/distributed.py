"""Run a function on N processes that form a torch.distributed job, as torchrun would set them up."""

import os
import socket
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(*args) on every rank of a fresh world; returns each rank's result, in rank order."""
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world_size, port, fn, args, results), nprocs=world_size, join=True)
        return [results[rank] for rank in range(world_size)]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    results[rank] = fn(*args)
