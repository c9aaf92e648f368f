"""A running sequence's own state beside its tokens (the scheduler's Sequence.sampling): how it
samples, what it has generated and what of that its request keeps."""

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..structured.rows import RowAdjustment
from ..text.streaming import IncrementalDecoder
from .requests import TokenLogprob

Candidates = tuple[tuple[int, float], ...]  # (token, probability), most likely first


@dataclass
class Progress:
    """Its random generator and adjustments; where text is watched (a server, a stream, stop
    strings), the decoder that turns its answer into text; and the answer as it grows."""

    generator: torch.Generator
    decoder: Optional[IncrementalDecoder]
    adjustment: Optional[RowAdjustment] = None  # its grammar, logit_bias, penalties (None: free)
    answer: list[int] = field(default_factory=list)  # generated tokens, without a stop token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the answer's, where the request asks
    candidates: list[Candidates] = field(default_factory=list)  # each step's likeliest, where asked (show_top)
    # Each prompt token's log probability (0 for the first), where asked: the prompt is computed whole.
    prompt_logprobs: list[float] = field(default_factory=list)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    ended: Optional[str] = None  # why it ended, once it has (its blocks are given back then)
