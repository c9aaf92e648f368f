"""Which tensor is split along which dimension, and the pieces of which shards make up a rank's slice.

Pure functions over shapes and in-memory shards; reading files is loading.py's business.
"""

from typing import Callable, NamedTuple, Optional

import torch

from ..model.args import ModelArgs
from ..parallel import EmbeddingLayout

# Split along the output dimension (dim 0) by fairscale's ColumnParallelLinear ...
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "output")
# ... and along the input dimension (dim 1) by RowParallelLinear. Norms are replicated.
ROW_PARALLEL = ("wo", "w2")
# Column-parallel too, but with more ranks than KV heads each rank holds a copy of one head.
KV_PROJECTIONS = ("wk", "wv")


def split_dim(name: str, layout: EmbeddingLayout) -> Optional[int]:
    """The dimension along which tensor `name` is split across shards, or None if replicated."""
    module = name.split(".")[-2]  # layers.0.attention.wq.weight -> wq
    if module == "tok_embeddings":
        return 1 if layout == "dim" else 0
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1
    return None


class Piece(NamedTuple):
    """Part of a rank's slice: `length` entries from `offset` on, along the split dimension of shard `source`."""

    source: int
    offset: int
    length: int


def shard_ranges(name: str, full_size: int, args: ModelArgs, n_shards: int,
                 head_copies: bool = True) -> list[tuple[int, int]]:
    """The [start, stop) of the full tensor's split dimension that each of n_shards holds.

    head_copies: with more shards than KV heads, whether each shard of wk/wv holds a copy of the
    one head its query heads use (Meta's and llama_tp's layout), rather than an even split of the
    rows (half a head each, as a tool that splits every tensor alike writes them).
    """
    if name.split(".")[-2] in KV_PROJECTIONS and n_shards > args.kv_heads and head_copies:
        group = n_shards // args.kv_heads
        return [((r // group) * args.head_dim, (r // group + 1) * args.head_dim) for r in range(n_shards)]
    assert full_size % n_shards == 0, f"{name}: {full_size} does not split {n_shards} ways"
    size = full_size // n_shards
    return [(r * size, (r + 1) * size) for r in range(n_shards)]


def pieces_for(want: tuple[int, int], held: list[tuple[int, int]], prefer: int) -> list[Piece]:
    """The pieces of the shards holding ranges `held` that make up range `want`, in order.

    Where several shards hold the same entries (replicated KV heads), shard `prefer` is read if
    it is one of them, else the first: a rank then reads its own file when the counts match.
    """
    pieces = []
    cursor, stop = want
    while cursor < stop:
        holders = [s for s, (start, end) in enumerate(held) if start <= cursor < end]
        assert holders, f"no shard holds entry {cursor} of {held}"
        source = prefer if prefer in holders else holders[0]
        start, end = held[source]
        length = min(stop, end) - cursor
        pieces.append(Piece(source, cursor - start, length))
        cursor += length
    return pieces


def full_size(name: str, shard_size: int, args: ModelArgs, n_shards: int) -> int:
    """The size of tensor `name`'s split dimension in the whole model, from its size in one shard."""
    if name.split(".")[-2] in KV_PROJECTIONS:
        # Checked against params.json: replicated heads would otherwise go unnoticed.
        expected = args.kv_heads * args.head_dim
        if shard_size * min(n_shards, args.kv_heads) != expected and shard_size * n_shards != expected:
            raise ValueError(
                f"{name} has {shard_size} rows per shard in a {n_shards}-shard checkpoint, which does "
                f"not make {args.kv_heads} KV heads of size {args.head_dim}; check that params.json "
                "belongs to these shards"
            )
        return expected
    return shard_size * n_shards


def holds_head_copies(name: str, shard_size: int, args: ModelArgs, n_shards: int) -> bool:
    """Whether shards of wk/wv that outnumber the KV heads hold whole heads (copies), told from
    their rows: a head's worth, where an even split of the rows holds less."""
    return n_shards <= args.kv_heads or shard_size == args.head_dim


def slice_plan(name: str, shard_shape: tuple[int, ...], args: ModelArgs, layout: EmbeddingLayout,
               n_shards: int, rank: int, world_size: int) -> tuple[Optional[int], list[Piece]]:
    """How rank `rank` of world_size assembles tensor `name` from n_shards shards of shape shard_shape.

    Returns the split dimension (None: replicated, read whole) and the pieces to concatenate along it.
    """
    dim = split_dim(name, layout)
    prefer = rank if rank < n_shards else 0
    if dim is None:
        return None, [Piece(prefer, 0, 0)]  # the whole tensor: offset and length unused
    size = full_size(name, shard_shape[dim], args, n_shards)
    want = shard_ranges(name, size, args, world_size)[rank]
    copies = dim == 0 and holds_head_copies(name, shard_shape[0], args, n_shards)
    return dim, pieces_for(want, shard_ranges(name, size, args, n_shards, copies), prefer)


def assemble_slice(open_shard: Callable[[int], dict[str, torch.Tensor]], n_shards: int, args: ModelArgs,
                   layout: EmbeddingLayout, rank: int, world_size: int, device: torch.device,
                   dtype: Optional[torch.dtype] = None, describe: Callable[[int], str] = str,
                   release: Callable[[torch.Tensor], None] = lambda tensor: None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors for a world of world_size, from a checkpoint of n_shards shards.

    open_shard(s) returns shard s; each shard is opened once, in order, and dropped before the
    next. A tensor that is one whole source tensor is returned as it is (a memory-mapped tensor
    stays mapped, read when first used); any other is written piece by piece into a new tensor,
    and release(source tensor) is called once its piece is copied. Tensors keep their dtype
    unless one is given, and own their storage.
    """
    shard = open_shard(0)
    shapes = {name: tuple(t.shape) for name, t in shard.items()}
    plans = {name: slice_plan(name, shape, args, layout, n_shards, rank, world_size)
             for name, shape in shapes.items()}
    state: dict[str, torch.Tensor] = {}
    for source in range(n_shards):
        wanted = [(name, index, piece) for name, (_, pieces) in plans.items()
                  for index, piece in enumerate(pieces) if piece.source == source]
        if wanted and source > 0:
            shard = open_shard(source)
        for name, index, piece in wanted:
            dim, pieces = plans[name]
            tensor = _tensor(shard, name, shapes[name], describe(source))
            if dim is None or len(pieces) == 1 and piece.length == tensor.shape[dim]:
                state[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
                if state[name].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
                    release(tensor)
                continue
            if name not in state:
                shape = list(tensor.shape)
                shape[dim] = sum(p.length for p in pieces)
                state[name] = torch.empty(shape, dtype=dtype or tensor.dtype, device=device)
            position = sum(p.length for p in pieces[:index])
            state[name].narrow(dim, position, piece.length).copy_(tensor.narrow(dim, piece.offset, piece.length))
            release(tensor)
        shard = None  # unmaps the file once nothing of it is kept
    return state


def _tensor(shard: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """shard[name], which must have the shape it has in the first shard (all shards are alike)."""
    if name not in shard or tuple(shard[name].shape) != shape:
        found = list(shard[name].shape) if name in shard else "no such tensor"
        raise ValueError(
            f"{source}: {name} is {found} where the first shard has {list(shape)}; the shards "
            "do not belong to one checkpoint"
        )
    return shard[name]
