"""Rank 0's engine and the HTTP process, over a pipe: the engine's Inbox (engine/serving.py) in
its own process, where the HTTP side, in another (http_process.py), holds the Mailbox.

From the HTTP process come its Mailbox's messages: each request (a GenerationRequest) and each
cancellation (a Cancel), and READY once it takes requests. To it go messages of (kind, payload, metric updates): a step's deltas
(by request id), requests that left the waiting line, the engine's state, and the model once it
has loaded. The metric updates are the engine's since the message before (relay.py).

A lost HTTP process (its end of the pipe closed) makes the channel `lost`: the launch script then
stops the engine as Ctrl-C would, and says why.
"""

import os
from multiprocessing.connection import Connection, wait
from typing import Optional, Union

from ..engine.requests import Delta, GenerationRequest, Submission
from ..engine.serving import Cancel
from .mailbox import ServerState
from .relay import MetricsRelay
from .served_model import ServedModel

# The kinds of message to the HTTP process
STARTED = "started"  # the server listens: its URL (the HTTP process's first message, or FAILED_TO_START)
FAILED_TO_START = "failed to start"  # why it could not listen
READY = "ready"  # the model has loaded: its ServedModel (answered with READY once requests are taken)
DELTAS = "deltas"  # a step's deltas: [(request id, Delta)]
LEFT_WAITING = "left waiting"  # how many requests left the waiting line
STATE = "state"  # the engine stops (ServerState.STOPPING) or has failed (ServerState.FAILED)
CLOSE = "close"  # the engine leaves: the HTTP process answers what is left and ends


class RemoteStream:
    """A request from the HTTP process, as rank 0's engine holds it (a Submission)."""

    def __init__(self, request: GenerationRequest, channel: "EngineChannel"):
        self.request, self._channel = request, channel

    def put(self, delta: Delta) -> None:
        self._channel.deliver([(self, delta)])


class EngineChannel:
    """The engine's Inbox, in rank 0's process, over its end of the pipe to the HTTP process."""

    def __init__(self, connection: Connection):
        self.metrics = MetricsRelay()  # EngineMetrics' (server.engine_loop)
        self.lost = False  # the HTTP process has gone
        self._connection = connection
        self._early: list[Union[GenerationRequest, Cancel]] = []  # come while waiting for READY's answer
        self._wake_reader, self._wake_writer = os.pipe()  # wake(), from a signal handler
        os.set_blocking(self._wake_writer, False)

    def ready(self, model: ServedModel) -> None:
        """The model has loaded: once this returns, the HTTP side takes requests (it has said so).
        Before the engine's loop takes from the channel."""
        self._send(READY, model)
        while not self.lost:
            try:
                message = self._connection.recv()
            except (EOFError, OSError):
                self.lost = True
                return
            if message == READY:
                return
            self._early.append(message)

    def take(self, timeout: Optional[float]) -> list[Union[RemoteStream, Cancel]]:
        """Every message that has come, waiting up to timeout seconds (None: forever) for the first."""
        self._send_metrics()  # the gauges' last values, before a wait
        if self._wake_reader in wait([self._connection, self._wake_reader], timeout):
            os.read(self._wake_reader, 64)  # readable: returns at once
        return self._received()

    def left_waiting(self, count: int = 1) -> None:
        self._send(LEFT_WAITING, count)

    def deliver(self, deltas: list[tuple[Submission, Delta]]) -> None:
        self._send(DELTAS, [(stream.request.id, delta) for stream, delta in deltas])

    def drain(self) -> list[Submission]:
        """The requests that have come and were not taken (the HTTP process answers any later ones)."""
        return [message for message in self._received() if isinstance(message, RemoteStream)]

    def stopping(self) -> None:
        self._send(STATE, ServerState.STOPPING)

    def failed(self) -> None:
        self._send(STATE, ServerState.FAILED)

    def wake(self) -> None:
        """Make a waiting take() return (from a signal handler too: a second Ctrl-C may come after close)."""
        if self._connection.closed:
            return
        try:
            os.write(self._wake_writer, b"\0")
        except BlockingIOError:  # a wake-up is pending already
            pass

    def close(self) -> None:
        """The engine leaves: the last message (again: nothing)."""
        if self._connection.closed:
            return
        self._send(CLOSE, None)
        self._connection.close()  # first: a signal's wake() from now on writes nothing
        os.close(self._wake_reader)
        os.close(self._wake_writer)

    def _send_metrics(self) -> None:
        if self.metrics.updates:
            self._send(DELTAS, [])

    def _send(self, kind: str, payload) -> None:
        if self.lost:
            return
        try:
            self._connection.send((kind, payload, self.metrics.take()))
        except OSError:
            self.lost = True

    def _received(self) -> list[Union[RemoteStream, Cancel]]:
        messages, self._early = self._early, []
        while not self.lost and self._connection.poll(0):
            try:
                messages.append(self._connection.recv())
            except (EOFError, OSError):
                self.lost = True
        return [RemoteStream(message, self) if isinstance(message, GenerationRequest) else message
                for message in messages]
