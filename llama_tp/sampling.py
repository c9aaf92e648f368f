"""Choosing the next token from logits: greedy, temperature and nucleus (top-p) sampling."""

import torch


def sample_top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Sample from the smallest set of most likely tokens whose probability reaches p.

    probs [bsz, vocab] -> token ids [bsz, 1].
    """
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    # A token stays if the tokens ranked above it have not reached p yet; the first always stays.
    probs_sorted = probs_sorted.masked_fill(mass_before >= p, 0.0)
    probs_sorted.div_(probs_sorted.sum(dim=-1, keepdim=True))
    choice = torch.multinomial(probs_sorted, num_samples=1)
    return torch.gather(order, -1, choice)


def next_token(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [bsz, vocab] -> token ids [bsz]; temperature 0 is greedy."""
    # A temperature that rounds to 0 in the logits' dtype is greedy too (dividing by it gives NaN).
    if temperature < torch.finfo(logits.dtype).tiny:
        return torch.argmax(logits, dim=-1)
    # Shift the best logit to 0 first: logits / temperature overflows to inf (and softmax to NaN)
    # for a tiny temperature, while values <= 0 divided by it only reach -inf.
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / temperature, dim=-1)
    return sample_top_p(probs, top_p).reshape(-1)
