"""Anthropic's Messages API with the real engine behind it (a tiny model, world size 1), through the
official `anthropic` client, against /v1/chat/completions through the openai client: the same
greedy answers for the same dialog, whole or streamed; a forced tool call held by the grammar and
its input streamed; a tool_result round trip; an output_config schema; count_tokens; the prompt
tokens reused from the prefix cache."""

import json
from contextlib import contextmanager

import anthropic
import httpx
import jsonschema
import pytest

from llama_tp import Llama
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from serve_client import anthropic_events, client
from test_serve_real_engine import MODEL, real_server
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0}  # not in the 2026 SDK's signature: an extra body field
SYSTEM = "You answer in one line."
ASKED = {"role": "user", "content": "What is the weather like in Oslo?"}
WEATHER = {"name": "weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}
OPENAI_WEATHER = {"type": "function", "function": {"name": "weather", "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    # room for the tools' description (Hermes' words, for this Llama 2 chat model)
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=512, max_batch_size=2)


@pytest.fixture(scope="module")
def server(llama):
    with real_server(llama) as running:
        yield running


@contextmanager
def no_prefix_cache(llama: Llama):
    """Every prompt computed in full: answers' usage then counts no cached tokens."""
    llama.model.prefix_cache.enabled = False
    try:
        yield
    finally:
        llama.model.prefix_cache.enabled = True


def messages_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def final_message(url: str, **fields) -> anthropic.types.Message:
    """A streamed message as the client puts it together from the events."""
    with messages_client(url).messages.stream(**fields) as stream:
        return stream.get_final_message()


def raw_events(url: str, **fields) -> list[tuple[str, dict]]:
    """A stream's every event (the client hides pings), as (type, data)."""
    body = {name: value for name, value in fields.items() if name != "extra_body"} | fields.get("extra_body", {})
    return anthropic_events(httpx.post(f"{url}/v1/messages", json=body | {"stream": True}, timeout=60).text)


def test_a_message_is_the_chat_completions_answer(server):
    for max_tokens in (6, 40):  # cut by max_tokens, and ended by the model (within 40 tokens or not)
        message = messages_client(server.url).messages.create(model=MODEL, max_tokens=max_tokens, system=SYSTEM,
                                                              messages=[ASKED], extra_body=GREEDY)
        chat = client(server.url).chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                                          messages=[{"role": "system", "content": SYSTEM}, ASKED])
        assert [block.text for block in message.content] == [chat.choices[0].message.content]
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
        assert message.usage.output_tokens == chat.usage.completion_tokens
        assert (message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens)


def test_a_stream_has_every_event_and_is_the_whole_message(server, llama):
    fields = {"model": MODEL, "max_tokens": 24, "system": SYSTEM, "messages": [ASKED], "extra_body": GREEDY}
    with no_prefix_cache(llama):
        whole = messages_client(server.url).messages.create(**fields)
        events = raw_events(server.url, **fields)
        streamed = final_message(server.url, **fields)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"} and len(kinds) > 8
    assert [data["delta"]["type"] for kind, data in events[3:-3]] == ["text_delta"] * (len(kinds) - 6)
    assert streamed.content[0].text == whole.content[0].text and len(streamed.content) == 1
    assert (streamed.stop_reason, streamed.usage) == (whole.stop_reason, whole.usage)
    assert whole.usage.cache_read_input_tokens == 0


def test_stop_sequences_cut_the_models_own_text(server):
    fields = {"model": MODEL, "max_tokens": 16, "messages": [ASKED], "extra_body": GREEDY}
    text = messages_client(server.url).messages.create(**fields).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text  # a stop string the answer really holds
    for stream in (False, True):
        message = (final_message(server.url, **fields, stop_sequences=[stop]) if stream else
                   messages_client(server.url).messages.create(**fields, stop_sequences=[stop]))
        assert (message.content[0].text, message.stop_reason, message.stop_sequence) == (
            text[:text.index(stop)], "stop_sequence", stop)


def test_a_forced_call_is_held_by_the_grammar_and_its_input_streams(server, llama):
    # a random model under a grammar writes the call a character or two a token
    fields = {"model": MODEL, "max_tokens": 200, "messages": [ASKED], "tools": [WEATHER],
              "tool_choice": {"type": "tool", "name": "weather"}, "extra_body": GREEDY}
    with no_prefix_cache(llama):
        whole = messages_client(server.url).messages.create(**fields)
        events = raw_events(server.url, **fields)
        streamed = final_message(server.url, **fields)
    (call,) = whole.content
    assert (call.type, call.name, whole.stop_reason) == ("tool_use", "weather", "tool_use")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    pieces = [data["delta"]["partial_json"] for kind, data in events if kind == "content_block_delta"]
    assert all(data["delta"]["type"] == "input_json_delta" for kind, data in events if kind == "content_block_delta")
    assert len(pieces) > 3 and json.loads("".join(pieces)) == call.input
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "weather", call.input)]
    assert (streamed.stop_reason, streamed.usage) == ("tool_use", whole.usage)
    chat = client(server.url).chat.completions.create(
        model=MODEL, max_tokens=200, messages=[ASKED], tools=[OPENAI_WEATHER], temperature=0,
        tool_choice={"type": "function", "function": {"name": "weather"}})
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == call.input
    any_call = messages_client(server.url).messages.create(**fields | {"tool_choice": {"type": "any"}})
    assert [block.name for block in any_call.content] == ["weather"]


def test_a_tool_result_round_trip_is_the_chat_completions_answer(server):
    asked = messages_client(server.url).messages.create(
        model=MODEL, max_tokens=200, messages=[ASKED], tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY)
    call = asked.content[0]
    answered = messages_client(server.url).messages.create(
        model=MODEL, max_tokens=20, tools=[WEATHER], extra_body=GREEDY, messages=[
            ASKED, {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in asked.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "-3 C and snowing"}]}]}])
    chat = client(server.url).chat.completions.create(
        model=MODEL, max_tokens=20, tools=[OPENAI_WEATHER], temperature=0, messages=[
            ASKED, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "weather", "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snowing"}])
    assert "".join(block.text for block in answered.content if block.type == "text") == (
        chat.choices[0].message.content or "")
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_an_output_config_schema_holds(server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    message = messages_client(server.url).messages.create(
        model=MODEL, max_tokens=40, messages=[ASKED], extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)
    assert message.stop_reason == "end_turn"
    chat = client(server.url).chat.completions.create(
        model=MODEL, max_tokens=40, messages=[ASKED], temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert message.content[0].text == chat.choices[0].message.content


def test_count_tokens_and_the_prompt_tokens_read_from_the_cache(server):
    fields = {"model": MODEL, "system": "Seven sleepy sailors sang softly.", "messages": [ASKED], "tools": [WEATHER]}
    counted = messages_client(server.url).messages.count_tokens(**fields).input_tokens
    first = messages_client(server.url).messages.create(max_tokens=4, extra_body=GREEDY, **fields).usage
    second = messages_client(server.url).messages.create(max_tokens=4, extra_body=GREEDY, **fields).usage
    assert first.input_tokens + first.cache_read_input_tokens == counted
    assert first.input_tokens > 100  # its tools and system prompt were not asked before
    shared = (counted - 1) // BLOCK_POSITIONS * BLOCK_POSITIONS  # the full blocks before the last token
    assert shared and (second.input_tokens, second.cache_read_input_tokens) == (counted - shared, shared)
