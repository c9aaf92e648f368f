"""What every request passes before any route sees it: the API key, one way of framing its body,
and the body itself, read whole within a size and a time limit (ServerLimits). An ASGI
middleware around the whole app, so that every route has it, the routes to come too; refusals
are OpenAI's error JSON, and a refusal that leaves a body unread closes the connection.

The headers' own deadline is the HTTP protocol's (server.py); this one starts once they are in.
"""

import asyncio
import ctypes
import ctypes.util
import gc
import hmac
import json
from typing import Callable, Optional

from fastapi.responses import Response

from .limits import ServerLimits
from .messages.protocol import messages_error
from .protocol import RequestError

# Open without the key, as in vLLM: load balancers and Prometheus ask these.
OPEN_PATHS = ("/health", "/metrics")
# After a body this large, the memory it took is handed back to the system (trim_memory).
TRIMMED_BODY_BYTES = 2**20


def openai_error(error: RequestError) -> tuple[int, dict]:
    """OpenAI's error JSON and its status."""
    return error.status, error.body()


def error_shape(path: str) -> Callable[[RequestError], tuple[int, dict]]:
    """Anthropic's errors for its Messages routes, OpenAI's for every other."""
    return messages_error if path.startswith("/v1/messages") else openai_error


def error_response(error: RequestError, shape: Callable[[RequestError], tuple[int, dict]] = openai_error,
                   close: bool = False) -> Response:
    """error as shape writes it (OpenAI's JSON by default); close: the connection ends after it (a body left unread)."""
    status, body = shape(error)
    # ASCII-escaped: a message may quote the client's text, lone surrogates and all
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers={"Connection": "close"} if close else None)


class Edge:
    """The ASGI middleware: refused (the status) is told of every refusal, for /metrics."""

    def __init__(self, app, api_key: Optional[str], limits: ServerLimits, refused: Callable[[int], None]):
        self.app, self.limits, self.refused = app, limits, refused
        # OpenAI's way (Authorization: Bearer) and Anthropic's (x-api-key)
        self.expected = None if api_key is None else (f"Bearer {api_key}".encode(), api_key.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, refusal = b"", self._refusal(scope)
        if refusal is None:
            try:
                body = await asyncio.wait_for(self._body(receive), self.limits.read_timeout)
            except asyncio.TimeoutError:
                refusal = RequestError(408, f"the request's body did not arrive within {self.limits.read_timeout:g} s "
                                       "(the server's --read_timeout)", None, "request_timeout")
            except _Refused as error:
                refusal = error.error
            except _ClientLeft:
                return
        large = len(body) >= TRIMMED_BODY_BYTES or (refusal is not None and refusal.status == 413)
        try:
            if refusal is not None:
                # The connection ends with the refusal: its body, unread, could be gigabytes, or
                # (framed two ways) be taken for another request.
                response = error_response(refusal, error_shape(scope["path"]), close=True)
                self.refused(response.status_code)
                await response(scope, receive, send)
                return
            # the body's one holder from here is the replay, which lets go of it once it is read
            replay, body = _Replay(body, receive), b""
            await self.app(scope, replay, send)
        finally:
            if large:
                trim_memory()

    def _refusal(self, scope) -> Optional[RequestError]:
        """What the headers alone refuse."""
        headers = dict(scope["headers"])  # names in lower case (uvicorn's)
        if b"transfer-encoding" in headers and b"content-length" in headers:
            return RequestError(400, "the request has both `Transfer-Encoding` and `Content-Length`, which could "
                                "frame its body two ways; send one of them", None, "invalid_framing")
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            # in constant time: no guessing byte by byte
            if not (hmac.compare_digest(given[0], self.expected[0]) | hmac.compare_digest(given[1], self.expected[1])):
                said = "a wrong API key" if any(given) else "no API key"
                return RequestError(401, f"the request has {said}; send the server's key as `Authorization: Bearer "
                                    "KEY` or `x-api-key: KEY` (the openai or anthropic client's api_key)", None,
                                    "invalid_api_key")
        if int(headers.get(b"content-length", b"0")) > self.limits.max_body_bytes:  # digits: h11 checked them
            return self._too_large()
        return None

    async def _body(self, receive) -> bytes:
        """The whole body, refused as soon as it passes the size limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise _Refused(self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> RequestError:
        return RequestError(413, f"the request's body is larger than the server takes ({self.limits.max_body_bytes} "
                            "bytes, --max_body_bytes)", None, "request_too_large")


def trim_memory() -> None:
    """Hand the memory freed since back to the system (glibc's malloc_trim; elsewhere nothing).
    A large body's copies (the bytes, the parsed JSON, its text) are freed once answered, but
    glibc keeps freed chunks of that size in each thread's arena for the next: a few such bodies
    would hold hundreds of megabytes for good."""
    if _LIBC is not None:
        # A refusal's traceback holds the parsed body in a reference cycle (frame, locals,
        # exception), which only the collector frees: collected first, or trimmed too soon.
        gc.collect()
        _LIBC.malloc_trim(0)


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        library = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return library if hasattr(library, "malloc_trim") else None


_LIBC = _glibc()


class _Replay:
    """The app's receive: the body read already, then the connection's own messages (its disconnect).
    It keeps no copy of the body once given, so that the memory is free to trim when the app is done."""

    def __init__(self, body: bytes, receive):
        self.body, self.receive = body, receive

    async def __call__(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()


class _Refused(Exception):
    def __init__(self, error: RequestError):
        self.error = error


class _ClientLeft(Exception):
    pass
