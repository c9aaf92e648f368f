"""Reading Meta-layout checkpoints: the shard files, their checks, and loading one rank's slice.

A checkpoint may have any number of shards: each rank assembles its own slice from the shards
that hold parts of it (merging when there are more shards than ranks, splitting when fewer),
reading them memory-mapped so that no rank ever holds the whole model. A quantized checkpoint
(checkpoint/quantized.py) loads straight into int8 and int4 layers.
"""

import math
import pickle
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ..kernels import cpu_kernels, matmul
from ..logs import logger
from ..model.args import ModelArgs
from ..model.meta_llama4 import EXTRA_STATE_GLOBALS, llama_tp_names
from ..model.transformer import Transformer
from ..model.quantize import (LINEAR_LAYERS, QUANTIZED_AT_LOAD, Int4Linear, Int8Linear, check_quantize_on,
                              layer_quantization, quantize_model, replace_linear_layers, use_kernels)
from ..parallel import EmbeddingLayout, Placement
from . import mapped_pages
from .quantized import check_quantized_load, stored_quantization, unfilled_layers
from .sharding import assemble_slice

# Real Llama 2 shards carry the rotary table, which the model computes itself.
TOLERATED_EXTRA_KEYS = ("rope.freqs",)
LINEAR_WEIGHTS = tuple(f"{layer}.weight" for layer in LINEAR_LAYERS)  # name endings


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
    """Tensors of one shard, memory-mapped: nothing is read until used; a Meta Llama 4 shard's
    under llama_tp's names (meta_llama4.py)."""
    # torch.save has written zip archives since torch 1.6; a cut-off archive loses its index at
    # the end, so this catches truncated files too, before torch's long, misleading messages.
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path} is not a torch checkpoint (not the zip archive torch.save writes); the file "
            "may be truncated or corrupt: download or convert it again"
        )
    try:
        with torch.serialization.safe_globals(EXTRA_STATE_GLOBALS):
            return llama_tp_names(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
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


def load_into(model: Transformer, shard: dict[str, torch.Tensor], device: torch.device,
              dtype: torch.dtype, source: Path, pack_linear: bool = False, quantize: Optional[str] = None) -> None:
    """Move this rank's tensors into the model strictly: every key present, every shape right.

    Tensors the model holds side by side (Transformer.checkpoint_layout) are stacked here, on
    the CPU where shard's tensors are, and each final tensor moves to device once, its sources
    given back as it goes: the device holds no more than the model's weights at any time.
    pack_linear: lay the linear layers' weights out for the device's fastest kernel (matmul.pack).
    quantize: "int8" or "int4": quantize each linear layer's weight on the CPU, in dtype as
    quantize_model would, before it moves (QUANTIZED_AT_LOAD).
    """
    layout = model.checkpoint_layout()
    expected = {part: shape for parts in layout.values() for part, shape in parts}
    missing = sorted(set(expected) - set(shard))
    unexpected = sorted(set(shard) - set(expected) - set(TOLERATED_EXTRA_KEYS))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model described by params.json: "
            f"missing {_listing(missing)}, unexpected {_listing(unexpected)}; check that "
            "params.json belongs to these shards"
        )
    for name, shape in expected.items():
        if shard[name].shape != shape:
            raise ValueError(
                f"{source}: {name} has shape {list(shard[name].shape)} but this rank's slice of the "
                f"model needs {list(shape)}; check params.json and the number of processes"
            )

    stored_dtypes = _quantized_tensors(model)
    for name, (stored_dtype, kind) in stored_dtypes.items():
        for part, _ in layout[name]:
            if shard[part].dtype != stored_dtype:
                raise ValueError(
                    f"{source}: {part} is {shard[part].dtype} where an {kind} checkpoint stores "
                    f"{stored_dtype}; the checkpoint mixes quantized and full-precision layers: write it again"
                )
    packing = pack_linear and matmul.packable(device, dtype)
    staging = threading.local()  # each converting thread's buffer for weights on their way to packing

    layers = dict(model.named_modules())
    quantized_layers = {f"{name}.weight": layer_quantization(name, quantize) for name in layers
                        if name.split(".")[-1] in LINEAR_LAYERS and quantize in QUANTIZED_AT_LOAD}

    def convert(name: str) -> "torch.Tensor | torch.nn.Module":
        """One model tensor from its checkpoint tensors: stacked, converted, packed if asked; or,
        for a linear layer quantized here, the quantized layer."""
        sources = [shard[part] for part, _ in layout[name]]
        if packing and name.endswith(LINEAR_WEIGHTS):
            converted = matmul.pack(_staged(sources, dtype, staging))
        else:
            # On the CPU; contiguous where a source is a view (meta_llama4.py's experts are transposed).
            tensor = (sources[0] if len(sources) == 1 else torch.cat(sources)).contiguous()
            if name in quantized_layers:
                layer = layers[name.removesuffix(".weight")]
                converted = QUANTIZED_AT_LOAD[quantized_layers[name]].quantizing(layer, tensor.to(dtype)).to(device)
            else:
                # Converted on the CPU, then moved: the device sees only the final tensor.
                converted = tensor.to(stored_dtypes.get(name, (dtype,))[0]).to(device)
        for source_tensor in sources:
            if converted is not source_tensor:  # converted, stacked or packed: the source is no longer used
                mapped_pages.release(source_tensor)
        return converted

    # Converting is copying memory, which one thread (oneDNN's reorder uses one) does not keep
    # busy: the demo model loads in 0.29 s instead of 0.31 with two threads on this 2-core machine.
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        state = dict(zip(layout, pool.map(convert, layout)))
    quantized = {name.removesuffix(".weight"): state.pop(name) for name in quantized_layers}
    replace_linear_layers(model, lambda name, layer: quantized.get(name, layer))
    for name, layer in quantized.items():
        state.update({f"{name}.{tensor}": value for tensor, value in layer.state_dict().items()})
    model.load_state_dict(state, strict=True, assign=True)
    if packing:
        for module in model.modules():
            if hasattr(module, "weight_packed"):
                module.weight_packed = True  # torch.compile sees a packed weight as a plain one


