"""What the server answers to chat completions and completions, in OpenAI's shapes: a whole
response, or server-sent event chunks. (OpenAI's Responses API, /v1/responses, is responses_api/.)

A Reply writes one request's answer, of `n` choices (indexed 0..n-1, each from its own engine
request); ChatReply and CompletionReply differ only in how a choice and its log probabilities
look (chat: `message`/`delta` and `logprobs.content`; completions: `text` and the legacy
`logprobs` of parallel lists). A reasoning model's chat answer holds its thinking apart, in
`reasoning_content`.
"""

import json
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from ..structured.tools import parse_tool_calls, tool_format
from ..text.reasoning import ReasoningSplitter, Split, Thinking
from ..engine.requests import Delta, GenerationRequest, TokenLogprob
from .protocol import RequestError

DONE = b"data: [DONE]\n\n"


def event(data: dict) -> bytes:
    """One server-sent event carrying data as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def parsed_calls(body, generator) -> Optional[tuple[str, set[str]]]:
    """With tools the model may call: their format and names, for parsing the answer's calls; else None."""
    if body.tools and body.tool_choice != "none":
        return tool_format(generator.formatter), {tool.function.name for tool in body.tools}
    return None


def finish_reason(delta: Delta) -> str:
    """OpenAI's finish reason of a final delta: "cancelled" reaches a client only when the server is
    stopping, which ends the answer cleanly: "stop"."""
    return "length" if delta.finish_reason == "length" else "stop"


def usage(finals: list[Delta]) -> dict:
    """The token counts of every choice's final delta: the prompt once (the first choice's, whose
    prefill the others share), the completions of all; cached_tokens are prompt tokens whose keys
    and values were reused from earlier requests."""
    prompt, completion = finals[0].prompt_tokens, sum(final.completion_tokens for final in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens},
    }


@dataclass(frozen=True)
class Answered:
    """One choice's whole answer: its text, its tokens' log probabilities (None: not asked), its last delta."""

    text: str
    logprobs: Optional[list[TokenLogprob]]
    final: Delta


