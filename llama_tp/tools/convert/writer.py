"""Writing a Meta-layout checkpoint folder, shard by shard, from tensors loaded on demand."""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from ...model.args import ModelArgs
from ...checkpoint.quantized import QuantizedWeight, check_split, check_storable, quantized_tensors
from ...checkpoint.sharding import KV_PROJECTIONS, split_dim
from ...logs import logger
from ...parallel import DTYPES
from ...checkpoint.record import RECORD_FILE, ModelRecord

# Loads one whole tensor, already named and laid out as in Meta's checkpoints: a float tensor, or a
# linear layer's weight as the source quantized it, for a quantized checkpoint to keep as it is.
TensorLoader = Callable[[], "torch.Tensor | QuantizedWeight"]


def ffn_params(dim: int, hidden_dim: int) -> dict:
    """multiple_of and ffn_dim_multiplier for which ModelArgs.ffn_hidden_dim gives hidden_dim exactly."""
    multiple_of = next(m for m in (256, 128, 64, 32, 16, 8, 4, 2, 1) if hidden_dim % m == 0)
    meta_default = int(2 * (4 * dim) / 3)
    # Meta's rule rounds up to multiple_of, so a multiplier a hair above the ratio lands on hidden_dim
    # even where float rounding would have put int(ratio * meta_default) one below it.
    candidates = [None, hidden_dim / meta_default, (hidden_dim + 0.5) / meta_default]
    for multiplier in candidates:
        params = {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}
        if ModelArgs(dim=dim, n_layers=1, n_heads=1, **params).ffn_hidden_dim == hidden_dim:
            return params
    raise ValueError(f"no multiple_of/ffn_dim_multiplier reproduces feed-forward size {hidden_dim} for dim {dim}")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Meta checkpoint for args with its unsplit shape, in the order they are written."""
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes |= {
            f"layers.{i}.attention.wq.weight": (q, args.dim),
            f"layers.{i}.attention.wk.weight": (kv, args.dim),
            f"layers.{i}.attention.wv.weight": (kv, args.dim),
            f"layers.{i}.attention.wo.weight": (args.dim, q),
        }
        if args.has_experts(i):
            shapes |= expert_shapes(args, f"layers.{i}.feed_forward")
        else:
            shapes |= swiglu_shapes(f"layers.{i}.feed_forward", args.dim, args.ffn_hidden_dim)
        shapes |= {f"layers.{i}.attention_norm.weight": (args.dim,), f"layers.{i}.ffn_norm.weight": (args.dim,)}
        if args.qkv_bias:
            shapes |= {f"layers.{i}.attention.{name}.bias": (rows,) for name, rows in (("wq", q), ("wk", kv), ("wv", kv))}
        if args.qk_norm:
            shapes |= {f"layers.{i}.attention.{name}.weight": (args.head_dim,) for name in ("q_norm", "k_norm")}
    return shapes | {"norm.weight": (args.dim,), "output.weight": (args.vocab_size, args.dim)}


def swiglu_shapes(prefix: str, dim: int, hidden_dim: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a SwiGLU's w1, w2 and w3 under prefix."""
    return {f"{prefix}.w1.weight": (hidden_dim, dim), f"{prefix}.w2.weight": (dim, hidden_dim),
            f"{prefix}.w3.weight": (hidden_dim, dim)}


def expert_shapes(args: ModelArgs, prefix: str) -> dict[str, tuple[int, ...]]:
    """A mixture of experts' tensors under prefix (feed_forward.py): the router and each expert's SwiGLU."""
    shapes = {f"{prefix}.router.weight": (args.n_experts, args.dim)}
    for expert in range(args.n_experts):
        shapes |= swiglu_shapes(f"{prefix}.experts.{expert}", args.dim, args.expert_hidden_dim)
    if args.shared_expert:
        shapes |= swiglu_shapes(f"{prefix}.shared_expert", args.dim, args.expert_hidden_dim)
    return shapes


def meta_name(name: str, top_names: dict[str, str], layer_pattern: str,
              layer_names: dict[str, str]) -> Optional[str]:
    """Meta's name for a source tensor, given the source's names (layer_pattern captures layer, module,
    and weight or bias)."""
    if name in top_names:
        return top_names[name]
    match = re.fullmatch(layer_pattern, name)
    if match and match.group(2) in layer_names:
        return f"layers.{match.group(1)}.{layer_names[match.group(2)]}.{match.group(3)}"
    return None


