"""Anthropic's Messages API for real: launch/serve.py with --api_key under torchrun, at world sizes
1 and 3, asked through the official `anthropic` client (the key as x-api-key) beside the openai
client (the key as a Bearer token) and langchain-anthropic: greedy answers equal chat
completions', whole or streamed with every event; a forced tool call, its input streamed, and a
tool_result round trip; an output_config schema; count_tokens; 401 and 400s in Anthropic's shape
with the server serving after."""

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from langchain_anthropic import ChatAnthropic

from demo_server import LaunchedServer
from serve_client import anthropic_events
from test_messages_real_engine import ASKED, GREEDY, OPENAI_WEATHER, SYSTEM, WEATHER
from test_serve_launch import LLAMA3_TOKENIZER, MODEL, checkpoints  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

KEY = "sk-test-key"


@pytest.fixture(params=[1, 3], ids=["world1", "world3"])
def server(request, checkpoints, tmp_path):  # noqa: F811
    # no prefix cache: a repeated request's usage is the first's
    launched = LaunchedServer(checkpoints[request.param], LLAMA3_TOKENIZER, MODEL, tmp_path / "serve.log",
                              request.param, "--max_seq_len", "512", "--max_batch_size", "2", "--api_key", KEY,
                              "--no_prefix_cache")
    yield launched
    launched.close()


def events_of(url: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's every event (the client hides pings), as (type, data)."""
    response = httpx.post(f"{url}/v1/messages", json=body | {"stream": True}, headers={"x-api-key": KEY}, timeout=120)
    return anthropic_events(response.text)


def test_messages_through_the_anthropic_client_and_langchain(server):
    messages = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120).messages
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120).chat.completions

    # A whole answer, and a streamed one with every event, are chat completions' answer.
    fields = {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "messages": [ASKED]}
    whole = messages.create(**fields, extra_body=GREEDY)
    chatted = chat.create(model=MODEL, max_tokens=12, temperature=0,
                          messages=[{"role": "system", "content": SYSTEM}, ASKED])
    assert [block.text for block in whole.content] == [chatted.choices[0].message.content]
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chatted.usage.prompt_tokens,
                                                                     chatted.usage.completion_tokens)
    events = events_of(server.url, fields | GREEDY)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert {data["delta"]["type"] for _, data in events[3:-3]} == {"text_delta"}
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == whole.content[0].text
    assert events[-2][1]["usage"] == whole.usage.model_dump(exclude_none=True)
    with messages.stream(**fields, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.usage) == (whole.content[0].text, whole.stop_reason,
                                                                      whole.usage)
    assert messages.count_tokens(model=MODEL, system=SYSTEM, messages=[ASKED]).input_tokens == whole.usage.input_tokens

    # A forced call, its input streamed as the model writes it, and the tool's result answered.
    called = {"model": MODEL, "max_tokens": 200, "messages": [ASKED], "tools": [WEATHER],
              "tool_choice": {"type": "tool", "name": "weather"}}
    asked = messages.create(**called, extra_body=GREEDY)
    (call,) = asked.content
    assert (call.type, call.name, asked.stop_reason) == ("tool_use", "weather", "tool_use")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    events = events_of(server.url, called | GREEDY)
    pieces = [data["delta"]["partial_json"] for kind, data in events if kind == "content_block_delta"]
    assert {data["delta"]["type"] for kind, data in events if kind == "content_block_delta"} == {"input_json_delta"}
    assert len(pieces) > 3 and json.loads("".join(pieces)) == call.input
    result = "-3 C and snowing"
    answered = messages.create(model=MODEL, max_tokens=12, tools=[WEATHER], extra_body=GREEDY, messages=[
        ASKED, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])
    chatted = chat.create(model=MODEL, max_tokens=12, tools=[OPENAI_WEATHER], temperature=0, messages=[
        ASKED, {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}])
    assert "".join(b.text for b in answered.content if b.type == "text") == (chatted.choices[0].message.content or "")
    assert answered.usage.input_tokens == chatted.usage.prompt_tokens

    # An output_config schema holds.
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    shaped = messages.create(model=MODEL, max_tokens=40, messages=[ASKED], extra_body=GREEDY,
                             output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(shaped.content[0].text), schema)

    # Refusals in Anthropic's shape, the server serving after each.
    body = {"model": MODEL, "max_tokens": 5, "messages": [ASKED]}
    for headers in ({}, {"x-api-key": "wrong"}):
        response = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers)
        assert (response.status_code, response.json()["error"]["type"]) == (401, "authentication_error")
    refusals = [({"messages": [ASKED]}, "`max_tokens` is required"),
                ({"messages": [{"role": "system", "content": SYSTEM}], "max_tokens": 5}, "`messages[0].role` must be"),
                ({"messages": [ASKED], "max_tokens": -1}, "`max_tokens`: input should be greater than or equal to 1"),
                ({"messages": [], "max_tokens": 5}, "`messages`: list should have at least 1 item")]
    for fields, words in refusals:
        response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL} | fields, headers={"x-api-key": KEY})
        assert (response.status_code, response.json()["type"], response.json()["error"]["type"]) == (
            400, "error", "invalid_request_error")
        assert words in response.json()["error"]["message"]
        assert messages.create(**body).usage.output_tokens == 5

    # langchain-anthropic, unchanged: invoke, stream and bind_tools.
    model = ChatAnthropic(base_url=server.url, api_key=KEY, model=MODEL, max_tokens=12, temperature=0, max_retries=0)
    assert model.invoke([("system", SYSTEM), ("human", ASKED["content"])]).content == whole.content[0].text
    assert "".join(chunk.text for chunk in model.stream([("system", SYSTEM), ("human", ASKED["content"])])) == (
        whole.content[0].text)

    def weather(city: Literal["Oslo", "Paris", "Rome"]) -> str:  # bounded: a random model's call ends
        """The weather in a city."""
        return result

    caller = ChatAnthropic(base_url=server.url, api_key=KEY, model=MODEL, max_tokens=200, max_retries=0)
    tool_calls = caller.bind_tools([weather], tool_choice="weather").invoke(ASKED["content"]).tool_calls
    assert [call["name"] for call in tool_calls] == ["weather"] and tool_calls[0]["args"]["city"] in (
        "Oslo", "Paris", "Rome")
