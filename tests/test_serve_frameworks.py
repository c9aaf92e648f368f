"""The frameworks users build on the official openai client, unchanged against our server:
langchain-openai, openai-agents and pydantic-ai, each through Chat Completions and the Responses
API (and pydantic-ai through Anthropic's Messages API too; langchain-anthropic:
test_messages_http.py), with the real engine of a tiny model behind the HTTP side (random weights, so every typed
answer here is one the grammar held, and every answer is greedy and the same on every run).

Their own code paths are what is tested: how each asks for tools, forced calls and typed outputs
(strict schemas, `response_format`, an output tool, `text.format`), how each reads a stream, and
how each parses what comes back. Schemas bound their strings, so that a model of random weights
closes them within the answer's tokens."""

import asyncio
import json
from typing import Annotated, Iterator

import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from agents.items import ToolCallItem, ToolCallOutputItem
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent as TypedAgent
from pydantic_ai import NativeOutput, ToolOutput
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel as TypedResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

from llama_tp import Llama
from serve_client import client
from serve_harness import HttpHarness
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-frameworks"
MAX_TOKENS = 96  # room for a forced call of a bounded argument, as the tiny model writes it
City = Annotated[str, Field(max_length=12)]


class Place(BaseModel):
    name: City
    coastal: bool


def weather(city: City) -> str:
    """The weather in a city."""
    return f"cold in {city}"


@pytest.fixture(scope="module")
def server(checkpoints) -> Iterator[HttpHarness]:
    set_tracing_disabled(True)  # openai-agents would send its traces to OpenAI's servers
    llama = Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=1024, max_batch_size=2)
    harness = HttpHarness(llama, MODEL)
    try:
        yield harness
    finally:
        harness.close()


def openai_answer(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """The official client's greedy answer to a user's prompt, and its tokens: what a framework
    must hand on unchanged."""
    completion = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, temperature=0)
    return completion.choices[0].message.content, completion.usage.completion_tokens


def bounded(city: str) -> bool:
    return isinstance(city, str) and len(city) <= 12


def banned(server: HttpHarness, first: str) -> dict[str, int]:
    """A logit_bias that keeps the model from every token whose text starts with `first`: where a
    grammar lets a call ("<tool_call>") or an answer ("{") begin, it chooses the other."""
    tokenizer = server.generator.tokenizer
    return {str(token): -100 for token in range(tokenizer.n_words)
            if tokenizer.decode([token]).lstrip(" ").startswith(first)}


# The official client: a typed answer beside tools

def test_a_typed_answer_beside_tools_is_a_call_or_that_answer(server):
    """response_format shapes the answer a turn ends with: a turn that may call a tool either calls
    one or answers in that shape (OpenAI's behaviour, which agents with tools and a typed output
    rely on); a turn that must call one calls it."""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                               "parameters": parameters}}]
    typed = {"type": "json_schema", "json_schema": {"name": "Place", "schema": Place.model_json_schema(),
                                                    "strict": True}}
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Is Oslo by the sea?"}], tools=tools,
               response_format=typed, max_tokens=MAX_TOKENS, temperature=0)
    answered = client(server.url).chat.completions.create(**ask, logit_bias=banned(server, "<")).choices[0]
    assert answered.finish_reason == "stop" and not answered.message.tool_calls
    assert bounded(Place.model_validate_json(answered.message.content).name)
    for choice, bias in (("auto", banned(server, "{")), ("required", {})):
        called = client(server.url).chat.completions.create(**ask, tool_choice=choice, logit_bias=bias).choices[0]
        [call] = called.message.tool_calls
        assert called.finish_reason == "tool_calls" and call.function.name == "weather"
        assert bounded(json.loads(call.function.arguments)["city"])


# langchain-openai

def chat_model(url: str, max_tokens: int = MAX_TOKENS, **options) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=MODEL, max_tokens=max_tokens, temperature=0,
                      max_retries=0, **options)


def test_langchain_invokes_and_streams_the_clients_answer(server):
    expected, tokens = openai_answer(server.url, "Hello!", 24)
    assert chat_model(server.url, max_tokens=24).invoke("Hello!").content == expected
    streamed = None
    for chunk in chat_model(server.url, max_tokens=24, stream_usage=True).stream("Hello!"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == expected
    assert streamed.usage_metadata["output_tokens"] == tokens  # from the stream's last chunk (stream_options)
    by_responses = chat_model(server.url, max_tokens=24, use_responses_api=True).invoke("Hello!")
    assert by_responses.text == expected


def test_langchain_binds_tools_and_types_answers(server):
    for choice in ("weather", "any"):  # a named call, then any call ("required")
        called = chat_model(server.url).bind_tools([weather], tool_choice=choice).invoke("Weather in Oslo?")
        [call] = called.tool_calls
        assert call["name"] == "weather" and list(call["args"]) == ["city"] and bounded(call["args"]["city"])
        assert call["id"].startswith("call_") and not called.invalid_tool_calls
    for method in ("json_schema", "function_calling"):  # response_format with a strict schema; a forced tool
        place = chat_model(server.url).with_structured_output(Place, method=method).invoke("A city by the sea?")
        assert isinstance(place, Place) and bounded(place.name)
    place = chat_model(server.url, use_responses_api=True).with_structured_output(Place).invoke("A city by the sea?")
    assert isinstance(place, Place)


# openai-agents

def agents_models(url: str) -> dict:
    """Both of openai-agents' models, each with its own client (made in the loop that uses it)."""
    return {"chat completions": lambda: OpenAIChatCompletionsModel(
                model=MODEL, openai_client=AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)),
            "responses": lambda: OpenAIResponsesModel(
                model=MODEL, openai_client=AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0))}