def shard_of(name: str, tensor: torch.Tensor, rank: int, n_shards: int, args: ModelArgs) -> torch.Tensor:
    """Rank's slice of a full tensor, split as llama_tp loads it (the embedding along dim)."""
    if name.split(".")[-2] in KV_PROJECTIONS and n_shards > args.kv_heads:  # weights, scales, zeros
        # More ranks than KV heads: each rank stores a copy of the one KV head its query heads use.
        copies = n_shards // args.kv_heads
        heads = tensor.view(args.kv_heads, args.head_dim, -1)  # kv_heads, head_dim, dim (or groups)
        tensor = heads.repeat_interleave(copies, dim=0).reshape(n_shards * args.head_dim, *tensor.shape[1:])
    dim = split_dim(name, "dim")
    return tensor if dim is None else tensor.chunk(n_shards, dim=dim)[rank]


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def write_checkpoint(dst: Path, params: dict, tensors: dict[str, TensorLoader], n_shards: int,
                     dtype: torch.dtype, files: dict[str, bytes], record: ModelRecord,
                     quantize: Optional[str] = None) -> Path:
    """Write params.json, n_shards consolidated.XX.pth, the tokenizer files and the model's record (llama_tp.json) to dst.

    Everything goes to a temporary folder beside dst that is renamed into place at the end, so
    dst either holds a complete checkpoint or does not exist. Each shard is built by loading every
    tensor again and keeping this rank's slice: memory holds one shard and one whole tensor.
    quantize="int8" or "int4" writes a quantized checkpoint (checkpoint/quantized.py) of the
    weights in dtype: what loading the dtype checkpoint with that quantize in one process would
    hold; a weight the source already holds quantized (QuantizedWeight) is kept as it is.
    """
    check_storable(quantize)
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"the destination {dst} already exists and is not an empty folder; "
                         "choose a new folder or remove it")
    args = ModelArgs.from_dict(params, source="the converted params.json")
    args.check_model_parallel_size(n_shards)
    if quantize:
        check_split(args, n_shards, quantize, fix="choose an --mp whose shards hold whole groups")
    shapes = expected_shapes(args)
    names = list(shapes)
    missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing:
        raise ValueError(f"the source has no weights for {', '.join(missing[:5])}"
                         f"{' and more' if len(missing) > 5 else ''}; is the download complete?")
    if unexpected:
        raise ValueError(f"the source has weights {', '.join(unexpected[:5])} beyond the {args.n_layers} "
                         "layers its configuration describes; check that configuration and weights match")

    partial = dst.with_name(f".{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for rank in range(n_shards):
            progress(f"writing shard {rank + 1} of {n_shards} to {dst}")
            shard = {}
            for name in names:
                full = tensors[name]()
                if tuple(full.shape) != shapes[name]:
                    raise ValueError(f"{name} has shape {list(full.shape)} in the source but its configuration "
                                     f"implies {list(shapes[name])}; check that configuration and weights match")
                if isinstance(full, QuantizedWeight):
                    shard |= _kept(name, full, rank, n_shards, args)
                    continue
                part = shard_of(name, full, rank, n_shards, args).to(dtype).contiguous().clone()
                shard |= quantized_tensors(name, part, n_shards, quantize) if quantize else {name: part}
            torch.save(shard, partial / f"consolidated.{rank:02d}.pth")
            del shard
        (partial / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        for file_name, content in files.items():
            (partial / file_name).write_bytes(content)
        (partial / RECORD_FILE).write_text(record.to_json())
        if dst.exists():
            dst.rmdir()  # empty, checked above
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    progress(f"done: {dst}")
    return dst


def _kept(name: str, weight: QuantizedWeight, rank: int, n_shards: int, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rank's slice of a weight quantized by its source, each of its tensors split as the weight is."""
    layer = name.removesuffix(".weight")
    return {f"{layer}.{end}": shard_of(f"{layer}.{end}", tensor, rank, n_shards, args).contiguous().clone()
            for end, tensor in weight.tensors.items()}


def progress(message: str) -> None:
    """Conversion progress on stderr, so stdout stays the program's output."""
    logger.info(f"llama_tp.convert: {message}")
