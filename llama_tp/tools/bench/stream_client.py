"""A streaming chat request timed chunk by chunk, as the serving benchmarks send it."""

import json
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds from time.perf_counter()."""

    start: float
    first: Optional[float] = None  # the first chunk with text
    last: Optional[float] = None  # the last chunk with text or a finish reason
    tokens: int = 0
    tokens_from_usage: bool = False
    finished: bool = False  # a finish reason came
    error: Optional[str] = None
    text: str = ""  # the answer
    cached_tokens: int = 0  # prompt tokens the server says it reused (usage.prompt_tokens_details)
    prompt_tokens: int = 0  # as the usage says


async def event_lines(response: httpx.Response):
    """The stream's lines as server-sent events split them: at CR, LF or CRLF only. httpx's
    aiter_lines also splits at U+2028, U+0085 and the like, which a JSON string may hold as they are."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = re.split(r"\r\n|\r|\n", pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


async def send(client: httpx.AsyncClient, url: str, body: dict,
               on_first: Optional[Callable[[], None]] = None) -> Outcome:
    """One streaming chat request, timed chunk by chunk; on_first is called at its first text."""
    outcome = Outcome(start=time.perf_counter())
    content_chunks = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                outcome.error = f"HTTP {response.status_code}: {text[:200]}"
                return outcome
            async for line in event_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"error event: {json.dumps(chunk['error'])[:200]}"
                    return outcome
                if chunk.get("usage"):
                    outcome.tokens, outcome.tokens_from_usage = chunk["usage"]["completion_tokens"], True
                    outcome.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    outcome.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        content_chunks += 1
                        if outcome.first is None and on_first is not None:
                            on_first()
                        outcome.first = outcome.first or now
                        outcome.last = now
                        outcome.text += choice["delta"]["content"]
                    if choice.get("finish_reason"):
                        outcome.last, outcome.finished = now, True
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    if not outcome.tokens_from_usage:  # a server that sends no usage: one token per chunk of text
        outcome.tokens = content_chunks
    if not outcome.finished:  # e.g. llama.cpp's server ends a stream when another request comes
        outcome.error = "the stream ended without a finish reason (for llama.cpp's server: --interrupt_requests False)"
    return outcome
