"""Running the app: a listening socket taken first (so a busy port fails before the model loads),
then uvicorn on it in a thread of its own, beside rank 0's engine loop (engine_loop)."""

import socket
import threading
import time
from typing import TYPE_CHECKING, Optional

import uvicorn
from fastapi import FastAPI

from ..engine import Serving
from .mailbox import Mailbox
from .metrics import EngineMetrics

if TYPE_CHECKING:
    from ..generation import Llama


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


class ServerThread:
    """uvicorn serving app on sock, in a daemon thread.

    It installs no signal handlers (the launch script owns Ctrl-C), configures no logging (its
    warnings go through the "uvicorn.error" logger) and writes no access log. stop() gives open
    streams graceful_seconds to end, then cancels them, which cancels their requests.
    """

    def __init__(self, app: FastAPI, sock: socket.socket, graceful_seconds: float = 1.0,
                 ssl_certfile: Optional[str] = None, ssl_keyfile: Optional[str] = None):
        """ssl_certfile and ssl_keyfile (PEM): serve HTTPS."""
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=graceful_seconds, ssl_certfile=ssl_certfile,
                                ssl_keyfile=ssl_keyfile)
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
