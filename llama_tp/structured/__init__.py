"""Answers in the shape a program needs: grammar constraints (JSON schemas, regular expressions,
choices, EBNF grammars) through xgrammar, and the batched logits adjustments the OpenAI API's
fields ask for (logit_bias, presence and frequency penalties).

constraint.py needs nothing more than the API; grammars.py and rows.py need xgrammar (the serve
extra), so the API imports them only when a request asks for a constraint.
"""
