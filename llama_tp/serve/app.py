"""The HTTP side: OpenAI's routes and Anthropic's Messages on FastAPI, in front of rank 0's mailbox
into the engine.

A generation request is parsed and checked (protocol.py; Anthropic's: messages/protocol.py, then
translated into a chat completion's body, messages/translate.py), turned into a GenerationRequest
(prepare.py) and submitted; its deltas come back through a RequestStream and go out whole or as
server-sent events (responses.py, messages/reply.py). Whatever ends the HTTP side's reading early
(the client leaving, the server stopping) cancels the request in the engine, so its slot is freed
within a step.
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

from ..engine.requests import Delta
from .edge import Edge, error_response, error_shape, openai_error
from .limits import ServerLimits
from .mailbox import Mailbox, Overloaded, RequestStream, ServerState, Unavailable
from .messages.protocol import CountTokensRequest, MessagesRequest, messages_error
from .messages.reply import MessageReply
from .messages.translate import chat_body
from .prepare import (asks_for_grammar, callable_tools, chat_prompt, chat_request, choices, completion_request,
                      dialog_tokens, text_tokens)
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest,
                       parse_body)
from .responses import Answered, ChatReply, CompletionReply, Reply
from .responses_api import output as responses_output
from .responses_api.prepare import asks_for_grammar as turn_asks_for_grammar
from .responses_api.prepare import prepare_turn
from .responses_api.protocol import ResponsesRequest
from .responses_api.store import ResponseStore

if TYPE_CHECKING:
    from ..generation import Llama


HEARTBEAT_SECONDS = 5.0  # a stream silent this long gets its door's heartbeat (Anthropic's ping)


def as_is(body):
    return body


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions, /v1/completions and /v1/messages."""

    body: type
    prepare: Callable
    reply: type[Reply]
    translate: Callable = as_is  # the checked body as the one prepare takes
    errors: Callable[[RequestError], tuple[int, dict]] = openai_error


CHAT = Endpoint(ChatCompletionRequest, chat_request, ChatReply)
COMPLETION = Endpoint(CompletionRequest, completion_request, CompletionReply)
MESSAGES = Endpoint(MessagesRequest, chat_request, MessageReply, chat_body, messages_error)
# Requests prepared at once whose grammar may take up to --grammar_timeout to compile, on threads
# of their own (beyond: 429): however many slow grammars come, the threads that prepare the
# other requests stay free.
GRAMMAR_REQUESTS = 16


