"""One response's output as the engine's deltas come: its items (a reasoning model's thinking, the
message, the function calls), the events of its stream, and the Response object they add up to.

A whole answer is the same deltas with the events left unsent, so a stream and a whole answer hold
the same items. The events are those the openai client parses (ResponseStreamEvent):

    response.created, response.in_progress
    per item: response.output_item.added, then for a reasoning item or a message
        response.content_part.added, response.reasoning_text.delta or response.output_text.delta...,
        response.reasoning_text.done or response.output_text.done, response.content_part.done;
    for a function call response.function_call_arguments.delta and .done; response.output_item.done
    response.completed, or response.incomplete (max_output_tokens), or response.failed
"""

import json
import time
import uuid
from typing import AsyncIterator, Callable, Optional

from ...structured.tools import parse_tool_calls
from ...text.reasoning import Split
from ..requests import Delta
from .prepare import Turn
from .protocol import ResponsesRequest
from .store import Stored


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse(event: dict) -> bytes:
    """One server-sent event, named by its type as OpenAI names them."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseOutput:
    """One response's items and events, delta by delta."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, turn: Turn):
        self.turn = turn
        self.splitter = turn.request.thinking.splitter() if turn.request.thinking is not None else None
        options = turn.request.options
        self.response = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False, "temperature": options.temperature,
            "text": {"format": body.text.format.echoed() if body.text and body.text.format else {"type": "text"}},
            "tool_choice": _echoed_choice(body.tool_choice), "tools": [_echoed_tool(tool) for tool in body.tools or ()],
            "top_p": options.top_p, "truncation": "disabled", "usage": None, "user": body.user,
            "metadata": body.metadata or {},
        }
        self.items: list[dict] = self.response["output"]
        self.texts: dict[int, str] = {}  # a reasoning item's or message's text so far, by output index
        self.open: Optional[int] = None  # the item whose text comes now
        self.held: list[str] = []  # with tools, the content until its end: a call is only known whole
        self.tokens: list[int] = []
        self.sequence = 0  # the next event's sequence_number

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict]:
        """The stream's first events, before any output."""
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))  # a copy: the items change as the answer comes

    def push(self, delta: Delta) -> list[dict]:
        """The events of one delta; after the last, the items are closed and the response ends."""
        self.tokens += delta.tokens
        split = self.splitter.push(delta.text) if self.splitter is not None else Split(content=delta.text)
        if delta.finished and self.splitter is not None:
            rest = self.splitter.finish()
            split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
        events = self.write("reasoning", split.reasoning) if split.reasoning else []
        if split.content and self.turn.tools is not None:
            self.held.append(split.content)
        elif split.content:
            events += self.write("message", split.content)
        if delta.finished:
            events += self.finish(delta)
        return events

    def write(self, kind: str, text: str) -> list[dict]:
        """text for a reasoning item or the message, opening it (and closing the one before) as needed."""
        events = []
        if self.open is None or self.items[self.open]["type"] != kind:
            events = self.close() + self.add(kind)
        index = self.open
        self.texts[index] += text
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", item_id=self.items[index]["id"],
                                        output_index=index, content_index=0, delta=text)]
        return events + [self.event("response.output_text.delta", item_id=self.items[index]["id"], output_index=index,
                                    content_index=0, delta=text, logprobs=[])]

    def add(self, kind: str) -> list[dict]:
        """A new reasoning item or message, empty, and its one content part."""
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
        self.items.append(item)
        self.open = index = len(self.items) - 1
        self.texts[index] = ""
        return [self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item))),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=_part(kind, ""))]

    def close(self, status: str = "completed") -> list[dict]:
        """End the open item: its whole text, its part, the item itself."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item, text = self.items[index], self.texts[index]
        kind = item["type"]
        item["content"], item["status"] = [_part(kind, text)], status
        done = (self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text) if kind == "reasoning" else
                self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]))
        return [done, self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                 part=_part(kind, text)),
                self.event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def finish(self, final: Delta) -> list[dict]:
        """The last items (with tools: the words and calls of the held content) and the response's end."""
        cut = final.finish_reason == "length"
        events = []
        calls = []
        if self.turn.tools is not None and self.held:
            content, calls = parse_tool_calls("".join(self.held), *self.turn.tools)
            if content:
                events += self.write("message", content)
        if not self.items and not calls:  # an empty answer is still a message
            events += self.add("message")
        events += self.close("incomplete" if cut else "completed")
        for call in calls:
            events += self.call(call.openai())
        thinking = self.turn.request.thinking
        self.response |= {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": final.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": final.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": thinking.reasoning_tokens(self.tokens)
                                                if thinking is not None else 0},
                      "total_tokens": final.prompt_tokens + final.completion_tokens},
        }
        return events + [self.event("response.incomplete" if cut else "response.completed", response=self.snapshot())]

    def call(self, call: dict) -> list[dict]:
        """A function call's item, whole: the call is known only once the answer has ended."""
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index, arguments = len(self.items) - 1, call["function"]["arguments"]
        events = [self.event("response.output_item.added", output_index=index, item=dict(item)),
                  self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=arguments),
                  self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=arguments)]
        item |= {"arguments": arguments, "status": "completed"}
        return events + [self.event("response.output_item.done", output_index=index, item=dict(item))]

    def failed(self, message: str) -> dict:
        """The stream's last event when the engine fails mid-answer."""
        self.response |= {"status": "failed", "error": {"code": "server_error", "message": message}}
        return self.event("response.failed", response=self.snapshot())

    def stored(self) -> Stored:
        """The ended response, and the conversation a later turn follows: the turn's and this answer."""
        return Stored(self.snapshot(), (*self.turn.conversation, self.answer_message()))

    def answer_message(self) -> dict:
        """The answer as a chat message, for the turn that follows it."""
        texts = {item["type"]: self.texts.get(index, "") for index, item in enumerate(self.items)}
        calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                          "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message = {"role": "assistant", "content": texts.get("message") or (None if calls else "")}
        if "reasoning" in texts:
            message["reasoning_content"] = texts["reasoning"]
        return message | ({"tool_calls": calls} if calls else {})


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _echoed_choice(choice) -> "str | dict":
    return choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto"


def _echoed_tool(tool) -> dict:
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": tool.strict}


async def whole(deltas: AsyncIterator[tuple[int, Delta]], output: ResponseOutput) -> Optional[Delta]:
    """Read the answer to its end into output; its last delta (None: the client left first)."""
    final = None
    async for _, delta in deltas:
        if delta.finish_reason != "error":
            output.push(delta)
        final = delta if delta.finished else final
    return final


async def events(deltas: AsyncIterator[tuple[int, Delta]], output: ResponseOutput,
                 keep: Callable[[ResponseOutput], None]) -> AsyncIterator[bytes]:
    """The answer as server-sent events; keep(output) once it has ended, unless the engine failed
    (then response.failed ends the stream)."""
    for event in output.opening():
        yield sse(event)
    async for _, delta in deltas:
        if delta.finish_reason == "error":
            yield sse(output.failed(delta.error or "the engine failed"))
            return
        for event in output.push(delta):
            yield sse(event)
        if delta.finished:
            keep(output)
