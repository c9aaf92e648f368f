"""Every rank compiles a request's grammar before the request is admitted, on the compiler's own
threads (structured/grammars.py), so that the loop the ranks run in lockstep never waits for a
compile: a grammar that takes minutes to compile on one rank would otherwise stop every answer
on every rank for as long.

Rank 0 holds a constrained request back from the waiting line (HeldRequests) and asks every rank
for its grammar, by a number it gives each grammar (News.compile). Each rank starts compiling (its
Shelf), and says in a later step which of its grammars are ready or failed. Once every rank has
said ready, the request joins the waiting line; once no request uses a grammar any more, rank 0
says so (News.release) and every rank lets it go (the compiler's cache may keep it for a schema
sent again, which is then ready at once).
"""

import itertools
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from ..structured.constraint import Constraint
from .requests import GenerationRequest, Submission

if TYPE_CHECKING:
    import xgrammar

    from ..structured.grammars import Grammars

# A rank's word on a grammar: its number, and None where it is ready or why it failed.
Report = tuple[int, Optional[str]]


class Shelf:
    """One rank's grammars by number: compiling, ready or failed, until released."""

    def __init__(self, grammars: "Optional[Callable[[], Grammars]]"):
        self.grammars = grammars  # the model's, made on first use
        self._futures: dict[int, Future] = {}
        self._unreported: list[int] = []

    def start(self, orders: Iterable[tuple[int, Constraint]]) -> None:
        """Begin compiling each (number, constraint) on the compiler's threads."""
        for number, constraint in orders:
            self._futures[number] = self.grammars().compile_later(constraint)
            self._unreported.append(number)

    def finished(self) -> tuple[Report, ...]:
        """The grammars that have finished compiling since the last call, in the order asked."""
        done = [number for number in self._unreported if self._futures[number].done()]
        self._unreported = [number for number in self._unreported if number not in done]
        return tuple((number, _failure(self._futures[number])) for number in done)

    def grammar(self, number: int) -> "xgrammar.CompiledGrammar":
        """A ready grammar (rank 0 admits a request only once every rank has said so)."""
        future = self._futures[number]
        assert future.done(), f"grammar {number} is not compiled on this rank yet"
        return future.result()

    def release(self, numbers: Iterable[int]) -> None:
        for number in numbers:
            self._futures.pop(number, None)
            if number in self._unreported:
                self._unreported.remove(number)


def _failure(future: Future) -> Optional[str]:
    error = future.exception()
    return None if error is None else str(error) or type(error).__name__


class HeldRequests:
    """Rank 0: constrained requests held back until every rank has their grammar, the number of
    each grammar in use, and the news for the other ranks (grammars to compile, and to let go)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.streams: list[Submission] = []  # held, in arrival order
        self._numbers: dict[Constraint, int] = {}  # each grammar in use by a held, waiting or running request
        self._users: Counter = Counter()  # requests using each number
        self._ready_on: dict[int, set[int]] = {}  # the ranks that hold each grammar ready
        self._failed: dict[int, str] = {}  # why a grammar failed (on the first rank that said so)
        self._next = itertools.count()
        self._orders: list[tuple[int, Constraint]] = []  # for the next news
        self._released: list[int] = []

    def hold(self, stream: Submission) -> bool:
        """Hold stream's request until its grammar is ready on every rank: True, or False (and
        nothing done) for a request without a grammar."""
        constraint = stream.request.constraint
        if constraint is None:
            return False
        number = self._numbers.get(constraint)
        if number is None:
            number = self._numbers[constraint] = next(self._next)
            self._ready_on[number] = set()
            self._orders.append((number, constraint))
        self._users[number] += 1
        self.streams.append(stream)
        return True

    def heard(self, rank: int, reports: Iterable[Report]) -> None:
        """A rank's reports of the grammars it has finished compiling."""
        for number, failure in reports:
            if number not in self._ready_on:  # released meanwhile
                continue
            if failure is None:
                self._ready_on[number].add(rank)
            else:
                self._failed.setdefault(number, f"compiling it failed on rank {rank}: {failure}")

    def ready(self) -> list[Submission]:
        """The held requests whose grammar every rank now holds, let go of."""
        ready = [s for s in self.streams if len(self._ready_on[self.number(s.request)]) == self.world_size]
        self.streams = [s for s in self.streams if s not in ready]
        return ready

    def failed(self) -> list[tuple[Submission, str]]:
        """The held requests whose grammar failed on some rank, with why, let go of."""
        failed = [(s, self._failed[self.number(s.request)]) for s in self.streams if self.number(s.request) in self._failed]
        self.streams = [s for s in self.streams if self.number(s.request) not in self._failed]
        return failed

    def number(self, request: GenerationRequest) -> Optional[int]:
        """The number of request's grammar (None: it has none)."""
        return None if request.constraint is None else self._numbers[request.constraint]

    def ended(self, request: GenerationRequest) -> None:
        """A request has ended, wherever it was: its grammar is let go of once no other uses it."""
        number = self.number(request) if request.constraint in self._numbers else None
        if number is None:
            return
        self._users[number] -= 1
        if self._users[number] == 0:
            del self._users[number], self._numbers[request.constraint], self._ready_on[number]
            self._failed.pop(number, None)
            self._released.append(number)

    def news(self) -> tuple[tuple[tuple[int, Constraint], ...], tuple[int, ...]]:
        """The grammars to compile and to let go of since the last call."""
        orders, released = tuple(self._orders), tuple(self._released)
        self._orders, self._released = [], []
        return orders, released
