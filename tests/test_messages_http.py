"""Anthropic's Messages API through the official `anthropic` client and langchain-anthropic (and raw
httpx for the events a client hides), with a fake engine behind the app (fake_engine.py): the
engine gets the request a chat completion of the same dialog gives it; Anthropic's shapes, its
stream's events, tool calls, its errors and keys; disconnects free their slot. The real engine
behind this door: test_messages_real_engine.py; under torchrun: test_messages_launch.py."""

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import anthropic
import httpx
import pytest
from langchain_anthropic import ChatAnthropic

from fake_engine import ANSWER, MODEL, served
from llama_tp.serve import app as app_module
from serve_client import (CHAT, LONG_ANSWER, anthropic_events, assert_idle, assert_serves, client, metric,
                          wait_until)

MESSAGES = "/v1/messages"
HELLO = [{"role": "user", "content": "Hello!"}]
WEATHER = {"name": "weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>'
KEY = "sk-local-0123456789"


@pytest.fixture(scope="module")
def server(llama2_tokenizer):
    """One server for the tests that leave it as they found it (room for a tool's description)."""
    with served(llama2_tokenizer, max_seq_len=512) as s:
        yield s


def messages_client(url: str, key: str = "x", **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, **options)


def streamed(url: str, body: dict, **headers) -> list[tuple[str, dict]]:
    response = httpx.post(f"{url}{MESSAGES}", json=body | {"stream": True}, headers=headers, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    return anthropic_events(response.text)


def same_request(first, second) -> bool:
    """Two engine requests alike but for their ids and arrival."""
    return replace(first, id="", arrival=0) == replace(second, id="", arrival=0)


# Answers

def test_a_message_is_anthropics_shape_and_the_chat_completions_request(server):
    dialog = [{"role": "system", "content": "Be brief."}, *HELLO]
    message = messages_client(server.url).messages.create(model=MODEL, max_tokens=20, system="Be brief.",
                                                          messages=HELLO, extra_body={"temperature": 0.2, "top_k": 3})
    engine_request = server.engine.requests[-1]
    assert message.id.startswith("msg_") and engine_request.id == message.id
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert [(block.type, block.text) for block in message.content] == [("text", ANSWER)]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    prompt = server.generator.formatter.encode_dialog_prompt(dialog)
    answer_tokens = len(server.generator.tokenizer.encode(ANSWER, bos=False, eos=False))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(prompt), answer_tokens)
    assert (message.usage.cache_read_input_tokens, message.usage.cache_creation_input_tokens) == (0, 0)
    chat = client(server.url).chat.completions.create(model=MODEL, messages=dialog, max_tokens=20, temperature=0.2,
                                                      extra_body={"top_k": 3})
    assert same_request(engine_request, server.engine.requests[-1]) and chat.choices[0].message.content == ANSWER
    assert engine_request.prompt_tokens == tuple(prompt) and engine_request.options.temperature == 0.2


def test_tools_stops_and_schemas_reach_the_engine_as_chat_completions_send_them(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    cases = [
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "weather"}},
         {"tools": [{"type": "function", "function": {"name": "weather", "description": WEATHER["description"],
                                                      "parameters": WEATHER["input_schema"]}}],
          "tool_choice": {"type": "function", "function": {"name": "weather"}}}),
        ({"stop_sequences": ["fox"], "output_config": {"format": {"type": "json_schema", "schema": schema}}},
         {"stop": ["fox"], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})]
    for fields, chat_fields in cases:
        httpx.post(f"{server.url}{MESSAGES}", json={"model": MODEL, "max_tokens": 9, "messages": HELLO} | fields)
        message_request = server.engine.requests[-1]
        httpx.post(f"{server.url}{CHAT}", json={"model": MODEL, "max_tokens": 9, "messages": HELLO} | chat_fields)
        assert same_request(message_request, server.engine.requests[-1])
    assert message_request.constraint is not None and message_request.stop == ("fox",)


def test_a_stream_has_every_event_and_adds_up_to_the_whole_message(server):
    body = {"model": MODEL, "max_tokens": 20, "messages": HELLO}
    events = streamed(server.url, body)
    kinds = [kind for kind, _ in events]
    texts = kinds.count("content_block_delta")
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * texts,
                     "content_block_stop", "message_delta", "message_stop"] and texts > 5
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(data["index"] == 0 and data["delta"]["type"] == "text_delta" for kind, data in events[3:-3])
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == ANSWER
    whole = messages_client(server.url).messages.create(**body)
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"] == whole.usage.model_dump(exclude_none=True)
    with messages_client(server.url).messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.usage) == (ANSWER, "end_turn", whole.usage)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_and_max_tokens_are_stop_reasons(server, stream):
    def message(**fields):
        if not stream:
            return messages_client(server.url).messages.create(model=MODEL, messages=HELLO, **fields)
        with messages_client(server.url).messages.stream(model=MODEL, messages=HELLO, **fields) as events:
            return events.get_final_message()

    stopped = message(max_tokens=20, stop_sequences=["jumps", "brown"])
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == (
        "The quick ", "stop_sequence", "brown")
    cut = message(max_tokens=3)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 3)


