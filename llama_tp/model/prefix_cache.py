"""Which tokens each row of the KV cache holds, so that a prompt that begins like an earlier one
skips that part of the prefill.

A conversation sends its whole history again at every turn, and a server's requests often
share a long system prompt: their keys and values are in the cache already, from the turn or
the request before. Every rank keeps the same record (the same calls reach every rank), so all
of them reuse alike.

The model keeps the record true: a forward pass that writes a row from some position on cuts
the row's record there (keep). Those that know which tokens they fed, the generation API's static
batches (rows 0, 1, ...) and the serving engine (a request per row, wherever it is free; also
generate's continuous batching), add them (extend).

The serving engine also copies: a request whose prompt begins as another row's tokens do (a
system prompt shared with another conversation, running or ended; the same question asked
again) takes those keys and values from that row (the scheduler's Copy, about a hundredth of
a prompt pass's time), so that a free row holding a whole conversation is not given up for a
few shared tokens (best_row) and conversations stay cached until their rows are the least
recently used.
"""

from typing import Sequence

# A shared start shorter than this is prefilled rather than copied from another row: a copy in
# every layer is not worth a few more tokens in a prompt pass.
MIN_COPIED_TOKENS = 16


class PrefixCache:
    def __init__(self, rows: int, enabled: bool = True):
        self.enabled = enabled
        self.rows: list[list[int]] = [[] for _ in range(rows)]  # row r's tokens from position 0
        self._last_used = [0] * rows
        self._uses = 0

    def reusable(self, row: int, prompt: Sequence[int]) -> int:
        """How many of prompt's first tokens row holds: the longest common start, short of the
        whole prompt (its last token must be fed to give the logits of the next)."""
        return self.held(row, prompt) if self.enabled else 0

    def held(self, row: int, prompt: Sequence[int]) -> int:
        """How many of prompt's first tokens row holds, short of the whole prompt, whether or not
        reuse across requests is enabled (a request's `n` choices share their prefill anyway)."""
        prompt = prompt if isinstance(prompt, list) else list(prompt)  # lists compare with lists only
        return max(0, min(common_length(self.rows[row], prompt), len(prompt) - 1))

    def best_row(self, prompt: Sequence[int], free: Sequence[int]) -> int:
        """Of the free rows, the one a request with this prompt should write: the one holding the
        longest start of prompt, if that is no less than what the row holds beyond it, which is
        lost (a conversation's next turn, the same prompt again); else an empty row, else the
        least recently used (its cache is the least likely to be asked for again). A shared start
        held elsewhere is copied (longest_start), not taken with the row that holds it."""

        def lost(row: int) -> int:
            return len(self.rows[row]) - self.reusable(row, prompt)

        longest = max(free, key=lambda row: (self.reusable(row, prompt), -lost(row), -self._last_used[row]))
        reused = self.reusable(longest, prompt)
        if reused and lost(longest) <= reused:
            return longest
        return min(free, key=lambda row: (len(self.rows[row]) > 0, self._last_used[row]))

    def longest_start(self, prompt: Sequence[int], rows: Sequence[int]) -> tuple[int, int]:
        """Of these rows (free or not), the one holding the longest start of prompt, and how
        many tokens of it (as reusable counts them)."""
        held = {row: self.reusable(row, prompt) for row in rows}
        row = max(rows, key=lambda row: (held[row], -row), default=0)
        return row, held.get(row, 0)

    def keep(self, row: int, length: int) -> None:
        """Row's first length tokens stay valid; what follows is about to be overwritten."""
        del self.rows[row][length:]
        self._touch(row)

    def extend(self, row: int, start: int, tokens: Sequence[int]) -> None:
        """Row now holds tokens from position start on: recorded if the record reaches start (a
        record holds tokens from position 0 without a gap)."""
        if len(self.rows[row]) == start:
            self.rows[row].extend(tokens)
            self._touch(row)

    def copy(self, source: int, dest: int, length: int) -> None:
        """Row dest now holds row source's first length tokens (their keys and values were copied)."""
        self.rows[dest][:] = self.rows[source][:length]
        self._touch(dest)

    def forget(self) -> None:
        """Nothing held is to be reused (a chat's /reset)."""
        for row in self.rows:
            row.clear()

    def _touch(self, row: int) -> None:
        self._uses += 1
        self._last_used[row] = self._uses


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
