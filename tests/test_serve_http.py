"""The HTTP side against the official openai client (and raw httpx for what it cannot send), with a
fake engine behind the mailbox (fake_engine.py): OpenAI's shapes, streaming, what the engine's
ends look like to clients, and disconnects that free their slot. Refusals: test_serve_refusals.py."""

import json
import signal
import time

import httpx
import openai
import pytest

from fake_engine import ANSWER, MODEL, served
from llama_tp.serve.app import create_app
from llama_tp.serve.server import ServerThread, bind
from serve_client import (CHAT, GOOD_CHAT, HELLO, LONG_ANSWER, assert_idle, assert_serves, client, metric,
                          wait_until, whole_through_a_failure)


@pytest.fixture(scope="module")
def server(llama2_tokenizer):
    """One server for the tests that leave it as they found it."""
    with served(llama2_tokenizer) as s:
        yield s


# Answers

def test_chat_completion(server, llama2_tokenizer):
    answer = client(server.url).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *HELLO], seed=3, temperature=0.2)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].logprobs is None
    request = server.engine.requests[-1]
    prompt = server.generator.formatter.encode_dialog_prompt([{"role": "system", "content": "Be brief."}, *HELLO])
    assert request.prompt_tokens == tuple(prompt)
    assert request.stop_tokens == frozenset(server.generator.formatter.stop_tokens)
    assert request.max_tokens == 64 - len(prompt)  # all that fits
    assert (request.options.seed, request.options.temperature) == (3, 0.2)
    assert request.id == answer.id
    tokens = len(llama2_tokenizer.encode(ANSWER, bos=False, eos=False))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), tokens)
    assert answer.usage.total_tokens == len(prompt) + tokens
    assert answer.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streams_chunks_then_usage_then_done(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": HELLO, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 5})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "The quick brown fox"  # 5 tokens: The, quick, brown, fo, x
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_chat_stream_through_the_openai_client(server):
    chunks = list(client(server.url).chat.completions.create(model=MODEL, messages=HELLO, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


def test_chat_logprobs(server, llama2_tokenizer):
    answer = client(server.url).chat.completions.create(model=MODEL, messages=HELLO, logprobs=True,
                                                         top_logprobs=2, max_completion_tokens=3)
    assert server.engine.requests[-1].logprobs and server.engine.requests[-1].top_logprobs == 2
    content = answer.choices[0].logprobs.content
    tokens = llama2_tokenizer.encode(ANSWER, bos=False, eos=False)[:3]
    assert [item.token for item in content] == [llama2_tokenizer.decode([t]) for t in tokens]
    assert all(item.logprob == -0.25 and bytes(item.bytes) == item.token.encode() for item in content)
    assert [len(item.top_logprobs) for item in content] == [2, 2, 2]
    assert content[1].top_logprobs[0].token == content[1].token
    assert answer.choices[0].finish_reason == "length"


def test_chat_logprobs_stream_with_their_tokens(server):
    chunks = list(client(server.url).chat.completions.create(model=MODEL, messages=HELLO, logprobs=True,
                                                             stream=True, max_tokens=4))
    entries = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [item.token for item in entries] == ["The", "quick", "brown", "fo"]
    assert all(item.top_logprobs == [] for item in entries)


def test_content_parts_and_developer_role(server):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    client(server.url).chat.completions.create(model=MODEL, messages=messages)
    expected = server.generator.formatter.encode_dialog_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}])
    assert server.engine.requests[-1].prompt_tokens == tuple(expected)


def test_neutral_values_of_unsupported_features_are_accepted(server):
    answer = client(server.url).chat.completions.create(
        model=MODEL, messages=HELLO, n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="me",
        response_format={"type": "text"}, tool_choice="none", store=False, metadata={"a": "b"})
    assert answer.choices[0].message.content == ANSWER


def test_completion(server, llama2_tokenizer):
    answer = client(server.url).completions.create(model=MODEL, prompt="Once upon a time", stop=[" fox"],
                                                    max_tokens=20, extra_body={
                                                        "top_k": 5, "repetition_penalty": 1.1, "min_tokens": 2})
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    assert answer.choices[0].text == "The quick brown" and answer.choices[0].finish_reason == "stop"
    request = server.engine.requests[-1]
    assert request.prompt_tokens == tuple(llama2_tokenizer.encode("Once upon a time", bos=True, eos=False))
    assert request.stop == (" fox",) and request.stop_tokens == frozenset(llama2_tokenizer.stop_tokens)
    assert (request.options.top_k, request.options.repetition_penalty, request.options.min_gen_len) == (5, 1.1, 2)


