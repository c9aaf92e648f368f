"""What the engine tells whoever watches it (the server's metrics, serve/metrics.py): requests
admitted, tokens made, requests ended, the load. The engine keeps no figures itself."""

from typing import NamedTuple

from .requests import RequestState
from .scheduler import Sequence


class CacheUse(NamedTuple):
    """The KV cache's blocks: how many, held by running sequences, cached (held by none, holding
    a prefix a later prompt can share), and the preemptions so far."""

    blocks: int = 0
    used: int = 0
    cached: int = 0
    preemptions: int = 0

    @property
    def usage(self) -> float:
        """The fraction of the blocks the running sequences hold."""
        return self.used / self.blocks if self.blocks else 0.0


class Observer:
    """The engine's events, each a no-op here: a watcher overrides those it counts."""

    def admitted(self, sequence: Sequence) -> None:
        """sequence took a cache row (its prompt and what of it the row held already)."""

    def token(self, sequence: Sequence, at: float) -> None:
        """sequence gained a token at time.monotonic() `at` (a speculation round's time is shared
        by the tokens it adds); its progress still holds the times of the tokens before."""

    def finished(self, sequence: Sequence, reason: str) -> None:
        """sequence ended: "stop", "length", "cancelled" or "error" (its grammar's dead end)."""

    def ended(self, state: RequestState) -> None:
        """A request ended in state, running or not (one that waited, refused as the server stops)."""

    def load(self, running: int, cache: CacheUse) -> None:
        """The running requests, and the KV cache's blocks they hold."""
