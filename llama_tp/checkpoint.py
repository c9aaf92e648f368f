"""Meta's checkpoint layout: which tensor is split along which dimension, and loading one rank's slice.

A checkpoint may have any number of shards: each rank assembles its own slice from the shards
that hold parts of it (merging when there are more shards than ranks, splitting when fewer),
reading them memory-mapped so that no rank ever holds the whole model.
"""

import pickle
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from .args import ModelArgs
from .model import Transformer
from .parallel import EmbeddingLayout, Placement

# Split along the output dimension (dim 0) by fairscale's ColumnParallelLinear ...
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "output")
# ... and along the input dimension (dim 1) by RowParallelLinear. Norms are replicated.
ROW_PARALLEL = ("wo", "w2")
# Real Llama 2 shards carry the rotary table, which the model computes itself.
TOLERATED_EXTRA_KEYS = ("rope.freqs",)


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


def shard_paths(ckpt_dir: Path) -> list[Path]:
    """The consolidated.XX.pth files of a checkpoint folder, in rank order."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(
            f"checkpoint directory {ckpt_dir} does not exist; pass --ckpt_dir with the folder "
            "that holds params.json and consolidated.XX.pth"
        )
    paths = sorted(ckpt_dir.glob("consolidated.*.pth"))
    if not paths:
        raise FileNotFoundError(
            f"no consolidated.XX.pth shard in {ckpt_dir}; pass --ckpt_dir with the folder that "
            "holds the model's shards"
        )
    expected = [ckpt_dir / f"consolidated.{i:02d}.pth" for i in range(len(paths))]
    if paths != expected:
        raise ValueError(
            f"the shards in {ckpt_dir} are {', '.join(p.name for p in paths)}; expected "
            f"consolidated.00.pth to consolidated.{len(paths) - 1:02d}.pth with none missing"
        )
    return paths


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one shard, memory-mapped: nothing is read until used."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError) as error:
        raise ValueError(
            f"{path} is not a readable torch checkpoint ({str(error).splitlines()[0]}); the file "
            "may be truncated or corrupt: download or convert it again"
        ) from None


def detect_embedding_layout(shard: dict[str, torch.Tensor], args: ModelArgs, n_shards: int) -> EmbeddingLayout:
    """Tell Llama 2's dim-split embedding from Llama 3's vocab-split one by the shard's shape."""
    rows, cols = _shape(shard, "tok_embeddings.weight", dims=2)
    if rows == args.vocab_size and cols * n_shards == args.dim:
        return "dim"
    if rows * n_shards == args.vocab_size and cols == args.dim:
        return "vocab"
    raise ValueError(
        f"tok_embeddings.weight of shape [{rows}, {cols}] in a {n_shards}-shard checkpoint fits "
        f"neither layout for vocab_size {args.vocab_size} and dim {args.dim}: expected "
        f"[{args.vocab_size}, {args.dim // n_shards}] or [{args.vocab_size // n_shards}, {args.dim}]"
        "; check that params.json and the tokenizer belong to these shards"
    )


def checkpoint_vocab_size(shard: dict[str, torch.Tensor], n_shards: int) -> int:
    """The vocabulary the checkpoint was trained with: output.weight rows times the shard count."""
    rows, _ = _shape(shard, "output.weight", dims=2)
    return rows * n_shards


def load_into(model: nn.Module, shard: dict[str, torch.Tensor], device: torch.device,
              dtype: torch.dtype, source: Path) -> None:
    """Move this rank's tensors into the model strictly: every key present, every shape right."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(shard))
    unexpected = sorted(set(shard) - set(expected) - set(TOLERATED_EXTRA_KEYS))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model described by params.json: "
            f"missing {_listing(missing)}, unexpected {_listing(unexpected)}; check that "
            "params.json belongs to these shards"
        )
    state = {}
    for name, target in expected.items():
        tensor = shard[name]
        if tensor.shape != target.shape:
            raise ValueError(
                f"{source}: {name} has shape {list(tensor.shape)} but this rank's slice of the "
                f"model needs {list(target.shape)}; check params.json and the number of processes"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)


class Piece(NamedTuple):
    """Part of a rank's slice: `length` entries from `offset` on, along the split dimension of shard `source`."""

    source: int
    offset: int
    length: int


def shard_ranges(name: str, full_size: int, args: ModelArgs, n_shards: int) -> list[tuple[int, int]]:
    """The [start, stop) of the full tensor's split dimension that each of n_shards holds."""
    if name.split(".")[-2] in ("wk", "wv") and n_shards > args.kv_heads:
        # More shards than KV heads: shard r keeps a copy of the one head its query heads use.
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
    if name.split(".")[-2] in ("wk", "wv"):
        # Checked against params.json: replicated heads would otherwise go unnoticed.
        expected = args.kv_heads * args.head_dim
        if shard_size * min(n_shards, args.kv_heads) != expected:
            raise ValueError(
                f"{name} has {shard_size} rows per shard in a {n_shards}-shard checkpoint, which does "
                f"not make {args.kv_heads} KV heads of size {args.head_dim}; check that params.json "
                "belongs to these shards"
            )
        return expected
    return shard_size * n_shards


