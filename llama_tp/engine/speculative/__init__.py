"""Speculative decoding: guess a few tokens cheaply, verify them in one pass of the target.

At small batches a decoding step is bound by reading the weights, and a pass over a few tokens
a row costs about what a pass over one does: every guess the target agrees with is a token for
free. Two ways to guess:

- "draft": a smaller model sharing the tokenizer, or the target itself quantized (draft.py);
- "lookup": tokens copied from where the row's last tokens appeared before (lookup.py).

rounds.py runs a round over the engine's generating rows; acceptance.py decides which guesses
stand; options.py checks the options and makes the speculator (checkpoint/draft.py loads the draft).
"""

from .options import SPECULATE_MODES, check_speculation, guesses_a_round, make_speculator
from .rounds import SpeculationStats, Speculator
from .rows import Outcome, Row

__all__ = ["SPECULATE_MODES", "Outcome", "Row", "SpeculationStats", "Speculator", "check_speculation",
           "guesses_a_round", "make_speculator"]
