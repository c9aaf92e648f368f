"""The engine serving requests that come one by one, as the ranks run in lockstep: each step rank 0
says what changed, then all of them step the engine alike.

Rank 0 alone hears of requests (through its Inbox: the server's Mailbox): it keeps the waiting
line, admits requests into free cache rows and hears of clients that left. At the start of every
step the ranks exchange News: rank 0's admissions and cancellations, and every rank's wish to stop
(Ctrl-C or SIGTERM reach ranks one by one). Everything after that the engine decides alike on
every rank from what they all hold. While nothing runs, rank 0 waits for a request, sending a
heartbeat now and then so that the other ranks, waiting in the exchange, never reach the process
group's timeout.
"""

import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Optional, Protocol, Union

from .. import parallel
from ..logs import logger
from ..structured.constraint import Constraint
from .engine import Admission, Engine, Update
from .grammar_shelf import HeldRequests, Shelf
from .observer import CacheUse
from .requests import Delta, RequestState, Submission

# The most a rank waits for news while nothing runs before the next heartbeat, in seconds.
MAX_HEARTBEAT_SECONDS = 10.0
# How often rank 0 asks the ranks, while nothing else runs, whether held requests' grammars are ready.
GRAMMAR_POLL_SECONDS = 0.05
# What clients are told once the engine has failed: the cause (a lost rank's error, with its
# addresses) goes to the server's log only.
ENGINE_FAILED = "the server cannot generate any more: its engine failed (the server's log says why)"


@dataclass(frozen=True)
class Cancel:
    request_id: str  # "": a wake-up only


class Inbox(Protocol):
    """Rank 0's source of requests and cancellations (the server's Mailbox)."""

    def take(self, timeout: Optional[float]) -> list[Union[Submission, Cancel]]:
        """Every message that has come, waiting up to timeout seconds (None: forever) for the first."""

    def left_waiting(self, count: int = 1) -> None:
        """count requests left the waiting line (admitted, or ended while waiting)."""

    def deliver(self, deltas: list[tuple[Submission, Delta]]) -> None:
        """A step's deltas, each to its request's stream, in order."""

    def drain(self) -> list[Submission]:
        """The requests still queued (once the engine stops or fails, so no more come)."""

    def stopping(self) -> None:
        """The engine is ending every request and will take no more."""

    def failed(self) -> None:
        """The engine cannot go on (a rank was lost): nothing more can be generated, and new
        requests are refused from now on (the server's /health says so first)."""


@dataclass(frozen=True)
class News:
    """What changed since the last step, as rank 0 saw it."""

    admitted: tuple[Admission, ...] = ()
    cancelled: tuple[str, ...] = ()  # ids of running requests whose clients left
    stop: bool = False  # some rank was asked to stop: end every request and leave
    compile: tuple[tuple[int, Constraint], ...] = ()  # grammars every rank starts compiling, by number
    release: tuple[int, ...] = ()  # grammars no request uses any more


