"""Prompt lookup: guesses copied from the text itself (Saxena 2023, "prompt lookup decoding").

Rewriting, summarising, answering about a document or editing code repeat long runs of the
prompt. Where a row's last few tokens appeared before, the tokens that followed them then are
a good guess for what follows now, and finding them costs no model at all.
"""

from array import array
from typing import Sequence

# The longest and the shortest tail looked up: a longer match is likelier to continue alike.
MAX_NGRAM = 3
MIN_NGRAM = 1

TOKEN_BYTES = array("q").itemsize


def lookup_guesses(tokens: Sequence[int], count: int, max_ngram: int = MAX_NGRAM,
                   min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to count tokens that followed the most recent earlier occurrence of the last n tokens of
    tokens, for the largest n from max_ngram down to min_ngram that has one; none if none has.

    Searched as bytes on the host (bytes.rfind): the tokens are the host's, and a round must not
    wait on a device, nor pay a tensor's overhead per row."""
    length = len(tokens)
    if count < 1 or length < 2:
        return []
    earlier = array("q", tokens[: length - 1]).tobytes()  # every n-gram that some token follows
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = array("q", tokens[length - n :]).tobytes()
        end = len(earlier)
        at = earlier.rfind(tail, 0, end)
        while at > 0 and at % TOKEN_BYTES:  # a match that straddles tokens: look further back
            end = at + len(tail) - 1
            at = earlier.rfind(tail, 0, end)
        if at >= 0:
            start = at // TOKEN_BYTES + n
            return list(tokens[start : start + count])
    return []
