"""Reusing what the KV cache already holds: the record of each row, a conversation's turns through
the API, and requests sharing a system prompt through the serving engine (full blocks of the
cache, shared: engine/blocks.py), with the same results as without reuse."""

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.model.kv_cache import BLOCK_POSITIONS
from llama_tp.model.prefix_cache import PrefixCache, common_length
from serve_harness import Harness, request, tokens_of
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, TINY_LLAMA3, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_longest_held_start_short_of_the_last_token_is_reused():
    cache = PrefixCache(3)
    cache.extend(0, 0, [1, 5, 6, 7])
    cache.extend(1, 0, [1, 5, 9])
    assert cache.reusable(0, [1, 5, 6, 7, 8]) == 4
    assert cache.reusable(0, [1, 5, 6, 7]) == 3  # the last prompt token is fed again for its logits
    assert cache.reusable(1, [1, 5, 6, 7, 8]) == 2 and cache.reusable(2, [1, 5]) == 0
    cache.extend(1, 5, [4])  # a gap after position 3: the record cannot hold it
    assert cache.rows[1] == [1, 5, 9]
    cache.keep(0, 2)  # a pass writes row 0 from position 2 on
    assert cache.rows[0] == [1, 5]
    assert PrefixCache(1, enabled=False).reusable(0, [1, 2]) == 0


@pytest.mark.parametrize("a, b, shared", [([1, 2, 3], [4, 2, 3], 0), ([1, 2, 3], [1, 2, 4], 2),
                                          ([1, 2, 3, 4, 5], [1, 9, 3, 4, 5], 1), ([], [1], 0), ([1, 2], [1, 2, 3], 2)])
def test_common_length(a, b, shared):
    assert common_length(a, b) == shared


@pytest.fixture(scope="module", params=["llama2", "llama3"])  # our attention kernel, and torch's
def llama(request, tmp_path_factory) -> Llama:
    params, layout = (TINY_LLAMA2, "dim") if request.param == "llama2" else (TINY_LLAMA3, "vocab")
    directory = tmp_path_factory.mktemp(request.param)
    write_checkpoint(directory, params, full_weights(params, 32000), 1, layout)
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=160, max_batch_size=2)


def conversation(llama: Llama, reuse: bool, turns: int = 4) -> tuple[list[list[float]], list[int], list[int]]:
    """A greedy chat of `turns` turns, each sending the whole dialog again: each answer's log
    probabilities, where each turn's first pass began, and each turn's prompt length."""
    starts, logprobs = [], []
    forward = llama.model.forward

    def noting(tokens, start_pos, *args, **kwargs):
        starts.append(start_pos[0] if isinstance(start_pos, list) else start_pos)  # the engine's: one a row
        return forward(tokens, start_pos, *args, **kwargs)

    llama.model.forward = noting
    llama.forget_prefixes()
    llama.model.prefix_cache.enabled = reuse
    dialog, first_starts, lengths = [], [], []
    try:
        for turn in range(turns):
            dialog.append({"role": "user", "content": f"Question {turn}: tell me about the number {turn * 7}."})
            lengths.append(len(llama.formatter.encode_dialog_prompt(dialog)))
            before = len(starts)
            result = llama.chat_completion([dialog], temperature=0, max_gen_len=12, logprobs=True)[0]
            first_starts.append(starts[before])
            logprobs.append(result["logprobs"])
            dialog.append(result["generation"])
    finally:
        llama.model.forward = forward
        llama.model.prefix_cache.enabled = True
    return logprobs, first_starts, lengths


def test_a_conversation_reuses_its_history_with_the_same_results(llama):
    reused, starts, lengths = conversation(llama, reuse=True)
    fresh, fresh_starts, _ = conversation(llama, reuse=False)
    assert fresh_starts == [0, 0, 0, 0]
    assert starts[0] == 0 and starts[-1] > 0 and followed_on(starts, lengths)
    for turn_reused, turn_fresh in zip(reused, fresh):
        assert len(turn_reused) == len(turn_fresh)  # the same tokens (the answers are in the dialog)
        assert turn_reused == pytest.approx(turn_fresh, abs=1e-5)  # within fp32 rounding


