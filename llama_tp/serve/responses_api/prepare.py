"""A checked Responses body into the engine's request: the conversation so far (a stored response's,
with previous_response_id) and the input items become chat messages, and the body a chat
completion request, which serve/prepare.py checks and turns into a GenerationRequest as it does
every chat request. Its refusals are told in the Responses API's names (`input`, not `messages`)."""

from dataclasses import dataclass
from typing import Optional

from pydantic import ValidationError

from ...structured.constraint import GrammarLimits
from ...structured.tools import tool_format
from ..prepare import chat_request
from ...engine.requests import GenerationRequest
from ..protocol import ChatCompletionRequest, RequestError, _request_error
from .protocol import (FunctionCallItem, FunctionCallOutputItem, FunctionChoice, MessageItem, ReasoningItem,
                       ResponsesRequest)
from .store import ResponseStore

# The chat request's field names in its refusals, and the Responses API's, longest first.
CHAT_NAMES = {
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "tool_choice.function.name": "tool_choice.name",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
}


@dataclass(frozen=True)
class Turn:
    """A Responses request as the engine takes it, and what its answer is written and kept with."""

    request: GenerationRequest
    conversation: list[dict]  # the chat messages so far, instructions left out: what a later turn follows
    tools: Optional[tuple[str, set[str]]]  # with tools: their format and names, for parsing the calls


def asks_for_grammar(body: ResponsesRequest) -> bool:
    """Whether the turn asks for a grammar (a text format's schema or JSON, a forced call), which preparing it compiles."""
    formatted = body.text is not None and body.text.format is not None and body.text.format.type != "text"
    return formatted or body.tool_choice not in (None, "none", "auto")


def prepare_turn(body: ResponsesRequest, generator, store: ResponseStore, response_id: str,
                 grammar_limits: GrammarLimits = GrammarLimits()) -> Turn:
    """The turn's request, its grammar compiled within grammar_limits; RequestError for what the
    server refuses, named as the Responses API names it."""
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise RequestError(400, f"`previous_response_id` {body.previous_response_id} is not a response this server "
                               f"keeps: it was stored with store false, deleted, or evicted (the server keeps the last "
                               f"{store.capacity}: --max_stored_responses)", "previous_response_id",
                               "previous_response_not_found")
        history = list(previous.conversation)
    conversation = history + chat_messages(body.input)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    tools = [tool.chat() for tool in body.tools or ()]
    choice = body.tool_choice
    chat = {
        "model": body.model, "messages": instructions + conversation, "temperature": body.temperature,
        "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens, "tools": tools or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
        else choice,
        "response_format": body.text.format.chat() if body.text and body.text.format else None,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    try:
        try:
            checked = ChatCompletionRequest.model_validate({key: value for key, value in chat.items() if value is not None})
        except ValidationError as error:  # what the chat body refuses of the turn (no messages at all: `input` [])
            raise _request_error(error.errors(include_url=False)[0]) from None
        request = chat_request(checked, generator, response_id, grammar_limits)
    except RequestError as error:
        raise in_responses_names(error) from None
    parsed = (tool_format(generator.formatter), {tool.name for tool in body.tools}) if tools and choice != "none" else None
    return Turn(request, conversation, parsed)


def chat_messages(items: list) -> list[dict]:
    """Input items as chat messages: a function call joins the assistant's answer before it (or
    makes one), its output is a tool message, a reasoning item is the next answer's reasoning_content."""
    messages: list[dict] = []
    reasoning: Optional[str] = None  # a reasoning item's, for the assistant message after it
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            continue
        if isinstance(item, MessageItem):
            message = {"role": item.role, "content": item.content}
        else:
            assert isinstance(item, FunctionCallItem)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:  # the same answer's
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
    return messages


def in_responses_names(error: RequestError) -> RequestError:
    """A chat request's refusal, its fields named as the Responses body names them."""
    message, param = error.message, error.param
    for chat_name, name in CHAT_NAMES.items():
        message = message.replace(f"`{chat_name}`", f"`{name}`")
        param = name if param == chat_name else param
    message = message.replace("max_completion_tokens", "max_output_tokens")  # the limit, named without quotes
    return RequestError(error.status, message, param, error.code)
