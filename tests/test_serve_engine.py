"""The serving engine without HTTP: continuous batching gives each request the answer it gets
alone, on one process and on two, and every request ends exactly once, however it ends."""

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.serve.mailbox import ENGINE_FAILED, Overloaded, ServerState, Unavailable
from serve_harness import Harness, request, text_of, tokens_of
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, successor_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts of 2 to 24 tokens: with a budget of 16 prompt tokens a step, the longest two are
# prefilled in two chunks while the others decode.
PROMPTS = [[1, 450, 4996, 17354], [1, 306, 4658], [1, 18637, 29892, 920, 29871, 13] * 4, [1, 450],
           [1, 1724, 338, 278, 7483, 310, 3444, 29973], [1, 15043] * 10, [1, 3869, 526]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3)


@pytest.fixture
def harness(llama):
    running = Harness(llama)
    yield running
    running.close()


def test_greedy_answers_equal_each_prompt_alone_whatever_else_runs(llama, harness):
    """7 requests at once on 3 cache rows: they wait, join the batch as rows free up, and each
    gets exactly generate()'s tokens for its prompt alone, and its text."""
    streams = [harness.submit(request(llama, prompt, 10, temperature=0)) for prompt in PROMPTS]
    answers = [harness.deltas(stream) for stream in streams]  # before generate() uses the same caches
    for prompt, deltas in zip(PROMPTS, answers):
        alone, _ = llama.generate([prompt], max_gen_len=10, temperature=0)
        assert tokens_of(deltas) == alone[0]
        assert text_of(deltas) == llama.tokenizer.decode(alone[0])
        last = deltas[-1]
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", len(prompt), 10)
    metrics = harness.mailbox.metrics
    assert metrics.requests_ended.labels("finished")._value.get() == len(PROMPTS)
    assert metrics.requests_running._value.get() == metrics.requests_waiting._value.get() == 0
    assert metrics.requests_running_max._value.get() == 3  # all 3 rows at once, the others waiting
    assert metrics.kv_cache_blocks_used_max._value.get() >= 3  # a block at least each
    assert metrics.prompt_tokens._value.get() == sum(map(len, PROMPTS))
    assert metrics.generation_tokens._value.get() == 10 * len(PROMPTS)


def test_seeded_sampling_is_reproducible_per_request(llama, harness):
    options = dict(temperature=1.0, top_p=0.95, top_k=50, seed=7)
    alone = tokens_of(harness.ask(request(llama, PROMPTS[0], 12, **options)))
    streams = [harness.submit(request(llama, prompt, 12, temperature=0.8)) for prompt in PROMPTS[1:3]]
    together = harness.submit(request(llama, PROMPTS[0], 12, **options))
    assert tokens_of(harness.deltas(together)) == alone
    for stream in streams:
        harness.deltas(stream)
    assert alone == llama.generate([PROMPTS[0]], max_gen_len=12, **options)[0][0]  # as the API samples it


def test_logprobs_are_the_models_own(llama, harness):
    deltas = harness.ask(request(llama, PROMPTS[4], 6, temperature=0, logprobs=True, top_logprobs=3))
    tokens, expected = llama.generate([PROMPTS[4]], max_gen_len=6, temperature=0, logprobs=True)
    logprobs = [lp for delta in deltas for lp in delta.logprobs]
    assert [lp.token for lp in logprobs] == tokens[0]
    assert [lp.logprob for lp in logprobs] == pytest.approx(expected[0], abs=1e-4)
    for lp in logprobs:  # greedy: the chosen token is the likeliest
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token and lp.top[0][1] == pytest.approx(lp.logprob)


def test_a_cancelled_request_ends_once_and_frees_its_row(llama, harness):
    stream = harness.submit(request(llama, PROMPTS[0], 50, temperature=0))
    harness.deltas(stream, count=2)  # it is generating
    harness.mailbox.cancel(stream.request.id)
    rest = harness.deltas(stream)
    assert rest[-1].finish_reason == "cancelled" and len(tokens_of(rest)) < 48
    after = harness.ask(request(llama, PROMPTS[1], 4, temperature=0))  # the engine goes on
    assert after[-1].finish_reason == "length"
    assert not harness.engine.scheduler.running
    assert harness.mailbox.metrics.requests_ended.labels("cancelled")._value.get() == 1


def test_the_waiting_line_is_bounded_and_refuses_at_once(llama):
    idle = Harness(llama, max_waiting=2, start=False)  # nothing takes the requests
    idle.submit(request(llama, PROMPTS[0], 4))
    idle.submit(request(llama, PROMPTS[1], 4))
    with pytest.raises(Overloaded, match="2 requests are already waiting for a slot \\(--max_waiting 2\\)"):
        idle.submit(request(llama, PROMPTS[2], 4))
    idle.mailbox.set_state(ServerState.STOPPING)
    with pytest.raises(Unavailable, match="shutting down"):
        idle.submit(request(llama, PROMPTS[2], 4))
    idle.close()