class Reply:
    """One request's answer: its id, creation time and model; whole or as chunks."""

    object: str
    chunk_object: str
    id_prefix: str
    heartbeat: Optional[bytes] = None  # sent on a stream that has been silent a while, if any

    def __init__(self, model: str, tokenizer, include_usage: bool = False, n: int = 1):
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.n = n
        self.finals: dict[int, Delta] = {}  # a stream's choices that have ended, by index

    # What the two kinds of answer write differently

    def choice(self, index: int, text: str, logprobs: Optional[list[TokenLogprob]], reason: str) -> dict:
        raise NotImplementedError

    def chunk_choice(self, index: int, text: str, logprobs: Optional[list[TokenLogprob]],
                     reason: Optional[str]) -> dict:
        raise NotImplementedError

    def expect(self, body, request: GenerationRequest, generator) -> None:
        """Learn what the answer needs of its checked body and request before it is written."""

    def opening(self) -> list[bytes]:
        """The chunks a stream begins with, before any text."""
        return []

    def failure(self, error: RequestError) -> bytes:
        """The event that ends a stream whose answer failed (the engine, or the request's grammar)."""
        return event(error.body())

    # The same for both

    def response(self, answers: list[Answered]) -> dict:
        """The whole answer, for a request that did not ask to stream: a choice per answer."""
        choices = [self.choice(index, answer.text, answer.logprobs, finish_reason(answer.final))
                   for index, answer in enumerate(answers)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage([answer.final for answer in answers])}

    def chunks(self, index: int, delta: Delta, logprobs: bool) -> list[bytes]:
        """The events for one delta of choice index: its text (and log probabilities); after its
        last, its finish reason; after every choice's last, the usage when asked, and [DONE]."""
        events = []
        if delta.text or delta.logprobs:
            events.append(self.chunk([self.chunk_choice(index, delta.text, list(delta.logprobs) if logprobs else None,
                                                        None)]))
        if delta.finished:
            events.append(self.chunk([self.chunk_choice(index, "", None, finish_reason(delta))]))
            events += self.ending(index, delta)
        return events

    def ending(self, index: int, final: Delta) -> list[bytes]:
        """After choice index's last delta: once every choice has ended, the usage when asked and [DONE]."""
        self.finals[index] = final
        if len(self.finals) < self.n:
            return []
        usage_chunk = [self.chunk([], usage([self.finals[i] for i in range(self.n)]))] if self.include_usage else []
        return usage_chunk + [DONE]

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
    thinking: Optional[Thinking] = None  # a reasoning model's answers: their thinking goes apart

    def __init__(self, model: str, tokenizer, include_usage: bool = False, n: int = 1):
        super().__init__(model, tokenizer, include_usage, n)
        self.held: dict[int, list[str]] = {}  # with tools, each choice's streamed text until its end, when calls are parsed
        self.splitters: dict[int, ReasoningSplitter] = {}  # a reasoning model's, each streamed choice's

    def expect(self, body, request, generator):
        self.tools = parsed_calls(body, generator)
        self.thinking = request.thinking

    def choice(self, index, text, logprobs, reason):
        """A choice's message: a reasoning model's thinking as its reasoning_content (the content
        null when the answer ended inside it), the calls parsed from what follows the thinking."""
        message, calls = {"role": "assistant", "content": text}, []
        if self.thinking is not None:
            split = self.thinking.split(text)
            text = split.content
            message = {"role": "assistant", "content": text or None, "reasoning_content": split.reasoning or None}
        if self.tools is not None:  # each choice's calls are its own
            content, calls = parse_tool_calls(text, *self.tools)
            if calls:
                message |= {"content": content, "tool_calls": [call.openai() for call in calls]}
        return {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                "finish_reason": "tool_calls" if calls and reason == "stop" else reason}

    def chunks(self, index, delta, logprobs):
        """With tools, a choice's text is held to its end: a call is only known once it is whole.
        Then the thinking comes as one reasoning delta, the words as one content delta and each
        call as a tool_calls delta. Without tools, a reasoning model's text comes as deltas of
        reasoning_content and of content as soon as it is known which a piece is."""
        if self.tools is None and self.thinking is None:
            return super().chunks(index, delta, logprobs)
        if self.tools is None:
            return self.split_chunks(index, delta, logprobs)
        held = self.held.setdefault(index, [])
        held.append(delta.text)
        if not delta.finished:
            return []
        choice = self.choice(index, "".join(held), None, finish_reason(delta))
        message, events = choice["message"], []
        if message["content"] or message.get("reasoning_content"):
            events.append(self.chunk([self.chunk_choice(index, message["content"] or "", None, None,
                                                        message.get("reasoning_content") or "")]))
        for number, call in enumerate(message.get("tool_calls", ())):
            events.append(self.chunk([{"index": index, "delta": {"tool_calls": [call | {"index": number}]},
                                       "logprobs": None, "finish_reason": None}]))
        events.append(self.chunk([self.chunk_choice(index, "", None, choice["finish_reason"])]))
        return events + self.ending(index, delta)

    def split_chunks(self, index: int, delta: Delta, logprobs: bool) -> list[bytes]:
        """A reasoning model's delta as a chunk of its thinking's and its content's new text."""
        splitter = self.splitters.setdefault(index, self.thinking.splitter())
        split = splitter.push(delta.text)
        if delta.finished:
            rest = splitter.finish()
            split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
        events = []
        if split.reasoning or split.content or delta.logprobs:
            events.append(self.chunk([self.chunk_choice(index, split.content, list(delta.logprobs) if logprobs else None,
                                                        None, split.reasoning)]))
        if delta.finished:
            events.append(self.chunk([self.chunk_choice(index, "", None, finish_reason(delta))]))
            events += self.ending(index, delta)
        return events

    def chunk_choice(self, index, text, logprobs, reason, reasoning: str = ""):
        delta = {"content": text} if text or (reason is None and not reasoning) else {}
        if reasoning:
            delta = {"reasoning_content": reasoning} | delta
        return {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": reason}

    def opening(self):
        return [self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for index in range(self.n)]

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

    def __init__(self, model: str, tokenizer, include_usage: bool = False, n: int = 1):
        super().__init__(model, tokenizer, include_usage, n)
        self.text_offsets: dict[int, int] = {}  # where each choice's next token's text begins, over a stream's chunks
        self.echo = ""  # with echo: the prompt's text, before each choice's answer

    def expect(self, body, request, generator):
        if body.echo:  # the prompt's text first
            self.echo = body.prompt if isinstance(body.prompt, str) else generator.tokenizer.decode(body.prompt)

    def response(self, answers):
        return super().response([Answered(self.echo + answer.text, answer.logprobs, answer.final)
                                 for answer in answers])

    def opening(self):
        return [self.chunk([self.chunk_choice(index, self.echo, None, None)]) for index in range(self.n)] if self.echo else []

    def choice(self, index, text, logprobs, reason):
        return {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs), "finish_reason": reason}

    def chunk_choice(self, index, text, logprobs, reason):
        return self.choice(index, text, logprobs, reason)

    def logprobs(self, index: int, logprobs: Optional[list[TokenLogprob]]) -> Optional[dict]:
        """The legacy shape: parallel lists of tokens, their log probabilities, {token: logprob} of
        the alternatives, and where each token's text begins in choice index's answer."""
        if logprobs is None:
            return None
        tokens = [self.token_text(item.token) for item in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(text)
        return {"tokens": tokens, "token_logprobs": [item.logprob for item in logprobs],
                "top_logprobs": [{self.token_text(token): logprob for token, logprob in item.top}
                                 for item in logprobs],
                "text_offset": offsets}
