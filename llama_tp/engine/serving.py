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
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

from .. import parallel
from ..logs import logger
from .engine import Admission, Engine, Update
from .observer import CacheUse
from .requests import Delta, GenerationRequest, RequestState

# The most a rank waits for news while nothing runs before the next heartbeat, in seconds.
MAX_HEARTBEAT_SECONDS = 10.0


@dataclass(frozen=True)
class Cancel:
    request_id: str  # "": a wake-up only


class Submission(Protocol):
    """A request as rank 0 hears of it, and where its deltas go (the HTTP side's RequestStream)."""

    request: GenerationRequest

    def put(self, delta: Delta) -> None: ...


class Inbox(Protocol):
    """Rank 0's source of requests and cancellations (the server's Mailbox)."""

    def take(self, timeout: Optional[float]) -> list[Union[Submission, Cancel]]:
        """Every message that has come, waiting up to timeout seconds (None: forever) for the first."""

    def left_waiting(self, count: int = 1) -> None:
        """count requests left the waiting line (admitted, or ended while waiting)."""

    def stopping(self) -> None:
        """The engine is ending every request and will take no more."""

    def failed(self, reason: str) -> None:
        """The engine cannot go on (a rank was lost): nothing more can be generated."""


@dataclass(frozen=True)
class News:
    """What changed since the last step, as rank 0 saw it."""

    admitted: tuple[Admission, ...] = ()
    cancelled: tuple[str, ...] = ()  # ids of running requests whose clients left
    stop: bool = False  # some rank was asked to stop: end every request and leave


class Serving:
    def __init__(self, engine: Engine, inbox: Optional[Inbox] = None):
        """inbox: rank 0's; None on the other ranks."""
        self.engine = engine
        self.inbox = inbox
        self.waiting: deque[Submission] = deque()  # rank 0: submitted, not yet admitted
        self.streams: dict[str, Submission] = {}  # rank 0: admitted requests' streams
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
        """Every rank: end the cancelled requests, admit the new ones."""
        for request_id in news.cancelled:
            self._deliver(self.engine.cancel(request_id))
        for admission in news.admitted:
            self.engine.admit(admission)

    # News

    def _exchange(self, stop_wish: bool) -> News:
        """Every rank's wish to stop, and rank 0's news, on every rank."""
        news = self._gather_news(stop_wish) if self.inbox is not None else None
        # A step without news or a wish to stop exchanges one byte a rank, no pickles.
        votes = parallel.gather_objects_if_any((news, stop_wish), stop_wish or (news is not None and news != News()))
        if votes is None:
            return News()
        news = votes[0][0]
        stop = any(wish for _, wish in votes)
        return News(news.admitted, news.cancelled, stop) if stop != news.stop else news

    def _gather_news(self, stop_wish: bool) -> News:
        """Rank 0: take the inbox's messages (waiting for one while idle), admit what fits."""
        idle = not self.engine.running and not self.waiting and not stop_wish
        # Alone, nothing needs a heartbeat: wait until a request (or the stop signal's wake-up) comes.
        timeout = (self.heartbeat if parallel.model_parallel_size() > 1 else None) if idle else 0
        cancelled = []
        for message in self.inbox.take(timeout):
            if isinstance(message, Cancel):
                if message.request_id:  # an empty id is a wake-up only
                    cancelled += self._cancel_request(message)
            else:
                self.waiting.append(message)
        admitted, taken = [], set()
        while self.waiting and not stop_wish:
            stream = self.waiting[0]
            slot = self.engine.choose_slot(stream.request.prompt_tokens, taken)
            if slot is None:
                break
            self.waiting.popleft()
            self.inbox.left_waiting()
            taken.add(slot)
            seed = stream.request.options.seed
            admitted.append(Admission(stream.request, slot, random.getrandbits(63) if seed is None else seed))
            self.streams[stream.request.id] = stream
        return News(tuple(admitted), tuple(cancelled), stop_wish)

    def _cancel_request(self, message: Cancel) -> list[str]:
        """A client left: drop its request from the waiting line here, or tell every rank."""
        waiting = next((s for s in self.waiting if s.request.id == message.request_id), None)
        if waiting is not None:
            self.waiting.remove(waiting)
            self.inbox.left_waiting()
            self._end_stream(waiting, Delta(finish_reason="cancelled"), RequestState.CANCELLED)
            return []
        return [message.request_id] if self.engine.find(message.request_id) else []

    # Deltas

    def _deliver(self, updates: list[Update]) -> None:
        """Rank 0: each update's delta to its request's stream (the last one closes it)."""
        if self.inbox is None:
            return
        for update in updates:
            request_id = update.sequence.request.id
            if update.delta.finished:
                self.streams.pop(request_id).put(update.delta)
            else:
                self.streams[request_id].put(update.delta)

    def _end_stream(self, stream: Submission, delta: Delta, state: RequestState) -> None:
        stream.put(delta)
        if self.engine.observer is not None:
            self.engine.observer.ended(state)

    def _end_everything(self) -> None:
        """Stopping: running requests end cleanly with what they have; waiting ones are refused."""
        self._deliver(self.engine.end_all())
        if self.inbox is not None:
            self.inbox.stopping()
            while self.waiting:
                self.inbox.left_waiting()
                self._end_stream(self.waiting.popleft(), Delta(finish_reason="error", error="the server is shutting down"),
                                 RequestState.CANCELLED)

    def _fail_everything(self, error: BaseException) -> None:
        """A rank is lost (or this one broke): every request ends with the error, the inbox says why."""
        if self.inbox is None:
            return
        reason = parallel.describe_peer_failure(error) if parallel.is_peer_failure(error) else f"{type(error).__name__}: {error}"
        logger.error(f"the engine stopped: {reason}")
        self.inbox.failed(reason)
        failed = Delta(finish_reason="error", error=f"the server failed: {reason}")
        for stream in [*self.streams.values(), *self.waiting]:
            self._end_stream(stream, failed, RequestState.FAILED)
        self.streams.clear()
        self.waiting.clear()
        if self.engine.observer is not None:
            self.engine.observer.load(0, CacheUse())
