"""The HTTP side with the real engine behind it (a tiny model, world size 1), through the official
openai client: what the fake engine cannot show (cached prompt tokens, the model's own log
probabilities, stop strings on its own text), and every status code with its exact body."""

import threading
from contextlib import contextmanager
from typing import Iterator

import httpx
import openai
import pytest

from llama_tp import Llama
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.serve.mailbox import ENGINE_FAILED, Mailbox, ServerState
from llama_tp.serve.metrics import ServerMetrics
from serve_client import client, metric
from serve_harness import HttpHarness
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-real"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"


class GatedMailbox(Mailbox):
    """A mailbox whose engine takes nothing while the gate is closed: requests stay waiting, as
    they do behind long answers, without racing the model's speed."""

    def __init__(self, max_waiting: int, open_gate: bool):
        super().__init__(max_waiting, ServerMetrics(MODEL))
        self.gate = threading.Event()
        if open_gate:
            self.gate.set()

    def take(self, timeout):
        self.gate.wait()
        return super().take(timeout)


class RealServer(HttpHarness):
    """The app with the real engine behind a gated mailbox."""

    def __init__(self, llama: Llama, max_waiting: int, open_gate: bool):
        super().__init__(llama, MODEL, GatedMailbox(max_waiting, open_gate))
        self.llama = llama

    def close(self) -> None:
        self.mailbox.gate.set()
        super().close()


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=2)


@contextmanager
def real_server(llama: Llama, max_waiting: int = 8, open_gate: bool = True) -> Iterator[RealServer]:
    server = RealServer(llama, max_waiting, open_gate)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def server(llama) -> Iterator[RealServer]:
    with real_server(llama) as running:
        yield running


def greedy(llama: Llama, prompt: str, max_tokens: int, **options) -> tuple[list[int], list[float]]:
    """The API's greedy tokens and their log probabilities for a completion prompt."""
    tokens = llama.tokenizer.encode(prompt, bos=True, eos=False)
    out, logprobs = llama.generate([tokens], max_gen_len=max_tokens, temperature=0, logprobs=True, **options)
    return out[0], logprobs[0]


def error_of(response: httpx.Response) -> tuple[int, dict]:
    return response.status_code, response.json()


def test_a_completion_is_the_apis_greedy_answer_with_its_usage(server):
    tokens, _ = greedy(server.llama, PROMPT, 8)
    answer = client(server.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    prompt_tokens = len(server.llama.tokenizer.encode(PROMPT, bos=True, eos=False))
    assert answer.choices[0].text == server.llama.tokenizer.decode(tokens)
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        prompt_tokens, 8, prompt_tokens + 8)
    assert answer.model == MODEL and answer.object == "text_completion"


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    """The second time, the prompt's full blocks of the cache before its last token are shared, and
    usage says so: none for this short prompt (test_prefix_cache.py and test_serve_vllm_metrics.py
    share whole blocks; this server's max_seq_len of 64 holds one block a prompt at most)."""
    prompt = "Seven sleepy sailors sang softly"  # no other test asks it: the first time, nothing is cached
    prompt_tokens = len(server.llama.tokenizer.encode(prompt, bos=True, eos=False))
    openai_client = client(server.url)
    first = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    shared = (prompt_tokens - 1) // BLOCK_POSITIONS * BLOCK_POSITIONS
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    assert second.choices[0].text == first.choices[0].text
    assert metric(server.url, "llama_tp_prompt_tokens_cached_total") == shared