@pytest.mark.parametrize("prompt", [[1, 450, 4996], [[1, 450, 4996]], ["Once"]])
def test_completion_prompt_forms(server, prompt):
    answer = client(server.url).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert answer.choices[0].text == "The quick" and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == (2 if prompt == ["Once"] else 3)


def test_completion_stream_and_legacy_logprobs(server):
    chunks = list(client(server.url).completions.create(
        model=MODEL, prompt="Once", stream=True, logprobs=1, max_tokens=3, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The quick brown"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 3
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in logprobs for t in lp.tokens] == ["The", "quick", "brown"]
    assert [o for lp in logprobs for o in lp.text_offset] == [0, 3, 8]  # where each token's text begins
    assert logprobs[0].top_logprobs == [{"The": -0.25}]


def test_models_health_and_metrics(server):
    models = client(server.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(server.url).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(server.url).models.retrieve("other")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    for name in ("llama_tp_requests_running", "llama_tp_requests_waiting", "llama_tp_prompt_tokens_total",
                 "llama_tp_generation_tokens_total", "llama_tp_time_to_first_token_seconds_bucket",
                 "llama_tp_time_per_output_token_seconds_bucket", "llama_tp_requests_refused_total"):
        assert name in response.text


def test_answers_ended_by_a_stopping_server_finish_with_stop(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        stream = client(s.url).chat.completions.create(model=MODEL, messages=HELLO, stream=True)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                s.engine.end_all("cancelled")
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert_serves(s.url)


def test_engine_failure_is_an_error_event_or_a_503(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        with pytest.raises(openai.APIError, match="rank 1 was lost"):
            for index, _ in enumerate(client(s.url).chat.completions.create(model=MODEL, messages=HELLO,
                                                                            stream=True)):
                if index == 2:
                    s.engine.end_all("error", "rank 1 was lost")
        response = whole_through_a_failure(s, CHAT, GOOD_CHAT, "rank 1 was lost")
        assert response.status_code == 503
        assert response.json()["error"] == {"message": "rank 1 was lost", "type": "server_error", "param": None,
                                            "code": "engine_failed"}
        assert metric(s.url, "llama_tp_requests_total", state="failed") == 2
        assert_serves(s.url)


# Disconnects: the engine hears of them, and the slot is free again.

def test_streaming_client_that_leaves_frees_its_slot(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        stream = client(s.url).chat.completions.create(model=MODEL, messages=HELLO, stream=True)
        for _, chunk in zip(range(3), stream):
            pass
        assert metric(s.url, "llama_tp_requests_running") == 1
        stream.close()
        wait_until(lambda: s.engine.cancelled == [chunk.id])
        assert_idle(s.url)
        assert metric(s.url, "llama_tp_requests_total", state="cancelled") == 1
        assert_serves(s.url)


def test_client_that_gives_up_waiting_for_a_whole_answer_frees_its_slot(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        with pytest.raises(openai.APITimeoutError):
            client(s.url, timeout=0.3).chat.completions.create(model=MODEL, messages=HELLO)
        wait_until(lambda: s.engine.cancelled == [s.engine.requests[0].id])
        assert_idle(s.url)
        assert metric(s.url, "llama_tp_requests_total", state="cancelled") == 1
        assert_serves(s.url)


def test_client_that_leaves_while_waiting_frees_its_place(llama2_tokenizer):
    with served(llama2_tokenizer) as s:
        s.engine.admitting.clear()
        with pytest.raises(openai.APITimeoutError):
            client(s.url, timeout=0.3).completions.create(model=MODEL, prompt="Once")
        wait_until(lambda: len(s.engine.cancelled) == 1)
        assert_idle(s.url)
        s.engine.admitting.set()
        assert_serves(s.url)


def test_stopping_the_server_cancels_open_streams(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        with httpx.stream("POST", f"{s.url}{CHAT}", json=GOOD_CHAT | {"stream": True}) as response:
            next(response.iter_lines())
            start = time.monotonic()
            s.server_thread.stop()
            assert time.monotonic() - start < 3
        wait_until(lambda: len(s.engine.cancelled) == 1)


# Running it

def test_bind_refuses_a_busy_port_and_the_thread_leaves_signals_alone(server):
    port = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*pass another --port"):
        bind("127.0.0.1", port)
    handler = signal.getsignal(signal.SIGINT)
    sock = bind("127.0.0.1", 0)
    thread = ServerThread(create_app(server.mailbox, server.generator, MODEL), sock).start()
    assert signal.getsignal(signal.SIGINT) is handler
    assert httpx.get(f"{thread.url}/health").status_code == 200
    thread.stop()