def slice_plan(name: str, shard_shape: tuple[int, ...], args: ModelArgs, layout: EmbeddingLayout,
               n_shards: int, rank: int, world_size: int) -> tuple[Optional[int], list[Piece]]:
    """How rank `rank` of world_size assembles tensor `name` from n_shards shards of shape shard_shape.

    Returns the split dimension (None: replicated, read whole) and the pieces to concatenate along it.
    """
    dim = split_dim(name, layout)
    prefer = rank if rank < n_shards else 0
    if dim is None:
        return None, [Piece(prefer, 0, shard_shape[0] if shard_shape else 1)]
    size = full_size(name, shard_shape[dim], args, n_shards)
    want = shard_ranges(name, size, args, world_size)[rank]
    return dim, pieces_for(want, shard_ranges(name, size, args, n_shards), prefer)


def assemble_slice(open_shard: Callable[[int], dict[str, torch.Tensor]], n_shards: int, args: ModelArgs,
                   layout: EmbeddingLayout, rank: int, world_size: int, device: torch.device,
                   dtype: Optional[torch.dtype] = None, describe: Callable[[int], str] = str,
                   ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors for a world of world_size, from a checkpoint of n_shards shards.

    open_shard(s) returns shard s (memory-mapped when read from disk); each shard is opened once
    and dropped before the next, so a rank touches only the parts it needs. Tensors keep their
    dtype unless one is given. Every returned tensor owns its storage: no view into a bigger one.
    """
    shard = open_shard(0)
    shapes = {name: tuple(t.shape) for name, t in shard.items()}
    plans = {name: slice_plan(name, shape, args, layout, n_shards, rank, world_size)
             for name, shape in shapes.items()}
    parts: dict[str, list[Optional[torch.Tensor]]] = {name: [None] * len(p) for name, (_, p) in plans.items()}
    for source in range(n_shards):
        wanted = [(name, index, piece) for name, (_, pieces) in plans.items()
                  for index, piece in enumerate(pieces) if piece.source == source]
        if wanted and source > 0:
            shard = open_shard(source)
        for name, index, piece in wanted:
            dim = plans[name][0]
            tensor = _tensor(shard, name, shapes[name], describe(source))
            if dim is not None:
                tensor = tensor.narrow(dim, piece.offset, piece.length)
            part = tensor.to(device=device, dtype=dtype or tensor.dtype)
            if part.untyped_storage().nbytes() != part.numel() * part.element_size():
                part = part.clone()  # a slice of a bigger tensor: copy it so the rest is never kept
            parts[name][index] = part
        shard = None  # unmaps the file once nothing of it is kept
    return {name: pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=plans[name][0])
            for name, pieces in parts.items()}


def open_checkpoint(ckpt_dir: Path, args: ModelArgs) -> tuple[list[Path], ModelArgs, EmbeddingLayout]:
    """The shards of ckpt_dir, args with the checkpoint's vocabulary filled in, and its embedding layout.

    A vocab_size already known (from the tokenizer) must agree with the checkpoint's.
    """
    paths = shard_paths(ckpt_dir)
    shard = load_shard(paths[0])
    vocab_size = checkpoint_vocab_size(shard, len(paths))
    if args.vocab_size not in (-1, vocab_size):
        raise ValueError(
            f"the checkpoint's vocabulary has {vocab_size} tokens but the tokenizer (or "
            f"params.json) has {args.vocab_size}; use the tokenizer that came with this checkpoint"
        )
    # One shard fits both embedding layouts. Llama 3's params.json names its vocab_size where
    # Llama 2's says -1: keep the family's layout, so that resharded copies split as Meta's do.
    single_shard_layout = "dim" if args.vocab_size == -1 else "vocab"
    args = args.with_vocab_size(vocab_size)
    if not args.splits_over(len(paths)):
        raise ValueError(
            f"{ckpt_dir} has {len(paths)} shards but this model ({args.n_heads} query heads, "
            f"{args.kv_heads} KV heads) cannot be split that way; check that params.json belongs "
            "to these shards"
        )
    layout = detect_embedding_layout(shard, args, len(paths))
    return paths, args, single_shard_layout if len(paths) == 1 else layout


def load_model(ckpt_dir: Path, args: ModelArgs, placement: Placement, dtype: torch.dtype) -> Transformer:
    """Build the model without initialising it and fill it with this rank's slice, whatever the shard count."""
    paths, args, layout = open_checkpoint(ckpt_dir, args)
    state = assemble_slice(lambda s: load_shard(paths[s]), len(paths), args, layout, placement.rank,
                           placement.world_size, placement.device, dtype, describe=lambda s: str(paths[s]))
    model = Transformer(args, placement.world_size, layout)
    load_into(model, state, placement.device, dtype, Path(ckpt_dir))
    return model


def _tensor(shard: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    """shard[name], which must have the shape it has in the first shard (all shards are alike)."""
    if name not in shard or tuple(shard[name].shape) != shape:
        found = list(shard[name].shape) if name in shard else "no such tensor"
        raise ValueError(
            f"{source}: {name} is {found} where the first shard has {list(shape)}; the shards "
            "do not belong to one checkpoint"
        )
    return shard[name]


def _shape(shard: dict[str, torch.Tensor], name: str, dims: int) -> tuple[int, ...]:
    if name not in shard:
        raise ValueError(f"the checkpoint has no {name}; is this a Meta-layout Llama checkpoint?")
    shape = tuple(shard[name].shape)
    if len(shape) != dims:
        raise ValueError(f"{name} has shape {list(shape)}; expected {dims} dimensions")
    return shape


def _listing(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
