"""Speculative decoding: guess a few tokens cheaply, verify them in one pass of the target.

At small batches a decoding step is bound by reading the weights, and a pass over a few tokens
a row costs about what a pass over one does: every guess the target agrees with is a token for
free. Two ways to guess:

- "draft": a smaller model sharing the tokenizer, or the target itself quantized (draft.py);
- "lookup": tokens copied from where the row's last tokens appeared before (lookup.py).

rounds.py runs a round over a batch of rows (the generation API's, decoding.py; the server's);
acceptance.py decides which guesses stand; setup.py checks the options and loads the draft.
"""

from .rounds import SpeculationStats, Speculator
from .rows import Outcome, Row
from .setup import SPECULATE_MODES, build_speculator, check_speculation

__all__ = ["SPECULATE_MODES", "Outcome", "Row", "SpeculationStats", "Speculator", "build_speculator",
           "check_speculation"]
