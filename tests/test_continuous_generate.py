"""generate with more prompts than cache rows runs them through continuous batching: each prompt
gets exactly the answer it gets alone (greedy, and sampled with its own seed), on one process and
on two, however long its prompt and its answer."""

import pytest

from distributed import run_world
from llama_tp import Llama
from llama_tp.engine import prompt_seed
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# 9 prompts on 3 rows, of 2 to 90 tokens.
PROMPTS = [[1, 450, 4996, 17354], [1, 306, 4658] * 30, [1, 450], [1, 18637, 29892, 920, 29871, 13] * 8,
           [1, 1724, 338, 278, 7483, 310, 3444, 29973], [1, 15043] * 20, [1, 3869, 526], [1, 29871] * 40,
           [1, 450, 4996]]
MAX_GEN_LEN = 24
SAMPLED = dict(temperature=1.0, top_p=0.95, top_k=50)


def build(checkpoint: str) -> Llama:
    return Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=128, max_batch_size=3)


def end_early(llama: Llama) -> None:
    """Make the answers end at different steps: stop at tokens that greedy answers meet at
    different positions (random weights rarely choose the real end of text)."""
    answers, _ = llama.generate(PROMPTS, MAX_GEN_LEN, temperature=0)
    llama.tokenizer.stop_tokens = {answers[0][3], answers[2][11], answers[4][17]}


def each_alone(llama: Llama) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy and sampled answers, each prompt in a call of its own (seeded as its place in the call)."""
    greedy = [llama.generate([prompt], MAX_GEN_LEN, temperature=0)[0][0] for prompt in PROMPTS]
    sampled = [llama.generate([prompt], MAX_GEN_LEN, seed=prompt_seed(7, index), **SAMPLED)[0][0]
               for index, prompt in enumerate(PROMPTS)]
    return greedy, sampled


def together(llama: Llama) -> tuple[list[list[int]], list[list[int]]]:
    return (llama.generate(PROMPTS, MAX_GEN_LEN, temperature=0)[0],
            llama.generate(PROMPTS, MAX_GEN_LEN, seed=7, **SAMPLED)[0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return str(directory)


@pytest.fixture(scope="module")
def llama(checkpoint) -> Llama:
    llama = build(checkpoint)
    end_early(llama)
    return llama


def test_each_prompt_gets_its_answer_alone_whatever_shares_its_rows(llama):
    passes = []
    forward = llama.model.forward

    def noting(tokens, start_pos, *args, **kwargs):
        passes.append(start_pos)
        return forward(tokens, start_pos, *args, **kwargs)

    llama.model.forward = noting
    try:
        greedy, sampled = together(llama)
    finally:
        llama.model.forward = forward
    # Rows at different positions in one pass: a row took a new prompt while others went on.
    assert any(isinstance(starts, list) and len(set(starts)) > 1 for starts in passes)
    lengths = {len(answer) for answer in greedy}
    assert len(lengths) >= 3 and max(lengths) == MAX_GEN_LEN  # answers of very different lengths
    alone_greedy, alone_sampled = each_alone(llama)
    assert greedy == alone_greedy
    assert sampled == alone_sampled
    assert sampled != llama.generate(PROMPTS, MAX_GEN_LEN, seed=8, **SAMPLED)[0]


def test_results_come_as_each_prompt_ends_and_are_returned_in_order(llama):
    texts = ["Once upon a time", "The capital of France is the city of" * 6, "Hello"] * 2
    seen = []
    results = llama.text_completion(texts, max_gen_len=MAX_GEN_LEN, temperature=0, token_ids=True,
                                    on_result=lambda index, result: seen.append((index, result)))
    assert sorted(index for index, _ in seen) == list(range(len(texts)))
    assert [result for _, result in sorted(seen, key=lambda pair: pair[0])] == results
    assert results == [llama.text_completion([text], max_gen_len=MAX_GEN_LEN, temperature=0, token_ids=True)[0]
                       for text in texts]


def test_a_list_of_seeds_gives_each_prompt_its_own(llama):
    """What a resumed job passes: the seeds of the prompts' places in the whole job."""
    whole, _ = llama.generate(PROMPTS, MAX_GEN_LEN, seed=7, **SAMPLED)
    rest, _ = llama.generate(PROMPTS[4:], MAX_GEN_LEN, seed=[prompt_seed(7, i) for i in range(4, len(PROMPTS))],
                             **SAMPLED)
    assert rest == whole[4:]
    with pytest.raises(ValueError, match="one integer per prompt"):
        llama.generate(PROMPTS, MAX_GEN_LEN, seed=[1, 2], **SAMPLED)


def _on_two_ranks(checkpoint: str, stop_tokens: set[int]) -> tuple:
    llama = build(checkpoint)
    llama.tokenizer.stop_tokens = stop_tokens
    return together(llama)


@pytest.mark.slow  # two spawned processes
def test_two_ranks_batch_as_each_prompt_alone_on_one(llama, tmp_path):
    write_checkpoint(tmp_path, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 2, "dim")
    greedy, sampled = run_world(2, _on_two_ranks, str(tmp_path), llama.tokenizer.stop_tokens)[0]
    alone_greedy, alone_sampled = each_alone(llama)
    assert greedy == alone_greedy
    assert sampled == alone_sampled
