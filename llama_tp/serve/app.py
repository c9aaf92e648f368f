"""The HTTP side: OpenAI's routes on FastAPI, in front of rank 0's mailbox into the engine.

A generation request is parsed and checked (protocol.py), turned into a GenerationRequest
(prepare.py) and submitted; its deltas come back through a RequestStream and go out whole or as
server-sent events (responses.py). Whatever ends the HTTP side's reading early (the client leaving,
the server stopping) cancels the request in the engine, so its slot is freed within a step.
"""

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..structured.tools import tool_format
from .edge import Edge, error_response
from .limits import ServerLimits
from .mailbox import Mailbox, ServerState
from .prepare import asks_for_grammar, chat_request, choices, completion_request, dialog_tokens, text_tokens
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
                       parse_body)
from .requests import Delta, Overloaded, RequestStream, Unavailable
from .responses import Answered, ChatReply, CompletionReply, Reply, event

if TYPE_CHECKING:
    from ..generation import Llama


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    body: type
    prepare: Callable
    reply: type[Reply]


CHAT = Endpoint(ChatCompletionRequest, chat_request, ChatReply)
COMPLETION = Endpoint(CompletionRequest, completion_request, CompletionReply)
# Requests prepared at once whose grammar may take up to --grammar_timeout to compile, on threads
# of their own (beyond: 429): however many slow grammars come, the threads that prepare the
# other requests stay free.
GRAMMAR_REQUESTS = 16


