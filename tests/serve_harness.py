"""The serving engine driven from Python, without HTTP: a mailbox, the engine's loop in a thread,
and an event loop in another, as the HTTP side holds one; and the same behind the real app on a
port the OS chose (HttpServer)."""

import asyncio
import itertools
import threading
from typing import Optional

from llama_tp import Llama
from llama_tp.serve.app import create_app
from llama_tp.engine import Delta, GenerationRequest
from llama_tp.serve.limits import ServerLimits
from llama_tp.serve.mailbox import Mailbox, RequestStream, ServerState
from llama_tp.serve.metrics import ServerMetrics
from llama_tp.serve.server import ServerThread, bind, engine_loop

_ids = itertools.count()


def request(generator: Llama, prompt: list[int], max_tokens: int, stop: tuple[str, ...] = (), logprobs: bool = False,
            top_logprobs: int = 0, stop_tokens: Optional[set[int]] = None, **options) -> GenerationRequest:
    """A checked request for prompt, sampling options as generator.sampling_options takes them."""
    return GenerationRequest(f"request-{next(_ids)}", tuple(prompt), max_tokens, generator.sampling_options(**options),
                             frozenset(generator.tokenizer.stop_tokens if stop_tokens is None else stop_tokens),
                             stop, logprobs, top_logprobs)


class Harness:
    """An engine serving generator's model in a thread; submit requests as the HTTP side would."""

    def __init__(self, generator: Llama, max_prefill_tokens: int = 16, max_waiting: int = 64, start: bool = True,
                 mailbox: Optional[Mailbox] = None, model_name: str = "harness"):
        self.generator = generator
        self.mailbox = mailbox or Mailbox(max_waiting, ServerMetrics(model_name))
        self.serving = engine_loop(generator, max_prefill_tokens, self.mailbox)
        self.engine = self.serving.engine
        self.stopping = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.mailbox.set_state(ServerState.READY)
        if start:
            self.thread.start()

    def _run(self) -> None:
        try:
            self.serving.run(self.stopping.is_set)
        except BaseException as error:  # the test looks at it
            self.error = error

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue request on the event loop, as the HTTP side does."""

        async def submit() -> RequestStream:
            return self.mailbox.submit(request)

        return asyncio.run_coroutine_threadsafe(submit(), self.loop).result(10)

    def deltas(self, stream: RequestStream, timeout: float = 60, count: Optional[int] = None) -> list[Delta]:
        """The stream's deltas up to its last (or the first count of them)."""

        async def collect() -> list[Delta]:
            deltas = []
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == count:
                    break
            return deltas

        return asyncio.run_coroutine_threadsafe(collect(), self.loop).result(timeout)

    def ask(self, request: GenerationRequest) -> list[Delta]:
        return self.deltas(self.submit(request))

    def stop(self) -> None:
        """Ask the engine to stop, as Ctrl-C does, and wait until it has."""
        self.stopping.set()
        self.mailbox.wake()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the engine did not stop"

    def close(self) -> None:
        """Stop the engine if it runs, then the event loop."""
        if self.thread.is_alive():
            self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)


class HttpHarness(Harness):
    """The HTTP side on a port the OS chose, with the real engine behind it; app_options as
    create_app takes them."""

    def __init__(self, generator: Llama, model_name: str, mailbox: Optional[Mailbox] = None, **app_options):
        super().__init__(generator, mailbox=mailbox, model_name=model_name)
        self.app = create_app(self.mailbox, generator, model_name, **app_options)
        limits = app_options.get("limits", ServerLimits())
        self.http = ServerThread(self.app, bind("127.0.0.1", 0), read_timeout=limits.read_timeout).start()
        self.url = self.http.url

    def close(self) -> None:
        super().close()
        self.http.stop()


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [token for delta in deltas for token in delta.tokens]


def text_of(deltas: list[Delta]) -> str:
    return "".join(delta.text for delta in deltas)
