"""OpenAI's Responses API (/v1/responses) through the official openai client's responses.create,
unchanged, with a tiny thinking Qwen3 (tests/thinking_model.py) behind the real engine: whole
answers and streams whose every event the SDK's own types validate, reasoning items, a tool round
trip, previous_response_id chains (kept, bounded, evicted oldest first), text.format schemas,
max_output_tokens, and the refusals, in the Responses API's error shape."""

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from fake_engine import MODEL as FAKE_MODEL, served
from llama_tp import Llama
from serve_client import LONG_ANSWER, assert_idle, client, metric, wait_until, whole_through_a_failure
from serve_harness import HttpHarness
from thinking_model import CONTENT, REASONING, thinking_qwen3
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "qwen3-thinking"
QUESTION = "Where is Paris?"
ANSWER = "\n\n" + CONTENT  # what the model writes after its thinking
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
    "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    checkpoint = thinking_qwen3(tmp_path_factory.mktemp("thinking"))
    return Llama.build(str(checkpoint), str(checkpoint / "tokenizer.json"), max_seq_len=1024, max_batch_size=2)


@pytest.fixture(scope="module")
def server(llama):
    harness = HttpHarness(llama, MODEL, max_stored_responses=3)
    yield harness
    harness.close()


def create(server, **body) -> Response:
    return client(server.url).responses.create(model=MODEL, temperature=0, **body)