def followed_on(starts: list[int], lengths: list[int]) -> bool:
    """Whether each turn fed no more than what follows the full blocks of the turn before's prompt
    (the answer's tokens may be re-encoded apart; a block filled since may hold more of the start)."""
    return all(start >= length // BLOCK_POSITIONS * BLOCK_POSITIONS for start, length in zip(starts[1:], lengths))


def test_a_batch_reuses_what_every_row_shares(llama):
    llama.forget_prefixes()
    prompts = [[1, 450, 4996, 17354, 1701], [1, 450, 4996, 306, 4658, 29892]]
    first, _ = llama.generate(prompts, max_gen_len=4, temperature=0)
    again = [prompts[0] + first[0] + [29871], prompts[1] + first[1][:2]]
    reused, _ = llama.generate(again, max_gen_len=5, temperature=0)
    llama.forget_prefixes()
    fresh, _ = llama.generate(again, max_gen_len=5, temperature=0)
    assert reused == fresh


@contextmanager
def serving(llama: Llama, reuse: bool) -> Iterator[Harness]:
    """An engine serving llama from an empty cache, reusing prompts or not."""
    llama.forget_prefixes()
    llama.model.prefix_cache.enabled = reuse
    harness = Harness(llama, max_prefill_tokens=32)
    try:
        yield harness
    finally:
        harness.close()
        llama.model.prefix_cache.enabled = True


SYSTEM = [1] + list(range(1000, 1128))  # 129 tokens every request begins with: two full blocks and one


def test_serving_reuses_a_shared_system_prompt_with_the_same_tokens(llama):
    prompts = [SYSTEM + [450 + i, 4996, 17354 + i] for i in range(5)]
    answers = {}
    for reuse in (True, False):
        with serving(llama, reuse) as harness:
            answers[reuse] = [harness.ask(request(llama, prompt, 8, temperature=0)) for prompt in prompts]
            cached = harness.mailbox.metrics.cached_prompt_tokens._value.get()
        shared = 2 * BLOCK_POSITIONS
        assert [deltas[-1].cached_tokens for deltas in answers[reuse]] == ([0] + [shared] * 4 if reuse else [0] * 5)
        assert cached == (4 * shared if reuse else 0)
    assert [tokens_of(d) for d in answers[True]] == [tokens_of(d) for d in answers[False]]


def test_serving_copies_a_system_turn_shorter_than_a_block_with_the_same_tokens(llama):
    """The first answer fills the first block; each later request copies the system turn from the
    block before it, and feeds only its own question."""
    system = [1] + list(range(2000, 2059))  # 60 tokens: no full block
    prompts = [system + [450 + i, 4996, 17354 + i] for i in range(4)]
    answers = {}
    for reuse in (True, False):
        with serving(llama, reuse) as harness:
            answers[reuse] = [harness.ask(request(llama, prompt, 8, temperature=0)) for prompt in prompts]
        assert all(len(tokens_of(deltas)) == 8 for deltas in answers[reuse])  # the first fills its block
        assert [deltas[-1].cached_tokens for deltas in answers[reuse]] == ([0] + [len(system)] * 3 if reuse else [0] * 4)
    assert [tokens_of(d) for d in answers[True]] == [tokens_of(d) for d in answers[False]]


def test_a_request_shares_the_blocks_a_running_one_filled_with_the_same_tokens(llama):
    """The second request holds the system prompt's full blocks with the first, which still runs."""
    answers = {}
    for reuse in (True, False):
        with serving(llama, reuse) as harness:
            running = harness.submit(request(llama, SYSTEM + [450, 4996, 17354], 80, temperature=0))
            first = harness.deltas(running, count=1)  # prefilled: its row holds the system prompt
            second = harness.ask(request(llama, SYSTEM + [306, 4658], 8, temperature=0))
            answers[reuse] = [tokens_of(first + harness.deltas(running)), tokens_of(second)]
        assert second[-1].cached_tokens == (2 * BLOCK_POSITIONS if reuse else 0)
    assert answers[True] == answers[False]


def _conversation_on_two_ranks(checkpoint: str) -> tuple[list[list[float]], list[int], list[int]]:
    llama = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=160, max_batch_size=2)
    return conversation(llama, reuse=True)


@pytest.mark.slow
def test_two_ranks_reuse_a_conversation_as_one_process_does(tmp_path):
    write_checkpoint(tmp_path / "mp1", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    write_checkpoint(tmp_path / "mp2", TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    one = Llama.build(str(tmp_path / "mp1"), str(LLAMA2_TOKENIZER), max_seq_len=160, max_batch_size=2)
    fresh, _, _ = conversation(one, reuse=False)
    for logprobs, starts, lengths in run_world(2, _conversation_on_two_ranks, str(tmp_path / "mp2")):
        assert followed_on(starts, lengths)
        for turn, expected in zip(logprobs, fresh):
            assert turn == pytest.approx(expected, abs=1e-5)
