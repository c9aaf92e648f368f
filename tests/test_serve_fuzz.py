"""Fuzzing the running server (issue 54): request bodies drawn from the protocol's own models
(every field a value of its declared type, the required ones always there), then mutated (fields
dropped, unknown ones added, values replaced by others of any type, extreme numbers, odd text,
deep nesting), sent in batches to launch/serve.py serving a tiny model, as the demo runs. No
answer may be a 5xx or an engine failure, none may hang, and after every batch a normal request
is answered within its usual time."""

import json
import os
import time
import typing
from typing import Any, Literal, Union

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from demo_server import LaunchedServer
from llama_tp.serve.messages.protocol import CountTokensRequest, MessagesRequest
from llama_tp.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from llama_tp.serve.responses_api.protocol import ResponsesRequest
from tiny_checkpoint import LLAMA2_TOKENIZER

pytestmark = pytest.mark.slow

MODEL = "tiny-fuzzed"
ROUTES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/v1/messages": MessagesRequest,
          "/v1/messages/count_tokens": CountTokensRequest, "/v1/responses": ResponsesRequest}
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0}
# Hypothesis examples, each a batch of 1 to 6 requests; LLAMA_TP_FUZZ_BATCHES=2000 for a long campaign.
BATCHES = int(os.environ.get("LLAMA_TP_FUZZ_BATCHES", "60"))

ODD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "e\u0301" * 50, "<|im_start|>user", "[INST]", "<s>", "{",
                            "a" * 3000, "\U0001F600" * 100, "[^\\s\\S]", "(a|b)*c", "root ::= \"x\"", "９"])
TEXT = st.text(max_size=30) | ODD_TEXT
NUMBERS = (st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from([0, -1, 1e308, -1e308, 5e-324, 2**63, -2**63 - 1, 10**40, 1e-300]))
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
# Dialogs a chat format takes: an optional system message, then user and assistant in turn, ending with the user.
DIALOGS = st.tuples(st.lists(st.text(max_size=40), max_size=1), st.integers(0, 2), st.text(max_size=40)).map(
    lambda parts: [{"role": "system", "content": text} for text in parts[0]]
    + [{"role": role, "content": f"{role} {turn}"} for turn in range(parts[1]) for role in ("user", "assistant")]
    + [{"role": "user", "content": parts[2]}])
# Fields whose values should mostly make sense (three times in four), so that requests get past
# the first checks and reach the engine; each still takes any value of its type now and then.
LIKELY = {
    "model": st.just(MODEL),
    "messages": DIALOGS,
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
    "content": st.text(max_size=40),
    "max_tokens": st.integers(1, 16), "max_completion_tokens": st.integers(1, 16), "min_tokens": st.integers(0, 4),
    "n": st.integers(1, 3), "best_of": st.integers(1, 3), "top_logprobs": st.integers(0, 5),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "prompt": st.text(max_size=40) | st.lists(st.integers(0, 31999), max_size=20),
    "tokens": st.lists(st.integers(0, 31999), max_size=20),
    "logit_bias": st.dictionaries(st.integers(0, 31999).map(str), st.floats(-100, 100), max_size=3),
    "guided_regex": st.sampled_from(["[ab]+", "a[^\\s\\S]", "[^\\s\\S]", "\\d{1,3}", "(x|y){2}"]),
    "guided_choice": st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3),
}


