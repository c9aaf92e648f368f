"""What a round of speculation is told about each row, and what it gives back."""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...sampling import SamplingOptions, stop_ban


@dataclass
class Row:
    """A row of a batch at the start of a round."""

    slot: int  # its cache row, in the target's caches and the draft's
    tokens: list[int]  # the row so far: the target's cache holds all but the last
    options: SamplingOptions
    generator: Optional[torch.Generator]  # None: torch's global one
    prompt_length: int  # min_gen_len counts the tokens after it
    stop_tokens: Sequence[int]  # impossible while fewer than min_gen_len tokens are generated
    room: int  # the most tokens this round may add: the row ends after them


@dataclass
class Outcome:
    """What a round added to a row."""

    tokens: list[int]  # the accepted guesses, then the target's own token
    logits: Optional[torch.Tensor] = None  # when asked: the target's logits predicting each, [len(tokens), vocab]


def histories(tokens: list[int], positions: int, options: SamplingOptions,
              device: torch.device) -> Optional[torch.Tensor]:
    """What the repetition penalty sees at the last `positions` predictions over tokens: the last
    sees every token, each one before it one fewer. [positions, len(tokens)], -1 for a token not
    seen yet; None without a penalty."""
    if options.repetition_penalty == 1.0:
        return None
    return batch_histories([tokens], positions, device)[0]


def batch_histories(sequences: Sequence[Sequence[int]], positions: int, device: torch.device) -> torch.Tensor:
    """histories for several rows at once, whatever their options: [rows, positions, longest],
    -1 for a token not seen yet or past a row's end. A row's sequence may end in -1s (padding)."""
    longest = max(map(len, sequences))
    ids = torch.tensor([[*tokens, *[-1] * (longest - len(tokens))] for tokens in sequences], device=device)
    first = torch.tensor([len(tokens) - positions + 1 for tokens in sequences], device=device)
    seen = first[:, None] + torch.arange(positions, device=device)  # rows, positions
    hidden = torch.arange(longest, device=device) >= seen[..., None]  # rows, positions, longest
    return ids[:, None, :].expand(-1, positions, -1).masked_fill(hidden, -1)


def suppressed(row: Row, position: int, positions: int, vocab: int, device: torch.device) -> Optional[torch.Tensor]:
    """The row's stop tokens, banned at each of `positions` consecutive positions from position
    while fewer than min_gen_len tokens come before: [positions, vocab] bool, or None if none is."""
    min_gen_len = row.options.min_gen_len
    if not min_gen_len or position - row.prompt_length >= min_gen_len:
        return None
    generated = position - row.prompt_length + torch.arange(positions, device=device)
    return stop_ban(generated, min_gen_len, sorted(row.stop_tokens), vocab)


def batch_suppressed(rows: Sequence[Row], positions_from: Sequence[int], positions: int, vocab: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """suppressed for several rows at once, row r's from positions_from[r]: [rows, positions, vocab]
    bool, or None if no row bans anything."""
    bans = [suppressed(row, position, positions, vocab, device) for row, position in zip(rows, positions_from)]
    if all(ban is None for ban in bans):
        return None
    nothing = torch.zeros(positions, vocab, dtype=torch.bool, device=device)
    return torch.stack([nothing if ban is None else ban for ban in bans])
