"""Python's logits processors (sampling/processors.py): run on rank 0 before each choice, whose
tokens the other ranks take; a processor that forces a sequence gets exactly it, sampled, greedy
or in beam search, at world sizes 1 and 2."""

import pytest
import torch

from distributed import run_world
from llama_tp import Llama
from llama_tp.sampling.processors import check_processors
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

END = 2
FORCED = [450, 4996, 17354, 1701, 29916, 432, 17204, END]  # "The quick brown fox jumps", then the end of text
PROMPTS = [[1, 306, 4658], [1, 15043, 29892, 920, 29871, 13] * 3]


class Forcing:
    """Makes every answer FORCED: all but its next token at -inf. Counts its calls (rank 0 alone calls it)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        forced = torch.full_like(logits, float("-inf"))
        forced[FORCED[len(generated)] if len(generated) < len(FORCED) else END] = 0.0  # (beam search's other beams go on)
        return forced


def forced_answers(llama: Llama) -> tuple[dict, int]:
    forcing = Forcing()
    prompt_lengths = []

    def sees_the_prompt(prompt: list[int], generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        prompt_lengths.append(len(prompt))
        return logits

    answers = {
        "sampled": llama.generate(PROMPTS, 20, temperature=1.0, seed=3, logits_processors=[sees_the_prompt, forcing])[0],
        "greedy": llama.generate(PROMPTS, 20, temperature=0, logits_processors=[forcing])[0],
        "beams": llama.generate(PROMPTS[:1], 20, num_beams=2, num_return_sequences=1, logits_processors=[forcing])[0],
        "text": [result["generation"] for result in llama.text_completion(["Hello"], max_gen_len=20,
                                                                            logits_processors=[forcing])],
        "prompt lengths": sorted(set(prompt_lengths)),
    }
    return answers, forcing.calls


def expected_answers(llama: Llama) -> dict:
    answer = FORCED[:-1]
    return {"sampled": [answer] * 2, "greedy": [answer] * 2, "beams": [answer],
            "text": [llama.tokenizer.decode(answer)], "prompt lengths": sorted({len(prompt) for prompt in PROMPTS})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[int, str]:
    root, weights = tmp_path_factory.mktemp("processors"), full_weights(TINY_LLAMA2, 32000)
    return {shards: str(write_checkpoint(root / f"mp{shards}", TINY_LLAMA2, weights, shards, "dim")) for shards in (1, 2)}


def test_a_processor_that_forces_a_sequence_gets_it(folders):
    llama = Llama.build(folders[1], str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4)
    answers, calls = forced_answers(llama)
    assert answers == expected_answers(llama)
    assert calls > 0
    free, _ = llama.generate(PROMPTS, 8, temperature=0)
    assert free[0] != FORCED[:8]  # the model alone says something else


def _on_two_ranks(folder: str) -> tuple[dict, int, dict]:
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4)
    answers, calls = forced_answers(llama)
    return answers, calls, expected_answers(llama)


@pytest.mark.slow  # two spawned processes
def test_two_ranks_take_rank_zeros_forced_sequence(folders):
    (answers, calls, expected), (other_answers, other_calls, _) = run_world(2, _on_two_ranks, folders[2])
    assert answers == expected
    # rank 1 never called them: it took rank 0's tokens
    assert other_answers == answers | {"prompt lengths": []} and calls > 0 and other_calls == 0


def test_what_is_not_a_processor_is_refused():
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        check_processors(len)
    with pytest.raises(ValueError, match=r"logits_processors\[1\] must be a callable"):
        check_processors([lambda ids, logits: logits, 3])
    with pytest.raises(ValueError, match=r"logits_processors\[0\] must take \(generated token ids, logits\)"):
        check_processors([lambda logits: logits])
    assert check_processors([lambda *arguments: arguments[-1], lambda prompt, ids, logits: logits])
