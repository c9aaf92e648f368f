"""A stand-in for the engine behind the HTTP side: a thread that takes requests from the mailbox and
answers each with a scripted text, one token per step, keeping the metrics as the real engine does.

It honours the contract in llama_tp/engine/requests.py: every request it takes ends with exactly one
final Delta; max_tokens ends an answer with "length", a stop string or the end of the script with
"stop"; a cancelled request ends with "cancelled" and frees its slot at the next step.
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator, Optional

from fastapi import FastAPI

from llama_tp.generation import Llama
from llama_tp.serve.app import create_app
from llama_tp.engine import Cancel, Delta, GenerationRequest, RequestState, TokenLogprob
from llama_tp.serve.mailbox import Mailbox, RequestStream, ServerState
from llama_tp.serve.metrics import ServerMetrics
from llama_tp.serve.server import ServerThread, bind
from llama_tp.text.streaming import IncrementalDecoder, cut_at_stop

ANSWER = "The quick brown fox jumps over the lazy dog."
MODEL = "tiny-llama"


class StandInModel:
    """All the HTTP side reads of a model."""

    def __init__(self, max_seq_len: int, vocab_size: int = 32000, max_batch_size: int = 4):
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size  # the most choices (`n`) a request may ask for
        self.args = SimpleNamespace(vocab_size=vocab_size)  # structured outputs compile for it
        self.cache_blocks = max_batch_size * -(-max_seq_len // 64)  # what a beam search may hold at most


@dataclass
class Served:
    url: str
    mailbox: Mailbox
    engine: "FakeEngine"
    generator: Llama
    app: FastAPI
    server_thread: ServerThread


@contextmanager
def served(tokenizer, max_waiting: int = 8, ready: bool = True, max_seq_len: int = 64,
           api_key: Optional[str] = None, formatter=None, **engine_options) -> Iterator[Served]:
    """The app on a free port of 127.0.0.1 with a fake engine behind it (READY unless ready=False);
    formatter: the chat format (default: the one the tokenizer implies)."""
    mailbox = Mailbox(max_waiting, ServerMetrics(MODEL))
    generator = Llama(StandInModel(max_seq_len), tokenizer, formatter)
    app = create_app(mailbox, generator, MODEL, api_key)
    server = ServerThread(app, bind("127.0.0.1", 0)).start()
    engine = FakeEngine(mailbox, tokenizer, **engine_options).start(ready)
    try:
        yield Served(server.url, mailbox, engine, generator, app, server)
    finally:  # the engine first: the requests it ends write to the server's event loop
        engine.stop()
        server.stop()


@dataclass
class Row:
    """A running request: its stream, the tokens given so far, what of their text has gone out."""

    stream: RequestStream
    decoder: IncrementalDecoder
    tokens: list[int] = field(default_factory=list)
    first_token_at: Optional[float] = None


class FakeEngine:
    def __init__(self, mailbox: Mailbox, tokenizer, answer: str = ANSWER, slots: int = 4,
                 step_seconds: float = 0.002):
        self.mailbox, self.tokenizer, self.metrics = mailbox, tokenizer, mailbox.metrics
        self.script = tokenizer.encode(answer, bos=False, eos=False)
        self.slots, self.step_seconds = slots, step_seconds
        self.admitting = threading.Event()  # cleared: requests stay waiting (to fill the waiting line)
        self.admitting.set()
        self.requests: list[GenerationRequest] = []  # every request taken, in order
        self.cancelled: list[str] = []  # ids of requests cancelled before their end
        self._waiting: list[RequestStream] = []
        self._running: dict[str, Row] = {}
        self._ending: Optional[tuple[str, Optional[str]]] = None  # (finish_reason, error) for every request
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-engine", daemon=True)

    def start(self, ready: bool = True) -> "FakeEngine":
        self._thread.start()
        if ready:
            self.mailbox.set_state(ServerState.READY)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def end_all(self, finish_reason: str, error: Optional[str] = None) -> None:
        """At the next step, end every request taken so far as the real engine does when stopping
        ("cancelled") or when a rank is lost ("error"); later requests are answered as before."""
        self._ending = (finish_reason, error)

    # The engine's thread

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = self.step_seconds if self._running or self._waiting else 0.02
            for message in self.mailbox.take(timeout=timeout):
                if isinstance(message, Cancel):
                    self._cancel(message.request_id)
                else:
                    self.requests.append(message.request)
                    self._waiting.append(message)
            if self._ending is not None:
                self._end_everything(*self._ending)
                self._ending = None
                continue
            while self.admitting.is_set() and self._waiting and len(self._running) < self.slots:
                self._admit(self._waiting.pop(0))
            for request_id in list(self._running):
                self._step(request_id)
            if self._running:
                time.sleep(self.step_seconds)

    def _admit(self, stream: RequestStream) -> None:
        self.mailbox.left_waiting()
        request = stream.request
        self._running[request.id] = Row(stream, IncrementalDecoder(self.tokenizer, request.stop))
        self.metrics.requests_running.set(len(self._running))
        self.metrics.prompt_tokens.inc(len(request.prompt_tokens))

    def _step(self, request_id: str) -> None:
        row = self._running[request_id]
        request = row.stream.request
        token = self.script[len(row.tokens) % len(self.script)]
        row.tokens.append(token)
        now = time.monotonic()
        if row.first_token_at is None:
            row.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.arrival)
        self.metrics.generation_tokens.inc()
        logprobs = ()
        if request.logprobs:
            alternatives = (token, *self.script[:request.top_logprobs])[:request.top_logprobs]
            logprobs = (TokenLogprob(token, -0.25, tuple((t, -0.25 - i) for i, t in enumerate(alternatives))),)
        text = row.decoder.push(row.tokens)
        reason = None
        if row.decoder.stopped or len(row.tokens) == len(self.script):
            reason = "stop"
        elif len(row.tokens) == request.max_tokens:
            reason = "length"
        if reason is None:
            row.stream.put(Delta(text=text, tokens=(token,), logprobs=logprobs))
            return
        final_text = cut_at_stop(self.tokenizer.decode(row.tokens), request.stop)
        text += row.decoder.finish(final_text)
        if len(row.tokens) > 1:
            self.metrics.time_per_output_token.observe((now - row.first_token_at) / (len(row.tokens) - 1))
        self._finish(request_id, RequestState.FINISHED, Delta(
            text=text, tokens=(token,), logprobs=logprobs, finish_reason=reason,
            prompt_tokens=len(request.prompt_tokens), completion_tokens=len(row.tokens),
            stop_string=row.decoder.matched))

    def _finish(self, request_id: str, state: RequestState, delta: Delta) -> None:
        row = self._running.pop(request_id)
        self.metrics.requests_running.set(len(self._running))
        self.metrics.requests_ended.labels(state.value).inc()
        row.stream.put(delta)

    def _cancel(self, request_id: str) -> None:
        for stream in self._waiting:
            if stream.request.id == request_id:
                self._waiting.remove(stream)
                self.mailbox.left_waiting()
                self.cancelled.append(request_id)
                self.metrics.requests_ended.labels(RequestState.CANCELLED.value).inc()
                stream.put(Delta(finish_reason="cancelled", prompt_tokens=len(stream.request.prompt_tokens)))
                return
        if request_id in self._running:  # else it has ended already: nothing to do
            self.cancelled.append(request_id)
            row = self._running[request_id]
            self._finish(request_id, RequestState.CANCELLED, Delta(
                finish_reason="cancelled", prompt_tokens=len(row.stream.request.prompt_tokens),
                completion_tokens=len(row.tokens)))

    def _end_everything(self, finish_reason: str, error: Optional[str]) -> None:
        state = RequestState.FAILED if finish_reason == "error" else RequestState.CANCELLED
        for stream in self._waiting:
            self.mailbox.left_waiting()
            self._running[stream.request.id] = Row(stream, IncrementalDecoder(self.tokenizer))
        self._waiting.clear()
        for request_id, row in list(self._running.items()):
            self._finish(request_id, state, Delta(finish_reason=finish_reason, error=error,
                                                  prompt_tokens=len(row.stream.request.prompt_tokens),
                                                  completion_tokens=len(row.tokens)))
