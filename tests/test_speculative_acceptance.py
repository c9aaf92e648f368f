"""speculative/acceptance.py's rules on distributions where each outcome is certain, or
certain once a guess is accepted or rejected: exact checks that take milliseconds, beside
test_speculative_rule.py's statistics (which a mutation run cannot afford for every mutant)."""

import torch

from llama_tp.engine.speculative.acceptance import accept_greedy, accept_sampled

ROWS = 2000


def one_hot(token: int, vocab: int = 4) -> list[float]:
    return [1.0 if t == token else 0.0 for t in range(vocab)]


def batch(positions: list[list[float]]) -> torch.Tensor:
    """The same distributions [positions, vocab] for every one of ROWS rows."""
    return torch.tensor(positions).expand(ROWS, -1, -1)


def test_after_a_rejected_draft_guess_the_token_comes_from_what_p_has_beyond_q():
    # Guess 0: p gives it 0.5 and q 1, accepted half the time; after a rejection only token 1 is
    # left in max(p - q, 0); after an acceptance, the next position's p is certain.
    p = batch([[0.5, 0.5, 0.0, 0.0], one_hot(3), one_hot(2)])
    q = batch([one_hot(0), one_hot(1)])
    guesses = torch.tensor([[0, 1]]).expand(ROWS, -1)  # the second is one p cannot choose
    accepted, token = accept_sampled(p, q, guesses, torch.full((ROWS,), 2), torch.Generator().manual_seed(0))
    assert set(accepted.tolist()) == {0, 1}
    assert 0.45 < (accepted == 1).double().mean() < 0.55
    assert (token[accepted == 0] == 1).all() and (token[accepted == 1] == 3).all()


def test_after_a_rejected_lookup_guess_the_token_is_any_other_p_allows():
    # Certain guesses (q None): guess 1 is accepted with p's 0.75, and after a rejection token 0
    # is all that p has besides it.
    p = batch([[0.25, 0.75, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], one_hot(1)])
    guesses = torch.tensor([[1, 0]]).expand(ROWS, -1)
    accepted, token = accept_sampled(p, None, guesses, torch.full((ROWS,), 2), torch.Generator().manual_seed(1))
    assert 0.70 < (accepted == 1).double().mean() < 0.80 and (accepted < 2).all()  # p never gives 0 at 1
    assert (token[accepted == 0] == 0).all()
    after = token[accepted == 1]  # the rejected second guess, 0, had no mass in p: p as it is
    assert set(after.tolist()) == {2, 3} and 0.4 < (after == 2).double().mean() < 0.6


def test_rows_accept_up_to_their_own_count_and_add_the_token_after_it():
    p = torch.tensor([[one_hot(1), one_hot(2), one_hot(3), one_hot(0)]] * 4)  # certain at every position
    guesses = torch.tensor([[1, 2, 3], [1, 2, -1], [1, -1, -1], [-1, -1, -1]])
    counts = torch.tensor([3, 2, 1, 0])
    for q in (None, torch.full((4, 3, 4), 0.25)):
        accepted, token = accept_sampled(p, q, guesses, counts, torch.Generator().manual_seed(2))
        assert accepted.tolist() == [3, 2, 1, 0]
        assert token.tolist() == [0, 3, 2, 1]  # the bonus token after each row's last guess


