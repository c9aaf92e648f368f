"""Which tokens each row of the KV cache holds, from position 0: what a row's next pass must feed.

The model keeps the record true: a forward pass that writes a row from some position on cuts
the row's record there (keep). Those that know which tokens they fed (the serving engine, a
speculation round, a draft catching up) add them (extend). The engine gives a row the blocks of a
sequence (engine/blocks.py), some of them shared with other sequences that start the same way,
and sets the row's record to the tokens they hold.

enabled: whether a prompt may start from blocks that earlier requests filled (a server's
--no_prefix_cache clears it); a request's `n` choices share their prompt's blocks anyway.
"""

from typing import Sequence


class PrefixCache:
    def __init__(self, rows: int, enabled: bool = True):
        self.enabled = enabled
        self.rows: list[list[int]] = [[] for _ in range(rows)]  # row r's tokens from position 0

    def reusable(self, row: int, prompt: Sequence[int]) -> int:
        """How many of prompt's first tokens row holds: the longest common start, short of the
        whole prompt (its last token must be fed to give the logits of the next)."""
        prompt = prompt if isinstance(prompt, list) else list(prompt)  # lists compare with lists only
        return max(0, min(common_length(self.rows[row], prompt), len(prompt) - 1))

    def keep(self, row: int, length: int) -> None:
        """Row's first length tokens stay valid; what follows is about to be overwritten."""
        del self.rows[row][length:]

    def extend(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """Row now holds tokens from position start on: recorded if the record reaches start (a
        record holds tokens from position 0 without a gap)."""
        if len(self.rows[row]) == start:
            self.rows[row].extend(tokens)

    def forget(self) -> None:
        """No row holds anything to be reused."""
        for row in self.rows:
            row.clear()


def common_length(a: list[int], b: list[int]) -> int:
    """How many first tokens lists a and b share."""
    shared = min(len(a), len(b))
    if a[:shared] == b[:shared]:  # the usual case, at the speed of one comparison
        return shared
    low, high = 0, shared  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