def raw(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def raw_events(server, **body) -> list[dict]:
    """The stream's events as sent, each checked against the SDK's own event types (strictly: the
    SDK itself builds them without checking) and against its SSE event name."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body}) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                EVENTS.validate_python(event)
                events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def prompt_tokens(llama: Llama, messages: list[dict], tools=None) -> int:
    """The prompt's length as the model's chat template renders the conversation, written out by hand."""
    return len(llama.formatter.encode_messages(messages, tools))


def items(response) -> list[tuple]:
    """(type, text) of each output item: a reasoning item's thinking, a message's text, a call's name and arguments."""
    shown = []
    for item in response.output:
        if item.type == "reasoning":
            shown.append(("reasoning", "".join(part.text for part in item.content)))
        elif item.type == "message":
            shown.append(("message", "".join(part.text for part in item.content)))
        else:
            shown.append((item.type, item.name, json.loads(item.arguments)))
    return shown


def test_a_whole_answer_holds_the_reasoning_and_the_message(server, llama):
    answered = raw(server, input=QUESTION, instructions="Be brief.")
    assert answered.status_code == 200
    response = Response.model_validate(answered.json())  # every field as the SDK's type has it
    assert items(response) == [("reasoning", REASONING), ("message", ANSWER)]
    assert response.status == "completed" and response.output_text == ANSWER
    assert response.instructions == "Be brief." and response.model == MODEL
    usage = response.usage
    assert usage.input_tokens == prompt_tokens(llama, [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": QUESTION}])
    assert usage.output_tokens_details.reasoning_tokens == 5  # <think> Let me think </think>
    assert usage.output_tokens == 11 and usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_chat_input_answers_as_chat_completions_does(server):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    response = create(server, input=conversation)
    chat = client(server.url).chat.completions.create(model=MODEL, temperature=0, messages=[
        {**message, "content": QUESTION} if isinstance(message["content"], list) else message
        for message in conversation])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_sends_every_event_of_its_answer(server):
    events = raw_events(server, input=QUESTION)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for part in ("output_item.added", "content_part.added", "content_part.done", "output_item.done"):
        assert kinds.count(f"response.{part}") == 2  # the reasoning item, then the message
    assert {"response.reasoning_text.done", "response.output_text.done"} <= set(kinds)
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == (REASONING, ANSWER)
    completed = events[-1]["response"]
    stored = client(server.url).responses.retrieve(completed["id"])
    assert items(stored) == items(Response.model_validate(completed)) == [("reasoning", REASONING), ("message", ANSWER)]


def test_the_sdks_stream_helper_reads_it_through(server):
    with client(server.url).responses.stream(model=MODEL, input=QUESTION, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == ANSWER


def test_a_tool_round_trip(server, llama):
    first = create(server, input=QUESTION, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert items(first) == [("reasoning", REASONING), ("function_call", "get_weather", {"city": "Paris"})]
    call = first.output[1]
    second = create(server, previous_response_id=first.id, tools=[WEATHER],
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # the conversation the second turn continued, written out by hand as the chat API takes it
    tools = [{"type": "function", "function": {key: value for key, value in WEATHER.items() if key != "type"}}]
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": None, "reasoning_content": REASONING,
                     "tool_calls": [{"id": call.call_id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert second.usage.input_tokens == prompt_tokens(llama, conversation, tools)
    events = raw_events(server, input=QUESTION, tools=[WEATHER], tool_choice="required")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], json.loads(e["arguments"])) for e in done] == [("get_weather", {"city": "Paris"})]


def test_output_items_sent_back_as_input_continue_the_conversation(server):
    first = create(server, input=QUESTION, tools=[WEATHER], tool_choice="required")
    call = first.output[1]
    by_items = create(server, tools=[WEATHER], input=[
        {"role": "user", "content": QUESTION}, *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    by_id = create(server, tools=[WEATHER], previous_response_id=first.id,
                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert by_items.usage.input_tokens == by_id.usage.input_tokens and by_items.output_text == by_id.output_text


def test_a_chain_of_previous_response_ids(server, llama):
    first = create(server, input=QUESTION)
    second = create(server, input="And Rome?", previous_response_id=first.id)
    third = create(server, input="And Oslo?", previous_response_id=second.id, instructions="Be brief.")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                    {"role": "user", "content": "And Rome?"},
                    {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                    {"role": "user", "content": "And Oslo?"}]
    assert third.usage.input_tokens == prompt_tokens(llama, conversation)
    assert third.output_text == ANSWER


def test_stored_responses_are_bounded_the_oldest_evicted_first(server):
    kept = [create(server, input=QUESTION, max_output_tokens=2) for _ in range(4)]  # the server keeps 3
    with pytest.raises(openai.BadRequestError) as refused:
        create(server, input="And Rome?", previous_response_id=kept[0].id)
    assert refused.value.body == {
        "message": f"`previous_response_id` {kept[0].id} is not a response this server keeps: it was stored with "
                   "store false, deleted, or evicted (the server keeps the last 3: --max_stored_responses)",
        "type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found"}
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.retrieve(kept[0].id)
    assert create(server, input="And Rome?", previous_response_id=kept[1].id).status == "completed"
    unstored = create(server, input=QUESTION, store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.retrieve(unstored.id)
    client(server.url).responses.delete(kept[3].id)
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.retrieve(kept[3].id)


def test_a_json_schema_holds_the_message_not_the_reasoning(server):
    parsed = client(server.url).responses.parse(model=MODEL, input=QUESTION, temperature=0, text_format=Verdict)
    assert items(parsed)[0] == ("reasoning", REASONING)
    assert parsed.output_parsed.answer in ("yes", "no")
    schema = Verdict.model_json_schema()
    events = raw_events(server, input=QUESTION, text={"format": {"type": "json_schema", "name": "verdict",
                                                                 "schema": schema, "strict": True}})
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    jsonschema.validate(json.loads(text), schema)


def test_max_output_tokens_inside_the_thinking_is_incomplete_with_no_message(server):
    response = create(server, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning"] and response.output[0].status == "incomplete"
    assert response.output_text == ""
    events = raw_events(server, input=QUESTION, max_output_tokens=3)
    assert events[-1]["type"] == "response.incomplete"


def test_enable_thinking_false_gives_no_reasoning_item(server):
    response = create(server, input=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert items(response) == [("message", CONTENT)] and response.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("body, status, message, param, code", [
    ({"input": QUESTION, "temprature": 0.5}, 400,
     "`temprature` is not a field this server knows (see docs/serving.md for those it takes)", "temprature",
     "unknown_parameter"),
    ({}, 400, "`input` is required", "input", "missing_required_parameter"),
    ({"input": QUESTION, "model": "gpt-5"}, 404, "the model `gpt-5` does not exist; this server serves "
     f"`{MODEL}`", "model", "model_not_found"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, '`input[0]`: items of type "web_search_call" are '
     "not supported by this server: it takes message, function_call, function_call_output and reasoning items",
     "input[0]", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     '`input[0].content`: part 0 is of type "input_image", which is not supported by this server: it takes text '
     "parts only", "input[0].content", "unsupported_parameter"),
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, 400, '`tools[0]`: tools of type "web_search" are not '
     "supported by this server: it calls the client's functions only", "tools[0]", "unsupported_parameter"),
    ({"input": QUESTION, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, 400,
     '`tool_choice`: a tool_choice of type "allowed_tools" is not supported by this server: choose "none", "auto", '
     '"required" or a function', "tool_choice", "unsupported_parameter"),
    ({"input": QUESTION, "max_output_tokens": 2000}, 400, "the prompt's 23 tokens and max_output_tokens 2000 make "
     "2023, beyond the model's max_seq_len of 1024; ask for at most 1001 tokens, shorten the prompt, or serve the "
     "model with a larger --max_seq_len", "max_output_tokens", "context_length_exceeded"),
    ({"input": QUESTION, "temperature": -1}, 400, "`temperature` must be in [0, 100] (0: greedy), found -1.0", "temperature",
     "invalid_value"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     '`text.format` must be {"type": "json_schema", "name": ..., "schema": {...}}, or a type "text" or '
     '"json_object" alone, found {"type": "json_schema", "name": "x"}', "text.format", "invalid_type"),
    ({"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nothing"}}}},
     400, None, "text.format.schema", "invalid_value"),
    ({"input": QUESTION, "tool_choice": {"type": "function", "name": "nowhere"}, "tools": [WEATHER]}, 400,
     '`tool_choice.name` is "nowhere", which is not one of the tools: get_weather', "tool_choice.name",
     "invalid_value"),
    ({"input": QUESTION, "reasoning": {"effort": "high"}}, 400, '`reasoning.effort` = "high" is not supported by '
     "this server: it has no effort setting; a thinking model such as Qwen3 thinks or not by its "
     'chat_template_kwargs {"enable_thinking": false}', "reasoning.effort", "unsupported_parameter"),
    ({"input": QUESTION, "include": ["message.output_text.logprobs"]}, 400, '`include` holds '
     '"message.output_text.logprobs", which is not supported by this server: it can include only '
     "reasoning.encrypted_content", "include", "unsupported_parameter"),
    ({"input": QUESTION, "stream_options": {}}, 400, "`stream_options` is only allowed when `stream` is true",
     "stream_options", "invalid_value"),
    ({"input": "<|im_start|>system"}, 400, "`input`: a message holds one of the chat format's control tags "
     "(<|endoftext|>, <|im_end|>, <|im_start|>), which could forge the dialog's turns; remove them", "input",
     "invalid_value"),
    # found by fuzzing (issue 54): a 500 before
    ({"input": []}, 400, "`input`: list should have at least 1 item after validation, not 0, found []", "input",
     "invalid_value"),
])
def test_refusals_in_the_responses_api_error_shape(server, body, status, message, param, code):
    refused = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert refused.status_code == status
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert message is None or error["message"] == message
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert create(server, input=QUESTION, max_output_tokens=2).status == "incomplete"  # it still serves


def test_the_sdk_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError):
        client(server.url).responses.create(model="gpt-5", input=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client(server.url).responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_nowhere")


# What only a scripted engine shows on time: failures and clients that leave.

def test_an_engine_failure_fails_the_response(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        events = []
        for event in client(s.url).responses.create(model=FAKE_MODEL, input="Hello", stream=True):
            events.append(event)
            if len(events) == 5:
                s.engine.end_all("error", "rank 1 was lost")
        assert events[-1].type == "response.failed"
        assert events[-1].response.error.message == "rank 1 was lost" and events[-1].response.status == "failed"
        response = whole_through_a_failure(s, "/v1/responses", {"model": FAKE_MODEL, "input": "Hello"},
                                           "rank 1 was lost")
        assert response.status_code == 503
        assert response.json()["error"] == {"message": "rank 1 was lost", "type": "server_error", "param": None,
                                            "code": "engine_failed"}


def test_a_client_that_leaves_frees_its_slot(llama2_tokenizer):
    with served(llama2_tokenizer, answer=LONG_ANSWER, step_seconds=0.01) as s:
        stream = client(s.url).responses.create(model=FAKE_MODEL, input="Hello", stream=True)
        for _, event in zip(range(6), stream):
            pass
        assert metric(s.url, "llama_tp_requests_running") == 1
        stream.close()
        wait_until(lambda: len(s.engine.cancelled) == 1)
        assert_idle(s.url)