def of_type(annotation: Any, name: str = "") -> st.SearchStrategy:
    """Values of a field's declared type (a model's: bodies of it); LIKELY's where it names one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return of_type(args[0], name)
    if origin is Union:
        values = st.one_of(*(of_type(arg, name) for arg in args))
    elif origin is Literal:
        values = st.sampled_from(args)
    elif origin is list:
        values = st.lists(of_type(args[0]), max_size=3)
    elif origin is dict:
        values = st.dictionaries(TEXT, of_type(args[1]), max_size=3)
    elif annotation is type(None):
        values = st.none()
    elif annotation is Any:
        values = JSON
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        values = bodies(annotation)
    else:
        values = {str: TEXT, bool: st.booleans(), int: st.integers(-5, 300) | NUMBERS,
                  float: st.floats(-3, 3) | NUMBERS}[annotation]
    return st.one_of(LIKELY[name], LIKELY[name], LIKELY[name], values) if name in LIKELY else values


@st.composite
def bodies(draw, model: type) -> dict:
    """A model's body as JSON: its required fields and up to four others, each of its type."""
    fields = {(info.alias or name): (info.annotation, info.is_required()) for name, info in model.model_fields.items()}
    chosen = [name for name, (_, required) in fields.items() if required]
    optional = sorted(name for name in fields if name not in chosen)
    if optional:
        chosen += draw(st.lists(st.sampled_from(optional), max_size=4, unique=True))
    return {name: draw(of_type(fields[name][0], name)) for name in chosen}


def nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def requests(draw) -> tuple[str, bytes]:
    """(route, body): a body of the route's model, then mutated; now and then not JSON at all."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    body = draw(bodies(ROUTES[route]))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        kind, keys = draw(st.sampled_from(["drop", "add", "replace", "nest"])), sorted(body)
        if kind == "add" or not keys:
            body[draw(TEXT)] = draw(JSON)
            continue
        key = draw(st.sampled_from(keys))
        if kind == "drop":
            del body[key]
        elif kind == "replace":
            body[key] = draw(JSON)
        else:
            body[key] = nested(body[key], draw(st.integers(1, 200)))
    raw = json.dumps(body).encode()
    cut = draw(st.sampled_from([None] * 18 + ["half", "bytes"]))
    if cut == "half":
        raw = raw[: len(raw) // 2]
    elif cut == "bytes":
        raw = raw.replace(b'"', b"\xff", 1)
    return route, raw


@pytest.fixture(scope="module")
def fuzzed(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "stderr.txt"
    server = LaunchedServer(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), MODEL, log, 1, "--max_seq_len", "128",
                            "--max_batch_size", "4", "--grammar_timeout", "5")
    usual = min(_timed_good(server.url) for _ in range(3))
    yield server, usual
    server.close()


def _timed_good(url: str) -> float:
    start = time.monotonic()
    answer = httpx.post(f"{url}/v1/chat/completions", json=GOOD, timeout=60)
    assert answer.status_code == 200, answer.text
    return time.monotonic() - start


def _answer(url: str, route: str, raw: bytes, streamed: bool) -> None:
    """Send one request; fail on a 5xx, an engine failure or a hang (a minute without an answer)."""
    headers = {"Content-Type": "application/json"}
    with httpx.stream("POST", f"{url}{route}", content=raw, headers=headers, timeout=60) as response:
        text = response.read().decode(errors="replace")
    assert response.status_code < 500, (route, raw[:300], response.status_code, text[:500])
    event(f"{route} {response.status_code}")  # what the fuzzing reached: --hypothesis-show-statistics
    if streamed and response.status_code == 200:
        failed = [line for line in text.splitlines() if line.startswith("data: {") and _engine_failure(json.loads(line[6:]))]
        assert not failed, (raw[:300], failed)


def _engine_failure(data: dict) -> bool:
    """Whether an event says the server failed: OpenAI's error event, Anthropic's, the Responses API's."""
    error = data.get("error")
    if data.get("type") == "error":  # Anthropic's
        return error["type"] in ("api_error", "overloaded_error")
    if data.get("type") == "response.failed":
        return True
    return isinstance(error, dict) and error.get("code") in ("engine_failed", "internal_error")


@settings(max_examples=BATCHES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(requests(), min_size=1, max_size=6))
def test_fuzzed_requests_get_no_5xx_and_the_server_serves_on(fuzzed, batch):
    server, usual = fuzzed
    for route, raw in batch:
        _answer(server.url, route, raw, b'"stream": true' in raw)
    assert server.job.poll() is None, server.log.read_text()[-3000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _timed_good(server.url) < max(10 * usual, usual + 10)
