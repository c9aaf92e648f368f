"""Rank 0's door into the engine, for the HTTP side's thread: submit and cancel requests, read
each request's deltas from its stream, know whether the engine is ready.

The HTTP side's calls only put messages in; the engine's loop (engine/serving.py, to which the
mailbox is its Inbox) takes them at the start of a step, which is when they reach the other
ranks. The waiting line is bounded (max_waiting): a request beyond it is refused at once, before
it costs anything.
"""

import asyncio
import enum
import queue
import threading
from typing import TYPE_CHECKING, Optional, Union

from ..engine.requests import Delta, GenerationRequest
from ..engine.serving import ENGINE_FAILED, Cancel

if TYPE_CHECKING:  # prometheus_client (the serve extra) only where a server runs: batch jobs need the engine alone
    from .metrics import ServerMetrics


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"  # Ctrl-C or SIGTERM: no new requests; the running ones are being ended
    FAILED = "failed"  # a rank was lost: nothing more can be generated


class Overloaded(Exception):
    """The waiting line is full (--max_waiting): answer 429 at once."""


class Unavailable(Exception):
    """The engine is loading, stopping or has failed: answer 503."""


class RequestStream:
    """The HTTP side's end of one request: the engine's Deltas, in order, up to the last one.

    The engine thread puts deltas in from its own thread; the HTTP side reads them on its event loop.
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self._loop = loop
        self._deltas: asyncio.Queue[Delta] = asyncio.Queue()

    def put(self, delta: Delta) -> None:
        """From any thread: hand the HTTP side a delta (dropped if the HTTP side's loop has closed)."""
        hand_over(self._loop, [(self, delta)])

    async def next(self) -> Delta:
        return await self._deltas.get()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            delta = await self.next()
            yield delta
            if delta.finished:
                return


class Mailbox:
    """Requests and cancellations from the HTTP thread to the engine, and the engine's state back."""

    def __init__(self, max_waiting: int, metrics: "ServerMetrics"):
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.state = ServerState.LOADING
        self._messages: "queue.SimpleQueue[Union[RequestStream, Cancel]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet admitted nor cancelled

    # The HTTP side's thread

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a checked request; its deltas come through the returned stream. Call it on the
        event loop that reads the stream. Raises Unavailable or Overloaded without queueing."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestStream]:
        """Queue the requests of one client's `n` choices in order, all or none, as submit does."""
        with self._lock:
            if self.state is not ServerState.READY:
                raise Unavailable(self.unavailable_reason())
            if self._waiting + len(requests) > self.max_waiting:
                more = f", no room for {len(requests)} more" if len(requests) > 1 else ""
                raise Overloaded(f"{self._waiting} requests are already waiting for a slot (--max_waiting "
                                 f"{self.max_waiting}){more}; try again shortly")
            self._waiting += len(requests)
            self.metrics.requests_waiting.set(self._waiting)
            # Queued under the lock: once the state has left READY, drain() finds every request queued.
            streams = [RequestStream(request, asyncio.get_running_loop()) for request in requests]
            for stream in streams:
                self._messages.put(stream)
        return streams

    def cancel(self, request_id: str) -> None:
        """The client of request_id has gone: free its slot (a no-op if it has ended)."""
        self._messages.put(Cancel(request_id))

    def unavailable_reason(self) -> str:
        """Why requests are refused now (for a 503 and /health); only meaningful when not READY."""
        if self.state is ServerState.LOADING:
            return "the model is still loading; try again shortly"
        if self.state is ServerState.STOPPING:
            return "the server is shutting down"
        return ENGINE_FAILED

    # The engine's thread

    def take(self, timeout: Optional[float]) -> list[Union[RequestStream, Cancel]]:
        """Every message that has come, waiting up to timeout seconds (None: forever) for the first."""
        try:
            first = self._messages.get(timeout=timeout) if timeout != 0 else self._messages.get_nowait()
        except queue.Empty:
            return []
        return [first, *self._queued()]

    def left_waiting(self, count: int = 1) -> None:
        """count requests left the waiting line (admitted, or cancelled while waiting)."""
        with self._lock:
            self._waiting -= count
            self.metrics.requests_waiting.set(self._waiting)

    def deliver(self, deltas: list[tuple[RequestStream, Delta]]) -> None:
        """A step's deltas to their streams, in order: the HTTP side's loop is woken once for them
        all, not once a delta (each wake-up is a write to its pipe, and a turn of its thread)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Delta]]] = {}
        for stream, delta in deltas:
            by_loop.setdefault(stream._loop, []).append((stream, delta))
        for loop, handed in by_loop.items():
            hand_over(loop, handed)

    def wake(self) -> None:
        """Make a waiting take() return (the state changed)."""
        self._messages.put(Cancel(""))

    def set_state(self, state: ServerState) -> None:
        with self._lock:
            self.state = state

    def stopping(self) -> None:
        """The engine ends every request and takes no more (Ctrl-C, SIGTERM)."""
        self.set_state(ServerState.STOPPING)

    def failed(self) -> None:
        """The engine cannot go on: requests are refused from now on (ENGINE_FAILED)."""
        self.set_state(ServerState.FAILED)
        with self._lock:
            self._waiting = 0
            self.metrics.requests_waiting.set(0)

    def drain(self) -> list[RequestStream]:
        """The requests still queued (after the state left READY, so no more come)."""
        return [message for message in self._queued() if isinstance(message, RequestStream)]

    def _queued(self) -> list[Union[RequestStream, Cancel]]:
        messages = []
        try:
            while True:
                messages.append(self._messages.get_nowait())
        except queue.Empty:
            return messages


def hand_over(loop: asyncio.AbstractEventLoop, deltas: list[tuple[RequestStream, Delta]]) -> None:
    """Put deltas in their streams' queues on loop, their readers' (dropped if it has closed: the
    server has stopped, nobody reads them, and the engine goes on)."""

    def put_all() -> None:
        for stream, delta in deltas:
            stream._deltas.put_nowait(delta)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:
        pass
