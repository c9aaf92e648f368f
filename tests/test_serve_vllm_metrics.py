"""/metrics under vLLM's names (what Grafana boards, llm-d and Datadog read), scraped while a known
load runs and after it: each series holds the value that load implies, with vLLM's model_name."""

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llama_tp import Llama
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.serve.mailbox import Mailbox
from llama_tp.serve.metrics import VLLM_NAMES, ServerMetrics
from serve_client import client, metric, wait_until
from serve_harness import HttpHarness
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-metrics"
PROMPT = list(range(100, 172))  # 72 token ids, a prompt no other test sends: a full block of the cache and more
ANSWER = 8  # tokens each answer has: min_tokens holds off the end of text until then
MAX_SEQ_LEN = 128  # two blocks of the KV cache


class SteppedMailbox(Mailbox):
    """A mailbox the engine takes from only when the test lets it: every step of the engine begins
    with a take(), so while the engine waits here its metrics hold still."""

    def __init__(self):
        super().__init__(8, ServerMetrics(MODEL))
        self.permits = threading.Semaphore(0)
        self.entered = 0  # take() calls begun: the engine's steps so far, plus the one it waits to begin

    def take(self, timeout):
        self.entered += 1
        self.permits.acquire()
        return super().take(timeout)

    def steps(self, count: int) -> None:
        """Let the engine make count steps, and wait until it waits again."""
        target = self.entered + count
        self.permits.release(count)
        wait_until(lambda: self.entered == target)


def vllm(url: str, name: str, **labels) -> float:
    return metric(url, name, model_name=MODEL, **labels)


@pytest.fixture
def stepped(checkpoints):
    """One cache row: a second request waits for the first to end, then reuses its prompt."""
    llama = Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=MAX_SEQ_LEN,
                        max_batch_size=1)
    harness = HttpHarness(llama, MODEL, mailbox=SteppedMailbox())
    yield harness
    harness.mailbox.permits.release(10_000)
    harness.close()


def test_a_known_load_shows_in_vllms_series(stepped):
    url, mailbox = stepped.url, stepped.mailbox
    answers = []

    def ask() -> None:
        answers.append(client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=ANSWER, temperature=0,
                                                      extra_body={"min_tokens": ANSWER}))

    first = threading.Thread(target=ask)
    first.start()
    wait_until(lambda: vllm(url, "vllm:num_requests_waiting") == 1)
    assert vllm(url, "vllm:num_requests_running") == 0
    mailbox.steps(5)  # the first request admitted, prefilled (in chunks of 16 tokens), its first token chosen
    second = threading.Thread(target=ask)  # the same prompt, waiting for the one cache row
    second.start()
    wait_until(lambda: vllm(url, "vllm:num_requests_waiting") == 1)
    assert vllm(url, "vllm:num_requests_running") == 1
    # the running request's prompt and first token hold both blocks of a cache of 1 row x MAX_SEQ_LEN positions
    assert vllm(url, "vllm:kv_cache_usage_perc") == 1
    assert metric(url, "llama_tp_kv_cache_blocks_used") == 2 and metric(url, "llama_tp_kv_cache_blocks_cached") == 0
    assert vllm(url, "vllm:prompt_tokens_total") == vllm(url, "vllm:prefix_cache_queries_total") == len(PROMPT)
    assert vllm(url, "vllm:generation_tokens_total") == 1
    assert vllm(url, "vllm:time_to_first_token_seconds_count") == 1
    assert vllm(url, "vllm:inter_token_latency_seconds_count") == 0

    mailbox.permits.release(10_000)  # the rest without pauses
    first.join(30)
    second.join(30)
    assert [answer.usage.completion_tokens for answer in answers] == [ANSWER, ANSWER]
    reused = answers[1].usage.prompt_tokens_details.cached_tokens
    assert reused == BLOCK_POSITIONS  # the prompt's full block, which the first request filled
    wait_until(lambda: vllm(url, "vllm:num_requests_running") == 0)
    expected = {
        "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0,
        "vllm:prompt_tokens_total": 2 * len(PROMPT), "vllm:prefix_cache_queries_total": 2 * len(PROMPT),
        "vllm:prefix_cache_hits_total": reused, "vllm:generation_tokens_total": 2 * ANSWER,
        "vllm:time_to_first_token_seconds_count": 2, "vllm:e2e_request_latency_seconds_count": 2,
        # every token after each request's first
        "vllm:inter_token_latency_seconds_count": 2 * (ANSWER - 1),
        "vllm:time_per_output_token_seconds_count": 2 * (ANSWER - 1),
        "vllm:request_time_per_output_token_seconds_count": 2, "vllm:num_preemptions_total": 0,
    }
    assert {name: vllm(url, name) for name in expected} == expected
    assert vllm(url, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    # the same figures as ours, under the other name
    assert vllm(url, "vllm:inter_token_latency_seconds_sum") == metric(url, "llama_tp_inter_token_latency_seconds_sum")
    assert metric(url, "llama_tp_generation_tokens_total") == 2 * ANSWER


def test_every_vllm_name_is_served_with_the_model_name(stepped):
    text = httpx.get(f"{stepped.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert set(VLLM_NAMES) <= set(families)
    assert all(sample.labels["model_name"] == MODEL for name in VLLM_NAMES for sample in families[name].samples)
