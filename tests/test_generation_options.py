"""Generation options beyond Meta's: top_k, repetition_penalty, stop, min_gen_len, seed, show_top."""

import math

import pytest
import torch
from scipy.stats import chi2
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper

from llama_tp import Llama
from llama_tp.sampling import SamplingOptions, adjust_logits, choose_next, distribution
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint
from torchrun import one_thread  # noqa: F401  (a fixture)

PROMPTS = ["The quick brown fox", "Über den Wolken"]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Llama:
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_LLAMA2, full_weights(TINY_LLAMA2, 32000), 1, "dim")
    return Llama.build(str(directory), str(LLAMA2_TOKENIZER), max_seq_len=48, max_batch_size=2)


def meta_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """What meta-llama/llama's generation.py samples from (verbatim in substance), in vocabulary order."""
    probs = torch.softmax(logits / temperature, dim=-1)
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[probs_sum - probs_sort > top_p] = 0.0
    probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
    return torch.zeros_like(probs).scatter_(-1, probs_idx, probs_sort)


def test_defaults_sample_from_metas_distribution():
    """The same distribution; not the same draws: Meta sorts the vocabulary and calls
    torch.multinomial, ours takes one uniform a row (docs/serving.md, Sampling)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    expected = meta_distribution(logits, 0.6, 0.9)
    assert torch.allclose(distribution(logits, SamplingOptions()), expected, atol=1e-6)
    draws = choose_next(logits[1].repeat(20_000, 1), SamplingOptions(), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=40).double()
    kept = expected[1] > 0
    assert counts[~kept].sum() == 0
    wanted = expected[1][kept].double() * len(draws)
    statistic = float(((counts[kept] - wanted) ** 2 / wanted).sum())
    assert chi2.sf(statistic, int(kept.sum()) - 1) > 1e-3


def test_repetition_penalty_and_top_k_match_transformers():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 300, generator=generator) * 4
    history = torch.randint(0, 300, (2, 12), generator=generator)
    ours = adjust_logits(logits, SamplingOptions(repetition_penalty=1.3), history)
    assert torch.allclose(ours, RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone()))
    # top-k: every sample lies in the k best of the penalised, tempered logits, as transformers keeps them.
    options = SamplingOptions(temperature=1.0, top_p=1.0, top_k=5, repetition_penalty=1.3)
    kept = TopKLogitsWarper(5)(history, ours.clone()) > float("-inf")
    samples = torch.stack([choose_next(logits, options, history) for _ in range(200)])  # 200, bsz
    assert bool(kept.gather(1, samples.T).all())
    assert len(set(samples[:, 0].tolist())) > 1  # it still samples


def test_top_k_one_is_greedy(llama):
    greedy = llama.text_completion(PROMPTS, temperature=0, max_gen_len=12)
    top1 = llama.text_completion(PROMPTS, temperature=1.5, top_p=1.0, top_k=1, max_gen_len=12)
    assert greedy == top1


def test_seed_makes_a_call_reproducible_without_touching_the_global_generator(llama):
    tokens = [llama.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, _ = llama.generate(tokens, 8, temperature=1.0, top_p=1.0, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    again, _ = llama.generate(tokens, 8, temperature=1.0, top_p=1.0, seed=7)
    other, _ = llama.generate(tokens, 8, temperature=1.0, top_p=1.0, seed=8)
    assert first == again != other


def test_min_gen_len_suppresses_stop_tokens(llama):
    prompt = [llama.tokenizer.encode(PROMPTS[0], bos=True, eos=False)]
    (greedy,), _ = llama.generate(prompt, 10, temperature=0)
    position = next(i for i in range(2, 10) if greedy[i] not in greedy[:i])
    original = llama.tokenizer.stop_tokens
    llama.tokenizer.stop_tokens = original | {greedy[position]}  # pretend it is an end-of-turn token
    try:
        (stopped,), _ = llama.generate(prompt, 10, temperature=0)
        (held,), _ = llama.generate(prompt, 10, temperature=0, min_gen_len=position + 2)
    finally:
        llama.tokenizer.stop_tokens = original
    assert stopped == greedy[:position]
    assert held[:position] == greedy[:position] and held[position] != greedy[position]
    assert len(held) >= position + 2


def test_stop_strings_cut_text_and_end_tokens(llama):
    full = llama.text_completion(PROMPTS, temperature=0, max_gen_len=20)
    text = full[0]["generation"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop not in full[1]["generation"]
    cut = llama.text_completion(PROMPTS, temperature=0, max_gen_len=20, stop=[stop])
    assert cut[0]["generation"] == text[: text.index(stop)]
    assert cut[1] == full[1]  # the other row of the batch runs on untouched
    tokens = [llama.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    (row, _), _ = llama.generate(tokens, 20, temperature=0, stop=[stop])
    decode = llama.tokenizer.decode
    assert stop in decode(row) and stop not in decode(row[:-1])


def test_show_top_lists_what_greedy_chose(llama):
    result = llama.text_completion(PROMPTS[:1], temperature=0, max_gen_len=8, show_top=3, logprobs=True)[0]
    assert len(result["top"]) == len(result["tokens"]) == 8
    for step, token, logprob in zip(result["top"], result["tokens"], result["logprobs"]):
        assert step[0][0] == token
        assert math.isclose(step[0][1], math.exp(logprob), rel_tol=1e-4)
        assert step[0][1] >= step[1][1] >= step[2][1]


@pytest.mark.parametrize("option, value", [
    ("top_k", -1), ("repetition_penalty", 0.0), ("min_gen_len", -2), ("seed", "7"), ("stop", "abc"), ("stop", 5), ("stop", [""]),
])
def test_bad_options_raise_value_errors_naming_them(llama, option, value):
    with pytest.raises(ValueError, match=option if option != "stop" else "stop"):
        llama.text_completion(PROMPTS, max_gen_len=4, **{option: value})
