"""Choosing the next token: the options an answer samples with (options.py), the rule for one set
of them (rule.py), and every row of a step sampled in one call, each by its own options
(sampler.py)."""

from .options import SamplingOptions, check_given
from .rule import (adjust_logits, choose_next, distribution, next_token, sample_top_p, seen_in, stop_ban,
                   top_candidates)

__all__ = ["SamplingOptions", "adjust_logits", "check_given", "choose_next", "distribution", "next_token",
           "sample_top_p", "seen_in", "stop_ban", "top_candidates"]
