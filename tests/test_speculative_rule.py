"""Speculation's pure parts: the acceptance rule (greedy and sampled, with a statistical check that
what it returns follows the target's distribution), prompt lookup, and the sampler's distribution."""

import pytest
import torch

from llama_tp.sampling import SamplingOptions, choose_next, distribution
from llama_tp.engine.speculative.acceptance import accept_greedy, accept_sampled
from llama_tp.engine.speculative.lookup import lookup_guesses


def test_greedy_accepts_the_guesses_up_to_the_first_the_target_would_not_choose():
    choices = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    guesses = torch.tensor([[5, 6, 7], [5, 9, 7], [4, 6, 7], [5, 6, -1]])
    accepted, token = accept_greedy(choices, guesses, torch.tensor([3, 3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0, 2]  # all and the bonus token; a wrong second; a wrong first; padded
    assert token.tolist() == [8, 6, 5, 7]


def test_padding_is_never_accepted_even_where_it_matches():
    accepted, token = accept_greedy(torch.tensor([[3, 3, 3]]), torch.tensor([[3, 3]]), torch.tensor([1]))
    assert (accepted.item(), token.item()) == (1, 3)
    p = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]]])
    accepted, token = accept_sampled(p, None, torch.tensor([[1, 1]]), torch.tensor([0]))
    assert (accepted.item(), token.item()) == (0, 1)


def test_a_guess_the_target_cannot_choose_is_rejected_and_never_chosen_instead():
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]]).repeat(200, 1, 1)
    q = torch.tensor([[[0.9, 0.05, 0.05]]]).repeat(200, 1, 1)
    accepted, token = accept_sampled(p, q, torch.zeros(200, 1, dtype=torch.long), torch.ones(200, dtype=torch.long),
                                     torch.Generator().manual_seed(0))
    assert accepted.sum() == 0 and (token != 0).all()


def test_guesses_drawn_from_the_target_itself_are_always_accepted():
    p = torch.softmax(torch.randn(50, 4, 10, generator=torch.Generator().manual_seed(1)), dim=-1)
    guesses = torch.multinomial(p[:, :3].reshape(-1, 10), 1, generator=torch.Generator().manual_seed(2)).view(50, 3)
    accepted, _ = accept_sampled(p, p[:, :3], guesses, torch.full((50,), 3), torch.Generator().manual_seed(3))
    assert (accepted == 3).all()


def test_seeded_sampling_is_reproducible():
    p = torch.softmax(torch.randn(8, 3, 20, generator=torch.Generator().manual_seed(4)), dim=-1)
    q = torch.softmax(torch.randn(8, 2, 20, generator=torch.Generator().manual_seed(5)), dim=-1)
    guesses = torch.randint(0, 20, (8, 2), generator=torch.Generator().manual_seed(6))
    runs = [accept_sampled(p, q, guesses, torch.full((8,), 2), torch.Generator().manual_seed(7)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# Three positions' distributions over 6 tokens: the target's p and a draft's q that differs from it
# (total variation 0.3 to 0.5 at each position).
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.05, 0.05],
                  [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
Q = torch.tensor([[0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                  [0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
SAMPLES = 40_000
# Chi-square's 99.9% quantile with 5 degrees of freedom: a matching distribution exceeds it once in 1000.
CHI_SQUARE_5_DOF_999 = 20.52


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    expected = expected.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def outputs_at(accepted: torch.Tensor, token: torch.Tensor, guesses: torch.Tensor, position: int) -> torch.Tensor:
    """The token each sample returned at position (accepted guesses, then the next token), where it reached."""
    reached = accepted >= position
    return torch.where(accepted[reached] > position, guesses[reached, position], token[reached])


@pytest.mark.parametrize("generators", ["one", "a row's own"])
@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_what_speculative_sampling_returns_follows_the_target_not_the_draft(draft, generators):
    """Each returned token follows the target's p at its position, a chi-square test at 99.9% on
    40 000 samples a position, whatever proposed it: a draft drawing from q, or certain
    guesses (lookup's); and it does not follow q. The same whether every row draws from one
    generator or each from its own."""
    generator = torch.Generator().manual_seed(8)
    if draft == "model":
        guesses = torch.stack([torch.multinomial(Q[i], SAMPLES, replacement=True, generator=generator)
                               for i in range(3)], dim=1)  # samples, 3
        q = Q.expand(SAMPLES, -1, -1)
    else:
        guesses, q = torch.tensor([[0, 4, 0]]).expand(SAMPLES, -1), None
    if generators != "one":
        generator = [torch.Generator().manual_seed(1000 + row) for row in range(SAMPLES)]
    accepted, token = accept_sampled(P.expand(SAMPLES, -1, -1), q, guesses, torch.full((SAMPLES,), 3), generator)
    for position in range(2):
        returned = outputs_at(accepted, token, guesses, position)
        assert len(returned) > SAMPLES / 4
        assert chi_square(returned, P[position]) < CHI_SQUARE_5_DOF_999, position
        if draft == "model":
            assert chi_square(returned, Q[position]) > 100 * CHI_SQUARE_5_DOF_999, position


def test_distribution_is_what_choose_next_samples_from():
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(9)) * 2
    history = torch.tensor([[3, 4, -1], [0, 0, 0]])
    options = SamplingOptions(temperature=0.8, top_p=0.8, top_k=6, repetition_penalty=1.3)
    probs = distribution(logits, options, history)
    assert torch.allclose(probs.sum(-1), torch.ones(2)) and ((probs > 0).sum(-1) <= 6).all()
    drawn = choose_next(logits.repeat(20_000, 1), options, history.repeat(20_000, 1),
                        generator=torch.Generator().manual_seed(10)).view(20_000, 2)
    for row in range(2):
        frequencies = torch.bincount(drawn[:, row], minlength=12).float() / len(drawn)
        assert (frequencies - probs[row]).abs().max() < 0.02
        assert ((frequencies > 0) == (probs[row] > 0)).all()
    greedy = distribution(logits, SamplingOptions(temperature=0), history)
    assert torch.equal(greedy.argmax(-1), choose_next(logits, SamplingOptions(temperature=0), history))
    assert torch.equal(greedy.sum(-1), torch.ones(2))


def test_lookup_copies_what_followed_the_most_recent_longest_match():
    tokens = [1, 7, 8, 9, 4, 7, 8, 5, 6, 2, 7, 8]
    assert lookup_guesses(tokens, 3) == [5, 6, 2]  # "7 8" last came before 5 6 2 (no earlier "2 7 8")
    assert lookup_guesses(tokens, 10) == [5, 6, 2, 7, 8]  # up to the end
    assert lookup_guesses([1, 2, 3, 9, 2, 3], 2) == [9, 2]
    assert lookup_guesses([1, 5, 3, 9, 4, 3], 2) == [9, 4]  # only the last token matches
    assert lookup_guesses([1, 2, 3], 4) == []  # no match: no guesses
    assert lookup_guesses([1, 2, 1, 2], 0) == [] and lookup_guesses([1], 3) == []
    assert lookup_guesses([4, 4, 4], 3) == [4]  # the most recent match is just before the end
