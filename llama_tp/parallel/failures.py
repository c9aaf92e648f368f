"""Failing, and finishing, together: a step that fails on one rank fails on all of them with the
cause, a collective that lost a rank is explained, torchrun is told the message, and at the end
the ranks leave the process group together."""

import hashlib
import os
import pickle
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fairscale_mp

from ..optional import MissingExtra
from .collectives import forget_shared_sum
from .group import _host_groups, collective_timeout, gather_objects, host_group, launcher_gone_message
from .shared_memory import is_exchange_timeout
from .watchdog import stop_watching

@contextmanager
def agreement(step: str) -> Iterator[None]:
    """Run a block on every rank, then fail on every rank if it failed on any.

    Without this, a rank whose own file is bad raises while the others walk on into the next
    collective and wait for it until the timeout. The failing rank re-raises its own exception;
    the others raise the same type naming that rank, so every rank reports the cause.
    """
    failure: Optional[Exception] = None
    try:
        yield
    except Exception as error:  # any failure, bug or not, must reach the other ranks
        failure = error
    verdicts = gather_objects(None if failure is None else _verdict(failure))
    if failure is not None:
        raise failure
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            kind, message = verdict
            raise kind(f"rank {rank} failed while {step}: {message}")


def _verdict(failure: Exception) -> tuple[type, str]:
    """What the other ranks raise for failure: the same kind of user error, else RuntimeError."""
    for kind in (FileNotFoundError, ValueError, MissingExtra):  # classes every rank can unpickle
        if isinstance(failure, kind):
            return kind, str(failure)
    return RuntimeError, f"{type(failure).__name__}: {failure}"


def is_peer_failure(error: BaseException) -> bool:
    """Whether error is a collective failing because another rank is gone or too slow.

    NCCL and the process-group store raise DistError; gloo raises a plain RuntimeError
    ("Connection closed by peer", "Timed out waiting ...") whose text names its gloo source file;
    so does our shared-memory exchange when it waits too long.
    """
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and ("gloo" in str(error) or is_exchange_timeout(error))


def check_same_on_every_rank(what: str, value: Any) -> None:
    """Raise on every rank if value is not the same on all of them.

    Ranks given different prompts run different numbers of steps, and one then waits for the
    others in a collective until the timeout; comparing a digest first turns that into a message.
    """
    digests = gather_objects(hashlib.sha256(pickle.dumps(value)).hexdigest())
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
    if differing:
        raise ValueError(
            f"{what} on rank(s) {', '.join(map(str, differing))} differ from rank 0's; every rank "
            "must make the same call with the same arguments (e.g. read the same prompts)"
        )


def describe_peer_failure(error: BaseException) -> str:
    """What a failed collective means for the user, in one line. Where torchrun has died, that
    is the cause (the peer this rank lost saw it first and stopped)."""
    launcher_gone = launcher_gone_message()
    if launcher_gone is not None:
        return launcher_gone
    detail = next(iter(str(error).strip().splitlines()), type(error).__name__)
    if "timed out" in detail.lower() or "timeout" in detail.lower():
        waited = collective_timeout().total_seconds()
        return (
            f"gave up waiting for the other processes of this job after {waited:g} s (one may be "
            "stuck, e.g. reading a slow disk, or was never started); set LLAMA_TP_TIMEOUT to wait "
            f"longer. torch.distributed reported: {detail}"
        )
    return (
        "lost contact with another process of this job, which failed or was stopped (see its "
        f"message above, or the launcher's summary). torch.distributed reported: {detail}"
    )


def wait_for_every_rank(timeout_seconds: float = 5.0) -> bool:
    """Wait briefly until every rank gets here, e.g. before exiting on an error; False where a
    rank of the process group is gone or stuck.

    torchrun stops the other ranks as soon as one exits, so without this a rank that is a
    moment late can be killed before it has printed its message. A rank that is gone or stuck
    does not hold the others for more than timeout_seconds. Before the process group exists (a
    command line refused at start), the ranks meet in the store torchrun's agent keeps.
    """
    if not dist.is_initialized():
        _wait_in_launcher_store(timeout_seconds)
        return True
    if dist.get_world_size() == 1:
        return True
    try:
        dist.monitored_barrier(host_group(), timeout=timedelta(seconds=timeout_seconds))
    except RuntimeError:  # a rank is gone or stuck: there is nobody to wait for
        return False
    return True


def _wait_in_launcher_store(timeout_seconds: float) -> None:
    """Count this rank in at torchrun's agent store and wait until every rank has, or until the
    timeout; outside torchrun, or alone, there is nobody to wait for."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    deadline = time.monotonic() + timeout_seconds
    key = f"llama_tp/arrived/{os.environ.get('TORCHELASTIC_RUN_ID')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_seconds))
        arrived = store.add(key, 1)
        while arrived < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(key, 0)
    except (RuntimeError, KeyError, ValueError):  # no store to reach: leave without waiting
        pass


def leave() -> bool:
    """Leave the process group together with the other ranks, at the end of a job or after an
    error this rank has reported, once they have all met: whether it was left (or never joined).

    Left to interpreter exit, a rank's gloo threads can be torn down while another rank still
    talks to it, and the rank dies with SIGABRT ("terminate called without an active exception"),
    failing a job that had finished, or adding that line to an error's own. Where a rank did not
    come (gone or stuck), the teardown could wait for it until the timeout (the peer watchdog's
    meeting, gloo's work with it): the group then stays, and the caller ends the process without
    the interpreter's teardown (cli's _exit) rather than hang or abort.
    """
    if not wait_for_every_rank():
        return False
    if dist.is_initialized():
        stop_watching()
        fairscale_mp.destroy_model_parallel()
        forget_shared_sum()
        dist.destroy_process_group()
        _host_groups.clear()
    return True
