"""sampling.py's options and the definition of what a row samples from, at the edges of each option:
the values just inside and just outside every range, ties at top-k's k-th, top-p's cut where
the mass reaches p exactly, the repetition penalty on either sign."""

import math

import pytest
import torch

from llama_tp.sampling import (SamplingOptions, adjust_logits, check_given, choose_next, distribution, seen_in, stop_ban,
                               top_candidates)

ACCEPTED = [
    {"temperature": 0}, {"temperature": 1e-9}, {"top_p": 1.0}, {"top_p": 1e-9}, {"min_p": 0.0}, {"min_p": 0.999},
    {"top_k": None}, {"top_k": 0}, {"top_k": 1}, {"repetition_penalty": 0.01}, {"repetition_penalty": 100},
    {"min_gen_len": 0}, {"seed": None}, {"seed": 0}, {"temperature": 2}, {"temperature": 100}, {"top_p": 1},
]
REFUSED = {
    "temperature below 0": ({"temperature": -0.1}, "temperature must be in [0, 100] (0: greedy), found -0.1"),
    # 1 / 1e308 is 0 in the sampler's fp32: the greedy answer, not the flattest
    "temperature above 100": ({"temperature": 1e308}, "temperature must be in [0, 100] (0: greedy), found 1e+308"),
    "top_p 0": ({"top_p": 0}, "top_p must be in (0, 1], found 0"),
    "top_p above 1": ({"top_p": 1.01}, "top_p must be in (0, 1], found 1.01"),
    "min_p 1": ({"min_p": 1}, "min_p must be in [0, 1) (0 for no cut, e.g. 0.05), found 1"),
    "min_p below 0": ({"min_p": -0.01}, "min_p must be in [0, 1) (0 for no cut, e.g. 0.05), found -0.01"),
    "top_k below 0": ({"top_k": -1}, "top_k must be a positive integer (or 0/None for no cut), found -1"),
    "top_k a fraction": ({"top_k": 2.5}, "top_k must be a positive integer (or 0/None for no cut), found 2.5"),
    "penalty 0": ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 100] (1 for none, e.g. 1.2 to "
                  "discourage repeats), found 0"),
    # 1e-300 is 0 in fp32: every repeated token's logit divided by 0
    "penalty 1e-300": ({"repetition_penalty": 1e-300}, "repetition_penalty must be in [0.01, 100] (1 for none, "
                       "e.g. 1.2 to discourage repeats), found 1e-300"),
    "penalty above 100": ({"repetition_penalty": 101}, "repetition_penalty must be in [0.01, 100] (1 for none, "
                          "e.g. 1.2 to discourage repeats), found 101"),
    "min_gen_len below 0": ({"min_gen_len": -1}, "min_gen_len must be a non-negative integer, found -1"),
    "min_gen_len a fraction": ({"min_gen_len": 1.5}, "min_gen_len must be a non-negative integer, found 1.5"),
    "seed a string": ({"seed": "7"}, "seed must be an integer or None, found '7'"),
    "temperature a string": ({"temperature": "hot"}, "temperature must be a number, found 'hot'"),
    "top_p a boolean": ({"top_p": True}, "top_p must be a number, found True"),
    "penalty None": ({"repetition_penalty": None}, "repetition_penalty must be a number, found None"),
    "min_p None": ({"min_p": None}, "min_p must be a number, found None"),
}


@pytest.mark.parametrize("options", ACCEPTED, ids=str)
def test_values_at_the_edge_of_each_range_are_accepted(options):
    SamplingOptions(**options).check()


@pytest.mark.parametrize("name", REFUSED)
def test_values_past_the_edge_are_refused_naming_them(name):
    options, message = REFUSED[name]
    with pytest.raises(ValueError) as refused:
        SamplingOptions(**options).check()
    assert str(refused.value) == message