def run_forecaster(server: HttpHarness, api: str, **agent_options):
    """An agent with a tool and a typed output, made to call the tool first (tool_choice
    "required", as users force a lookup): the run, and the cities the tool was asked about."""
    asked = []

    @function_tool
    def weather_tool(city: City) -> str:
        """The weather in a city."""
        asked.append(city)
        return weather(city)

    async def run():
        agent = Agent(name="forecaster", instructions="Answer briefly.", model=agents_models(server.url)[api](),
                      tools=[weather_tool], output_type=Place, **agent_options)
        return await Runner.run(agent, "Is Oslo by the sea, and how cold is it?", max_turns=3)

    return asyncio.run(run()), asked


def test_openai_agents_call_a_tool_then_answer_in_their_type(server):
    # After the call, tool_choice is reset to "auto": the answer may be another call or a Place,
    # and the model (kept from starting a call) gives the Place.
    settings = ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0,
                             extra_body={"logit_bias": banned(server, "<")})
    result, asked = run_forecaster(server, "chat completions", model_settings=settings)
    assert len(asked) == 1 and bounded(asked[0])
    calls = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert len(calls) == 1 and json.loads(calls[0].raw_item.arguments) == {"city": asked[0]}
    assert [item.output for item in outputs] == [weather(asked[0])]
    assert isinstance(result.final_output, Place) and bounded(result.final_output.name)


def test_openai_agents_call_a_tool_through_the_responses_api(server):
    # Its forced call comes with the Place's schema in text.format (the Responses API takes no
    # logit_bias to steer the turn after it: the run stops at the tool's answer).
    settings = ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    result, asked = run_forecaster(server, "responses", model_settings=settings, tool_use_behavior="stop_on_first_tool")
    assert len(asked) == 1 and bounded(asked[0]) and result.final_output == weather(asked[0])
    [call] = [item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert json.loads(call.raw_item.arguments) == {"city": asked[0]} and call.raw_item.call_id


@pytest.mark.parametrize("api", ["chat completions", "responses"])
def test_openai_agents_carry_a_conversation_with_calls_on(server, api):
    """A run's items (the user's words, the call, the tool's answer) sent on with the user's next
    words, as a chat application does between turns: the history is the model's prompt."""
    first, asked = run_forecaster(server, api, tool_use_behavior="stop_on_first_tool",
                                  model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS,
                                                               temperature=0))
    history = first.to_input_list()
    assert [item.get("type", "message") for item in history] == ["message", "function_call", "function_call_output"]

    async def run():
        agent = Agent(name="guide", model=agents_models(server.url)[api](), output_type=Place,
                      model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
        return await Runner.run(agent, history + [{"role": "user", "content": "And is it by the sea?"}])

    assert len(asked) == 1 and isinstance(asyncio.run(run()).final_output, Place)


@pytest.mark.parametrize("api", ["chat completions", "responses"])
def test_openai_agents_stream_a_typed_answer(server, api):
    async def run():
        agent = Agent(name="guide", model=agents_models(server.url)[api](), output_type=Place,
                      model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
        streamed = Runner.run_streamed(agent, "A city by the sea?")
        deltas = [event.data.delta async for event in streamed.stream_events() if event.type == "raw_response_event"
                  and getattr(event.data, "type", "") == "response.output_text.delta"]
        return deltas, streamed.final_output

    deltas, place = asyncio.run(run())
    assert len(deltas) > 1 and Place.model_validate_json("".join(deltas)) == place
    assert isinstance(place, Place)


# pydantic-ai

def typed_models(url: str) -> dict:
    provider = OpenAIProvider(base_url=f"{url}/v1", api_key="x")
    return {"chat completions": OpenAIChatModel(MODEL, provider=provider),
            "responses": TypedResponsesModel(MODEL, provider=provider),
            "messages": AnthropicModel(MODEL, provider=AnthropicProvider(base_url=url, api_key="x"))}


def typed_outputs(api: str) -> tuple:
    """An output tool (a forced call), the same named, and response_format (which pydantic-ai sends
    Anthropic's API only for the models it knows)."""
    return (Place, ToolOutput(Place)) + ((NativeOutput(Place),) if api != "messages" else ())


@pytest.mark.parametrize("api", ["chat completions", "responses", "messages"])
def test_pydantic_ai_types_answers_by_tool_and_by_schema(server, api):
    model, settings = typed_models(server.url)[api], {"max_tokens": MAX_TOKENS, "temperature": 0}
    for output in typed_outputs(api):
        place = TypedAgent(model, output_type=output, model_settings=settings).run_sync("A city by the sea?").output
        assert isinstance(place, Place) and bounded(place.name)


@pytest.mark.parametrize("api", ["chat completions", "responses", "messages"])
def test_pydantic_ai_streams_the_answers_it_gives_whole(server, api):
    model, settings = typed_models(server.url)[api], {"max_tokens": 24, "temperature": 0}
    agent = TypedAgent(model, model_settings=settings)
    whole = agent.run_sync("Hello!").output

    async def stream():
        async with agent.run_stream("Hello!") as run:
            return [delta async for delta in run.stream_text(delta=True)]

    deltas = asyncio.run(stream())
    assert "".join(deltas) == whole == openai_answer(server.url, "Hello!", 24)[0]
    for output in typed_outputs(api)[::2]:  # a typed answer streamed: its output tool's call, or its JSON
        typed = TypedAgent(model, output_type=output, model_settings=settings | {"max_tokens": MAX_TOKENS})

        async def stream_typed():
            async with typed.run_stream("A city by the sea?") as run:
                return [part async for part in run.stream_output(debounce_by=None)], await run.get_output()

        parts, place = asyncio.run(stream_typed())
        assert parts[-1] == place == typed.run_sync("A city by the sea?").output and isinstance(place, Place)