def test_count_tokens_is_the_messages_input_tokens(server):
    fields = {"model": MODEL, "system": "Be brief.", "messages": HELLO, "tools": [WEATHER]}
    counted = messages_client(server.url).messages.count_tokens(**fields)
    created = messages_client(server.url).messages.create(max_tokens=5, **fields)
    assert counted.input_tokens == created.usage.input_tokens
    none = messages_client(server.url).messages.count_tokens(**fields, tool_choice={"type": "none"})
    assert none.input_tokens < counted.input_tokens  # the model is not told of the tools
    with pytest.raises(anthropic.NotFoundError) as refused:
        messages_client(server.url).messages.count_tokens(**fields | {"model": "claude-sonnet-4-5"})
    assert refused.value.body == {"type": "error", "error": {"type": "not_found_error", "message": (
        f"the model `claude-sonnet-4-5` does not exist; this server serves `{MODEL}`")}}


# Tools

def test_calls_are_tool_use_blocks_whole_or_streamed(llama2_tokenizer):
    with served(llama2_tokenizer, answer=f"Let me look.\n{CALL}", max_seq_len=512) as s:
        fields = {"model": MODEL, "max_tokens": 60, "messages": HELLO, "tools": [WEATHER]}
        whole = messages_client(s.url).messages.create(**fields)
        (text, call), stop_reason = whole.content, whole.stop_reason
        assert (text.type, text.text, stop_reason) == ("text", "Let me look.", "tool_use")
        assert (call.type, call.name, call.input) == ("tool_use", "weather", {"city": "Oslo", "days": [1, 2]})
        assert call.id.startswith("toolu_")
        events = streamed(s.url, fields)  # held to the end, where the call is parsed
        assert [(kind, data.get("index")) for kind, data in events] == [
            ("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_delta", 0),
            ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
            ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
        assert events[5][1]["content_block"] | {"id": ""} == {"type": "tool_use", "id": "", "name": "weather",
                                                              "input": {}}
        assert json.loads(events[6][1]["delta"]["partial_json"]) == call.input
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        unknown = messages_client(s.url).messages.create(**fields | {"tools": [WEATHER | {"name": "time"}]})
        assert [block.type for block in unknown.content] == ["text"] and unknown.stop_reason == "end_turn"


def test_a_forced_calls_input_streams_as_the_model_writes_it(llama2_tokenizer):
    with served(llama2_tokenizer, answer=CALL, max_seq_len=512) as s:
        fields = {"model": MODEL, "max_tokens": 60, "messages": HELLO, "tools": [WEATHER],
                  "tool_choice": {"type": "any"}}
        events = streamed(s.url, fields)
        kinds = [kind for kind, _ in events]
        pieces = [data["delta"]["partial_json"] for kind, data in events if kind == "content_block_delta"]
        assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * len(pieces),
                         "content_block_stop", "message_delta", "message_stop"] and len(pieces) > 5
        assert all(data["delta"]["type"] == "input_json_delta"
                   for kind, data in events if kind == "content_block_delta")
        assert events[2][1]["content_block"]["name"] == "weather"
        assert "".join(pieces) == '{"city": "Oslo", "days": [1, 2]}'
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        with messages_client(s.url).messages.stream(**fields) as stream:
            final = stream.get_final_message()
        whole = messages_client(s.url).messages.create(**fields)
        assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content] == [
            ("weather", {"city": "Oslo", "days": [1, 2]})]
        assert final.usage == whole.usage and final.stop_reason == whole.stop_reason == "tool_use"


# Errors, keys and ends

