"""int8 checkpoints: the linear layers stored as grouped int8 (kernels/int8.py), written once and
loaded as they are (1.25 bytes per weight on disk and while loading instead of 2 or 4).

A Meta-layout folder in which every linear layer (wq, wk, wv, wo, w1, w2, w3, output) is stored
as NAME.weight, int8 [out, in], with NAME.scales and NAME.zeros, fp32 [out, in / group]; the
embedding and norms keep the checkpoint's float dtype. The groups are those of the whole,
unsplit layer (kernels.int8.group_size of its full width), and the shards split all three tensors
as they split the weight: column-parallel layers by output rows (KV heads copied alike),
row-parallel ones (wo, w2) by inputs, so their scales and zeros by groups. That needs every
part of a row-parallel layer to hold whole groups: check_int8_split.
"""

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..args import ModelArgs
from ..kernels.int8 import group_size, quantize_int8
from ..logs import logger
from ..parallel import communication_after, require_cxx_compiler
from ..quantize import QUANTIZATIONS, Int8Linear, check_quantize, replace_linear_layers
from .sharding import COLUMN_PARALLEL, ROW_PARALLEL

# What a checkpoint can store; int8_dynamic rounds the activations too, which only happens at run time.
STORABLE = ("int8",)
# The tensors beside an int8 layer's weight, by name ending.
GRID_TENSORS = (".scales", ".zeros")


def check_storable(quantize: Optional[str]) -> None:
    """Refuse a --quantize that a checkpoint cannot be written in, before any work is done."""
    if quantize is None or quantize in STORABLE:
        return
    if quantize in QUANTIZATIONS:
        raise ValueError(
            f"--quantize {quantize} is applied at load time only (it rounds each activation as it "
            f"runs), not a storage format; write --quantize {' or '.join(STORABLE)}, or a full-precision "
            f"checkpoint and load it with quantize='{quantize}'"
        )
    raise ValueError(f"--quantize {quantize!r} is not supported; use {' or '.join(STORABLE)} or leave it unset")


def stored_quantization(shard: dict[str, torch.Tensor]) -> Optional[str]:
    """"int8" if the shard holds int8 linear layers (an int8 tensor, or scales and zeros), else None."""
    int8 = any(tensor.dtype == torch.int8 or name.endswith(GRID_TENSORS) for name, tensor in shard.items())
    return "int8" if int8 else None


def row_parallel_widths(args: ModelArgs) -> dict[str, int]:
    """The full input width of each row-parallel layer, by its name within a layer."""
    return {"attention.wo": args.n_heads * args.head_dim, "feed_forward.w2": args.ffn_hidden_dim}


def holds_whole_groups(args: ModelArgs, n_parts: int) -> bool:
    """Whether splitting the row-parallel layers n_parts ways leaves each part whole int8 groups."""
    return all(_whole_groups(width, n_parts) for width in row_parallel_widths(args).values())


def _whole_groups(width: int, n_parts: int) -> bool:
    return width % (n_parts * group_size(width)) == 0


def check_int8_split(args: ModelArgs, n_parts: int, fix: str) -> None:
    """Refuse to split an int8 model n_parts ways where a part of a row-parallel layer would cut
    its groups; fix says what to do instead, and the message adds the part counts that work."""
    for name, width in row_parallel_widths(args).items():
        if not _whole_groups(width, n_parts):
            fitting = [n for n in range(1, args.n_heads + 1) if args.splits_over(n) and holds_whole_groups(args, n)]
            raise ValueError(
                f"{name} (in every layer) has {width} inputs, quantized in int8 groups of "
                f"{group_size(width)}: split {n_parts} ways, parts of {width / n_parts:g} inputs would "
                f"cut its groups; {fix} (whole groups: {', '.join(map(str, fitting))})"
            )


def int8_tensors(name: str, tensor: torch.Tensor, n_shards: int) -> dict[str, torch.Tensor]:
    """One shard's slice of a checkpoint tensor as an int8 checkpoint of n_shards stores it: a
    linear layer's weight as NAME.weight, NAME.scales and NAME.zeros, in the groups of the whole
    layer (exactly the whole layer's quantization, split, as each group is rounded on its own;
    check_int8_split first); any other tensor unchanged."""
    module = name.split(".")[-2]  # layers.0.attention.wq.weight -> wq
    if not name.endswith(".weight") or module not in COLUMN_PARALLEL + ROW_PARALLEL:
        return {name: tensor}
    full_width = tensor.shape[1] * (n_shards if module in ROW_PARALLEL else 1)
    q, scales, zeros = quantize_int8(tensor, group_size(full_width))
    layer = name.removesuffix(".weight")
    return {name: q, f"{layer}.scales": scales, f"{layer}.zeros": zeros}


def check_int8_load(ckpt_dir: Path, args: ModelArgs, world_size: int, device: torch.device,
                    quantize: Optional[str]) -> None:
    """Refuse what cannot load an int8 checkpoint, before anything is read: int8_dynamic, a world
    size that cuts groups, CPU without a C++ compiler. quantize=None loads it as int8, and says so."""
    check_quantize(quantize)
    if quantize == "int8_dynamic":
        raise ValueError(
            f"quantize='int8_dynamic' cannot load {ckpt_dir}: its linear layers are stored as grouped "
            "int8 already, and int8_dynamic rounds full-precision weights its own way; load it with "
            "quantize='int8' (or none), or load a full-precision checkpoint with int8_dynamic"
        )
    check_int8_split(args, world_size, fix=(
        f"{ckpt_dir} is an int8 checkpoint: run it on a number of processes whose slices hold whole "
        "groups, or load the full-precision checkpoint with quantize='int8', which groups each "
        "process's slice itself"))
    if device.type == "cpu":
        require_cxx_compiler(f"the int8 checkpoint {ckpt_dir} on CPU", "load a full-precision checkpoint")
    if quantize is None:
        logger.info(f"{ckpt_dir} stores its linear layers as int8: loading them as int8 (quantize='int8')")


def unfilled_int8_layers(model: nn.Module) -> nn.Module:
    """The model with every linear layer an Int8Linear of unfilled (meta) tensors, shaped as this
    rank's slice of an int8 checkpoint, for checkpoint.load_into to fill."""

    def unfilled(name: str, layer: nn.Module) -> Int8Linear:
        rows, width = layer.weight.shape
        groups = width // group_size(layer.in_features)  # the groups of the whole layer
        q = torch.empty(rows, width, dtype=torch.int8, device="meta")
        grid = [torch.empty(rows, groups, dtype=torch.float32, device="meta") for _ in GRID_TENSORS]
        return Int8Linear(q, *grid, communication_after(layer))

    return replace_linear_layers(model, unfilled)
