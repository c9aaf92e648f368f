"""Each answer's adjustments (its grammar's state, logit_bias, penalties, banned words) and the one
batched call that applies them all to a step's logits, wherever the engine samples.

Every rank holds the same RowAdjustments and feeds them the same tokens, so every rank computes
the same mask itself: filling a mask takes microseconds a row, while sending it from rank 0 would
add a collective (and vocab / 8 bytes a row) to every step.

xgrammar (the `serve` extra) is imported only where a request asks for a grammar: logit_bias and
the penalties work without it.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..text.reasoning import Thinking
from .bad_words import banned_next
from .constraint import Constraint
from .logits import allowed_tokens, ban_logits, bias_logits, mask_logits, penalize_logits

if TYPE_CHECKING:
    import xgrammar

    from .grammars import Grammars


@dataclass
class RowAdjustment:
    """One answer's adjustments: None of each when not asked."""

    matcher: Optional["xgrammar.GrammarMatcher"] = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    counts: dict[int, int] = field(default_factory=dict)  # generated tokens, for the penalties
    # A reasoning model's answer: its grammar holds the text after the thinking, never inside it.
    thinking: Optional[Thinking] = None
    thinks: Optional[bool] = False  # inside the thinking (no mask); None: the first token may open it
    bad_words: tuple[tuple[int, ...], ...] = ()  # banned words' token sequences (bad_words.py)

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def masks(self) -> bool:
        """Whether the grammar masks this step's logits."""
        return self.matcher is not None and not self.matcher.is_terminated() and self.thinks is not True

    def accept(self, token: int) -> bool:
        """The answer's next token, chosen: advance the grammar, count it. False where the grammar
        refuses it: only where its mask allowed no token at all (the row's logits were all -inf,
        and the sampler took a token anyway), so the answer cannot go on."""
        if self.matcher is not None and self._after_thinking(token) and not self.matcher.is_terminated():
            if not self.matcher.accept_token(token):
                return False
        if self.penalizes:
            self.counts[token] = self.counts.get(token, 0) + 1
        return True

    def _after_thinking(self, token: int) -> bool:
        """Whether token belongs to the answer after the thinking; moves past the thinking's tags."""
        if self.thinks is None:  # the first token: the start tag opens the thinking, else the answer begins
            self.thinks = token == self.thinking.start_token
            return not self.thinks
        if self.thinks:
            self.thinks = token != self.thinking.end_token
            return False
        return True


def make_adjustment(grammars: "Callable[[], Grammars]", constraint: Optional[Constraint] = None,
                    logit_bias: tuple = (), presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    thinking: Optional[Thinking] = None,
                    grammar: Optional["xgrammar.CompiledGrammar"] = None,
                    bad_words: tuple[tuple[int, ...], ...] = ()) -> Optional[RowAdjustment]:
    """A new answer's adjustments, or None when it asks for none. grammars: the model's compiled
    grammars, made when asked for (the first constraint). thinking: a reasoning model's answer,
    whose constraint waits for the end of its thinking. grammar: the constraint's, compiled
    already (else it is compiled, or taken from the cache, here). bad_words: the token sequences
    of the words it may not hold."""
    if constraint is None and not logit_bias and not presence_penalty and not frequency_penalty and not bad_words:
        return None
    matcher = None
    if constraint is not None:
        if grammar is not None:
            from .grammars import xgrammar

            matcher = xgrammar.GrammarMatcher(grammar)
        else:
            matcher = grammars().matcher(constraint)
    if matcher is None or thinking is None:
        return RowAdjustment(matcher, tuple(logit_bias), presence_penalty, frequency_penalty, bad_words=bad_words)
    return RowAdjustment(matcher, tuple(logit_bias), presence_penalty, frequency_penalty, thinking=thinking,
                         thinks=True if thinking.opened else None, bad_words=bad_words)


def adjust_rows(rows: Sequence[Optional[RowAdjustment]], logits: torch.Tensor, vocab_start: int = 0,
                vocab_size: Optional[int] = None, tokens: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """logits [rows, width] (the vocabulary from vocab_start on: a rank's slice, or all of it) with
    each row's adjustments applied; rows without any (None) are left as they are, and a batch
    without any costs nothing. vocab_size: the whole vocabulary's (default: width). tokens: each
    row's tokens so far, where a row bans words."""
    if all(row is None for row in rows):
        return logits
    width = logits.shape[-1]
    vocab_size = vocab_size or vocab_start + width
    device = logits.device
    constrained = [index for index, row in enumerate(rows) if row is not None and row.masks]
    if constrained:
        from .grammars import xgrammar  # a row holds a matcher: its grammar was compiled by xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(constrained), vocab_size)
        for place, index in enumerate(constrained):
            rows[index].matcher.fill_next_token_bitmask(bitmask, place)
            if rows[index].thinks is None:  # a reasoning model's first token may open its thinking
                allow_token(bitmask, place, rows[index].thinking.start_token)
        picked = torch.tensor(constrained, device=device)
        rows_logits = logits[picked]
        if vocab_start == 0 and width == vocab_size and rows_logits.dtype == torch.float32:
            # the whole vocabulary: xgrammar's own kernel, twice as fast as unpacking the bits
            xgrammar.apply_token_bitmask_inplace(rows_logits, bitmask.to(device))
        else:  # a rank's slice: its part of the mask
            allowed = allowed_tokens(bitmask, vocab_size)[:, vocab_start : vocab_start + width].to(device)
            rows_logits = mask_logits(rows_logits, allowed)
        logits = logits.index_copy(0, picked, rows_logits)
    biased = [(index, token - vocab_start, bias) for index, row in enumerate(rows) if row is not None
              for token, bias in row.logit_bias if vocab_start <= token < vocab_start + width]
    if biased:
        indices, tokens, bias = zip(*biased)
        logits = bias_logits(logits, torch.tensor(indices, device=device), torch.tensor(tokens, device=device),
                             torch.tensor(bias, device=device))
    banned = [(index, token - vocab_start) for index, row in enumerate(rows) if row is not None and row.bad_words
              for token in banned_next(tokens[index], row.bad_words) if vocab_start <= token < vocab_start + width]
    if banned:
        indices, columns = zip(*banned)
        logits = ban_logits(logits, torch.tensor(indices, device=device), torch.tensor(columns, device=device))
    penalized = [index for index, row in enumerate(rows) if row is not None and row.penalizes]
    if penalized:
        counts = torch.zeros(len(penalized), width, device=device)
        for place, index in enumerate(penalized):
            for token, count in rows[index].counts.items():
                if vocab_start <= token < vocab_start + width:
                    counts[place, token - vocab_start] = count
        picked = torch.tensor(penalized, device=device)
        presence = torch.tensor([rows[index].presence_penalty for index in penalized], device=device)
        frequency = torch.tensor([rows[index].frequency_penalty for index in penalized], device=device)
        logits = logits.index_copy(0, picked, penalize_logits(logits[picked], counts, presence, frequency))
    return logits


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token's bit in row of xgrammar's packed mask (int32 words: bit j of word i is token 32 i + j)."""
    word, bit = divmod(token, 32)
    bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # bit 31 is the int32's sign