def test_refusals_in_anthropics_shape_then_a_good_request(server):
    cases = [({"messages": HELLO}, "`max_tokens` is required"),
             ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5}, '`messages[0].role` must be "user"'),
             ({"messages": HELLO, "max_tokens": -5}, "`max_tokens`: input should be greater than or equal to 1"),
             ({"messages": [], "max_tokens": 5}, "`messages`: list should have at least 1 item"),
             ({"messages": HELLO, "max_tokens": 5000}, "and max_tokens 5000 make")]
    refused = metric(server.url, "llama_tp_requests_refused_total", status="400")
    for fields, words in cases:  # raw: the client itself refuses to send some of them
        response = httpx.post(f"{server.url}{MESSAGES}", json={"model": MODEL} | fields)
        assert (response.status_code, set(response.json()), response.json()["error"]["type"]) == (
            400, {"type", "error"}, "invalid_request_error")
        assert words in response.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as error:
        messages_client(server.url).messages.create(model=MODEL, max_tokens=-5, messages=HELLO)
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "`max_tokens`: input should be greater than or equal to 1, found -5")}}
    assert metric(server.url, "llama_tp_requests_refused_total", status="400") == refused + len(cases) + 1
    good = messages_client(server.url).messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert good.usage.output_tokens == 5


def test_a_prompt_beyond_the_context_names_both_numbers_and_the_flag(server):
    fields = {"model": MODEL, "system": "word " * 600, "messages": HELLO}
    tokens = messages_client(server.url).messages.count_tokens(**fields).input_tokens
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages_client(server.url).messages.create(max_tokens=5, **fields)
    message = refused.value.body["error"]["message"]
    assert f"the prompt has {tokens} tokens but the model's max_seq_len is 512" in message and tokens > 600
    assert message.endswith("shorten the prompt, or serve the model with a larger --max_seq_len")


def test_unknown_paths_and_bugs_in_anthropics_shape(server, monkeypatch):
    response = httpx.get(f"{server.url}/v1/messages/batches")
    assert (response.status_code, response.json()) == (404, {"type": "error", "error": {
        "type": "not_found_error", "message": "GET /v1/messages/batches: Not Found"}})
    response = httpx.get(f"{server.url}{MESSAGES}")
    assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    monkeypatch.setattr(server.generator.tokenizer, "encode", lambda *args, **kwargs: 1 / 0)
    response = httpx.post(f"{server.url}{MESSAGES}", json={"model": MODEL, "max_tokens": 5, "messages": HELLO})
    assert (response.status_code, response.json()) == (500, {"type": "error", "error": {
        "type": "api_error", "message": "internal error: ZeroDivisionError"}})


def test_overload_loading_and_engine_failure(llama2_tokenizer):
    with served(llama2_tokenizer, max_waiting=1, answer=LONG_ANSWER, step_seconds=0.01, max_seq_len=512) as s:
        s.engine.admitting.clear()
        with httpx.stream("POST", f"{s.url}{MESSAGES}", json={"model": MODEL, "max_tokens": 5, "messages": HELLO,
                                                              "stream": True}) as waiting:
            wait_until(lambda: metric(s.url, "llama_tp_requests_waiting") == 1)
            with pytest.raises(anthropic.RateLimitError) as refused:
                messages_client(s.url).messages.create(model=MODEL, max_tokens=5, messages=HELLO)
            assert refused.value.body == {"type": "error", "error": {"type": "rate_limit_error", "message": (
                "1 requests are already waiting for a slot (--max_waiting 1); try again shortly")}}
            s.engine.admitting.set()
            assert anthropic_events(waiting.read().decode())[-1][0] == "message_stop"
        with pytest.raises(anthropic.APIStatusError, match="rank 1 was lost") as failed:
            with messages_client(s.url).messages.stream(model=MODEL, max_tokens=500, messages=HELLO) as stream:
                for index, _ in enumerate(stream):
                    if index == 3:
                        s.engine.end_all("error", "rank 1 was lost")
        assert failed.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": "rank 1 was lost"}}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(messages_client(s.url).messages.create, model=MODEL, max_tokens=500, messages=HELLO)
            wait_until(lambda: metric(s.url, "llama_tp_requests_running") == 1)
            s.engine.end_all("error", "rank 1 was lost")
            with pytest.raises(anthropic.InternalServerError) as failed:
                whole.result()
        assert failed.value.status_code == 529 and failed.value.body["error"]["type"] == "overloaded_error"
    with served(llama2_tokenizer, ready=False) as s:
        with pytest.raises(anthropic.InternalServerError) as loading:
            messages_client(s.url).messages.create(model=MODEL, max_tokens=5, messages=HELLO)
        assert loading.value.status_code == 529 and loading.value.body["error"]["type"] == "overloaded_error"


