"""Quantized checkpoints: the linear layers stored as grouped int8 (kernels/int8.py) or int4
(kernels/int4.py), written once and loaded as they are.

A Meta-layout folder in which every linear layer (wq, wk, wv, wo, w1, w2, w3, output) is stored as
- int8: NAME.weight, int8 [out, in], with NAME.scales and NAME.zeros, fp32 [out, in / group]:
  1.25 bytes per weight;
- int4: NAME.weight, uint8 [out, in / 2] (two 4-bit codes a byte, in GGUF's order), with
  NAME.scales and NAME.mins, fp16 [out, in / 32]: 0.625 bytes per weight.
Each layer says by its tensors which it is (mins: int4, zeros: int8), so one checkpoint holds
both: an int4 checkpoint keeps its output head in int8 (quantize.layer_quantization) and is
named by its other layers, as int4, which is how it loads unasked. The embedding and norms keep
the checkpoint's float dtype.

The groups are those of the whole, unsplit layer (int8: kernels.int8.group_size of its full
width; int4: 32 inputs), and the shards split all three tensors as they split the weight:
column-parallel layers by output rows (KV heads copied alike), row-parallel ones (wo, w2) by
inputs, so their scales and zeros (mins) by groups. That needs every part of a row-parallel
layer to hold whole groups, and int4 needs every layer's inputs to be whole groups of 32:
check_split.
"""

from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..args import ModelArgs
from ..kernels import int4
from ..kernels.int8 import group_size, quantize_int8
from ..logs import logger
from ..parallel import check_int4_device, communication_after, require_cxx_compiler
from ..quantize import QUANTIZATIONS, Int4Linear, Int8Linear, check_quantize, layer_quantization, replace_linear_layers
from .sharding import COLUMN_PARALLEL, ROW_PARALLEL

# What a checkpoint can store; int8_dynamic rounds the activations too, which only happens at run time.
STORABLE = ("int8", "int4")
# The tensors beside a quantized layer's weight, by kind, the last one telling the kinds apart.
GRID_TENSORS = {"int8": ("scales", "zeros"), "int4": ("scales", "mins")}


class QuantizedWeight(NamedTuple):
    """A whole linear layer's weight as a checkpoint of `kind` stores it, taken as a source holds
    it (GGUF's blocks) rather than rounded here: tensors by name ending (weight and GRID_TENSORS)."""

    kind: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, int]  # of the weight it stands for


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


def stored_kind(names, layer: str) -> Optional[str]:
    """"int4" or "int8" for the checkpoint layer `layer` (e.g. layers.0.attention.wq) among the
    tensor names of a shard, or None if it is stored in full precision."""
    return next((kind for kind, grid in GRID_TENSORS.items() if f"{layer}.{grid[-1]}" in names), None)


def stored_quantization(shard: dict[str, torch.Tensor]) -> Optional[str]:
    """"int4" if the shard holds int4 linear layers (whatever its output head), "int8" if int8 ones, else None."""
    ends = {name.rsplit(".", 1)[-1] for name in shard}
    if GRID_TENSORS["int4"][-1] in ends:
        return "int4"
    if GRID_TENSORS["int8"][-1] in ends or any(tensor.dtype == torch.int8 for tensor in shard.values()):
        return "int8"
    return None


def _input_widths(args: ModelArgs) -> dict[str, tuple[int, bool]]:
    """Each kind of linear layer within a layer: its full input width and whether shards split it."""
    return {"attention.wq, wk, wv": (args.dim, False), "attention.wo": (args.n_heads * args.head_dim, True),
            "feed_forward.w1, w3": (args.dim, False), "feed_forward.w2": (args.ffn_hidden_dim, True)}


def _group(width: int, quantization: str) -> int:
    """The inputs per group of a layer `width` inputs wide."""
    return int4.GROUP_SIZE if quantization == "int4" else group_size(width)


def _whole_groups(width: int, split: bool, n_parts: int, quantization: str) -> bool:
    return width % ((n_parts if split else 1) * _group(width, quantization)) == 0


def holds_whole_groups(args: ModelArgs, n_parts: int, quantization: str) -> bool:
    """Whether every layer's slice of n_parts holds whole groups of `quantization`."""
    return all(_whole_groups(width, split, n_parts, quantization) for width, split in _input_widths(args).values())


def check_split(args: ModelArgs, n_parts: int, quantization: str, fix: str) -> None:
    """Refuse to quantize, or split, a model n_parts ways where a layer's slice would cut its
    groups; fix says what to do instead, and the message adds the part counts that work."""
    for name, (width, split) in _input_widths(args).items():
        group = _group(width, quantization)
        if width % group:
            raise ValueError(f"{name} (in every layer) has {width} inputs, not whole {quantization} groups of "
                             f"{group} inputs; use int8, whose groups fit any width")
        if not _whole_groups(width, split, n_parts, quantization):
            fitting = [n for n in range(1, args.n_heads + 1)
                       if args.splits_over(n) and holds_whole_groups(args, n, quantization)]
            raise ValueError(
                f"{name} (in every layer) has {width} inputs, quantized in {quantization} groups of "
                f"{group}: split {n_parts} ways, parts of {width / n_parts:g} inputs would cut its "
                f"groups; {fix} (whole groups: {', '.join(map(str, fitting))})"
            )


