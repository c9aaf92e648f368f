import torch

from llama_tp.sampling import next_token, sample_top_p


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(next_token(logits, temperature=0, top_p=0.9), logits.argmax(-1))


def test_greedy_takes_the_first_of_equal_best_like_argmax():
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    assert next_token(logits, temperature=0, top_p=0.9).tolist() == [2, 0]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    torch.manual_seed(0)
    draws = {sample_top_p(probs, 0.8).item() for _ in range(300)}
    assert draws == {1, 2}  # 0.5 + 0.3 reaches 0.8; 0.15 and 0.05 are outside the nucleus
    draws = {sample_top_p(probs, 0.81).item() for _ in range(300)}
    assert draws == {1, 2, 3}


def test_tiny_top_p_is_greedy_and_full_top_p_reaches_every_token():
    probs = torch.tensor([[0.2, 0.3, 0.25, 0.25]])
    torch.manual_seed(0)
    assert {sample_top_p(probs, 1e-6).item() for _ in range(50)} == {1}
    assert {sample_top_p(probs, 1.0).item() for _ in range(400)} == {0, 1, 2, 3}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.6, 0.4]])
    torch.manual_seed(0)
    draws = torch.cat([sample_top_p(probs, 1.0) for _ in range(2000)])
    assert abs(draws.float().mean().item() - 0.4) < 0.04


def test_top_p_cuts_a_token_once_the_mass_above_it_reaches_p_exactly():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])  # powers of two: the running sums are exact
    torch.manual_seed(0)
    assert {sample_top_p(probs, 0.75).item() for _ in range(300)} == {0, 1}  # 0.5 + 0.25 reaches 0.75


def test_each_row_samples_from_its_own_nucleus():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.125, 0.125, 0.25, 0.5]])
    torch.manual_seed(0)
    draws = torch.cat([sample_top_p(probs, 0.75) for _ in range(300)], dim=1)  # [2 rows, 300 draws]
    assert set(draws[0].tolist()) == {0, 1} and set(draws[1].tolist()) == {2, 3}


def test_a_generator_makes_the_draws_the_same_whatever_the_global_seed():
    probs = torch.full((64, 4), 0.25)

    def draws(global_seed, seed):
        torch.manual_seed(global_seed)
        return sample_top_p(probs, 1.0, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draws(0, 5), draws(1, 5))
    assert not torch.equal(draws(0, 5), draws(0, 6))


def test_next_token_samples_within_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.3]])).expand(200, -1)
    torch.manual_seed(0)
    assert next_token(logits, temperature=1.0, top_p=0.1).tolist() == [0] * 200  # only the best reaches 0.1
    assert set(next_token(logits, temperature=1.0, top_p=1.0).tolist()) == {0, 1, 2}
