"""A step's choices as the host reads them: once a step for all rows, and as rank 0 made them.

Every rank computes the logits and samples, but ranks whose logits differ in their last bits
(GPUs of different models or drivers) could choose different tokens, then disagree on which rows
end, and wait for each other in a collective until the timeout. So the choices travel from
model-parallel rank 0 to the others (parallel.from_first_rank) in the same small tensor the host
reads back: tokens, whether the sampler's nucleus needs a full sort, and what the caller adds
(log probabilities, the likeliest alternatives), all as float64 columns [rows, n].
"""

from typing import Callable, Sequence

import torch

from .. import parallel
from ..sampling.sampler import Draw

Columns = Callable[[torch.Tensor], Sequence[torch.Tensor]]


def read_back(columns: Sequence[torch.Tensor], exchange: bool = False) -> tuple[torch.Tensor, list[list[float]]]:
    """Rank 0's columns side by side (each [rows] or [rows, n]): [rows, total] float64 on the
    device, and the same on the host, in one copy. exchange: sent from rank 0 even where the ranks
    compute alike (rank 0 alone ran the step's logits processors)."""
    rows = len(columns[0])
    matrix = parallel.from_first_rank(torch.cat([column.double().reshape(rows, -1) for column in columns], dim=-1),
                                      always=exchange)
    return matrix, matrix.tolist()


def agreed_tokens(draw: Draw, more: Columns = lambda tokens: (),
                  exchange: bool = False) -> tuple[torch.Tensor, list[list[float]]]:
    """The step's tokens [rows] on the device as rank 0 chose them, and per row on the host
    [token, unsettled, *more(tokens)'s columns]: one read-back, two where some row's nucleus
    reaches past the sampler's candidates (then settled with a full sort, as rank 0 says)."""
    matrix, rows = read_back([draw.tokens, _unsettled(draw), *more(draw.tokens)], exchange)
    if draw.unsettled is not None and any(row[1] for row in rows):
        tokens = draw.settle([bool(row[1]) for row in rows])
        matrix, rows = read_back([tokens, torch.zeros_like(tokens), *more(tokens)], exchange)
    return matrix[:, 0].long(), rows


def _unsettled(draw: Draw) -> torch.Tensor:
    return torch.zeros_like(draw.tokens) if draw.unsettled is None else draw.unsettled
