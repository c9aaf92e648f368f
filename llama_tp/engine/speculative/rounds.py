"""A round of speculative decoding: guess a few tokens for every row, verify them all in one pass
of the target, keep the guesses it agrees with and its own next token.

Where our CPU kernels run, that pass gives every position exactly the logits of a one-token step
(kv_cache.MAX_KERNEL_STEP_TOKENS), so greedy rounds choose exactly the tokens that decoding without
guesses chooses, and sampled ones follow the target's distribution (acceptance.py). What the
target's caches hold past the accepted tokens (the rejected guesses, padding) is never read:
attention reads a row only up to its own position, and the next round writes those positions
again. Every rank runs the same round, and takes rank 0's guesses and verdicts (choices.py),
so that ranks whose logits differ in the last bits still decide alike.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ... import parallel
from ..choices import read_back
from ...kernels import matmul
from ...model.transformer import Transformer
from ...sampling.sampler import distributions
from .acceptance import accept_greedy, accept_sampled
from .draft import Draft
from .lookup import lookup_guesses
from .rows import Outcome, Row, batch_histories, batch_suppressed


@dataclass
class SpeculationStats:
    """Counts since the speculator was made (or reset): how well the guesses fare."""

    proposed: int = 0  # guesses offered
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
        if model.exact_steps:
            return max(0, min(self.k, matmul.KERNEL_MAX_ROWS // rows - 1))
        return self.k

    def round(self, model: Transformer, rows: list[Row], want_logits: bool = False) -> list[Outcome]:
        """Guess, verify in one pass of the target, accept: what each row gained (at least one token)."""
        k = self.guesses_for(model, len(rows))
        fits = min(model.max_seq_len - len(row.tokens) for row in rows)  # positions left after the last
        counts = [max(0, min(k, row.room - 1, fits)) for row in rows]
        plain = not want_logits and all(row.options.takes_best_logit for row in rows)
        if self.mode == "lookup":
            guesses = [lookup_guesses(row.tokens, count) for row, count in zip(rows, counts)]
            drawn_from: Optional[torch.Tensor] = None  # certain guesses
        else:
            guesses, drawn_from = self.draft.propose(rows, counts, plain)
        width = max(map(len, guesses))
        starts = [len(row.tokens) - 1 for row in rows]
        fed = model.padded_width(width + 1, starts)  # the target's whole verifying step's, where it fits
        device = model.rotary.device
        # Each row's last token, its guesses, and padding (never accepted).
        feed = torch.tensor([[row.tokens[-1], *g, *[0] * (fed - 1 - len(g))] for row, g in zip(rows, guesses)],
                            device=device)
        logits = model.forward(feed, starts, vocab_slice=plain, slots=[row.slot for row in rows])
        logits = logits[:, : width + 1]  # rows, width + 1, vocab (or this rank's slice)
        if plain:
            choices = parallel.vocab_argmax(logits.flatten(0, 1)).view(len(rows), width + 1)
            padded = torch.tensor([g + [-1] * (width - len(g)) for g in guesses], device=device)
            accepted, token = accept_greedy(choices, padded, torch.tensor(list(map(len, guesses)), device=device))
        else:
            accepted, token = self._verify(rows, guesses, drawn_from, logits)
        # The round's one read-back for every row, as rank 0 decided (the greedy verdicts are
        # the same on every rank: vocab_argmax's winners come from the same gathered pairs).
        verdicts = [(int(taken), int(chosen)) for taken, chosen in read_back([accepted, token])[1]]
        outcomes = []
        for index, (row, g, (taken, token)) in enumerate(zip(rows, guesses, verdicts)):
            model.prefix_cache.extend(row.slot, len(row.tokens) - 1, [row.tokens[-1], *g[:taken]])
            outcomes.append(Outcome(g[:taken] + [token], logits[index, : taken + 1] if want_logits else None))
            self.stats.proposed += len(g)
            self.stats.accepted += taken
            self.stats.verified_rows += 1
            self.stats.tokens += taken + 1
        return outcomes

    @staticmethod
    def _verify(rows: list[Row], guesses: list[list[int]], drawn_from: Optional[torch.Tensor],
                logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's accepted count and next token, [rows] each on the device, from the target's
        logits [rows, width + 1, vocab] at each row's last token and guesses (padded to the
        longest), with each row's options applied at each position: one set of distributions
        for all rows, then one verdict for the greedy rows and one for the sampled.
        drawn_from [rows, width, vocab]: what the guesses were drawn from (None: certain guesses)."""
        count, positions, vocab = logits.shape
        device = logits.device
        history = None
        if any(row.options.repetition_penalty != 1.0 for row in rows):
            padded_rows = [row.tokens + g + [-1] * (positions - 1 - len(g)) for row, g in zip(rows, guesses)]
            history = batch_histories(padded_rows, positions, device).flatten(0, 1)  # rows * positions, longest
        ban = batch_suppressed(rows, [len(row.tokens) for row in rows], positions, vocab, device)
        p = distributions(logits.flatten(0, 1), [row.options for row in rows for _ in range(positions)], history,
                          None if ban is None else ban.flatten(0, 1)).view(count, positions, vocab)
        counts = torch.tensor([len(g) for g in guesses], device=device)
        padded = torch.tensor([g + [-1] * (positions - 1 - len(g)) for g in guesses], dtype=torch.long, device=device)
        accepted = torch.empty(count, dtype=torch.long, device=device)
        token = torch.empty(count, dtype=torch.long, device=device)
        greedy = [index for index, row in enumerate(rows) if row.options.greedy]
        sampled = [index for index, row in enumerate(rows) if not row.options.greedy]
        if greedy:  # each position's distribution is one-hot on its choice
            at = torch.tensor(greedy, device=device)
            accepted[at], token[at] = accept_greedy(_of(p, at).argmax(dim=-1), padded[at], counts[at])
        if sampled:
            at = torch.tensor(sampled, device=device)
            q = None if drawn_from is None else _of(drawn_from, at)
            accepted[at], token[at] = accept_sampled(_of(p, at), q, padded[at], [len(guesses[i]) for i in sampled],
                                                     [rows[i].generator for i in sampled])
        return accepted, token


def _of(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor's rows [n, ...]: without a copy when they are all of them, in order."""
    return tensor if len(rows) == len(tensor) else tensor[rows]
