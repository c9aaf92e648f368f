"""text_completion with echo=True: the prompt comes back whole, and a stop string cuts only what
follows it (one inside the prompt does not count)."""

import pytest

from llama_tp import Llama
from tiny_checkpoint import LLAMA2_TOKENIZER
from torchrun import one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Hello world, said the fox to the"


@pytest.fixture(scope="module")
def llama(checkpoints) -> Llama:
    return Llama.build(str(checkpoints["llama2", 1]), str(LLAMA2_TOKENIZER), max_seq_len=48, max_batch_size=1)


def echoed_text(llama: Llama) -> tuple[str, int]:
    """The prompt and its greedy answer of 12 tokens as one text, and where the answer starts in it."""
    prompt = llama.tokenizer.encode(PROMPT, bos=True, eos=False)
    answer, _ = llama.generate([prompt], max_gen_len=12, temperature=0)
    return llama.tokenizer.decode(prompt + answer[0]), len(llama.tokenizer.decode(prompt))


def test_a_stop_string_inside_the_prompt_does_not_cut(llama):
    full, start = echoed_text(llama)
    assert "fox" not in full[start:], full  # the stop string is in the prompt alone
    result = llama.text_completion([PROMPT], max_gen_len=12, temperature=0, echo=True, stop=["fox"])
    assert result[0]["generation"] == full
    plain = llama.text_completion([PROMPT], max_gen_len=12, temperature=0, stop=["fox"])
    assert plain[0]["generation"] == full[start:]


def test_a_stop_string_in_the_answer_cuts_there(llama):
    full, start = echoed_text(llama)
    stop = full[start + 4:start + 7]
    assert stop.strip() and stop not in full[:start + 4], full
    result = llama.text_completion([PROMPT], max_gen_len=12, temperature=0, echo=True, stop=[stop])
    assert result[0]["generation"] == full[:full.index(stop, start)]