def create_app(mailbox: Mailbox, generator: "Optional[Llama]", model_name: str,
               api_key: Optional[str] = None, max_stored_responses: int = 1024,
               limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The server's routes. generator (a Llama) gives the tokenizer, chat format, max_seq_len and
    sampling defaults; None while the model loads, then set app.state.generator before the mailbox
    goes READY. model_name is the one name clients may ask for. api_key: every route but /health
    and /metrics then needs `Authorization: Bearer API_KEY` or `x-api-key: API_KEY` (OpenAI's and
    Anthropic's ways; the open two as in vLLM), and the API's docs pages are off.
    max_stored_responses: how many Responses API answers are kept for previous_response_id.
    limits: what one request may ask of the server (edge.py, limits.py)."""
    documented = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="llama_tp", summary="An OpenAI- and Anthropic-compatible server over tensor-parallel Llama ranks",
                  **documented)
    app.state.generator = generator
    started = int(time.time())
    stored = ResponseStore(max_stored_responses)
    grammar_threads = anyio.CapacityLimiter(GRAMMAR_REQUESTS)
    compiling = 0  # requests preparing on grammar_threads: counted on the event loop, so never past them
    app.add_middleware(Edge, api_key=api_key, limits=limits,
                       refused=lambda status: mailbox.metrics.requests_refused.labels(str(status)).inc())

    def refuse(error: RequestError, shape: Callable = openai_error) -> Response:
        response = error_response(error, shape)
        mailbox.metrics.requests_refused.labels(str(response.status_code)).inc()
        return response

    def refuse_submission(error: "RequestError | Overloaded | Unavailable", shape: Callable = openai_error) -> Response:
        """A request the server cannot take: its own fault, a full waiting line (429), no engine (503)."""
        if isinstance(error, Overloaded):
            error = RequestError(429, str(error), None, "rate_limit_exceeded")
        elif isinstance(error, Unavailable):
            error = RequestError(503, str(error), None, "service_unavailable")
        return refuse(error, shape)

    def check_model(name: str) -> None:
        if name != model_name:
            raise RequestError(404, f"the model `{name}` does not exist; this server serves `{model_name}`",
                               "model", "model_not_found")

    async def prepare_off_loop(prepare: Callable, compiles: bool):
        """prepare() off the event loop: a long prompt takes a while to encode, a grammar
        (compiles) to compile, on grammar_threads, at most GRAMMAR_REQUESTS at once (beyond: 429)."""
        nonlocal compiling
        if not compiles:
            return await run_in_threadpool(prepare)
        if compiling == GRAMMAR_REQUESTS:
            raise Overloaded(f"{GRAMMAR_REQUESTS} requests already wait for their grammars to compile; "
                             "try again shortly")
        compiling += 1
        try:
            return await anyio.to_thread.run_sync(prepare, limiter=grammar_threads)
        finally:
            compiling -= 1

    async def generate(request: Request, endpoint: Endpoint) -> Response:
        generator = app.state.generator
        try:
            if generator is None:
                raise Unavailable("the model is still loading; try again shortly")
            # Off the event loop: parsing a body of megabytes takes a while, and every stream waits on the loop.
            raw = await request.body()
            body = await run_in_threadpool(lambda: endpoint.translate(parse_body(raw, endpoint.body)))
            check_model(body.model)
            reply = endpoint.reply(model_name, generator.tokenizer, body.include_usage, body.n or 1)
            prepared = await prepare_off_loop(functools.partial(endpoint.prepare, body, generator, reply.id,
                                                                limits.grammar), asks_for_grammar(body))
            requests = choices(body, prepared, generator)
            reply.expect(body, prepared, generator)
            streams = mailbox.submit_all(requests)
        except (RequestError, Overloaded, Unavailable) as error:
            return refuse_submission(error, endpoint.errors)
        answer = Answer(streams, mailbox, request)
        if body.stream:
            return EventStream(answer, heartbeats(events(answer, reply, prepared.logprobs), reply.heartbeat))
        return await whole(answer, reply, prepared.logprobs, endpoint.errors)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETION)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (also as Claude Code's /v1/messages?beta=true)."""
        return await generate(request, MESSAGES)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (responses_api/): a turn of a conversation, kept for previous_response_id."""
        generator = app.state.generator
        response_id = responses_output.new_id("resp")
        try:
            if generator is None:
                raise Unavailable("the model is still loading; try again shortly")
            raw = await request.body()
            body = await run_in_threadpool(parse_body, raw, ResponsesRequest)
            check_model(body.model)
            turn = await prepare_off_loop(functools.partial(prepare_turn, body, generator, stored, response_id,
                                                            limits.grammar), turn_asks_for_grammar(body))
            streams = mailbox.submit_all([turn.request])
        except (RequestError, Overloaded, Unavailable) as error:
            return refuse_submission(error)
        output = responses_output.ResponseOutput(response_id, model_name, body, turn)
        answer = Answer(streams, mailbox, request)

        def keep(ended: responses_output.ResponseOutput) -> None:
            if body.store is not False:
                stored.put(response_id, ended.stored())

        if body.stream:
            return EventStream(answer, responses_output.events(answer.deltas(), output, keep))
        try:
            final = await responses_output.whole(answer.deltas(), output)
        finally:
            answer.close()
        if final is None:  # the client has gone: nobody reads this
            return Response(status_code=499)
        if final.finish_reason == "error":
            return error_response(failure(final))
        keep(output)
        return JSONResponse(output.response)

    def not_kept(response_id: str) -> Response:
        return error_response(RequestError(404, f"no stored response has the id `{response_id}`", "response_id",
                                           "not_found"))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        kept = stored.get(response_id)
        return not_kept(response_id) if kept is None else JSONResponse(kept.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not stored.delete(response_id):
            return not_kept(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def tokenizer_route(request: Request, body_type: type, answer: Callable,
                              shape: Callable = openai_error) -> Response:
        """/tokenize and /detokenize (vLLM's), /v1/messages/count_tokens: the tokenizer alone, no engine."""
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
            return refuse(error, shape)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        def answer(body: CountTokensRequest, generator) -> dict:
            return {"input_tokens": len(chat_prompt(chat_body(body), generator))}

        return await tokenizer_route(request, CountTokensRequest, answer, messages_error)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def answer(body: TokenizeRequest, generator) -> dict:
            if body.messages is None:
                tokens = text_tokens(body.prompt, generator, bos=body.add_special_tokens)
            else:
                tokens = dialog_tokens(body.messages, generator, callable_tools(body), body.chat_template_kwargs)
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
        """Unknown paths and methods, in OpenAI's error shape too (Anthropic's on its routes)."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(RequestError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                                           None, code), error_shape(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        """Our own bug: OpenAI's shape for the client (Anthropic's on its routes); uvicorn logs the traceback."""
        return error_response(RequestError(500, f"internal error: {type(error).__name__}", None, "internal_error"),
                              error_shape(request.url.path))

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


async def whole(answer: Answer, reply: Reply, logprobs: bool, shape: Callable = openai_error) -> Response:
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
        return error_response(failure(failed), shape)
    if finals[0].beams:  # beam search: one request, whose best beams are the choices
        return JSONResponse(reply.response([Answered(beam.text, list(beam.logprobs) if logprobs else None, beam)
                                            for beam in finals[0].beams]))
    return JSONResponse(reply.response([Answered("".join(texts[index]), items[index] if logprobs else None,
                                                 finals[index]) for index in range(len(answer.streams))]))


async def events(answer: Answer, reply: Reply, logprobs: bool) -> AsyncIterator[bytes]:
    """The answer as server-sent events: chunks, each choice's finish reason, the usage when
    asked, [DONE]; an engine failure as an error event, which ends the stream."""
    for chunk in reply.opening():
        yield chunk
    async for index, delta in answer.deltas():
        if delta.finish_reason == "error":
            yield reply.failure(failure(delta))
            return
        for chunk in reply.chunks(index, delta, logprobs):
            yield chunk


async def heartbeats(chunks: AsyncIterator[bytes], heartbeat: Optional[bytes]) -> AsyncIterator[bytes]:
    """chunks as they come, and heartbeat (if any) whenever none has come for HEARTBEAT_SECONDS:
    an answer held to its end, or waiting for a slot, keeps its connection alive."""
    if heartbeat is None:
        async for chunk in chunks:
            yield chunk
        return
    iterator = chunks.__aiter__()
    coming = None
    try:
        while True:
            coming = asyncio.ensure_future(iterator.__anext__())
            while not (await asyncio.wait((coming,), timeout=HEARTBEAT_SECONDS))[0]:
                yield heartbeat
            try:
                chunk = coming.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if coming is not None:
            coming.cancel()  # the stream ends early: the chunks' own cleanup runs


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
