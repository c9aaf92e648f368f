"""Prompt lookup: guesses copied from the text itself (Saxena 2023, "prompt lookup decoding").

Rewriting, summarising, answering about a document or editing code repeat long runs of the
prompt. Where a row's last few tokens appeared before, the tokens that followed them then are
a good guess for what follows now, and finding them costs no model at all.
"""

from typing import Sequence

import torch

# The longest and the shortest tail looked up: a longer match is likelier to continue alike.
MAX_NGRAM = 3
MIN_NGRAM = 1


def lookup_guesses(tokens: Sequence[int], count: int, max_ngram: int = MAX_NGRAM,
                   min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to count tokens that followed the most recent earlier occurrence of the last n tokens of
    tokens, for the largest n from max_ngram down to min_ngram that has one; none if none has."""
    length = len(tokens)
    if count < 1 or length < 2:
        return []
    ids = torch.tensor(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Every earlier n-gram that some token follows: windows[s] = ids[s : s + n], s + n < length.
        windows = ids[: length - 1].unfold(0, n, 1)  # length - n, n
        hits = (windows == ids[length - n :]).all(dim=-1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start : start + count].tolist()
    return []
