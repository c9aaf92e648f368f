"""What the Messages door answers: a message whole, or as Anthropic's server-sent events.

A stream opens with message_start and a ping; each of the answer's blocks is opened
(content_block_start), filled (content_block_delta: thinking_delta, text_delta, input_json_delta)
and closed (content_block_stop); message_delta brings the stop reason and usage, and message_stop
ends it. A ping also goes out whenever the stream has been silent for a while (app.py), and an
engine failure ends it with an error event.

A reasoning model's thinking (the server's --reasoning_parser, text/reasoning.py) is a thinking
block before the rest, streamed as it is generated, as text is. With tools the model may call,
what follows the thinking is held to its end, when its calls are parsed (a call is only known
whole), as chat completions do; but where tool_choice forces a call, the grammar holds it to one
call, whose input then streams as input_json_delta pieces as the model writes it.
"""

import json
import re
import uuid
from typing import Optional

from ...structured.tools import parse_tool_calls
from ...text.reasoning import ReasoningSplitter, Split, Thinking
from ...engine.requests import Delta
from ..responses import Reply, event, parsed_calls
from ..protocol import RequestError
from .protocol import messages_error

# A block as it opens in a stream, before its deltas fill it; the deltas' type is `{kind}_delta`,
# their text in the field `kind`.
OPENED = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}