def test_a_lookup_guess_rejected_after_others_were_accepted_is_never_the_token():
    # Even rows may reject their last guess (position 2), odd rows their second: the residual
    # must leave out the guess each row rejected, at the place it was rejected.
    p = torch.tensor([[one_hot(1), one_hot(2), [0.0, 0.5, 0.0, 0.5], one_hot(0)],
                      [one_hot(1), [0.5, 0.0, 0.5, 0.0], one_hot(3), one_hot(0)]]).repeat(ROWS // 2, 1, 1)
    guesses = torch.tensor([[1, 2, 3], [1, 0, 3]]).repeat(ROWS // 2, 1)
    accepted, token = accept_sampled(p, None, guesses, torch.full((ROWS,), 3), torch.Generator().manual_seed(3))
    for rows, rejected_at, left in ((slice(0, None, 2), 2, 1), (slice(1, None, 2), 1, 2)):
        assert set(accepted[rows].tolist()) == {rejected_at, 3}
        assert (token[rows][accepted[rows] == rejected_at] == left).all()
        assert (token[rows][accepted[rows] == 3] == 0).all()


def test_a_guess_neither_model_could_choose_falls_back_on_p():
    # Even rows: p(g) = q(g) = 0, so the guess is rejected, and max(p - q, 0) has no mass where p
    # equals q elsewhere: p itself. Odd rows beside them reject theirs with mass left (token 2).
    p = torch.tensor([[one_hot(1), one_hot(3)], [one_hot(2), one_hot(3)]]).repeat(ROWS // 2, 1, 1)
    q = torch.tensor([[one_hot(1)], [one_hot(0)]]).repeat(ROWS // 2, 1, 1)
    accepted, token = accept_sampled(p, q, torch.zeros(ROWS, 1, dtype=torch.long), torch.ones(ROWS, dtype=torch.long),
                                     torch.Generator().manual_seed(4))
    assert (accepted == 0).all() and token.tolist() == [1, 2] * (ROWS // 2)


def test_no_guesses_at_all_draws_from_p():
    p = batch([[0.0, 0.5, 0.5, 0.0]])
    for q in (None, torch.zeros(ROWS, 0, 4)):
        accepted, token = accept_sampled(p, q, torch.zeros(ROWS, 0, dtype=torch.long), torch.zeros(ROWS, dtype=torch.long),
                                         torch.Generator().manual_seed(5))
        assert (accepted == 0).all() and set(token.tolist()) == {1, 2}


def test_a_row_that_accepts_all_its_guesses_draws_from_p_whole_whatever_its_padding_holds():
    # Rows guess 2 of 3 places; the padding (token 3) is where a third guess would be: it must not
    # be taken out of p as a rejected guess would.
    p = batch([one_hot(1), one_hot(2), [0.5, 0.0, 0.0, 0.5], one_hot(0)])
    guesses = torch.tensor([[1, 2, 3]]).expand(ROWS, -1)
    for q in (None, batch([one_hot(1), one_hot(2), one_hot(3)])):
        accepted, token = accept_sampled(p, q, guesses, torch.full((ROWS,), 2), torch.Generator().manual_seed(6))
        assert (accepted == 2).all()
        assert set(token.tolist()) == {0, 3} and 0.4 < (token == 3).double().mean() < 0.6


def test_each_row_decides_with_its_own_generator_whatever_else_is_in_the_batch():
    rows, vocab = 6, 8
    p = torch.softmax(torch.randn(rows, 3, vocab, generator=torch.Generator().manual_seed(7)), dim=-1)
    q = torch.softmax(torch.randn(rows, 2, vocab, generator=torch.Generator().manual_seed(8)), dim=-1)
    guesses = torch.randint(0, vocab, (rows, 2), generator=torch.Generator().manual_seed(9))
    counts = torch.tensor([2, 2, 1, 2, 0, 2])

    def generators(chosen):
        return [torch.Generator().manual_seed(20 + row) for row in chosen]

    outcomes = set()
    for draft in (q, None):
        accepted, token = accept_sampled(p, draft, guesses, counts, generators(range(rows)))
        for row, count in enumerate(counts.tolist()):  # alone, padded to no more than its own guesses
            own = slice(row, row + 1)
            alone = accept_sampled(p[own, : count + 1], None if draft is None else draft[own, :count],
                                   guesses[own, :count], [count], generators([row]))
            assert (accepted[row], token[row]) == alone, row
        outcomes.update(zip(accepted.tolist(), token.tolist()))
    assert len(outcomes) > 3  # the rows did not all decide alike


def test_everything_is_made_on_the_inputs_device():
    # On the meta device a tensor made on the CPU by mistake cannot be mixed in: a GPU's case.
    meta = torch.device("meta")
    guesses, counts = torch.zeros(2, 3, dtype=torch.long, device=meta), torch.ones(2, dtype=torch.long, device=meta)
    accepted, token = accept_greedy(torch.zeros(2, 4, dtype=torch.long, device=meta), guesses, counts)
    assert accepted.device == token.device == meta
    accepted, token = accept_sampled(torch.rand(2, 4, 5, device=meta), torch.rand(2, 3, 5, device=meta), guesses,
                                     counts)
    assert accepted.device == token.device == meta and token.shape == (2,)