class Serving:
    def __init__(self, engine: Engine, inbox: Optional[Inbox] = None):
        """inbox: rank 0's; None on the other ranks."""
        self.engine = engine
        self.inbox = inbox
        self.waiting: deque[Submission] = deque()  # rank 0: submitted, not yet admitted
        self.streams: dict[str, Submission] = {}  # rank 0: admitted requests' streams
        # Grammars compiled before their requests are admitted (grammar_shelf.py): every rank's,
        # and rank 0's held requests.
        self.shelf = Shelf(engine.grammars)
        self.held = HeldRequests(parallel.model_parallel_size())
        self.heartbeat = min(MAX_HEARTBEAT_SECONDS, parallel.collective_timeout().total_seconds() / 3)

    def run(self, stop_requested: Callable[[], bool]) -> None:
        """Serve until some rank is asked to stop (then every request ends cleanly) or a rank is
        lost (then every request ends with an error, and the error is raised)."""
        try:
            while True:
                news = self._exchange(stop_requested())
                self.apply(news)
                if news.stop:
                    self._end_everything()
                    return
                if self.engine.running:
                    self._deliver(self.engine.step())
        except BaseException as error:
            self._fail_everything(error)
            raise

    def apply(self, news: News) -> None:
        """Every rank: start and let go of grammars, end the cancelled requests, admit the new ones."""
        self.shelf.start(news.compile)
        self.shelf.release(news.release)
        for request_id in news.cancelled:
            self._deliver(self.engine.cancel(request_id))
        for admission in news.admitted:
            self.engine.admit(admission, None if admission.grammar is None else self.shelf.grammar(admission.grammar))

    # News

    def _exchange(self, stop_wish: bool) -> News:
        """Every rank's wish to stop, and rank 0's news, on every rank."""
        news = self._gather_news(stop_wish) if self.inbox is not None else None
        compiled = self.shelf.finished()
        # A step without news, a wish to stop or a grammar compiled exchanges one byte a rank, no pickles.
        votes = parallel.gather_objects_if_any((news, stop_wish, compiled),
                                               stop_wish or bool(compiled) or (news is not None and news != News()))
        if votes is None:
            return News()
        if self.inbox is not None:
            for rank, (_, _, reports) in enumerate(votes):
                self.held.heard(rank, reports)
        news = votes[0][0]
        return replace(news, stop=any(wish for _, wish, _ in votes))

    def _gather_news(self, stop_wish: bool) -> News:
        """Rank 0: take the inbox's messages (waiting for one while idle), admit what fits."""
        idle = not self.engine.running and not self.waiting and not stop_wish
        # Alone, nothing needs a heartbeat: wait until a request (or the stop signal's wake-up) comes.
        timeout = (self.heartbeat if parallel.model_parallel_size() > 1 else None) if idle else 0
        if idle and self.held.streams:  # a grammar compiles somewhere: ask again soon
            timeout = GRAMMAR_POLL_SECONDS
        cancelled = []
        for message in self.inbox.take(timeout):
            if isinstance(message, Cancel):
                if message.request_id:  # an empty id is a wake-up only
                    cancelled += self._cancel_request(message)
            elif not self.held.hold(message):
                self.waiting.append(message)
        for stream, failure in self.held.failed():
            self.inbox.left_waiting()
            self._end_stream(stream, Delta(finish_reason="error", error=f"the request's grammar: {failure}",
                                           error_code="invalid_value", error_status=400), RequestState.FAILED)
        self.waiting.extend(self.held.ready())
        admitted, taken = [], set()
        while self.waiting and not stop_wish:
            stream = self.waiting[0]
            slots = self.engine.choose_slots(stream.request, taken)  # a beam search's: one a beam
            if slots is None:
                break
            self.waiting.popleft()
            self.inbox.left_waiting()
            taken.update(slots)
            seed = stream.request.options.seed
            admitted.append(Admission(stream.request, slots[0], random.getrandbits(63) if seed is None else seed,
                                      self.held.number(stream.request), slots[1:]))
            self.streams[stream.request.id] = stream
        return News(tuple(admitted), tuple(cancelled), stop_wish, *self.held.news())

    def _cancel_request(self, message: Cancel) -> list[str]:
        """A client left: drop its request from the waiting line (or the held ones) here, or tell every rank."""
        waiting = next((s for s in [*self.waiting, *self.held.streams] if s.request.id == message.request_id), None)
        if waiting is not None:
            (self.waiting if waiting in self.waiting else self.held.streams).remove(waiting)
            self.inbox.left_waiting()
            self._end_stream(waiting, Delta(finish_reason="cancelled"), RequestState.CANCELLED)
            return []
        return [message.request_id] if self.engine.find(message.request_id) else []

    # Deltas

    def _deliver(self, updates: list[Update]) -> None:
        """Rank 0: each update's delta to its request's stream (the last one closes it)."""
        if self.inbox is None or not updates:
            return
        deltas = []
        for update in updates:
            request_id = update.sequence.request.id
            if update.delta.finished:
                deltas.append((self.streams.pop(request_id), update.delta))
                self.held.ended(update.sequence.request)
            else:
                deltas.append((self.streams[request_id], update.delta))
        self.inbox.deliver(deltas)

    def _end_stream(self, stream: Submission, delta: Delta, state: RequestState) -> None:
        """Rank 0: a request's last delta, wherever it was (held, waiting or running)."""
        stream.put(delta)
        self.held.ended(stream.request)
        if self.engine.observer is not None:
            self.engine.observer.ended(state)

    def _end_everything(self) -> None:
        """Stopping: running requests end cleanly with what they have; waiting ones are refused."""
        self._deliver(self.engine.end_all())
        if self.inbox is not None:
            self.inbox.stopping()
            refused = Delta(finish_reason="error", error="the server is shutting down", error_code="service_unavailable")
            for stream in [*self.waiting, *self.held.streams, *self.inbox.drain()]:
                self.inbox.left_waiting()
                self._end_stream(stream, refused, RequestState.CANCELLED)
            self.waiting.clear()
            self.held.streams.clear()

    def _fail_everything(self, error: BaseException) -> None:
        """A rank is lost (or this one broke): the inbox refuses new requests (/health says 503)
        first, then every request, running, waiting, held or still in the inbox, ends with OpenAI's
        error (engine_failed). Why goes to the log: the error's text can hold internal addresses."""
        if self.inbox is None:
            return
        self.inbox.failed()
        reason = parallel.describe_peer_failure(error) if parallel.is_peer_failure(error) else f"{type(error).__name__}: {error}"
        logger.error(f"the engine stopped: {reason}")
        failed = Delta(finish_reason="error", error=ENGINE_FAILED)
        for stream in [*self.streams.values(), *self.waiting, *self.held.streams, *self.inbox.drain()]:
            self._end_stream(stream, failed, RequestState.FAILED)
        self.streams.clear()
        self.waiting.clear()
        self.held.streams.clear()
        if self.engine.observer is not None:
            self.engine.observer.load(0, CacheUse())
