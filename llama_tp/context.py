"""How many tokens a model was trained to attend over, and refusing a max_seq_len beyond them.

Positions past that were never seen in training: the rotary angles there are new to the model,
and its answers fall apart (often without an error). A converted model's record says its
context (llama_tp.json's context_length); Meta's checkpoints say nothing, so their families'
published contexts are used, told apart by tokenizer and rotary settings.
"""

import os
from typing import NamedTuple, Optional

from .args import ModelArgs
from .checkpoint.record import ModelRecord
from .text.tokenizer import Llama3Tokenizer, Tokenizer

# Set to 1 to run past the trained context anyway (long-context experiments, rope scaling tests).
ALLOW_VARIABLE = "LLAMA_TP_ALLOW_LONG_CONTEXT"


class Context(NamedTuple):
    tokens: int
    source: str  # where the figure comes from, for the message


def trained_context(args: ModelArgs, tokenizer, record: ModelRecord) -> Optional[Context]:
    """The model's trained context, or None where it is not known (then nothing is refused)."""
    if record.context_length is not None:
        return Context(record.context_length, "its llama_tp.json's context_length")
    if args.use_scaled_rope:
        return Context(131072, "Llama 3.1's and 3.2's, whose rotary scaling this model has")
    if isinstance(tokenizer, Llama3Tokenizer) and args.rope_theta == 500000.0:
        return Context(8192, "Llama 3's")
    if type(tokenizer) is Tokenizer and args.rope_theta == 10000.0:  # Llama 2's SentencePiece (not Code Llama)
        return Context(4096, "Llama 2's")
    return None


def check_max_seq_len(max_seq_len: int, context: Optional[Context]) -> None:
    """Refuse a max_seq_len beyond the trained context, unless LLAMA_TP_ALLOW_LONG_CONTEXT=1."""
    if context is None or max_seq_len <= context.tokens or os.environ.get(ALLOW_VARIABLE) == "1":
        return
    raise ValueError(
        f"max_seq_len {max_seq_len} is beyond the {context.tokens} tokens this model was trained for "
        f"({context.source}): past them its answers fall apart; pass --max_seq_len {context.tokens} or less, "
        f"or set {ALLOW_VARIABLE}=1 to take that risk"
    )
