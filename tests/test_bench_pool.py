"""The serving benchmark's KV cache cases (tools/bench/pool.py) against our server with a tiny model
behind it: what each case reads from /metrics and from the answers, and the checks it prints."""

import asyncio
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from llama_tp import Llama
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.serve.metrics import ServerMetrics
from llama_tp.tools.bench import pool
from llama_tp.tools.bench.serve import main
from serve_harness import HttpHarness
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_SEQ_LEN = 256  # the load's longest prompt (about 180 tokens) and an answer
ROWS = 4
ANSWER = 56  # tokens: past the first block of every prompt of the load (15 to 177 tokens, BLOCK_POSITIONS 64)
STEP_SECONDS = 0.04  # the shortest pass of the shared case: /metrics, read every 0.1 s, sees the chats at once


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=MAX_SEQ_LEN,
                       max_batch_size=ROWS)


def _taking_at_least(seconds: float, model_pass: Callable) -> Callable:
    def slow_pass(*args, **kwargs):
        time.sleep(seconds)
        return model_pass(*args, **kwargs)

    return slow_pass


@contextmanager
def served(llama: Llama, blocks: int) -> Iterator[str]:
    """Our server with the tiny model and a KV cache of this many blocks; its URL."""
    model = llama.model
    model.setup_caches(ROWS, MAX_SEQ_LEN, model.rotary.device, model.layers[0].attention.cache.k.dtype,
                       blocks * BLOCK_POSITIONS)
    llama.forget_prefixes()
    server = HttpHarness(llama, "tiny")
    try:
        yield server.url
    finally:
        server.close()


def test_the_gauges_are_read_from_our_metrics():
    metrics = ServerMetrics("m")
    metrics.requests_running.set(3)
    metrics.kv_cache_blocks_used.set(17)
    metrics.preemptions.inc(2)
    metrics.requests_running_max.set(5)
    assert pool.read_metrics(metrics.render().decode()) == {"running": 3.0, "blocks_used": 17.0, "running_max": 5.0,
                                                            "blocks_used_max": 0.0, "blocks_cached": 0.0,
                                                            "preemptions": 2.0}


def test_a_peak_is_the_servers_record_where_it_rose_while_the_clients_ran():
    """The server's record (every step's value) beats the reads, which can fall between steps; a
    record that did not rise was set before the clients ran, so the reads' highest stands."""
    watch = pool.Watch()
    for running, record in ((1, 2), (3, 5), (0, 5)):  # a step of 5 fell between the reads
        watch.record({"running": running, "running_max": record})
    assert watch.highest("running") == 5
    watch = pool.Watch()
    for running in (1, 3, 0):  # an earlier load of 8 set the record
        watch.record({"running": running, "running_max": 8})
    assert watch.highest("running") == 3


def test_many_sees_every_client_running_at_once(llama):
    with served(llama, 16) as url:
        model, results = asyncio.run(pool.many(url, levels=(2, ROWS), requests=8, max_tokens=8))
    assert model == "tiny" and [r["concurrency"] for r in results] == [2, ROWS]
    checks = pool.many_checks(results)
    assert [c["passed"] for c in checks[:2]] == [True, True], checks  # answered; the running gauge reached 4
    assert checks[1]["check"] == f"all {ROWS} clients ran at once: the running gauge reached {ROWS}"
    assert checks[2]["check"].startswith(f"output tokens/s at {ROWS} clients")
    # llama-server's figure at as many clients beside ours
    peer = [dict(results[-1], output_tokens_per_s=results[-1]["output_tokens_per_s"] / 2)]
    assert pool.many_checks(results, peer)[3] == {"check": f"at {ROWS} clients 2.00x llama-server's output tokens/s "
                                                           f"({peer[0]['output_tokens_per_s']:.1f}; at least 1.5x)",
                                                  "passed": True}


def test_shared_holds_the_system_prompt_once(llama, monkeypatch):
    """Four chats behind a system prompt of 8 house rules (three blocks of the Llama 2 chat's
    prompts), in 10 blocks: four copies would not fit. Each chat starts at the one before's first
    token, so all four run at once only while the first's 16 tokens outlast three starts: each
    pass is held to STEP_SECONDS, where the tiny model's few milliseconds a step let the first
    answer end, under a loaded machine's HTTP latency, before the last chat came in."""
    for name in ("forward", "forward_segments"):
        monkeypatch.setattr(llama.model, name, _taking_at_least(STEP_SECONDS, getattr(llama.model, name)))
    with served(llama, 10) as url:
        _, figures = asyncio.run(pool.shared(url, clients=ROWS, rules=8, max_tokens=16))
    requests = figures["requests"]
    assert [r["error"] for r in requests] == [None] * ROWS
    assert requests[0]["cached_tokens"] == 0 and all(r["cached_tokens"] == 3 * BLOCK_POSITIONS for r in requests[1:])
    assert all(r["completion_tokens"] == 16 for r in requests)
    checks = pool.shared_checks(figures)
    assert [c["passed"] for c in checks[:3]] == [True, True, True], checks
    assert figures["peak_blocks_used"] < sum(-(-(r["prompt_tokens"] + 16) // BLOCK_POSITIONS) for r in requests)
    assert checks[3]["check"].startswith("time to first token after the first's: at most ")


def test_burst_overflows_the_pool_and_every_answer_is_its_own(llama):
    """Eight clients at once on four rows of 56-token answers in four blocks: every answer outgrows
    its prompt's first block (the longest prompt, 177 tokens, its third), so any three running at
    once (or the longest and one more) overflow the pool, whatever the order they came in."""
    with served(llama, 4) as url:
        _, figures = asyncio.run(pool.burst(url, clients=8, max_tokens=ANSWER))
    checks = pool.burst_checks(figures, ANSWER)
    assert all(c["passed"] for c in checks), checks
    assert checks[1]["check"] == f"every request completed: 8 of 8 answers of {ANSWER} tokens, 0 refused by the waiting " \
                                "line, 0 failed"
    failed = dict(figures, requests=[dict(figures["requests"][0], error="HTTP 429: full", same_as_alone=False)]
                  + figures["requests"][1:])
    assert [c["passed"] for c in pool.burst_checks(failed, ANSWER)] == [True, False, False]
    assert "1 refused by the waiting line" in pool.burst_checks(failed, ANSWER)[1]["check"]


@pytest.mark.parametrize("options, words", [
    ({"case": "shared", "peer": "llama-server"}, "--peer runs in case many only"),
    ({"case": "many", "peer": "llama-server"}, "needs --ours too"),
    ({"case": "many", "peer": "vllm"}, "--peer 'vllm'"),
])
def test_the_cases_refuse_what_they_cannot_measure(options, words):
    with pytest.raises(ValueError, match=words):
        main(url="http://127.0.0.1:1", **options)
