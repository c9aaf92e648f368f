"""A thinking model's answers through Anthropic's Messages API (tests/thinking_model.py: a tiny Qwen3
whose template thinks, served with its reasoning parser): the thinking is a thinking block, whole
or as thinking_delta events, apart from the text as chat completions keep reasoning_content apart
from content; `thinking: {"type": "disabled"}` is the template's enable_thinking false; a forced
call follows the thinking; a thinking block sent back reaches the template as reasoning_content."""

import json

import anthropic
import httpx
import pytest

from serve_client import anthropic_events, client
from serve_harness import HttpHarness
from test_serve_reasoning import MODEL, NO_THINKING, WEATHER, checkpoint, llama  # noqa: F401 (fixtures)
from thinking_model import CONTENT, REASONING
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

HELLO = [{"role": "user", "content": "Where is Paris?"}]
GREEDY = {"temperature": 0}
TOOL = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(llama):  # noqa: F811
    harness = HttpHarness(llama, MODEL)
    yield harness
    harness.close()


def message(server, **fields) -> anthropic.types.Message:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
        **{"model": MODEL, "max_tokens": 64, "messages": HELLO, "extra_body": GREEDY} | fields)


def events(server, **fields) -> list[tuple[str, dict]]:
    body = {"model": MODEL, "max_tokens": 64, "messages": HELLO, "stream": True} | GREEDY | fields
    return anthropic_events(httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).text)


def blocks(events_: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """Each block's type and its deltas joined, in the stream's order."""
    kinds = {data["index"]: data["content_block"]["type"] for kind, data in events_ if kind == "content_block_start"}
    joined = {index: "" for index in kinds}
    for kind, data in events_:
        if kind == "content_block_delta":
            delta = data["delta"]
            joined[data["index"]] += delta.get("thinking", delta.get("text", delta.get("partial_json")))
    return [(kinds[index], joined[index]) for index in sorted(kinds)]


def test_the_thinking_is_a_block_of_its_own_whole_or_streamed(server):
    whole = message(server)
    chat = client(server.url).chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=64)
    reasoning, content = chat.choices[0].message.model_extra["reasoning_content"], chat.choices[0].message.content
    assert (reasoning, content) == (REASONING, "\n\n" + CONTENT)
    assert [block.model_dump(exclude_none=True) for block in whole.content] == [
        {"type": "thinking", "thinking": reasoning, "signature": ""}, {"type": "text", "text": content}]
    assert whole.stop_reason == "end_turn" and whole.usage.output_tokens == chat.usage.completion_tokens
    streamed = events(server)
    assert blocks(streamed) == [("thinking", reasoning), ("text", content)]
    deltas = [data["delta"]["type"] for kind, data in streamed if kind == "content_block_delta"]
    assert deltas == sorted(deltas, reverse=True) and deltas.count("thinking_delta") > 1  # thinking, then text
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.stream(
            model=MODEL, max_tokens=64, messages=HELLO, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.model_dump().get("thinking"), b.model_dump().get("text")) for b in final.content] == [
        ("thinking", reasoning, None), ("text", None, content)]

    def counts(usage):  # the prompt (some of it from the cache the second time) and the answer
        return usage.input_tokens + usage.cache_read_input_tokens, usage.output_tokens

    assert counts(final.usage) == counts(whole.usage)


def test_thinking_disabled_is_the_templates_switch(server):
    whole = message(server, thinking={"type": "disabled"})
    chat = client(server.url).chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=64,
                                                      extra_body=NO_THINKING)
    assert [(block.type, block.text) for block in whole.content] == [("text", CONTENT)]
    assert chat.choices[0].message.content == CONTENT
    assert blocks(events(server, thinking={"type": "disabled"})) == [("text", CONTENT)]
    assert [block.type for block in message(server, thinking={"type": "enabled", "budget_tokens": 1024}).content] == [
        "thinking", "text"]


def test_a_limit_inside_the_thinking_leaves_a_thinking_block_only(server):
    cut = message(server, max_tokens=3)
    assert [block.type for block in cut.content] == ["thinking"] and cut.stop_reason == "max_tokens"
    assert REASONING.startswith(cut.content[0].thinking)
    assert [kind for kind, _ in blocks(events(server, max_tokens=3))] == ["thinking"]


def test_a_forced_call_follows_the_thinking(server):
    # room for a call the grammar has the model write a character or two a token
    fields = {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 400}
    whole = message(server, **fields)
    assert [block.type for block in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
    assert (whole.content[0].thinking, whole.content[1].name, whole.content[1].input) == (
        REASONING, "get_weather", {"city": "Paris"})
    streamed = blocks(events(server, **fields))
    assert [kind for kind, _ in streamed] == ["thinking", "tool_use"] and streamed[0][1] == REASONING
    assert json.loads(streamed[1][1]) == {"city": "Paris"}


def test_a_thinking_block_sent_back_reaches_the_template(server):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}

    def counted(assistant: list[dict]) -> int:
        dialog = [*HELLO, {"role": "assistant", "content": assistant}, result]
        return anthropic.Anthropic(base_url=server.url, api_key="x").messages.count_tokens(
            model=MODEL, tools=[TOOL], messages=dialog).input_tokens

    thought = counted([{"type": "thinking", "thinking": REASONING, "signature": ""}, call])
    chat = client(server.url).chat.completions.create(
        model=MODEL, max_tokens=1, tools=[WEATHER], messages=[*HELLO, {
            "role": "assistant", "content": None, "reasoning_content": REASONING, "tool_calls": [{
                "id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}])
    assert thought == chat.usage.prompt_tokens > counted([call])  # the template wrote the thinking