def test_check_given_leaves_out_what_was_not_given():
    check_given(temperature=None, top_p=None, top_k=None, seed=None)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], found 2$"):
        check_given(temperature=None, top_p=2)


def test_greedy_and_taking_the_best_logit():
    assert SamplingOptions(temperature=0).greedy and SamplingOptions(temperature=1e-39).greedy  # below fp32's tiny
    assert not SamplingOptions(temperature=1e-37).greedy
    assert SamplingOptions(temperature=0).takes_best_logit
    assert not SamplingOptions(temperature=0, repetition_penalty=1.1).takes_best_logit
    assert not SamplingOptions(temperature=0, min_gen_len=1).takes_best_logit
    assert not SamplingOptions(temperature=0.5).takes_best_logit


def test_distribution_is_greedy_exactly_where_the_options_are():
    tiny = torch.finfo(torch.float32).tiny  # the smallest temperature that samples: a tie is split, not broken
    tie = torch.zeros(1, 2)
    assert not SamplingOptions(temperature=tiny).greedy
    assert distribution(tie, SamplingOptions(temperature=tiny, top_p=1.0)).tolist() == [[0.5, 0.5]]
    assert distribution(tie, SamplingOptions(temperature=tiny / 2, top_p=1.0)).tolist() == [[1.0, 0.0]]


def test_a_seed_gives_a_private_generator():
    assert SamplingOptions().generator(torch.device("cpu")) is None
    generator = SamplingOptions(seed=3).generator(torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=torch.Generator().manual_seed(3)))


def test_stop_tokens_are_banned_until_min_gen_len_tokens_were_generated():
    ban = stop_ban(torch.tensor([0, 1, 2]), 2, [1, 4], 5)
    assert ban.tolist() == [[False, True, False, False, True], [False, True, False, False, True], [False] * 5]


def test_the_repetition_penalty_shrinks_positive_logits_and_grows_negative_ones():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0], [2.0, -2.0, 3.0, -1.0]])
    history = torch.tensor([[0, 1, -1], [3, -1, -1]])  # -1: padding, never token 3
    penalised = adjust_logits(logits, SamplingOptions(repetition_penalty=2.0), history)
    assert penalised.tolist() == [[1.0, -4.0, 3.0, -1.0], [2.0, -2.0, 3.0, -2.0]]
    assert torch.equal(adjust_logits(logits, SamplingOptions(), history), logits)  # 1: none
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert torch.equal(adjust_logits(logits, SamplingOptions(repetition_penalty=2.0), empty), logits)
    assert torch.equal(adjust_logits(logits, SamplingOptions(repetition_penalty=2.0), None), logits)  # no history
    below_one = adjust_logits(torch.tensor([[0.5, 1.0]]), SamplingOptions(repetition_penalty=2.0), torch.tensor([[0, 1]]))
    assert below_one.tolist() == [[0.25, 0.5]]  # positive below 1 shrinks too
    banned = adjust_logits(logits, SamplingOptions(), None, torch.tensor([[True, False, False, False]] * 2))
    assert banned[:, 0].tolist() == [-math.inf, -math.inf] and torch.equal(banned[:, 1:], logits[:, 1:])
    assert seen_in(torch.tensor([[2, -1], [-1, -1]]), 3).tolist() == [[False, False, True], [False] * 3]


