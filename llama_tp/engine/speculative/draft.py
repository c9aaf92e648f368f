"""The draft model's side of a round: catching up with each row, then guessing token after token.

The draft is a second Transformer (a smaller checkpoint that shares the tokenizer, or the target
itself quantized), split over the ranks as the target is, with caches of its own in the same
rows. Its PrefixCache record says what each of its cache rows holds, so each round feeds it
just what it lacks: usually the last one or two tokens (the target's own token after the
guesses it accepted, and the last of those if it never fed it), a whole prompt the first time.
"""

from typing import Optional, Sequence

import torch

from ... import parallel
from ..choices import read_back
from ...model.transformer import Transformer
from ...sampling.sampler import distributions, draw
from .rows import Row, batch_histories, batch_suppressed

# Rows that lack at most this many tokens are fed together, each from as far back as the one that
# lacks the most: after a round a row lacks its new token, and the last guess it accepted if it
# never fed that one.
CATCH_UP_TOGETHER = 2


class Draft:
    def __init__(self, model: Transformer, description: str):
        self.model = model
        self.description = description  # for people: "int8 copy of the target", a folder

    def propose(self, rows: list[Row], counts: list[int], plain: bool) -> tuple[list[list[int]], Optional[torch.Tensor]]:
        """counts[r] guesses for each row, each drawn as the row's options draw from the draft's logits; and, when some row samples, the distributions the guesses
        were drawn from, [rows, most guesses, vocab] (what a greedy row's hold, or a row's past
        its count, is never read).

        plain: every row is plain greedy, so the draft's best token is picked from vocabulary
        slices (parallel.vocab_argmax) without gathering its logits.
        """
        guesses: list[list[int]] = [[] for _ in rows]
        steps = max(counts, default=0)
        chosen = [r for r, count in enumerate(counts) if count > 0]
        if not steps:
            return guesses, None
        logits = self.catch_up([rows[r].slot for r in chosen], [rows[r].tokens for r in chosen], plain)
        drawn_from = []
        for step in range(steps):
            picks, probs = self._pick([rows[r] for r in chosen], [guesses[r] for r in chosen],
                                      [counts[r] for r in chosen], logits, plain)
            drawn_from.append(probs)
            for r, token in zip(chosen, picks):
                guesses[r].append(token)
            if step + 1 < steps:
                starts = [len(rows[r].tokens) + step for r in chosen]
                logits = self._forward([[token] for token in picks], starts, [rows[r].slot for r in chosen], plain)
        guesses = [g[:count] for g, count in zip(guesses, counts)]
        if plain or all(rows[r].options.greedy for r in chosen):
            return guesses, None
        q = torch.stack(drawn_from, dim=1)  # chosen, steps, vocab
        if len(chosen) < len(rows):
            index = torch.tensor(chosen, device=q.device)
            q = q.new_zeros(len(rows), *q.shape[1:]).index_copy_(0, index, q)
        return guesses, q

    def catch_up(self, slots: Sequence[int], sequences: Sequence[list[int]], plain: bool) -> torch.Tensor:
        """Feed the draft what it lacks of each sequence, its last token at least, in cache row
        slots[r]: the logits predicting each sequence's next token, [rows, vocab] (or this
        rank's slice).

        Rows that lack a token or two (every round's case) are fed in one pass; rows that lack
        more (a prompt), in one pass for each sequence length.
        """
        cache = self.model.prefix_cache
        lacking = [len(tokens) - cache.reusable(slot, tokens) for slot, tokens in zip(slots, sequences)]
        groups: dict[int, list[int]] = {}  # by length; 0: the rows that lack little
        for index, (tokens, lack) in enumerate(zip(sequences, lacking)):
            groups.setdefault(0 if lack <= CATCH_UP_TOGETHER <= len(tokens) else len(tokens), []).append(index)
        logits: list[Optional[torch.Tensor]] = [None] * len(slots)
        for group in groups.values():
            # Every row's feed ends at its last token; one that holds more feeds some of it again:
            # the same tokens at the same positions, so the same keys and values.
            width = max(lacking[index] for index in group)
            starts = [len(sequences[index]) - width for index in group]
            fed = self._forward([sequences[index][start:] for index, start in zip(group, starts)], starts,
                                [slots[index] for index in group], plain)
            for row, index in enumerate(group):
                logits[index] = fed[row]
        return torch.stack(logits)

    def _forward(self, tokens: list[list[int]], starts: list[int], slots: list[int], plain: bool) -> torch.Tensor:
        """The draft's logits after tokens [rows, n] fed from starts in slots, [rows, vocab or slice]."""
        feed = torch.tensor(tokens, device=self.model.rotary.device)
        logits = self.model.forward(feed, starts, last_only=True, vocab_slice=plain, slots=slots)[:, -1]
        for slot, start, fed in zip(slots, starts, tokens):
            self.model.prefix_cache.extend(slot, start, fed)
        return logits

    @staticmethod
    def _pick(rows: list[Row], guesses: list[list[int]], counts: list[int], logits: torch.Tensor,
              plain: bool) -> tuple[list[int], Optional[torch.Tensor]]:
        """Each row's next guess from the draft's logits [rows, vocab], all rows at once, drawn as
        the row draws (a row past its count draws nothing); and unless plain, the distributions
        they were drawn from [rows, vocab]."""
        if plain:
            return parallel.vocab_argmax(logits).tolist(), None
        device, vocab = logits.device, logits.shape[-1]
        history = None
        if any(row.options.repetition_penalty != 1.0 for row in rows):
            history = batch_histories([row.tokens + g for row, g in zip(rows, guesses)], 1, device)[:, 0]
        ban = batch_suppressed(rows, [len(row.tokens) + len(g) for row, g in zip(rows, guesses)], 1, vocab, device)
        probs = distributions(logits, [row.options for row in rows], history, None if ban is None else ban[:, 0])
        tokens = probs.argmax(dim=-1)  # a greedy row's best token: its distribution is one-hot
        sampling = [index for index, (row, g, count) in enumerate(zip(rows, guesses, counts))
                    if not row.options.greedy and len(g) < count]
        if sampling:
            drawn = draw(probs, sampling, [row.generator for row in rows])
            tokens = tokens.index_put((torch.tensor(sampling, device=device),), drawn)
        # Read back once for every row, as rank 0 drew them: a rank whose draft drew otherwise
        # would record other tokens in its draft's cache and feed it other passes later.
        return [int(row[0]) for row in read_back([tokens])[1]], probs