def sse(kind: str, data: dict) -> bytes:
    """One server-sent event of Anthropic's: its type, then its data as JSON."""
    return f"event: {kind}\n".encode() + event(data)


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def usage(final: Delta) -> dict:
    """Anthropic's counts: input_tokens are the prompt tokens computed for this request, those
    whose keys and values were reused from earlier ones are cache_read_input_tokens (their sum is
    the prompt, as count_tokens gives it)."""
    return {"input_tokens": final.prompt_tokens - final.cached_tokens, "output_tokens": final.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": final.cached_tokens}


def stop_reason(final: Delta, called: bool) -> str:
    if final.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "end_turn" if final.stop_string is None else "stop_sequence"


class MessageReply(Reply):
    object = "message"
    id_prefix = "msg_"
    heartbeat = sse("ping", {"type": "ping"})

    def __init__(self, model: str, tokenizer, include_usage: bool = False, n: int = 1):
        super().__init__(model, tokenizer, include_usage, n)
        self.tools: Optional[tuple[str, set[str]]] = None  # with tools: their format and names; calls are parsed
        self.call: Optional[CallInput] = None  # a forced call, streamed as it is written
        self.thinking: Optional[Thinking] = None  # a reasoning model's answer: its thinking is a block of its own
        self.splitter: Optional[ReasoningSplitter] = None  # and the stream's thinking and the rest, apart
        self.prompt_tokens = 0
        self.held: list[str] = []  # with tools, the streamed text after the thinking until its end
        self.started = 0  # blocks started in the stream
        self.open: Optional[str] = None  # the type of the block open now

    def expect(self, body, request, generator):
        self.tools = parsed_calls(body, generator)
        if self.tools is not None and body.tool_choice not in (None, "auto"):
            self.call = CallInput()
        self.thinking = request.thinking
        if self.thinking is not None:
            self.splitter = self.thinking.splitter()
        self.prompt_tokens = len(request.prompt_tokens)

    # A whole message

    def response(self, answers):
        answer = answers[0]  # a message is one answer
        split = self.thinking.split(answer.text) if self.thinking is not None else Split(content=answer.text)
        blocks, called = self.blocks(split.content)
        thought = [OPENED["thinking"] | {"thinking": split.reasoning}] if split.reasoning else []
        return self.message(thought + blocks, answer.final, stop_reason(answer.final, called), usage(answer.final))

    def message(self, blocks: list[dict], final: Optional[Delta], reason: Optional[str], counts: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": blocks, "model": self.model,
                "stop_reason": reason, "stop_sequence": final.stop_string if final is not None else None,
                "usage": counts}

    def blocks(self, text: str) -> tuple[list[dict], bool]:
        """The blocks of the answer's text after any thinking, and whether it called a tool."""
        content, calls = parse_tool_calls(text, *self.tools) if self.tools is not None else (text, [])
        blocks = [{"type": "text", "text": content}] if content else []
        return blocks + [{"type": "tool_use", "id": tool_use_id(), "name": call.name,
                          "input": json.loads(call.arguments)} for call in calls], bool(calls)

    # A stream

    def opening(self):
        counts = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}  # how much of the prompt is cached is known at its end
        return [sse("message_start", {"type": "message_start", "message": self.message([], None, None, counts)}),
                self.heartbeat]

    def chunks(self, index, delta, logprobs):
        split = self.split(delta)
        events = self.piece("thinking", split.reasoning) if split.reasoning else []
        if self.tools is None:
            if split.content:
                events += self.piece("text", split.content)
        else:
            self.held.append(split.content)
            if self.call is not None:
                events += self.call_input(split.content)
        return events + self.ending(delta) if delta.finished else events

    def split(self, delta: Delta) -> Split:
        """A delta's thinking and the rest (after the last delta, with what the splitter held)."""
        if self.splitter is None:
            return Split(content=delta.text)
        split = self.splitter.push(delta.text)
        if delta.finished:
            rest = self.splitter.finish()
            split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
        return split

    def failure(self, error: RequestError) -> bytes:
        return sse("error", messages_error(error)[1])

    def piece(self, kind: str, text: str) -> list[bytes]:
        """A thinking_delta or text_delta, after opening a block of its kind if none is open."""
        events = [] if self.open == kind else self.start(OPENED[kind])
        return events + [self.delta({"type": f"{kind}_delta", kind: text})]

    def call_input(self, text: str) -> list[bytes]:
        """A forced call: its block once its name is written, then its input as it comes."""
        unnamed = self.call.name is None
        piece = self.call.push(text)
        events = []
        if unnamed and self.call.name is not None:
            events += self.start({"type": "tool_use", "id": tool_use_id(), "name": self.call.name, "input": {}})
        if piece:
            events.append(self.delta({"type": "input_json_delta", "partial_json": piece}))
        return events

    def ending(self, final: Delta) -> list[bytes]:
        """After the last delta: the blocks held to the end, then the stop reason and usage."""
        events = []
        if self.call is not None and self.call.name is not None:  # its input has streamed
            called = self.call.closed
        elif self.tools is not None:
            blocks, called = self.blocks("".join(self.held))
            for block in blocks:
                if block["type"] == "text":
                    events += self.piece("text", block["text"])
                else:
                    events += self.start(block | {"input": {}})
                    events.append(self.delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
        else:
            called = False
        events += self.close()
        return events + [
            sse("message_delta", {"type": "message_delta", "usage": usage(final), "delta": {
                "stop_reason": stop_reason(final, called), "stop_sequence": final.stop_string}}),
            sse("message_stop", {"type": "message_stop"})]

    def start(self, block: dict) -> list[bytes]:
        events = self.close()
        self.open = block["type"]
        self.started += 1
        return events + [sse("content_block_start", {"type": "content_block_start", "index": self.started - 1,
                                                     "content_block": block})]

    def delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.started - 1, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.started - 1})]


class CallInput:
    """A forced call as the model writes it: the tool's name once it is written, then its input
    object's text piece by piece, up to the object's closing brace. The grammar holds the call to
    {"name": ..., "arguments" (Llama 3: "parameters"): {...}}, name first (structured/tools.py)."""

    OPENING = re.compile(r'"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

    def __init__(self):
        self.text = ""
        self.name: Optional[str] = None
        self.read = 0  # where the input has been read to in text
        self.depth = 0  # of objects and arrays, outside strings
        self.in_string = self.escaped = False
        self.closed = False  # the input object is whole

    def push(self, text: str) -> str:
        """The input's text that text adds (the name, once written, is in self.name)."""
        self.text += text
        if self.name is None:
            found = self.OPENING.search(self.text)
            if found is None:
                return ""
            self.name, self.read = found.group(1), found.end()
        begin = self.read
        while not self.closed and self.read < len(self.text):
            char = self.text[self.read]
            self.read += 1
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped = char == "\\"
                self.in_string = char != '"'
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
        return self.text[begin:self.read]
