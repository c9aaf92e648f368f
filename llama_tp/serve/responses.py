"""What the server answers, in OpenAI's shapes: a whole response, or server-sent event chunks.

A Reply writes one request's answer; ChatReply and CompletionReply differ only in how a choice
and its log probabilities look (chat: `message`/`delta` and `logprobs.content`; completions:
`text` and the legacy `logprobs` of parallel lists).
"""

import json
import time
import uuid
from typing import Optional

from ..structured.tools import parse_tool_calls
from .requests import Delta, TokenLogprob

DONE = b"data: [DONE]\n\n"


def event(data: dict) -> bytes:
    """One server-sent event carrying data as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(delta: Delta) -> str:
    """OpenAI's finish reason of a final delta: "cancelled" reaches a client only when the server is
    stopping, which ends the answer cleanly: "stop"."""
    return "length" if delta.finish_reason == "length" else "stop"


def usage(final: Delta) -> dict:
    """The token counts of a final delta; cached_tokens are prompt tokens whose keys and values were reused."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


class Reply:
    """One request's answer: its id, creation time and model; whole or as chunks."""

    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, model: str, tokenizer, include_usage: bool = False):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage

    # What the two kinds of answer write differently

    def choice(self, text: str, logprobs: Optional[list[TokenLogprob]], reason: str) -> dict:
        raise NotImplementedError

    def chunk_choice(self, text: str, logprobs: Optional[list[TokenLogprob]], reason: Optional[str]) -> dict:
        raise NotImplementedError

    def opening(self) -> list[bytes]:
        """The chunks a stream begins with, before any text."""
        return []

    # The same for both

    def response(self, text: str, logprobs: Optional[list[TokenLogprob]], final: Delta) -> dict:
        """The whole answer, for a request that did not ask to stream."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(text, logprobs, finish_reason(final))], "usage": usage(final)}

    def chunks(self, delta: Delta, logprobs: bool) -> list[bytes]:
        """The events for one delta: its text (and log probabilities); after the last, the finish
        reason, the usage when asked, and [DONE]."""
        events = []
        if delta.text or delta.logprobs:
            events.append(self.chunk([self.chunk_choice(delta.text, list(delta.logprobs) if logprobs else None, None)]))
        if delta.finished:
            events.append(self.chunk([self.chunk_choice("", None, finish_reason(delta))]))
            if self.include_usage:
                events.append(self.chunk([], usage(delta)))
            events.append(DONE)
        return events

    def chunk(self, choices: list[dict], counts: Optional[dict] = None) -> bytes:
        data = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:  # null on every chunk but the last, as OpenAI does
            data["usage"] = counts
        return event(data)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


class ChatReply(Reply):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    tools: Optional[tuple[str, set[str]]] = None  # with tools: their format and names; calls are parsed

    def __init__(self, model: str, tokenizer, include_usage: bool = False):
        super().__init__(model, tokenizer, include_usage)
        self.held: list[str] = []  # with tools, a stream's text until the end, when calls are parsed

    def choice(self, text, logprobs, reason):
        message, calls = {"role": "assistant", "content": text}, []
        if self.tools is not None:
            content, calls = parse_tool_calls(text, *self.tools)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.openai() for call in calls]}
        return {"index": 0, "message": message, "logprobs": self.logprobs(logprobs),
                "finish_reason": "tool_calls" if calls and reason == "stop" else reason}

    def chunks(self, delta, logprobs):
        """With tools, the text is held to the end: a call is only known once it is whole. Then
        the words come as one content delta and each call as a tool_calls delta."""
        if self.tools is None:
            return super().chunks(delta, logprobs)
        self.held.append(delta.text)
        if not delta.finished:
            return []
        choice = self.choice("".join(self.held), None, finish_reason(delta))
        message, events = choice["message"], []
        if message["content"]:
            events.append(self.chunk([self.chunk_choice(message["content"], None, None)]))
        for index, call in enumerate(message.get("tool_calls", ())):
            events.append(self.chunk([{"index": 0, "delta": {"tool_calls": [call | {"index": index}]},
                                       "logprobs": None, "finish_reason": None}]))
        events.append(self.chunk([self.chunk_choice("", None, choice["finish_reason"])]))
        if self.include_usage:
            events.append(self.chunk([], usage(delta)))
        return events + [DONE]

    def chunk_choice(self, text, logprobs, reason):
        delta = {"content": text} if text or reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": reason}

    def opening(self):
        return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])]

    def logprobs(self, logprobs: Optional[list[TokenLogprob]]) -> Optional[dict]:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}, or None when not asked."""
        if logprobs is None:
            return None
        return {"content": [self.entry(item.token, item.logprob) | {
            "top_logprobs": [self.entry(token, logprob) for token, logprob in item.top]} for item in logprobs]}

    def entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class CompletionReply(Reply):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str, tokenizer, include_usage: bool = False):
        super().__init__(model, tokenizer, include_usage)
        self.text_offset = 0  # where the next token's text begins, over the chunks of a stream
        self.echo = ""  # with echo: the prompt's text, before the answer's

    def response(self, text, logprobs, final):
        return super().response(self.echo + text, logprobs, final)

    def opening(self):
        return [self.chunk([self.chunk_choice(self.echo, None, None)])] if self.echo else []

    def choice(self, text, logprobs, reason):
        return {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": reason}

    def chunk_choice(self, text, logprobs, reason):
        return self.choice(text, logprobs, reason)

    def logprobs(self, logprobs: Optional[list[TokenLogprob]]) -> Optional[dict]:
        """The legacy shape: parallel lists of tokens, their log probabilities, {token: logprob} of
        the alternatives, and where each token's text begins in the answer."""
        if logprobs is None:
            return None
        tokens = [self.token_text(item.token) for item in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [item.logprob for item in logprobs],
                "top_logprobs": [{self.token_text(token): logprob for token, logprob in item.top}
                                 for item in logprobs],
                "text_offset": offsets}
