"""A round of speculative decoding: guess a few tokens for every row, verify them all in one pass
of the target, keep the guesses it agrees with and its own next token.

Where our CPU kernels run, that pass gives every position exactly the logits of a one-token step
(model.MAX_KERNEL_STEP_TOKENS), so greedy rounds choose exactly the tokens that decoding without
guesses chooses, and sampled ones follow the target's distribution (acceptance.py). What the
target's caches hold past the accepted tokens (the rejected guesses, padding) is never read:
attention reads a row only up to its own position, and the next round writes those positions
again. Every rank runs the same round, and takes rank 0's guesses and verdicts (choices.py),
so that ranks whose logits differ in the last bits still decide alike.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from .. import parallel
from ..choices import read_back
from ..kernels import matmul
from ..model import Transformer
from ..sampling import choose_next, distribution
from .acceptance import accept_greedy, accept_sampled
from .draft import Draft
from .lookup import lookup_guesses
from .rows import Outcome, Row, histories, suppressed


@dataclass
class SpeculationStats:
    """Counts since the speculator was made (or reset): how well the guesses fare."""

    proposed: int = 0  # guesses offered (the rest of a longer prompt not counted)
    accepted: int = 0  # of those, accepted
    verified_rows: int = 0  # rows verified, one pass of the target each
    tokens: int = 0  # tokens the rounds added

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens a row gains per pass of the target (1 without speculation)."""
        return self.tokens / self.verified_rows if self.verified_rows else 0.0

    def describe(self) -> str:
        return (f"{self.accepted} of {self.proposed} guesses accepted ({100 * self.acceptance_rate:.0f}%), "
                f"{self.tokens_per_pass:.2f} tokens a row per pass of the target")


class Speculator:
    """How a Llama guesses (mode "draft" or "lookup"), how many tokens a round (k), and its counts."""

    def __init__(self, mode: str, k: int, draft: Optional[Draft] = None):
        self.mode, self.k, self.draft = mode, k, draft
        self.stats = SpeculationStats()

    def guesses_for(self, model: Transformer, rows: int) -> int:
        """Guesses a row for a round of `rows` rows: k, or fewer where our kernels would otherwise
        hand the verifying pass's products to oneDNN, whose rows do not come out as in a
        one-token step (matmul.KERNEL_MAX_ROWS)."""
        if model.layers[0].attention.cache.kernel_attends:
            return max(0, min(self.k, matmul.KERNEL_MAX_ROWS // rows - 1))
        return self.k

    def round(self, model: Transformer, rows: list[Row], want_logits: bool = False) -> list[Outcome]:
        """Guess, verify in one pass of the target, accept: what each row gained (at least one token)."""
        k = self.guesses_for(model, len(rows))
        fits = min(model.max_seq_len - len(row.tokens) for row in rows)  # positions left after the last
        counts = [max(0, min(k, row.room - 1, fits)) for row in rows]
        plain = not want_logits and all(row.options.takes_best_logit for row in rows)
        forced = [list(row.forced[:count]) for row, count in zip(rows, counts)]
        if self.mode == "lookup":
            guesses = [f + lookup_guesses(row.tokens + f, count - len(f))
                       for row, f, count in zip(rows, forced, counts)]
            drawn_from: list[Optional[torch.Tensor]] = [None] * len(rows)
        else:
            guesses, drawn_from = self.draft.propose(rows, counts, forced, plain)
        width = max(map(len, guesses))
        device = model.rotary.device
        # Each row's last token, its guesses, and padding (never accepted) up to the longest.
        feed = torch.tensor([[row.tokens[-1], *g, *[0] * (width - len(g))] for row, g in zip(rows, guesses)],
                            device=device)
        logits = model.forward(feed, [len(row.tokens) - 1 for row in rows], vocab_slice=plain,
                               slots=[row.slot for row in rows])  # rows, width + 1, vocab (or this rank's slice)
        if plain:
            choices = parallel.vocab_argmax(logits.flatten(0, 1)).view(len(rows), width + 1)
            for index, row in enumerate(rows):
                if row.forced:  # the prompt's own tokens, whatever the model prefers
                    ahead = list(row.forced[: width + 1])
                    choices[index, : len(ahead)] = torch.tensor(ahead, device=device)
            padded = torch.tensor([g + [-1] * (width - len(g)) for g in guesses], device=device)
            accepted, token = accept_greedy(choices, padded, torch.tensor(list(map(len, guesses)), device=device))
        else:
            verdicts = [self._verify(row, g, q, logits[index, : len(g) + 1])
                        for index, (row, g, q) in enumerate(zip(rows, guesses, drawn_from))]
            accepted, token = (torch.cat(column) for column in zip(*verdicts))
        # The round's one read-back for every row, as rank 0 decided (the greedy verdicts are
        # the same on every rank: vocab_argmax's winners come from the same gathered pairs).
        verdicts = [(int(taken), int(chosen)) for taken, chosen in read_back([accepted, token])[1]]
        outcomes = []
        for index, (row, g, f, (taken, token)) in enumerate(zip(rows, guesses, forced, verdicts)):
            model.prefix_cache.extend(row.slot, len(row.tokens) - 1, [row.tokens[-1], *g[:taken]])
            outcomes.append(Outcome(g[:taken] + [token], logits[index, : taken + 1] if want_logits else None))
            self.stats.proposed += len(g) - len(f)
            self.stats.accepted += max(0, taken - len(f))
            self.stats.verified_rows += 1
            self.stats.tokens += taken + 1
        return outcomes

    @staticmethod
    def _verify(row: Row, guesses: list[int], drawn_from: Optional[torch.Tensor],
                logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's accepted count and next token, [1] each on the device, from the target's
        logits [guesses + 1, vocab] at its last token and each guess, with the row's options
        applied at each position."""
        positions, vocab = logits.shape
        device = logits.device
        history = histories(row.tokens + guesses, positions, row.options, device)
        suppress = suppressed(row, len(row.tokens), positions, vocab, device)
        ahead = torch.tensor(list(row.forced[:positions]), dtype=torch.long, device=device)
        count = torch.tensor([len(guesses)], device=device)
        padded = torch.tensor([guesses], dtype=torch.long, device=device)
        if row.options.greedy:
            choices = choose_next(logits, row.options, history, suppress)
            choices[: len(ahead)] = ahead
            accepted, token = accept_greedy(choices[None], padded, count)
        else:
            p = distribution(logits, row.options, history, suppress)
            p[: len(ahead)] = torch.nn.functional.one_hot(ahead, vocab).to(p.dtype)
            q = None if drawn_from is None else drawn_from[None]  # None: prompt lookup's certain guesses
            accepted, token = accept_sampled(p[None], q, padded, count, row.generator)
        return accepted, token
