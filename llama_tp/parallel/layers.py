"""fairscale's model-parallel layers, built without initialising their weights and talking to the
other ranks through `collectives`."""

from contextlib import contextmanager
from typing import Callable, Iterator, Literal

import torch
from fairscale.nn.model_parallel import layers as fairscale_layers

from ..kernels import matmul
from .collectives import all_gather_last_dim, all_reduce

# Llama 2 checkpoints split the token embedding along the model dimension (fairscale's
# ParallelEmbedding), Llama 3 along the vocabulary (VocabParallelEmbedding).
EmbeddingLayout = Literal["dim", "vocab"]


def column_parallel_linear(in_features: int, out_features: int, gather_output: bool) -> torch.nn.Module:
    """y = x W^T with W split by output rows; each rank computes its slice of y."""
    with _skip_weight_init():
        return _ColumnParallelLinear(
            in_features, out_features, bias=False, gather_output=gather_output, init_method=_keep
        )


class _ColumnParallelLinear(fairscale_layers.ColumnParallelLinear):
    """fairscale's layer without its autograd wrapper around the input, which only matters for
    training and cost ~30 us per call: 5 of the ~80 ms of a one-thread decode step."""

    weight_packed = False  # the weight is in oneDNN's layout (matmul.pack); set by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul.linear(x, self.weight, self.weight_packed)
        return all_gather_last_dim(y) if self.gather_output else y


def row_parallel_linear(in_features: int, out_features: int, reduce: bool = True) -> torch.nn.Module:
    """y = x W^T with W split by input columns; partial products are summed across ranks, or with
    reduce=False left as this rank's part, for the caller to sum with others in one all-reduce
    (a mixture of experts' outputs, as Meta's Llama 4 does)."""
    with _skip_weight_init():
        layer = _RowParallelLinear(
            in_features, out_features, bias=False, input_is_parallel=True, init_method=_keep
        )
    layer.reduce = reduce
    return layer


class _RowParallelLinear(fairscale_layers.RowParallelLinear):
    """fairscale's layer, summing partial products through collectives.all_reduce (shared memory on CPU)."""

    weight_packed = False  # as _ColumnParallelLinear's
    reduce = True  # whether the partial products are summed here (row_parallel_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul.linear(x, self.weight, self.weight_packed)
        return all_reduce(y) if self.reduce else y


def parallel_embedding(vocab_size: int, dim: int, layout: EmbeddingLayout) -> torch.nn.Module:
    with _skip_weight_init():
        if layout == "dim":
            return _ParallelEmbedding(vocab_size, dim, init_method=_keep)
        return _VocabParallelEmbedding(vocab_size, dim, init_method=_keep)


class _ParallelEmbedding(fairscale_layers.ParallelEmbedding):
    """fairscale's layer (each rank holds some of the model dimension), gathered by all_gather_last_dim."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(torch.nn.functional.embedding(tokens, self.weight))


class _VocabParallelEmbedding(fairscale_layers.VocabParallelEmbedding):
    """fairscale's layer (each rank holds some of the vocabulary), summing through all_reduce."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        elsewhere = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local = torch.where(elsewhere, 0, tokens - self.vocab_start_index)
        rows = torch.nn.functional.embedding(local, self.weight).masked_fill(elsewhere[..., None], 0.0)
        return all_reduce(rows)


def _keep(weight: torch.Tensor) -> torch.Tensor:
    return weight


@contextmanager
def _skip_weight_init() -> Iterator[None]:
    """Build fairscale layers without initialising their weights.

    Above one process fairscale builds a full-size master weight on every rank and copies this
    rank's slice out of it: pure waste (and the whole model in memory) when real weights are
    loaded right after. Left untouched, the freshly allocated weights cost no resident memory.
    """
    original = fairscale_layers._initialize_affine_weight
    fairscale_layers._initialize_affine_weight = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fairscale_layers._initialize_affine_weight = original


def communication_after(layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a parallel linear layer does with its local product in inference: all-reduce (row
    parallel), all-gather (column parallel gathering its output) or nothing; for layers that
    replace one's matrix product (quantized weights) but must talk to the other ranks the same way."""
    if isinstance(layer, fairscale_layers.RowParallelLinear):
        return all_reduce if getattr(layer, "reduce", True) else _keep
    if isinstance(layer, fairscale_layers.ColumnParallelLinear):
        return all_gather_last_dim if layer.gather_output else _keep
    raise TypeError(f"{type(layer).__name__} is not one of fairscale's parallel linear layers")
