"""Structured outputs for real: the demo model served by launch/serve.py, asked greedily through
the official openai client. Every answer to 12 JSON schemas of different shapes parses and
validates with jsonschema; JSON mode answers an object; regexes, choices and grammars hold;
streams too. Needs the demo model (downloaded once per machine, see test_demo_network.py)."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from demo_server import MODEL, demo_server
from distributed import run_world
from llama_tp import Llama
from llama_tp.tools import demo

pytestmark = pytest.mark.slow

SCHEMAS = {
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
             "required": ["colour"], "additionalProperties": False},
    "nested objects": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["person"],
        "additionalProperties": False},
    "bounded array": {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}}, "required": ["tags"],
        "additionalProperties": False},
    "number ranges": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["age", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{6}$"}},
                "required": ["phone"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
              "required": ["value"], "additionalProperties": False},
    "array of objects": {"type": "array", "items": {"type": "object", "properties": {
        "step": {"type": "integer", "minimum": 1, "maximum": 9}, "done": {"type": "boolean"}},
        "required": ["step", "done"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    "booleans and null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                          "required": ["ok", "note"], "additionalProperties": False},
    "const and enum of numbers": {"type": "object", "properties": {"version": {"const": 2},
                                                                   "level": {"enum": [1, 2, 3]}},
                                  "required": ["version", "level"], "additionalProperties": False},
    "string lengths": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}},
                       "required": ["code"], "additionalProperties": False},
    "definitions": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                         "y": {"type": "integer"}},
                                        "required": ["x", "y"], "additionalProperties": False}},
                    "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                                     "end": {"$ref": "#/$defs/point"}},
                    "required": ["start", "end"], "additionalProperties": False},
    "bare enum of strings": {"enum": ["yes", "no", "maybe"]},
    "optional fields": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                                         "year": {"type": "integer", "minimum": 1900,
                                                                  "maximum": 2100}},
                        "required": ["title"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = demo_server(tmp_path_factory.mktemp("structured") / "serve.log")
    yield served
    served.close()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def ask(server, name: str, schema: dict, stream: bool = False) -> str:
    messages = [{"role": "user", "content": f"Answer in JSON: an example of {name}."}]
    answer = client(server).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=200, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    assert answer.choices[0].finish_reason == "stop"
    return answer.choices[0].message.content


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_answer_validates_against_its_schema(server, name):
    jsonschema.validate(json.loads(ask(server, name, SCHEMAS[name])), SCHEMAS[name])


def test_streamed_answers_validate_and_equal_whole_ones(server):
    for name in ("nested objects", "anyOf"):
        text = ask(server, name, SCHEMAS[name], stream=True)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert text == ask(server, name, SCHEMAS[name])


def test_json_mode_answers_an_object_even_when_sampled(server):
    for seed in range(3):
        answer = client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=300, seed=seed,
            temperature=1.0, response_format={"type": "json_object"})
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_regex_choice_and_grammar_on_both_routes(server):
    openai_client = client(server)
    text = openai_client.completions.create(model=MODEL, prompt="Call me on", max_tokens=20, temperature=0,
                                            extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", text.choices[0].text)
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    grammar = 'root ::= "(" [a-z] [a-z] " " [0-9] ")"'
    text = openai_client.completions.create(model=MODEL, prompt="A pair:", max_tokens=20, temperature=0,
                                            extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([a-z]{2} [0-9]\)", text.choices[0].text)


def test_constrained_and_free_requests_share_the_batch(server):
    """Free answers in a batch beside constrained ones are those they get alone."""
    from concurrent.futures import ThreadPoolExecutor

    def free() -> str:
        return client(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=16,
            temperature=0).choices[0].message.content

    alone = free()
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(ask, server, name, SCHEMAS[name]) for name in list(SCHEMAS)[:4]]
        frees = [pool.submit(free) for _ in range(2)]
        for name, future in zip(SCHEMAS, constrained):
            jsonschema.validate(json.loads(future.result()), SCHEMAS[name])
        assert [future.result() for future in frees] == [alone, alone]


def _api_answers(checkpoint: str) -> list[str]:
    """chat_completion and text_completion with response_format, greedy, a batch of two dialogs."""
    llama = Llama.build(checkpoint, f"{checkpoint}/tokenizer.json", max_seq_len=512, max_batch_size=2)
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["nested objects"]}}
    dialogs = [[{"role": "user", "content": "Who lives where?"}], [{"role": "user", "content": "An address."}]]
    chats = llama.chat_completion(dialogs, temperature=0, max_gen_len=120, response_format=response_format)
    ranges = {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMAS["number ranges"]}}
    texts = llama.text_completion(["My pet:"], temperature=0, max_gen_len=60, response_format=ranges)
    return [chat["generation"]["content"] for chat in chats] + [texts[0]["generation"]]


def test_the_python_api_takes_response_format():
    first, second, text = run_world(1, _api_answers, str(demo.demo_checkpoint(1)))[0]
    for answer in (first, second):
        jsonschema.validate(json.loads(answer), SCHEMAS["nested objects"])
    jsonschema.validate(json.loads(text), SCHEMAS["number ranges"])


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30}},
                                                "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(server, stream):
    """The model calls the function (forced), the tool's answer goes back, the model answers in words."""
    openai_client = client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                   tool_choice="required", max_tokens=80, stream=stream)
    if stream:
        chunks = [chunk for chunk in answer if chunk.choices]
        calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls, finish = answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": '{"celsius": 18, "sky": "cloudy"}'}]
    words = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                  max_tokens=40)
    assert words.choices[0].message.content and not words.choices[0].message.tool_calls
    assert words.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_bans_and_forces_tokens(server):
    openai_client = client(server)
    messages = [{"role": "user", "content": "Say hello."}]
    plain = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                                  logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=1,
                                                   logit_bias={str(tokens[0]): -100})
    assert banned.choices[0].message.content != first
    forced = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=3,
                                                   logit_bias={"28": 100})  # "=" every time
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": [28, 28, 28]}).json()["prompt"]
    assert forced.choices[0].message.content == detokenized
