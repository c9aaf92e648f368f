"""The logits adjustments of structured outputs and OpenAI's sampling fields, as pure functions on
a batch of logits [rows, vocab] (or a rank's slice of the vocabulary): one call for all rows."""

import torch

# Each byte's 8 bits as booleans: unpacking a mask through this table is a third faster than
# shifting words (12 against 19 ms for 8 rows of 49152 on the loaded 2-core machine).
BYTE_BITS = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # 256, 8


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed mask [rows, ceil(vocab / 32)] int32 (bit j of word i: token 32 i + j is
    allowed) -> bool [rows, vocab]."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # rows, 4 words (little-endian: low byte first)
    return BYTE_BITS.to(bitmask.device)[as_bytes].flatten(1)[:, :vocab]


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with every token not allowed (bool [rows, vocab]) at -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def bias_logits(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """OpenAI's logit_bias: bias[i] added to logits[rows[i], tokens[i]] (three equal-length 1-d tensors)."""
    return logits.index_put((rows, tokens), bias.to(logits.dtype), accumulate=True)


def ban_logits(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits with logits[rows[i], tokens[i]] at -inf (banned words' next tokens; two equal-length 1-d tensors)."""
    return logits.index_put((rows, tokens), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def penalize_logits(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: each token's logit less frequency times the
    times it was generated, less presence once if it was. counts [rows, vocab]; presence and
    frequency [rows]."""
    counts = counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
