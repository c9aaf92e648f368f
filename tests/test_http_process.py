"""The HTTP side in a process of its own (serve/http_process.py), with the real engine of a tiny
model in this one, as launch/serve.py runs them: answers equal the engine's alone, the engine's
metrics are counted there, and whichever process goes first, the other ends its requests and
stops; what the HTTP process is sent (the model's text side) pickles whole."""

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from llama_tp import Llama
from llama_tp.serve.http_process import HttpProcess, HttpSettings
from llama_tp.serve.mailbox import ENGINE_FAILED
from llama_tp.serve.metrics import ServerMetrics
from llama_tp.serve.relay import MetricsRelay, apply_updates
from llama_tp.serve.served_model import ServedModel
from llama_tp.serve.server import bind, engine_loop
from llama_tp.text.chat_format import ChatMLFormat, TemplateChatFormat
from llama_tp.text.hf_tokenizer import HFTokenizer
from serve_client import client, metric, wait_until
from test_convert_hf import CHATML_TEMPLATE, byte_level_tokenizer
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-process"
DIALOGS = [[{"role": "user", "content": f"Count to {n}."}] for n in range(6)]


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)


class Served:
    """An HTTP process on a free port, and the engine's loop over llama in a thread of this one."""

    def __init__(self, llama: Llama, ready: bool = True, engine: bool = True):
        self.http = HttpProcess(bind("127.0.0.1", 0), HttpSettings(MODEL, max_waiting=16))
        self.http.wait_until_listening()
        self.serving = engine_loop(llama, 16, self.http.channel)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serving.run,
                                       args=(lambda: self.stopping.is_set() or self.http.lost,), daemon=True)
        if ready:
            self.http.channel.ready(ServedModel(llama))
        if engine:
            self.thread.start()

    def stop_engine(self) -> None:
        self.stopping.set()
        self.http.channel.wake()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the engine did not stop"


@contextmanager
def served(llama: Llama, **options) -> Iterator[Served]:
    server = Served(llama, **options)
    try:
        yield server
    finally:
        if server.thread.is_alive():
            server.stop_engine()
        server.http.stop()


def answer_alone(llama: Llama, dialog: list[dict]) -> str:
    return llama.chat_completion([dialog], temperature=0, max_gen_len=8)[0]["generation"]["content"]


def test_answers_and_metrics_come_through_the_http_process(llama):
    expected = [answer_alone(llama, dialog) for dialog in DIALOGS]
    with served(llama) as server:
        openai_client = client(server.http.url)

        def chat(dialog: list[dict]) -> str:
            return openai_client.chat.completions.create(model=MODEL, messages=dialog, temperature=0,
                                                         max_tokens=8).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:  # 2 cache rows: most wait for one
            assert list(pool.map(chat, DIALOGS)) == expected
        chunks = list(openai_client.chat.completions.create(model=MODEL, messages=DIALOGS[1], temperature=0,
                                                            max_tokens=8, stream=True))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected[1]
        url = server.http.url
        # The engine's counts, relayed: 7 requests ended, each of 8 tokens or fewer; nothing runs or waits.
        wait_until(lambda: metric(url, "llama_tp_requests_total", state="finished") == 7)
        assert 7 <= metric(url, "llama_tp_generation_tokens_total") <= 56
        assert metric(url, "llama_tp_time_to_first_token_seconds_count") == 7
        assert metric(url, "llama_tp_requests_running") == metric(url, "llama_tp_requests_waiting") == 0
        assert metric(url, "llama_tp_requests_running_max") == 2
        assert metric(url, "vllm:num_requests_running", model_name=MODEL) == 0
        process = server.http.process
    assert process.exitcode == 0  # it ended when the engine closed the channel
    server.http.channel.wake()  # a second Ctrl-C after the channel closed: nothing to wake
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_health_says_loading_until_the_model_is_sent_and_ready_at_once(llama):
    with served(llama, ready=False, engine=False) as server:
        health = httpx.get(f"{server.http.url}/health")
        assert health.status_code == 503 and "still loading" in health.text
        server.http.channel.ready(ServedModel(llama))  # returns once the HTTP process takes requests
        assert httpx.get(f"{server.http.url}/health").status_code == 200


