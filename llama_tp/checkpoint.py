"""Meta's checkpoint layout: which tensor is split along which dimension, and loading one rank's shard."""

import ctypes
import ctypes.util
import mmap
import pickle
import platform
import zipfile
from pathlib import Path
from typing import Optional

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
        if state[name].data_ptr() != tensor.data_ptr():
            release_pages(tensor)
    model.load_state_dict(state, strict=True, assign=True)


def load_model(ckpt_dir: Path, args: ModelArgs, placement: Placement, dtype: torch.dtype) -> Transformer:
    """Build the model without initialising it and fill it with this rank's shard."""
    paths = shard_paths(ckpt_dir)
    if len(paths) != placement.world_size:
        raise ValueError(
            f"found {len(paths)} shards in {ckpt_dir} but the world size is {placement.world_size}; "
            f"run with --nproc_per_node {len(paths)}"
        )
    path = paths[placement.rank]
    shard = load_shard(path)
    vocab_size = checkpoint_vocab_size(shard, len(paths))
    if vocab_size != args.vocab_size:
        raise ValueError(
            f"the checkpoint's vocabulary has {vocab_size} tokens but the tokenizer (or "
            f"params.json) has {args.vocab_size}; use the tokenizer that came with this checkpoint"
        )
    layout = detect_embedding_layout(shard, args, len(paths))
    model = Transformer(args, placement.world_size, layout)
    load_into(model, shard, placement.device, dtype, path)
    return model


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


# --- Loading speed (issue 6): keep peak memory near the converted weights' size. ---

_MADV_DONTNEED = 4  # Linux


def release_pages(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped checkpoint tensor's pages from this process once it has been converted.

    Otherwise the mapped shard stays resident beside its converted copy until loading ends (1.5x
    the fp32 weights for a bf16 checkpoint). The mapping is private and never written, so a later
    read simply pages the data in from the file again: the tensor stays valid.
    """
    if not _libc or tensor.device.type != "cpu":
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page  # whole pages only: neighbours share edges
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _load_libc() -> "Optional[ctypes.CDLL]":
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_libc = _load_libc()