def create_app(mailbox: Mailbox, generator: "Optional[Llama]", model_name: str,
               api_key: Optional[str] = None, limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The server's routes. generator (a Llama) gives the tokenizer, chat format, max_seq_len and
    sampling defaults; None while the model loads, then set app.state.generator before the mailbox
    goes READY. model_name is the one name clients may ask for. api_key: every route but /health
    and /metrics then needs `Authorization: Bearer API_KEY` (as in vLLM), and the API's docs
    pages are off. limits: what one request may ask of the server (edge.py, limits.py)."""
    documented = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="llama_tp", summary="An OpenAI-compatible server over tensor-parallel Llama ranks",
                  **documented)
    app.state.generator = generator
    started = int(time.time())
    grammar_threads = anyio.CapacityLimiter(GRAMMAR_REQUESTS)
    compiling = 0  # requests preparing on grammar_threads: counted on the event loop, so never past them
    app.add_middleware(Edge, api_key=api_key, limits=limits,
                       refused=lambda status: mailbox.metrics.requests_refused.labels(str(status)).inc())

    def refuse(error: RequestError) -> Response:
        mailbox.metrics.requests_refused.labels(str(error.status)).inc()
        return error_response(error)

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        nonlocal compiling
        generator = app.state.generator
        try:
            if generator is None:
                raise Unavailable("the model is still loading; try again shortly")
            # Off the event loop: parsing a body of megabytes takes a while, and every stream waits on the loop.
            body = await run_in_threadpool(parse_body, await request.body(), endpoint.body)
            if body.model != model_name:
                raise RequestError(404, f"the model `{body.model}` does not exist; this server serves "
                                   f"`{model_name}`", "model", "model_not_found")
            reply = endpoint.reply(model_name, generator.tokenizer, body.include_usage, body.n or 1)
            # Off the event loop: a long prompt takes a while to encode, a grammar to compile.
            prepare = functools.partial(endpoint.prepare, body, generator, reply.id, limits.grammar)
            if asks_for_grammar(body):
                if compiling == GRAMMAR_REQUESTS:
                    raise Overloaded(f"{GRAMMAR_REQUESTS} requests already wait for their grammars to compile; "
                                     "try again shortly")
                compiling += 1
                try:
                    prepared = await anyio.to_thread.run_sync(prepare, limiter=grammar_threads)
                finally:
                    compiling -= 1
            else:
                prepared = await run_in_threadpool(prepare)
            requests = choices(body, prepared, generator)
            if getattr(body, "tools", None) and body.tool_choice != "none":  # answers parsed for calls
                reply.tools = (tool_format(generator.formatter), {tool.function.name for tool in body.tools})
            if getattr(body, "echo", False):  # completions' echo: the prompt's text first
                reply.echo = body.prompt if isinstance(body.prompt, str) else generator.tokenizer.decode(body.prompt)
            streams = mailbox.submit_all(requests)
        except RequestError as error:
            return refuse(error)
        except Overloaded as error:
            return refuse(RequestError(429, str(error), None, "rate_limit_exceeded"))
        except Unavailable as error:
            return refuse(RequestError(503, str(error), None, "service_unavailable"))
        answer = Answer(streams, mailbox, request)
        if body.stream:
            return EventStream(answer, events(answer, reply, prepared.logprobs))
        return await whole(answer, reply, prepared.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETION)

    async def tokenizer_route(request: Request, body_type: type, answer: Callable) -> Response:
        """/tokenize and /detokenize (vLLM's): the tokenizer alone, no engine."""
        generator = app.state.generator
        try:
            if generator is None:
                raise RequestError(503, "the model is still loading; try again shortly", None, "service_unavailable")
            body = await run_in_threadpool(parse_body, await request.body(), body_type)
            if body.model not in (None, model_name):
                raise RequestError(404, f"the model `{body.model}` does not exist; this server serves "
                                   f"`{model_name}`", "model", "model_not_found")
            return JSONResponse(await run_in_threadpool(answer, body, generator))
        except RequestError as error:
            return refuse(error)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def answer(body: TokenizeRequest, generator) -> dict:
            tokens = (dialog_tokens(body.messages, generator) if body.messages is not None
                      else text_tokens(body.prompt, generator, bos=body.add_special_tokens))
            return {"count": len(tokens), "max_model_len": generator.model.max_seq_len, "tokens": tokens}

        return await tokenizer_route(request, TokenizeRequest, answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        def answer(body: DetokenizeRequest, generator) -> dict:
            vocab, max_seq_len = generator.model.args.vocab_size, generator.model.max_seq_len
            if len(body.tokens) > max_seq_len:  # the limit /tokenize and the prompts have
                raise RequestError(400, f"`tokens` holds {len(body.tokens)} ids, more than the model's max_seq_len "
                                   f"of {max_seq_len}", "tokens", "context_length_exceeded")
            outside = [token for token in body.tokens if not 0 <= token < vocab]
            if outside:
                raise RequestError(400, f"`tokens` holds token id {outside[0]}, outside the vocabulary [0, {vocab})",
                                   "tokens", "invalid_value")
            return {"prompt": generator.tokenizer.decode(body.tokens)}

        return await tokenizer_route(request, DetokenizeRequest, answer)

    def model_card() -> dict:
        generator = app.state.generator
        return {"id": model_name, "object": "model", "created": started, "owned_by": "llama_tp",
                "max_model_len": generator.model.max_seq_len if generator is not None else None}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        if name != model_name:
            return error_response(RequestError(404, f"the model `{name}` does not exist; this server serves "
                                               f"`{model_name}`", "model", "model_not_found"))
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        if mailbox.state is ServerState.READY:
            return JSONResponse({"status": "ok"})
        return error_response(RequestError(503, mailbox.unavailable_reason(), None, "service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(mailbox.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        """Unknown paths and methods, in OpenAI's error shape too."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(RequestError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                                           None, code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        """Our own bug: OpenAI's shape for the client; uvicorn logs the traceback."""
        return error_response(RequestError(500, f"internal error: {type(error).__name__}", None, "internal_error"))

    return app


def failure(delta: Delta) -> RequestError:
    """The error a request's last delta ended it with (finish_reason "error"), as the client sees it."""
    return RequestError(delta.error_status, delta.error or "the engine failed", None, delta.error_code)


class Answer:
    """An admitted request's deltas, from each of its choices' streams as they come, up to every
    choice's last one or until the client leaves.

    close() tells the engine to cancel the choices that have not ended: call it whenever the
    reading stops, for whatever reason.
    """

    def __init__(self, streams: list[RequestStream], mailbox: Mailbox, request: Request):
        self.streams, self.mailbox, self.request = streams, mailbox, request
        self.ended: set[int] = set()  # the choices whose last delta has come
        self._leaving: "asyncio.Future | None" = None

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as they come."""
        self._leaving = asyncio.ensure_future(disconnected(self.request))
        coming: dict[int, asyncio.Future] = {}  # each running choice's next delta
        try:
            while len(self.ended) < len(self.streams):
                for index, stream in enumerate(self.streams):
                    if index not in self.ended and index not in coming:
                        coming[index] = asyncio.ensure_future(stream.next())
                await asyncio.wait((*coming.values(), self._leaving), return_when=asyncio.FIRST_COMPLETED)
                if not any(future.done() for future in coming.values()):  # the client has gone
                    return
                for index in sorted(index for index, future in coming.items() if future.done()):
                    delta = coming.pop(index).result()
                    if delta.finished:
                        self.ended.add(index)
                    yield index, delta
        finally:
            for future in coming.values():
                future.cancel()
            self.close()

    def close(self) -> None:
        if self._leaving is not None:
            self._leaving.cancel()
        for index, stream in enumerate(self.streams):
            if index not in self.ended:
                self.ended.add(index)
                self.mailbox.cancel(stream.request.id)


async def disconnected(request: Request) -> None:
    """Return when the client has gone (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(answer: Answer, reply: Reply, logprobs: bool) -> Response:
    """The answer as one JSON response, once every choice's last delta has come."""
    texts = [[] for _ in answer.streams]
    items = [[] for _ in answer.streams]
    finals: dict[int, Delta] = {}
    try:
        async for index, delta in answer.deltas():
            texts[index].append(delta.text)
            items[index].extend(delta.logprobs)
            if delta.finished:
                finals[index] = delta
    finally:
        answer.close()
    if len(finals) < len(answer.streams):  # the client has gone: nobody reads this
        return Response(status_code=499)
    failed = next((final for final in finals.values() if final.finish_reason == "error"), None)
    if failed is not None:
        return error_response(failure(failed))
    return JSONResponse(reply.response([Answered("".join(texts[index]), items[index] if logprobs else None,
                                                 finals[index]) for index in range(len(answer.streams))]))


async def events(answer: Answer, reply: Reply, logprobs: bool) -> AsyncIterator[bytes]:
    """The answer as server-sent events: chunks, each choice's finish reason, the usage when
    asked, [DONE]; an engine failure as an error event, which ends the stream."""
    for chunk in reply.opening():
        yield chunk
    async for index, delta in answer.deltas():
        if delta.finish_reason == "error":
            yield event(failure(delta).body())
            return
        for chunk in reply.chunks(index, delta, logprobs):
            yield chunk


class EventStream(StreamingResponse):
    """A stream of server-sent events that cancels its request however the stream ends (the client
    leaving, the server stopping, an error), even before its first event."""

    media_type = "text/event-stream"

    def __init__(self, answer: Answer, content: AsyncIterator[bytes]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.close()
