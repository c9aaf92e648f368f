"""bad_words (structured/bad_words.py): each word banned in every way it is tokenized, its last
token only where the tokens before complete the rest of it; applied with the step's other rules,
on every path (sampled, greedy on vocabulary slices, beam search), and changing nothing where
the words cannot occur. A tiny model built to say "the darn dog" keeps saying it without the ban."""

import re

import pytest
import torch

from llama_tp import Llama
from llama_tp.engine import GenerationRequest, run_job
from llama_tp.engine.requests import BeamSearch
from llama_tp.model.args import ModelArgs
from llama_tp.sampling import SamplingOptions
from llama_tp.structured.bad_words import banned_next, word_sequences
from llama_tp.structured.rows import RowAdjustment, adjust_rows
from llama_tp.text.tokenizer import load_tokenizer
from llama_tp.tools.bench.hf import build_hf_model
from test_beam_search import sharp_weights
from tiny_checkpoint import LLAMA2_TOKENIZER, SHARED_DATA, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

VOCAB, END = 32000, 2
# Llama 2's pieces of "the darn dog day" (the darn: "▁d" "arn"), and "d" glued to what comes before
THE, D, ARN, DOG, DAY, GLUED_D = 278, 270, 2753, 11203, 2462, 29881
SAMPLED = dict(temperature=1.0, top_p=1.0)


def test_each_word_is_banned_as_it_is_tokenized_glued_and_after_a_space(llama2_tokenizer):
    assert word_sequences(llama2_tokenizer, ["darn", " dog "]) == ((GLUED_D, ARN), (D, ARN), (26169,), (DOG,))
    llama3 = load_tokenizer(str(SHARED_DATA / "llama3-tokenizer.model"))
    assert word_sequences(llama3, ["darn"]) == ((67, 1923), (74777,))  # " darn" is one token of Llama 3's
    with pytest.raises(ValueError, match=r"bad_words\[1\] must be a word or phrase, found ' '"):
        word_sequences(llama2_tokenizer, ["darn", " "])


def test_a_words_last_token_is_banned_where_the_tokens_before_complete_it():
    words = ((D, ARN), (DOG,), (1, 2, 3))
    assert banned_next([THE], words) == [DOG]  # one token: always
    assert banned_next([THE, D], words) == [ARN, DOG]
    assert banned_next([1, 2], words) == [DOG, 3]
    assert banned_next([2], words) == [DOG]
    assert banned_next([], words) == [DOG]


def test_bans_apply_to_a_ranks_slice_of_the_vocabulary():
    logits = torch.zeros(2, 8)
    rows = [RowAdjustment(bad_words=((5, 12), (9,))), None]
    # vocabulary 16, this rank's half from token 8: row 0 ends with 5, so 12 (column 4) and 9 (column 1) go
    adjusted = adjust_rows(rows, logits, vocab_start=8, vocab_size=16, tokens=[[1, 5], [5]])
    assert adjusted[0].tolist() == [0, float("-inf"), 0, 0, float("-inf"), 0, 0, 0] and adjusted[1].tolist() == [0] * 8


