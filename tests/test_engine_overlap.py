"""A step's tokens reported while the device runs the next step (Engine.overlap, a GPU's default):
every request gets the deltas of an engine that reports each token at once, however it ends (its
length, a stop token, a stop string found in its text after it was fed once more, a cancelled
client, a preemption), greedy, seeded sampled and beam search, alone and in a batch. On a CPU the model's pass
has run by the time the report comes, so these tests check the order of things, not the timing."""

import pytest

from llama_tp import Llama
from llama_tp.engine import Admission, Engine, GenerationRequest, run_job
from llama_tp.engine.requests import BeamSearch, Delta
from llama_tp.sampling import SamplingOptions
from serve_harness import request
from test_preemption import with_pool
from test_serve_engine import PROMPTS
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=3)


def deltas_by_request(llama: Llama, requests: list, overlap: bool) -> list[list[Delta]]:
    """Each request's deltas, in order, through one engine (run_job: more requests than rows)."""
    return run(engine_of(llama, overlap), requests)


def engine_of(llama: Llama, overlap: bool) -> Engine:
    engine = llama.engine(16, text=True)
    engine.overlap = overlap
    return engine


def run(engine: Engine, requests: list) -> list[list[Delta]]:
    """Each request's deltas, from a cache that holds no earlier run's prompts: a start copied from
    another run's blocks was computed in another pass, which without our kernels (torch's products
    depend on the rows beside) differs by fp32's rounding, which a sampled token may not survive."""
    engine.scheduler.pool.forget()
    found: dict[str, list[Delta]] = {each.id: [] for each, _ in requests}
    for updates in run_job(engine, requests):
        for update in updates:
            found[update.sequence.request.id].append(update.delta)
    return [found[each.id] for each, _ in requests]


def same_deltas(overlapped: list[list[Delta]], at_once: list[list[Delta]]) -> None:
    """Tokens, text pieces, ends and counts equal; log probabilities to float rounding (a row's
    products may see other rows beside it)."""
    for ours, theirs in zip(overlapped, at_once):
        assert [(d.text, d.tokens, d.finish_reason, d.prompt_tokens, d.completion_tokens, d.stop_string)
                for d in ours] == [(d.text, d.tokens, d.finish_reason, d.prompt_tokens, d.completion_tokens,
                                    d.stop_string) for d in theirs]
        ours_lp = [lp for d in ours for lp in d.logprobs]
        theirs_lp = [lp for d in theirs for lp in d.logprobs]
        assert [lp.token for lp in ours_lp] == [lp.token for lp in theirs_lp]
        assert [lp.logprob for lp in ours_lp] == pytest.approx([lp.logprob for lp in theirs_lp], abs=1e-5)


def test_greedy_sampled_logprobs_and_limits_as_reported_at_once(llama):
    requests = []
    for index, prompt in enumerate(PROMPTS):
        options = dict(temperature=0) if index % 2 else dict(temperature=0.9, top_p=0.9)
        requests.append((request(llama, prompt, 6 + 3 * index, logprobs=index == 4, top_logprobs=2 if index == 4 else 0,
                                 **options), 100 + index))
    at_once = deltas_by_request(llama, requests, overlap=False)
    assert all(deltas[-1].finish_reason in ("length", "stop") for deltas in at_once)
    same_deltas(deltas_by_request(llama, requests, overlap=True), at_once)


def test_a_stop_string_ends_the_answer_where_it_ends_at_once(llama):
    """The stop string is found in a token's text after the next step has fed that token: the
    step's token for it is dropped, and the answer ends where it would have."""
    plain = [(request(llama, prompt, 24, temperature=0), 0) for prompt in PROMPTS[:3]]
    texts = ["".join(d.text for d in deltas) for deltas in deltas_by_request(llama, plain, overlap=False)]
    stops = [text[len(text) // 3 : len(text) // 3 + 3] for text in texts]  # found a third of the way in
    requests = [(request(llama, prompt, 24, stop=(stop,), temperature=0), 0) for prompt, stop in zip(PROMPTS, stops)]
    at_once = deltas_by_request(llama, requests, overlap=False)
    assert [deltas[-1].stop_string for deltas in at_once] == stops
    overlapped = deltas_by_request(llama, requests, overlap=True)
    same_deltas(overlapped, at_once)


def test_reports_come_a_step_later_and_a_cancel_reports_what_was_made(llama):
    """Overlapping, a step returns the tokens of the step before (the first step, prefilling and
    choosing the first token, returns none); cancelling reports the last token, then the end."""
    engine = engine_of(llama, overlap=True)
    each = request(llama, PROMPTS[0], 20, temperature=0)
    engine.admit(Admission(each, engine.choose_slot(each.prompt_tokens, set()), 0))
    assert engine.step() == []  # its first token is made, not yet reported
    first = engine.step()  # the second is made; the first reported
    assert [len(update.delta.tokens) for update in first] == [1]
    assert len(engine.running[0].tokens) == len(PROMPTS[0]) + 2
    ended = engine.cancel(each.id)
    assert [update.delta.finish_reason for update in ended] == [None, "cancelled"]
    assert ended[-1].delta.completion_tokens == 2 and not engine.running


def test_preempted_requests_answer_as_reported_at_once(llama):
    """A pool of four blocks for three rows of answers that grow into a second block: the newest
    is preempted and fed again, with reports overlapping and at once alike. (Both runs preempt:
    whether a preempted answer equals the one it would have had alone is test_preemption's, and
    holds bit for bit only where products are the same whatever the rows beside, our kernels'.)"""
    prompts = [[1] + [450 + 37 * row + column for column in range(40)] for row in range(3)]
    requests = [(request(llama, prompt, 60, min_gen_len=60, temperature=0.8), 7 + index)
                for index, prompt in enumerate(prompts)]
    blocks = llama.model.cache_blocks
    with_pool(llama, 4)
    try:
        engines = {overlap: engine_of(llama, overlap) for overlap in (False, True)}
        at_once, overlapped = (run(engines[overlap], requests) for overlap in (False, True))
        assert engines[True].scheduler.preemptions == engines[False].scheduler.preemptions > 0
    finally:
        with_pool(llama, blocks)
    same_deltas(overlapped, at_once)


def test_a_beam_search_beside_overlapped_reports_answers_as_at_once(llama):
    """A search's beams are chosen and forked inside the step (beams.py), beside rows whose reports
    wait for the next step: every answer, the search's beams too, is the one reported at once."""
    search = GenerationRequest("beams", tuple(PROMPTS[4]), 12, SamplingOptions(), frozenset(llama.tokenizer.stop_tokens),
                               beams=BeamSearch(2, returned=2))
    requests = [(request(llama, PROMPTS[0], 12, temperature=0.8), 1), (search, 2),
                (request(llama, PROMPTS[2], 12, temperature=0), 3)]
    at_once = deltas_by_request(llama, requests, overlap=False)
    overlapped = deltas_by_request(llama, requests, overlap=True)
    same_deltas(overlapped, at_once)
    assert [[beam.tokens for beam in deltas[-1].beams] for deltas in overlapped] == \
           [[beam.tokens for beam in deltas[-1].beams] for deltas in at_once]
    assert len(overlapped[1][-1].beams) == 2
