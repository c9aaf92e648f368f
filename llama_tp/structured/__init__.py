"""Answers in the shape a program needs: grammar constraints (JSON schemas, regular expressions,
choices, EBNF grammars) through xgrammar, and the batched logits adjustments the OpenAI API's
fields ask for (logit_bias, presence and frequency penalties)."""

from .constraint import Constraint
from .grammars import Grammars, grammars_for
from .rows import RowAdjustment, adjust_rows, make_adjustment

__all__ = ["Constraint", "Grammars", "grammars_for", "RowAdjustment", "adjust_rows", "make_adjustment"]