def test_distribution_cuts_at_each_options_edge():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    plain = SamplingOptions(temperature=1.0, top_p=1.0)
    assert torch.allclose(distribution(logits, plain), torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    # top-p: a token stays while those above it hold less than p; at exactly p the cut is made.
    assert distribution(logits, SamplingOptions(temperature=1.0, top_p=0.5)).tolist() == [[1.0, 0, 0, 0]]
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=1.0, top_p=0.51)),
                          torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # top-k: the k best, and any tied with the k-th.
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=1.0, top_p=1.0, top_k=3)),
                          torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=1.0, top_p=1.0, top_k=2)),
                          torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=1.0, top_p=1.0, top_k=9)),
                          torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    # min-p: tokens below min_p times the best's probability go.
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=1.0, top_p=1.0, min_p=0.3)),
                          torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    at_the_edge = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])  # the second at exactly half the best's
    assert torch.allclose(distribution(at_the_edge, SamplingOptions(temperature=1.0, top_p=1.0, min_p=0.5)),
                          torch.tensor([[2 / 3, 1 / 3, 0]]))
    # temperature 2: probabilities go as their square roots.
    hot = torch.sqrt(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert torch.allclose(distribution(logits, SamplingOptions(temperature=2.0, top_p=1.0)), (hot / hot.sum())[None])
    greedy = SamplingOptions(temperature=0)
    assert distribution(logits, greedy).tolist() == [[1.0, 0, 0, 0]] and distribution(logits, greedy).dtype == logits.dtype
    penalised = distribution(logits, SamplingOptions(temperature=0, repetition_penalty=4.0), torch.tensor([[0]]))
    assert penalised.tolist() == [[0, 1.0, 0, 0]]  # log 0.5 * 4 is below log 0.25
    assert distribution(logits, greedy, suppress=torch.tensor([[True, False, False, False]])).tolist() == [[0, 1.0, 0, 0]]
    # Rows apart: each shifted by its own best logit.
    rows = torch.cat([logits, logits + 50.0, logits - 50.0])
    for options in (SamplingOptions(temperature=0.5, top_p=1.0), SamplingOptions(temperature=0.5, top_p=0.9, top_k=3)):
        assert torch.allclose(distribution(rows, options), distribution(logits, options).expand(3, -1))


def test_top_candidates_are_the_samplers_view():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    ids, probs = top_candidates(logits, SamplingOptions(temperature=0), 2)
    assert ids.tolist() == [[0, 1]] and torch.allclose(probs, torch.tensor([[0.5, 0.25]]))
    ids, probs = top_candidates(logits, SamplingOptions(temperature=2.0), 9)  # n past the vocabulary: all
    hot = torch.sqrt(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert ids.shape == (1, 4) and torch.allclose(probs, (hot / hot.sum())[None])
    ids, _ = top_candidates(logits, SamplingOptions(temperature=0, repetition_penalty=4.0), 1,
                            history=torch.tensor([[0]]))
    assert ids.tolist() == [[1]]  # the best after the penalty: log 0.5 * 4 is below log 0.25
    ids, _ = top_candidates(logits, SamplingOptions(temperature=0), 1, suppress=torch.tensor([[True, False, False, False]]))
    assert ids.tolist() == [[1]]  # a banned token is no candidate


def test_masks_are_made_on_the_inputs_device():
    # On the meta device a mask made on the CPU by mistake cannot be mixed in: a GPU's case.
    meta = torch.device("meta")
    assert stop_ban(torch.zeros(2, dtype=torch.long, device=meta), 1, [1], 5).device == meta
    assert seen_in(torch.zeros(2, 3, dtype=torch.long, device=meta), 5).device == meta


def test_choose_next_applies_the_history_the_ban_and_the_generator():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3))  # 3 rows of 4 tokens
    greedy = SamplingOptions(temperature=0)
    assert choose_next(logits, greedy).tolist() == [0, 0, 0]
    penalty = SamplingOptions(temperature=0, repetition_penalty=4.0)
    assert choose_next(logits, penalty, history=torch.tensor([[0], [0], [1]])).tolist() == [1, 1, 0]
    assert choose_next(logits, greedy, suppress=torch.tensor([[True, False, False, False]] * 3)).tolist() == [1] * 3
    sampled, many = SamplingOptions(temperature=1.0, top_p=1.0), logits.repeat(100, 1)
    first = choose_next(many, sampled, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, choose_next(many, sampled, generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(first, choose_next(many, sampled, generator=torch.Generator().manual_seed(6)))