def follower_weights(followers: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """A model whose next token after t is one of followers[t], each as likely (as
    tiny_checkpoint.successor_weights, with several successors): every layer's output zero, so each
    position's state is its own token's embedding; each follower's output row points along it."""
    weights = full_weights(TINY_LLAMA2, VOCAB)
    for name in weights:
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    embeddings = weights["tok_embeddings.weight"].float()
    output = torch.zeros_like(embeddings)
    for token, following in followers.items():
        for follower in following:
            output[follower] += 4.0 * embeddings[token] / embeddings[token].norm()
    weights["output.weight"] = output.to(torch.bfloat16)
    return weights


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    """'the' is followed by 'darn', 'dog' or 'day' alike, and each of them by 'the' again."""
    weights = follower_weights({1: [THE], THE: [D, DOG, DAY], D: [ARN], ARN: [THE], DOG: [THE], DAY: [THE]})
    folder = write_checkpoint(tmp_path_factory.mktemp("darn"), TINY_LLAMA2, weights, 1, "dim")
    return Llama.build(str(folder), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=8)


def said(llama: Llama, answers: list[list[int]], word: str) -> int:
    """How many answers hold word as a word of their text."""
    return sum(bool(re.search(rf"\b{word}\b", llama.tokenizer.decode(answer))) for answer in answers)


@pytest.mark.usefixtures("one_thread")
def test_banned_words_stay_out_of_every_sampled_answer(llama):
    prompts = [[1, THE]] * 200
    free, _ = llama.generate(prompts, 16, seed=3, **SAMPLED)
    assert said(llama, free, "darn") > 150 and said(llama, free, "dog") > 150  # the model's favourite words
    banned, _ = llama.generate(prompts, 16, seed=3, bad_words=["darn", "dog"], **SAMPLED)
    assert said(llama, banned, "darn") == said(llama, banned, "dog") == 0
    assert not any(token in (DOG, 26169) for answer in banned for token in answer)
    assert not any(answer[index:index + 2] in ([D, ARN], [GLUED_D, ARN]) for answer in banned
                   for index in range(len(answer)))
    # the word's first token is no word of its own: it stays, followed by anything but the rest (the
    # model knows no follower for what comes then: its answer wanders off), and 'day' is still said
    assert sum(D in answer for answer in banned) > 100 and said(llama, banned, "day") > 100
    # greedy, on vocabulary slices: 'the' is followed by 'darn' (the first of the three)
    greedy, _ = llama.generate([[1, THE]], 8, temperature=0)
    greedy_banned, _ = llama.generate([[1, THE]], 8, temperature=0, bad_words=["darn"])
    assert greedy[0][:2] == [D, ARN] and said(llama, greedy_banned, "darn") == 0


@pytest.mark.usefixtures("one_thread")
def test_words_that_cannot_occur_change_nothing(llama):
    prompts = [[1, THE], [1, DAY, THE]] * 8
    for options in (SAMPLED | {"seed": 5}, {"temperature": 0}):
        free, _ = llama.generate(prompts, 16, **options)
        banned, _ = llama.generate(prompts, 16, bad_words=["zebra", "crossing guard"], **options)
        assert banned == free


@pytest.fixture(scope="module")
def sharp(tmp_path_factory) -> tuple[Llama, torch.nn.Module]:
    """test_beam_search's sharp tiny model, ours and transformers'."""
    weights = sharp_weights()
    folder = write_checkpoint(tmp_path_factory.mktemp("sharp"), TINY_LLAMA2, weights, 1, "dim")
    llama = Llama.build(str(folder), str(LLAMA2_TOKENIZER), max_seq_len=64, max_batch_size=4)
    args = ModelArgs.from_dict(TINY_LLAMA2).with_vocab_size(VOCAB)
    return llama, build_hf_model({name: tensor.float() for name, tensor in weights.items()}, args, 64, torch.float32)


@pytest.mark.usefixtures("one_thread")
def test_beam_search_bans_words_as_transformers_bad_words_ids(sharp):
    """Banned words' tokens go to -inf among the log probabilities, as transformers' NoBadWordsLogitsProcessor
    sets them in beam search: the same beams, none holding the words."""
    llama, model = sharp
    prompt = [1, 450, 4996, 17354, 1701, 29916]
    search = BeamSearch(4, returned=4)

    def ours(words: tuple) -> list[list[int]]:
        request = GenerationRequest("0", tuple(prompt), 16, SamplingOptions(), frozenset({END}), bad_words=words,
                                    beams=search)
        updates = [update for step in run_job(llama.engine(), [(request, 0)]) for update in step]
        return [list(beam.tokens) for beam in updates[-1].delta.beams]

    free = ours(())
    words = ((free[0][2],), tuple(free[1][4:6]))  # a token of the best beam, two of the second's
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=16, num_beams=4, num_return_sequences=4, do_sample=False,
                             eos_token_id=[END], pad_token_id=0, bad_words_ids=[list(word) for word in words])
    theirs = [row[len(prompt):].tolist() for row in out]
    theirs = [answer[: answer.index(END)] if END in answer else answer for answer in theirs]
    banned = ours(words)
    assert banned == theirs and banned != free
    assert not any(answer[index:index + len(word)] == list(word) for answer in banned for word in words
                   for index in range(len(answer)))


def test_no_words_ask_nothing_of_the_tokenizer():
    """generate() without bad_words on a model whose tokenizer only decodes (the benchmarks' stand-in)."""
    assert word_sequences(object(), ()) == ()