def tensor_quantization(name: str, quantize: Optional[str]) -> Optional[str]:
    """What `quantize` makes of the checkpoint tensor `name`: its layer's quantization if it is a
    linear layer's weight, else None."""
    module = name.split(".")[-2]  # layers.0.attention.wq.weight -> wq
    if quantize is None or not name.endswith(".weight") or module not in COLUMN_PARALLEL + ROW_PARALLEL:
        return None
    return layer_quantization(name.removesuffix(".weight"), quantize)


def quantized_tensors(name: str, tensor: torch.Tensor, n_shards: int, quantize: str) -> dict[str, torch.Tensor]:
    """One shard's slice of a checkpoint tensor as a `quantize` checkpoint of n_shards stores it: a
    linear layer's weight as NAME.weight and its GRID_TENSORS, in the groups of the whole layer
    (exactly the whole layer's quantization, split, as each group is rounded on its own;
    check_split first); any other tensor unchanged."""
    kind = tensor_quantization(name, quantize)
    if kind is None:
        return {name: tensor}
    if kind == "int4":
        parts = int4.quantize_int4(tensor)
    else:
        full_width = tensor.shape[1] * (n_shards if name.split(".")[-2] in ROW_PARALLEL else 1)
        parts = quantize_int8(tensor, group_size(full_width))
    layer = name.removesuffix(".weight")
    return dict(zip((name, *(f"{layer}.{grid}" for grid in GRID_TENSORS[kind])), parts))


def check_quantized_load(ckpt_dir: Path, args: ModelArgs, world_size: int, device: torch.device,
                         quantize: Optional[str], stored: str) -> None:
    """Refuse what cannot load a checkpoint stored as `stored`, before anything is read: another
    quantization, a world size that cuts groups, int4 where no kernel takes it, a CPU without a C++
    compiler.
    quantize=None loads it as stored, and says so."""
    check_quantize(quantize)
    if quantize not in (None, stored):
        raise ValueError(
            f"quantize={quantize!r} cannot load {ckpt_dir}: its linear layers are stored as grouped {stored} "
            f"already, and {quantize} would round them a second time; load it with quantize='{stored}' "
            f"(or none), or load a full-precision checkpoint with quantize={quantize!r}"
        )
    if stored == "int4":
        check_int4_device(device)
    check_split(args, world_size, stored, fix=(
        f"{ckpt_dir} is an {stored} checkpoint: run it on a number of processes whose slices hold whole "
        f"groups, or load the full-precision checkpoint with quantize='{stored}', which groups each "
        "process's slice itself"))
    if device.type == "cpu":
        require_cxx_compiler(f"the {stored} checkpoint {ckpt_dir} on CPU", "load a full-precision checkpoint")
    if quantize is None:
        logger.info(f"{ckpt_dir} stores its linear layers as {stored}: loading them as {stored} (quantize='{stored}')")


def unfilled_layers(model: nn.Module, names, stored: str) -> nn.Module:
    """The model with every linear layer an Int8Linear or Int4Linear of unfilled (meta) tensors, as
    the checkpoint tensor `names` of a `stored` checkpoint say, shaped as this rank's slice, for
    checkpoint.load_into to fill."""
    # A fused layer is stored as its parts (wqkv as wq, wk, wv): the first one says how.
    first_part = {f"{prefix}.{module.FUSED[0]}".lstrip("."): f"{prefix}.{module.FUSED[1][0]}".lstrip(".")
                  for prefix, module in model.named_modules() if hasattr(module, "FUSED")}

    def unfilled(name: str, layer: nn.Module) -> nn.Module:
        rows, width = layer.weight.shape
        kind = stored_kind(names, first_part.get(name, name)) or stored
        if kind == "int4":
            grid = [torch.empty(rows, width // int4.GROUP_SIZE, dtype=torch.float16, device="meta") for _ in range(2)]
            return Int4Linear(torch.empty(rows, width // 2, dtype=torch.uint8, device="meta"), *grid,
                              communication_after(layer))
        groups = width // group_size(layer.in_features)  # the groups of the whole layer
        grid = [torch.empty(rows, groups, dtype=torch.float32, device="meta") for _ in range(2)]
        return Int8Linear(torch.empty(rows, width, dtype=torch.int8, device="meta"), *grid, communication_after(layer))

    return replace_linear_layers(model, unfilled)
