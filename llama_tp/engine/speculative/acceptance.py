"""Which guesses the target accepts, and the token it adds after them: pure functions on
probabilities, unit-tested directly.

Rows of a batch guess different numbers of tokens: guesses [rows, m] are padded past each row's
count (counts [rows]), and padding is never accepted. Position i of a row (0 <= i <= m) is the
target's prediction after the row's tokens and its first i guesses.
"""

from typing import Optional, Sequence, Union

import torch

from ...sampling.sampler import Generators, inverse_cdf, on_device, uniforms


def accept_greedy(choices: torch.Tensor, guesses: torch.Tensor,
                  counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the guesses up to the first that differs from the target's choice.

    choices [rows, m + 1]: the target's token at each position; guesses [rows, m]; counts [rows].
    Returns the accepted count [rows] and the next token [rows]: the target's choice where the
    first guess failed, or after the last guess (the bonus token). Exactly the tokens that
    decoding without guesses would choose.
    """
    m = guesses.shape[1]
    valid = torch.arange(m, device=guesses.device)[None, :] < counts[:, None]  # rows, m
    agree = (guesses == choices[:, :m]) & valid
    accepted = agree.long().cumprod(dim=-1).sum(dim=-1)  # the leading run of agreements
    return accepted, choices.gather(-1, accepted[:, None]).squeeze(-1)


def accept_sampled(p: torch.Tensor, q: Optional[torch.Tensor], guesses: torch.Tensor,
                   counts: Union[torch.Tensor, Sequence[int]],
                   generators: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the tokens it returns
    follow p, the target's distributions, whatever q proposed them.

    p [rows, m + 1, vocab]: the target's distribution at each position; q [rows, m, vocab]: the
    distribution each guess was drawn from (None: the guesses were certain, as prompt lookup's
    are: q is one-hot on each); guesses [rows, m]; counts [rows], on the device or the host.
    Guess i is accepted with probability min(1, p(g) / q(g)) while all before it were; at the
    first rejection the next token is drawn from max(p - q, 0), normalised; after the last
    guess, from p. Returns the accepted count [rows] and the next token [rows].

    generators: one for every row (None: torch's global one), or one per row. A row's uniform
    numbers accept its guesses, and the last takes the next token by the inverse CDF (as
    sampler.py's draw does). A seeded generator gives the same result on every rank and in
    every run.
    """
    rows, m = guesses.shape
    uniform = _uniforms(counts, m, generators, p.device)  # rows, m + 1
    counts = torch.as_tensor(counts, device=p.device)
    valid = torch.arange(m, device=guesses.device)[None, :] < counts[:, None]  # rows, m
    index = guesses.clamp(min=0)[..., None]  # rows, m, 1
    p_guess = p[:, :m].gather(-1, index).squeeze(-1)  # rows, m
    q_guess = torch.ones_like(p_guess) if q is None else q.gather(-1, index).squeeze(-1)
    accept = (uniform[:, :m] * q_guess < p_guess) & valid  # probability min(1, p / q)
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # rows
    at = torch.arange(rows, device=p.device)
    p_next = p[at, accepted]  # rows, vocab
    # q at the position of the next token: the rejected guess's distribution, or nothing after
    # the last guess (so the residual is p itself).
    rejected = accepted < counts
    if not m:
        q_next = torch.zeros_like(p_next)
    elif q is None:
        q_next = torch.zeros_like(p_next)
        rejected_guess = guesses[at, accepted.clamp(max=m - 1)]
        q_next[at[rejected], rejected_guess[rejected]] = 1.0
    else:  # a row that accepted all its guesses reads a q it then ignores
        q_next = q[at, accepted.clamp(max=m - 1)] * rejected[:, None]
    residual = (p_next - q_next).clamp(min=0)
    # A rejection needs p(g) < q(g), so the residual has mass; if rounding left none, p itself.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    return accepted, inverse_cdf(residual, uniform[:, m])


def _uniforms(counts: Union[torch.Tensor, Sequence[int]], m: int, generators: Generators,
              device: torch.device) -> torch.Tensor:
    """Uniform numbers [rows, m + 1] float64: each row's for its guesses, then (at m) its token's.

    One generator for every row: all of them in one call. One a row: count + 1 numbers from each
    row's own, so that what a seeded row draws does not depend on the other rows' guesses; its
    count is read on the host (pass counts as a list to spare a read-back)."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(len(counts), m + 1, dtype=torch.float64, device=device, generator=generators)
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    drawn = on_device(torch.cat([uniforms(count + 1, generator, device) for count, generator in zip(counts, generators)]),
                      device)
    places = [row * (m + 1) + i for row, count in enumerate(counts) for i in (*range(count), m)]
    uniform = torch.zeros(len(counts) * (m + 1), dtype=torch.float64, device=device)
    return uniform.index_put_((torch.tensor(places, device=device),), drawn).view(len(counts), m + 1)