def test_requests_the_engine_never_took_end_when_it_stops(llama):
    """The engine closes the channel with requests it never read (sent as it stopped): each ends
    with the server's shutting down, as a 503, and the HTTP process exits."""
    with served(llama, engine=False) as server:
        with ThreadPoolExecutor(2) as pool:
            asked = [pool.submit(httpx.post, f"{server.http.url}/v1/chat/completions", timeout=30,
                                 json={"model": MODEL, "messages": dialog, "max_tokens": 4}) for dialog in DIALOGS[:2]]
            wait_until(lambda: metric(server.http.url, "llama_tp_requests_waiting") == 2)
            server.http.stop()
            answers = [future.result() for future in asked]
    assert [answer.status_code for answer in answers] == [503, 503]
    assert all(answer.json()["error"]["message"] == "the server is shutting down" for answer in answers)
    assert server.http.process.exitcode == 0


def test_a_lost_engine_fails_the_requests_and_ends_the_http_process(llama):
    """The engine's process ending without a word (its end of the pipe closed) fails what waits
    with OpenAI's error JSON and ends the HTTP process: no server is left holding the port."""
    with served(llama, engine=False) as server:
        with ThreadPoolExecutor(1) as pool:
            asked = pool.submit(httpx.post, f"{server.http.url}/v1/chat/completions", timeout=30,
                                json={"model": MODEL, "messages": DIALOGS[0], "max_tokens": 4})
            wait_until(lambda: metric(server.http.url, "llama_tp_requests_waiting") == 1)
            server.http.channel._connection.close()  # what the engine's process ending does to its end
            answer = asked.result()
        assert answer.status_code == 503 and answer.json()["error"]["message"] == ENGINE_FAILED
        server.http.process.join(15)
        assert server.http.process.exitcode == 0


def test_a_lost_http_process_stops_the_engine(llama):
    """The HTTP process killed: the engine's loop ends at its next step (nothing can reach it) and
    the launch script's message names the exit code."""
    with served(llama) as server:
        server.http.process.kill()
        server.thread.join(30)
        assert not server.thread.is_alive() and server.http.lost
        assert server.http.ended_unexpectedly().startswith("the HTTP server's process ended unexpectedly "
                                                           "(exit code -9)")


def test_a_server_that_cannot_start_says_why():
    """TLS files that are no certificate: the HTTP process cannot listen, and rank 0 hears why."""
    http = HttpProcess(bind("127.0.0.1", 0), HttpSettings(MODEL, 4, ssl_certfile=__file__, ssl_keyfile=__file__))
    with pytest.raises(RuntimeError, match="the HTTP server stopped while starting"):
        http.wait_until_listening()
    assert http.process.exitcode == 0


def test_relayed_metrics_count_as_counted_in_place():
    relay, direct, relayed = MetricsRelay(), ServerMetrics(MODEL), ServerMetrics(MODEL)
    for metrics in (relay, direct):
        metrics.requests_running.set(3)
        metrics.generation_tokens.inc()
        metrics.preemptions.inc(2)
        metrics.time_to_first_token.observe(0.03)
        metrics.requests_ended.labels("cancelled").inc()
        metrics.requests_running.set(1)
    apply_updates(relayed, relay.take())
    assert relayed.render() == direct.render() and relay.take() == []


def test_the_served_model_pickles_whole(llama, tmp_path):
    """What the HTTP process is sent: the same prompts, limits and sampling defaults; a Hugging
    Face chat template compiles again on the other side."""
    served_model = pickle.loads(pickle.dumps(ServedModel(llama)))
    dialog = [{"role": "user", "content": "Hello there"}]
    assert served_model.formatter.encode_dialog_prompt(dialog) == llama.formatter.encode_dialog_prompt(dialog)
    assert (served_model.model.max_seq_len, served_model.model.max_batch_size, served_model.model.cache_blocks,
            served_model.model.args) == (64, 2, llama.model.cache_blocks, llama.model.args)
    assert served_model.sampling_options(top_k=5) == llama.sampling_options(top_k=5)
    byte_level_tokenizer(tmp_path)
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    template = TemplateChatFormat(CHATML_TEMPLATE, tokenizer, ChatMLFormat(tokenizer))
    copy = pickle.loads(pickle.dumps(template))
    assert copy.encode_dialog_prompt(dialog) == template.encode_dialog_prompt(dialog)
