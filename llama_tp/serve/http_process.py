"""The HTTP side in a process of its own, as vLLM's API server: uvicorn, the app, every request's
preparing (tokenizing, chat templates, grammars checked) and every answer's JSON and server-sent
events run there, never holding the GIL of rank 0's engine while it steps the model.

Rank 0 starts it (HttpProcess) with the listening socket before the model loads, so /health
answers 503 meanwhile (once its imports are done, while the model loads); the engine's end of
their pipe is an EngineChannel (channel.py). In the HTTP process the app talks to a Mailbox as
it would beside the engine, and a Front carries the mailbox's messages to the engine and the
engine's back to the mailbox.

Ctrl-C and SIGTERM reach both processes: the HTTP one leaves them to the engine, which ends what
runs, then closes the channel. Whichever process goes first, the other one sees the pipe close: an engine
without its HTTP side stops (the launch script says why), an HTTP side without its engine ends
every request with an error and exits.
"""

import multiprocessing
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

from ..engine.requests import Delta
from ..engine.serving import ENGINE_FAILED
from .app import create_app
from .channel import CLOSE, DELTAS, FAILED_TO_START, LEFT_WAITING, READY, STARTED, STATE, EngineChannel
from .limits import ServerLimits
from .mailbox import Mailbox, RequestStream, ServerState
from .metrics import ServerMetrics
from .relay import apply_updates
from .server import ServerThread

# Seconds the HTTP process may take to import its modules and listen.
START_SECONDS = 120.0
# Seconds it may take, once the engine has closed the channel, to end its streams and exit.
STOP_SECONDS = 10.0


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP side's options (launch/serve.py's)."""

    model_name: str
    max_waiting: int
    api_key: Optional[str] = None
    max_stored_responses: int = 1024
    limits: ServerLimits = ServerLimits()
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None


class HttpProcess:
    """Rank 0's handle on the HTTP process: its channel, its URL, its end."""

    def __init__(self, sock: socket.socket, settings: HttpSettings):
        """Start serving on sock (which the HTTP process takes over). Its imports take seconds:
        the model loads meanwhile, and wait_until_listening() says whether it came up."""
        context = multiprocessing.get_context("spawn")  # no fork of a process with the process group's threads
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=serve_http, args=(child_end, sock, settings), name="llama_tp-http",
                                       daemon=True)
        self.process.start()
        child_end.close()
        sock.close()
        self.channel = EngineChannel(self._connection)
        self.url: Optional[str] = None  # http(s)://HOST:PORT, once it listens

    @property
    def lost(self) -> bool:
        """Whether the HTTP process ended before the engine closed the channel."""
        return self.channel.lost

    def ended_unexpectedly(self) -> str:
        """The message for a lost HTTP process."""
        self.process.join(1)
        return (f"the HTTP server's process ended unexpectedly (exit code {self.process.exitcode}), so no request "
                "can reach the model (anything it said is in the log above)")

    def stop(self) -> None:
        """Close the channel and wait for the HTTP process to answer what is left and exit."""
        self.channel.close()
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def wait_until_listening(self) -> str:
        """Its URL once it listens (before the channel is used); or RuntimeError saying why it does not."""
        if not self._connection.poll(START_SECONDS):
            self.process.kill()
            raise RuntimeError(f"the HTTP server did not start within {START_SECONDS:g} seconds")
        try:
            kind, payload, _ = self._connection.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the HTTP server's process ended while starting (exit code {self.process.exitcode}); "
                               "its log says why") from None
        if kind == FAILED_TO_START:
            self.process.join()
            raise RuntimeError(payload)
        assert kind == STARTED, kind
        self.url = payload
        return payload


def serve_http(connection: Connection, sock: socket.socket, settings: HttpSettings) -> None:
    """The HTTP process: the app on sock, its mailbox joined to the engine through connection."""
    # Ctrl-C and SIGTERM reach the whole job (a terminal's group, a service manager's): they are the
    # engine's to handle, which ends the running answers, then closes the channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mailbox = Mailbox(settings.max_waiting, ServerMetrics(settings.model_name))
    app = create_app(mailbox, None, settings.model_name, settings.api_key, settings.max_stored_responses,
                     settings.limits)
    server = ServerThread(app, sock, ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile,
                          read_timeout=settings.limits.read_timeout)
    try:
        server.start()
    except RuntimeError as error:
        connection.send((FAILED_TO_START, str(error), []))
        return
    connection.send((STARTED, server.url, []))
    try:
        Front(connection, mailbox, app.state).run()
    finally:
        server.stop()  # open streams get their last events first


class Front:
    """The HTTP process's side of the channel: the mailbox's requests and cancellations out, on a
    thread of its own; the engine's deltas, states and metrics in, until the engine closes it."""

    def __init__(self, connection: Connection, mailbox: Mailbox, app_state):
        self.connection, self.mailbox, self.app_state = connection, mailbox, app_state
        self.streams: dict[str, RequestStream] = {}  # sent to the engine, not yet ended
        self._sending = threading.Lock()  # the connection's, for both threads
        self._closing = False

    def run(self) -> None:
        sender = threading.Thread(target=self._send_requests, name="llama_tp-requests", daemon=True)
        sender.start()
        try:
            self._receive()
        finally:
            self._closing = True
            if self.mailbox.state in (ServerState.LOADING, ServerState.READY):
                self.mailbox.stopping()  # no more requests: they would reach no engine
            self.mailbox.wake()
            sender.join()
            self._end_unanswered()

    def _send_requests(self) -> None:
        while not self._closing:
            for message in self.mailbox.take(None):
                if isinstance(message, RequestStream):
                    self.streams[message.request.id] = message  # before the engine can answer it
                    message = message.request
                elif not message.request_id:  # a wake-up only
                    continue
                if not self._send(message):
                    return

    def _receive(self) -> None:
        while True:
            try:
                kind, payload, updates = self.connection.recv()
            except (EOFError, OSError):  # the engine's process has gone
                self.mailbox.failed()
                return
            apply_updates(self.mailbox.metrics, updates)
            if kind == DELTAS:
                self.mailbox.deliver([(self._stream(request_id, delta), delta) for request_id, delta in payload])
            elif kind == LEFT_WAITING:
                self.mailbox.left_waiting(payload)
            elif kind == READY:
                self.app_state.generator = payload
                self.mailbox.set_state(ServerState.READY)
                self._send(READY)  # the engine says the server answers only once it does
            elif kind == STATE:
                if payload is ServerState.FAILED:
                    self.mailbox.failed()
                else:
                    self.mailbox.stopping()
            elif kind == CLOSE:
                return

    def _send(self, message) -> bool:
        """Whether message went (else the engine's process has gone: _receive sees it)."""
        with self._sending:
            try:
                self.connection.send(message)
                return True
            except OSError:
                return False

    def _stream(self, request_id: str, delta: Delta) -> RequestStream:
        return self.streams.pop(request_id) if delta.finished else self.streams[request_id]

    def _end_unanswered(self) -> None:
        """Requests the engine never took (sent as it stopped, or still here) end with an error."""
        if self.mailbox.state is ServerState.FAILED:
            last = Delta(finish_reason="error", error=ENGINE_FAILED)
        else:
            last = Delta(finish_reason="error", error="the server is shutting down", error_code="service_unavailable")
        for stream in [*self.streams.values(), *self.mailbox.drain()]:
            stream.put(last)
        self.streams.clear()