def test_a_waiting_stream_gets_pings(llama2_tokenizer, monkeypatch):
    monkeypatch.setattr(app_module, "HEARTBEAT_SECONDS", 0.05)
    with served(llama2_tokenizer) as s:
        s.engine.admitting.clear()
        with httpx.stream("POST", f"{s.url}{MESSAGES}", json={"model": MODEL, "max_tokens": 5, "messages": HELLO,
                                                              "stream": True}) as response:
            lines = response.iter_lines()
            pings = 0
            while pings < 4:
                pings += next(lines) == 'data: {"type":"ping"}'
            s.engine.admitting.set()
            kinds = [kind for kind, _ in anthropic_events("\n".join(lines))]
        assert kinds[-1] == "message_stop" and "content_block_delta" in kinds
        s.engine.admitting.clear()  # a client that leaves while it waits, pinged, frees its place
        with httpx.stream("POST", f"{s.url}{MESSAGES}", json={"model": MODEL, "max_tokens": 5, "messages": HELLO,
                                                              "stream": True}) as response:
            lines = response.iter_lines()
            while next(lines) != 'data: {"type":"ping"}' or len(s.engine.requests) < 2:
                pass
        wait_until(lambda: s.engine.cancelled == [s.engine.requests[1].id])
        assert_idle(s.url)


def test_a_client_that_leaves_frees_its_slot(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01, max_seq_len=512) as s:
        with messages_client(s.url).messages.stream(model=MODEL, max_tokens=500, messages=HELLO) as stream:
            for _, event in zip(range(5), stream):
                pass
            assert metric(s.url, "llama_tp_requests_running") == 1
        wait_until(lambda: s.engine.cancelled == [s.engine.requests[0].id])
        assert_idle(s.url)
        assert_serves(s.url)


def test_either_way_of_sending_the_key_on_every_route(llama2_tokenizer):
    with served(llama2_tokenizer, api_key=KEY) as s:
        prompt = {"model": MODEL, "messages": HELLO}
        body = prompt | {"max_tokens": 5}
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            headers |= {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
            assert httpx.post(f"{s.url}{MESSAGES}?beta=true", json=body, headers=headers).json()["type"] == "message"
            counted = httpx.post(f"{s.url}/v1/messages/count_tokens", json=prompt, headers=headers)
            assert counted.json() == {"input_tokens": 10}
            assert httpx.post(f"{s.url}{CHAT}", json=body, headers=headers).status_code == 200
            assert httpx.get(f"{s.url}/v1/models", headers=headers).status_code == 200
        assert messages_client(s.url, KEY).beta.messages.create(**body).type == "message"
        assert anthropic.Anthropic(base_url=s.url, auth_token=KEY, max_retries=0).messages.create(**body).content
        for key in ("wrong", None):
            headers = {} if key is None else {"x-api-key": key}
            said = "no API key" if key is None else "a wrong API key"
            response = httpx.post(f"{s.url}{MESSAGES}", json=body, headers=headers)
            assert (response.status_code, response.json()["error"]["type"]) == (401, "authentication_error")
            message = response.json()["error"]["message"]
            assert said in message and "x-api-key: KEY" in message
            assert httpx.post(f"{s.url}/v1/messages/count_tokens", json=prompt, headers=headers).status_code == 401
            response = httpx.post(f"{s.url}{CHAT}", json=body, headers=headers)  # OpenAI's shape there
            assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
        with pytest.raises(anthropic.AuthenticationError):
            messages_client(s.url, "wrong").messages.create(**body)
        assert metric(s.url, "llama_tp_requests_refused_total", status="401") == 7


# A framework on the SDK

def test_langchain_anthropic_invokes_streams_and_binds_tools(llama2_tokenizer):
    with served(llama2_tokenizer) as s:
        chat = ChatAnthropic(base_url=s.url, api_key="x", model=MODEL, max_tokens=20, max_retries=0)
        assert chat.invoke("Hello!").content == ANSWER
        assert "".join(chunk.text for chunk in chat.stream("Hello!")) == ANSWER
    with served(llama2_tokenizer, answer=CALL, max_seq_len=512) as s:
        def weather(city: str) -> str:
            """The weather in a city."""
            return "cold"

        chat = ChatAnthropic(base_url=s.url, api_key="x", model=MODEL, max_tokens=60, max_retries=0)
        called = chat.bind_tools([weather]).invoke("How cold is Oslo?")
        assert [(call["name"], call["args"]) for call in called.tool_calls] == [("weather", {"city": "Oslo",
                                                                                            "days": [1, 2]})]
        forced = chat.bind_tools([weather], tool_choice="weather")
        streamed_calls = None
        for chunk in forced.stream("How cold is Oslo?"):
            streamed_calls = chunk if streamed_calls is None else streamed_calls + chunk
        assert [(call["name"], call["args"]) for call in streamed_calls.tool_calls] == [
            ("weather", {"city": "Oslo", "days": [1, 2]})]
        assert s.engine.requests[-1].constraint is not None  # held by the grammar