def _staged(sources: list[torch.Tensor], dtype: torch.dtype, staging: threading.local) -> torch.Tensor:
    """sources stacked along dim 0 in dtype, for packing: the source itself if it is one in dtype,
    else written into this thread's reusable buffer.

    Packing copies the weight anyway, so the stacked copy is needed only until then. A new tensor
    each time would take fresh pages from the system, which costs more than the copy itself, and
    raise the peak memory of loading: the stacked wq/wk/wv and w1/w3 are 40% of the demo model's
    weights (its load peaks 5% lower this way).
    """
    if len(sources) == 1 and sources[0].dtype == dtype and sources[0].is_contiguous():
        return sources[0]
    shape = (sum(source.shape[0] for source in sources), *sources[0].shape[1:])
    numel = math.prod(shape)
    buffer = getattr(staging, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = staging.buffer = torch.empty(numel, dtype=dtype)
    stacked = buffer[:numel].view(shape)
    row = 0
    for source in sources:
        stacked[row:row + source.shape[0]].copy_(source)
        row += source.shape[0]
    return stacked


def _quantized_tensors(model: Transformer) -> dict[str, tuple[torch.dtype, str]]:
    """The tensors of the model's int8 and int4 layers, which load in the dtype they are stored in
    (int8 and fp32; uint8 and fp16), with the kind of their layer."""
    kinds = {Int8Linear: "int8", Int4Linear: "int4"}
    return {f"{prefix}.{name}": (tensor.dtype, kinds[type(module)]) for prefix, module in model.named_modules()
            if type(module) in kinds for name, tensor in module.named_buffers()}


class Checkpoint(NamedTuple):
    """An opened checkpoint folder: its shards, the model it holds, how it is laid out."""

    paths: list[Path]
    args: ModelArgs  # with the checkpoint's vocabulary filled in
    layout: EmbeddingLayout
    quantization: Optional[str]  # "int8" or "int4" for a quantized checkpoint (checkpoint/quantized.py)
    first_shard: dict[str, torch.Tensor]  # memory-mapped, read once: opening a shard costs ~16 ms


def open_checkpoint(ckpt_dir: Path, args: ModelArgs) -> Checkpoint:
    """The shards of ckpt_dir, args with the checkpoint's vocabulary filled in, its embedding layout
    and quantization.

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
    return Checkpoint(paths, args, single_shard_layout if len(paths) == 1 else layout, stored_quantization(shard),
                      shard)


def load_slice(checkpoint: Checkpoint, rank: int, world_size: int, device: torch.device,
               dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors (of world_size) from an opened checkpoint, whatever its shard count."""
    paths = checkpoint.paths
    return assemble_slice(lambda s: checkpoint.first_shard if s == 0 else load_shard(paths[s]), len(paths),
                          checkpoint.args, checkpoint.layout, rank, world_size, device, dtype,
                          describe=lambda s: str(paths[s]), release=mapped_pages.release)


def load_model(ckpt_dir: Path, args: ModelArgs, placement: Placement, dtype: torch.dtype,
               quantize: Optional[str] = None, pack: bool = True, opened: Optional[Checkpoint] = None) -> Transformer:
    """Build the model without initialising it and fill it with this rank's slice, whatever the
    shard count; linear layers quantized as asked (see model/quantize.py), or else, with pack, laid out
    for the device's fastest kernel (see matmul.packing_pays). A quantized checkpoint's layers load
    as they are stored. opened: ckpt_dir's open_checkpoint, if the caller has it already."""
    checkpoint = opened or open_checkpoint(ckpt_dir, args)
    world_size = placement.world_size
    if len(checkpoint.paths) != world_size:
        processes = f"{world_size} process" + "es" * (world_size > 1)
        logger.info(f"resharding {len(checkpoint.paths)} shards onto {processes} while loading; `python -m "
               f"llama_tp.reshard {ckpt_dir} DST_DIR --mp {world_size}` saves this work at every start")
    model = Transformer(checkpoint.args, world_size, checkpoint.layout)
    stored = checkpoint.quantization
    device = placement.device
    if stored:
        check_quantized_load(ckpt_dir, checkpoint.args, world_size, device, quantize, stored)
        unfilled_layers(model, checkpoint.first_shard.keys(), stored)
    else:
        check_quantize_on(quantize, device)
    # The slice is assembled on the CPU (mapped, converted only where the CPU computes); load_into
    # moves each final tensor to the device. A quantized checkpoint's embedding and norms are
    # converted in load_into, its quantized layers kept as they are.
    convert_here = device.type == "cpu" and not stored
    state = load_slice(checkpoint, placement.rank, world_size, torch.device("cpu"), dtype if convert_here else None)
    pack_linear = pack and quantize is None and not stored
    load_into(model, state, device, dtype, Path(ckpt_dir), pack_linear=pack_linear,
              quantize=None if stored else quantize)
    if cpu_kernels.decoding_kernels_run_on(device):
        cpu_kernels.load_decoding_kernels()  # before torch.compile traces a decoding step that calls them
    return use_kernels(quantize_model(model, quantize) if quantize == "int8_dynamic" else model)


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