def test_stopping_ends_running_requests_cleanly_and_refuses_waiting_ones(llama):
    harness = Harness(llama)
    streams = [harness.submit(request(llama, PROMPTS[0], 50, temperature=0)) for _ in range(4)]  # 3 rows
    first = harness.deltas(streams[0], count=3)
    harness.stop()
    rest = harness.deltas(streams[0])
    assert rest[-1].finish_reason == "cancelled"
    assert text_of(first + rest) == llama.tokenizer.decode(tokens_of(first + rest))  # no text held back
    assert harness.deltas(streams[3])[-1].error == "the server is shutting down"
    assert harness.mailbox.state is ServerState.STOPPING and harness.error is None
    harness.close()


def test_a_lost_rank_ends_every_request_with_an_error(llama, monkeypatch, caplog):
    """The client hears that the engine failed; the lost rank's words (gloo's, with its source and
    addresses) go to the log only."""
    harness = Harness(llama, start=False)
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    monkeypatch.setattr(llama.model, "forward", lambda *args, **kwargs: (_ for _ in ()).throw(lost))
    stream = harness.submit(request(llama, PROMPTS[0], 5))
    harness.thread.start()
    last = harness.deltas(stream)[-1]
    harness.thread.join(10)
    assert harness.error is lost
    assert (last.finish_reason, last.error, last.error_code) == ("error", ENGINE_FAILED, "engine_failed")
    assert "lost contact with another process" in caplog.text and "gloo" in caplog.text
    assert harness.mailbox.state is ServerState.FAILED
    harness.close()


@pytest.fixture(scope="module", params=["plain", "speculating"])
def chain(request, tmp_path_factory) -> tuple[Llama, list[int]]:
    """A model whose greedy answer to [1, 450] is fixed: 'The quick brown fox' then eos; also with
    its int8 copy as a draft, whose guesses are right: a round then ends at the stop or limit."""
    chain = [1, 450, 4996, 17354, 1701, 29916, 2]
    directory = tmp_path_factory.mktemp("chain")
    write_checkpoint(directory, TINY_LLAMA2, successor_weights(TINY_LLAMA2, 32000, dict(zip(chain[:-1], chain[1:]))), 1, "dim")
    speculation = dict(speculate="draft", draft_quantize="int8") if request.param == "speculating" else {}
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=2, **speculation), chain


def test_stop_tokens_stop_strings_and_min_tokens(chain):
    llama, chain = chain
    harness = Harness(llama)
    try:
        at_eos = harness.ask(request(llama, chain[:2], 20, temperature=0))
        assert tokens_of(at_eos) == chain[2:-1] and at_eos[-1].finish_reason == "stop"
        assert at_eos[-1].completion_tokens == 5  # the eos is generated, not returned
        assert text_of(at_eos) == llama.tokenizer.decode(chain[2:-1])
        at_string = harness.ask(request(llama, chain[:2], 20, stop=("brown f",), temperature=0))
        assert text_of(at_string) == "quick " and at_string[-1].finish_reason == "stop"
        assert tokens_of(at_string) == chain[2:5]  # up to the token that completed the string
        at_limit = harness.ask(request(llama, chain[:2], 3, temperature=0))
        assert tokens_of(at_limit) == chain[2:5] and at_limit[-1].finish_reason == "length"
        no_eos_yet = harness.ask(request(llama, chain[:2], 7, min_gen_len=6, temperature=0))
        assert len(tokens_of(no_eos_yet)) == 7 and no_eos_yet[-1].finish_reason == "length"
        assert 2 not in tokens_of(no_eos_yet)[:6]
    finally:
        harness.close()


def _serve_on_two_ranks(checkpoint: str) -> list[list[int]]:
    """Rank 0 submits requests while every rank runs the engine; rank 1 asks to stop at the end."""
    llama = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=3)
    rank = torch.distributed.get_rank()
    if rank == 0:
        harness = Harness(llama, start=False)
        streams = [harness.submit(request(llama, prompt, 8, temperature=0)) for prompt in PROMPTS]
        harness.thread.start()
        answers = [tokens_of(harness.deltas(stream)) for stream in streams]
        harness.close()
        return answers
    from llama_tp.serve.server import engine_loop  # the other ranks have no mailbox

    engine_loop(llama, 16, None).run(lambda: False)  # ends when rank 0 stops
    return []


@pytest.mark.slow
def test_two_ranks_serve_what_one_process_generates(llama, tmp_path):
    write_checkpoint(tmp_path, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    answers = run_world(2, _serve_on_two_ranks, str(tmp_path))[0]
    assert answers == [llama.generate([prompt], max_gen_len=8, temperature=0)[0][0] for prompt in PROMPTS]