def test_chat_logprobs_are_the_models(server):
    llama = server.llama
    dialog = [{"role": "user", "content": "Name three colours."}]
    prompt = llama.formatter.encode_dialog_prompt(dialog)
    expected, expected_logprobs = llama.generate([prompt], max_gen_len=5, temperature=0, logprobs=True)
    answer = client(server.url).chat.completions.create(model=MODEL, messages=dialog, max_tokens=5, temperature=0,
                                                         logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert [item.token for item in content] == [llama.tokenizer.decode([t]) for t in expected[0]]
    assert [item.logprob for item in content] == pytest.approx(expected_logprobs[0], abs=1e-4)
    for item in content:  # greedy: the chosen token is the likeliest, with its own log probability
        assert len(item.top_logprobs) == 3
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (item.token, item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob


def test_a_stop_string_cuts_the_models_own_text(server):
    tokens, _ = greedy(server.llama, PROMPT, 12)
    text = server.llama.tokenizer.decode(tokens)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text  # a stop string the answer really holds
    answer = client(server.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                   stop=[stop])
    assert answer.choices[0].text == text[:text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    pieces = [chunk.choices[0].text for chunk in client(server.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True)]
    assert "".join(pieces) == text[:text.index(stop)]


def test_health_and_models(server):
    assert error_of(httpx.get(f"{server.url}/health")) == (200, {"status": "ok"})
    models = httpx.get(f"{server.url}/v1/models").json()
    card = {"id": MODEL, "object": "model", "created": models["data"][0]["created"], "owned_by": "llama_tp",
            "max_model_len": 64}
    assert models == {"object": "list", "data": [card]}
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").json() == card
    assert [model.id for model in client(server.url).models.list()] == [MODEL]
    assert error_of(httpx.get(f"{server.url}/v1/models/gpt-4")) == (404, {"error": {
        "message": f"the model `gpt-4` does not exist; this server serves `{MODEL}`",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})


def test_404_and_405_codes_and_bodies(server):
    with pytest.raises(openai.NotFoundError) as refused:
        client(server.url).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 404
    assert refused.value.body == {"message": f"the model `gpt-4` does not exist; this server serves `{MODEL}`",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert error_of(httpx.get(f"{server.url}/v1/nothing")) == (404, {"error": {
        "message": "GET /v1/nothing: Not Found", "type": "invalid_request_error", "param": None,
        "code": "not_found"}})
    assert error_of(httpx.get(f"{server.url}/v1/chat/completions")) == (405, {"error": {
        "message": "GET /v1/chat/completions: Method Not Allowed", "type": "invalid_request_error",
        "param": None, "code": "method_not_allowed"}})
    assert metric(server.url, "llama_tp_requests_refused_total", status="404") == 1  # the model only


def test_429_when_the_waiting_line_is_full(llama):
    with real_server(llama, max_waiting=1, open_gate=False) as server, httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}) as first:
            assert metric(server.url, "llama_tp_requests_waiting") == 1
            with pytest.raises(openai.RateLimitError) as refused:
                client(server.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            assert refused.value.status_code == 429
            assert refused.value.body == {
                "message": "1 requests are already waiting for a slot (--max_waiting 1); try again shortly",
                "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
            server.mailbox.gate.set()
            assert first.read().endswith(b"data: [DONE]\n\n")
        assert metric(server.url, "llama_tp_requests_refused_total", status="429") == 1
        assert client(server.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_503_while_loading_and_stopping(llama):
    with real_server(llama) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        unavailable = {"type": "server_error", "param": None, "code": "service_unavailable"}
        server.mailbox.set_state(ServerState.LOADING)
        for response in (httpx.get(f"{server.url}/health"), httpx.post(f"{server.url}/v1/completions", json=body)):
            assert error_of(response) == (503, {"error": {
                "message": "the model is still loading; try again shortly", **unavailable}})
        server.mailbox.set_state(ServerState.READY)
        server.stop()  # as Ctrl-C or SIGTERM: the engine ends and the mailbox says STOPPING
        assert server.mailbox.state is ServerState.STOPPING and server.error is None
        with pytest.raises(openai.InternalServerError) as refused:
            client(server.url).completions.create(**body)
        assert refused.value.status_code == 503
        assert refused.value.body == {"message": "the server is shutting down", **unavailable}
        assert error_of(httpx.get(f"{server.url}/health"))[0] == 503


def test_503_engine_failed_when_a_step_breaks(llama, monkeypatch):
    """A failure inside the engine ends the request with engine_failed, and every later one with
    503; what broke is in the log, not in what clients see."""
    with real_server(llama) as server:
        def broken(*args, **kwargs):
            raise RuntimeError("the step broke")

        monkeypatch.setattr(llama.model, "forward", broken)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
        failed = {"type": "server_error", "param": None}
        assert error_of(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)) == (503, {"error": {
            "message": ENGINE_FAILED, "code": "engine_failed", **failed}})
        server.thread.join(30)
        assert isinstance(server.error, RuntimeError) and server.mailbox.state is ServerState.FAILED
        assert error_of(httpx.get(f"{server.url}/health")) == (503, {"error": {
            "message": ENGINE_FAILED,
            "code": "service_unavailable", **failed}})


def test_500_internal_error_when_the_server_has_a_bug(server, monkeypatch):
    """A bug on the HTTP side (here: the tokenizer breaking) answers OpenAI's 500 shape, names no
    detail beyond the exception's type, and the server keeps serving."""
    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(server.llama.tokenizer, "encode", broken)
        response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT})
    assert error_of(response) == (500, {"error": {"message": "internal error: ZeroDivisionError",
                                                  "type": "server_error", "param": None, "code": "internal_error"}})
    answer = client(server.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert answer.usage.completion_tokens == 2
