"""Running the app: a listening socket taken first (so a busy port fails before the model loads),
then uvicorn on it in a thread of its own (in the HTTP process, http_process.py; beside the engine's
loop, engine_loop, where tests drive both in one process), speaking HTTP/1.1 through h11 with a
deadline on every request's headers."""

import asyncio
import functools
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine import Serving
from .limits import ServerLimits
from .mailbox import Mailbox
from .metrics import EngineMetrics

if TYPE_CHECKING:
    from ..generation import Llama

# Seconds a kept-alive connection may stay idle between requests (uvicorn's timeout_keep_alive).
KEEP_ALIVE_SECONDS = 5
# The most another thread waits for the GIL while uvicorn's runs Python (sys.setswitchinterval).
# Python's default, 5 ms, is as long as a GPU's step: the thread that hands a step's deltas over
# (the HTTP process's Front; the engine itself where both share a process) would find uvicorn's
# streaming the last step's deltas and wait up to that long to go on.
GIL_SWITCH_SECONDS = 0.0005


def engine_loop(generator: "Llama", max_prefill_tokens: int, mailbox: Optional[Mailbox]) -> Serving:
    """The engine's serving loop over generator's model, on every rank: rank 0's hears of requests
    through mailbox (None on the others), sends each its text and counts it in the metrics."""
    observer = EngineMetrics(mailbox.metrics) if mailbox is not None else None
    return Serving(generator.engine(max_prefill_tokens, observer, text=mailbox is not None), mailbox)


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: a free one), or a ValueError that says what to change."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ValueError(f"cannot listen on {host}:{port} ({error.strerror}): pass another --host") from None
    sock = socket.socket(family, kind, proto)
    try:
        # A port held only by the closed connections of a server that just stopped (TIME_WAIT) is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's backlog
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({error.strerror}): pass another --port") from None
    return sock


class HeadersDeadline(H11Protocol):
    """uvicorn's h11 protocol, where a request's headers must be in within read_timeout seconds of
    the connection's opening (or of the answer before, on a kept-alive connection); else the
    connection is closed. uvicorn's own keep-alive timeout starts only after a first answer, and
    any byte resets it: a client that sends nothing, or its headers a byte at a time, would hold a
    connection (and a file descriptor) for ever. h11 bounds the headers' size (16 KB)."""

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self._deadline is not None:  # the headers are in
            self._deadline.cancel()
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # the next request's
            self._start_deadline()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.read_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class ServerThread:
    """uvicorn serving app on sock, in a daemon thread.

    It installs no signal handlers (the launch script owns Ctrl-C), configures no logging (its
    warnings go through the "uvicorn.error" logger) and writes no access log. stop() gives open
    streams graceful_seconds to end, then cancels them, which cancels their requests.
    """

    def __init__(self, app: FastAPI, sock: socket.socket, graceful_seconds: float = 1.0,
                 ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None,
                 read_timeout: float = ServerLimits.read_timeout):
        """ssl_certfile and ssl_keyfile (PEM): serve HTTPS. read_timeout: seconds for a request's
        headers to arrive (the body's own deadline is the app's: edge.py)."""
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=graceful_seconds, ssl_certfile=ssl_certfile,
                                ssl_keyfile=ssl_keyfile, timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                http=functools.partial(HeadersDeadline, read_timeout=read_timeout))
        self.server = uvicorn.Server(config)
        self.scheme = "https" if ssl_certfile else "http"
        self.sock = sock
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="llama_tp-http",
                                        daemon=True)

    @property
    def url(self) -> str:
        """http(s)://HOST:PORT as bound (the port chosen, if 0 was asked)."""
        host, port = self.sock.getsockname()[:2]
        return f"{self.scheme}://[{host}]:{port}" if ":" in host else f"{self.scheme}://{host}:{port}"

    def start(self, timeout: float = 10.0) -> "ServerThread":
        """Start serving; return once connections are accepted."""
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server stopped while starting; its log says why")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {timeout} seconds")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, end open connections, and wait for the thread (at most timeout seconds)."""
        self.server.should_exit = True
        self._thread.join(timeout)
