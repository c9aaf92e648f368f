"""The server tests as the server's clients: the official openai client, values from /metrics,
and the check that the server still serves."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import MODEL

HELLO = [{"role": "user", "content": "Hello!"}]
LONG_ANSWER = "word " * 200  # long enough to still be going when the client leaves
GOOD_CHAT = {"model": MODEL, "messages": HELLO}
GOOD_COMPLETION = {"model": MODEL, "prompt": "Once"}
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"


def client(url: str, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, **options)


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from /metrics (0 for a labelled counter that has not counted yet)."""
    families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))
    for family in families:
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    if labels and any(name.startswith(family.name) for family in families):
        return 0.0
    raise KeyError(name)


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_serves(url: str) -> None:
    """A good request works: the server kept serving."""
    answer = client(url).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def assert_idle(url: str) -> None:
    """Nothing waits or runs any more (the fake engine keeps the gauges as the real one does)."""
    wait_until(lambda: metric(url, "llama_tp_requests_running") == 0 and metric(url, "llama_tp_requests_waiting") == 0)


def anthropic_events(text: str) -> list[tuple[str, dict]]:
    """An Anthropic stream's events, pings too (its client hides them), as (event type, data)."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(kind == data["type"] for kind, data in events), events
    return events


def whole_through_a_failure(served, path: str, body: dict, error: str) -> httpx.Response:
    """The answer to a whole (not streamed) request when the fake engine fails while it runs."""
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{served.url}{path}", json=body, timeout=10)
        wait_until(lambda: metric(served.url, "llama_tp_requests_running") == 1)
        served.engine.end_all("error", error)
        return whole.result()
