"""Rewrite a Meta-layout checkpoint with another number of shards.

    python -m llama_tp.reshard SRC_DIR DST_DIR --mp N [--quantize int8] [--force]

Loading already reshards on the fly; a resharded copy saves that work (and the reading of
other ranks' files) at every start. With N above the model's KV heads, each shard holds a copy
of the KV head its query heads use, which is the layout llama_tp loads at world size N.
--quantize int8|int4 writes a quantized checkpoint (checkpoint/quantized.py); a quantized
checkpoint stays as it is.
"""

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from ..model.args import ModelArgs
from ..checkpoint import load_slice, open_checkpoint
from ..checkpoint.quantized import check_split, check_storable, quantized_tensors
from ..checkpoint.record import RECORD_FILE
from .cli import run

# Copied beside the shards: the architecture, whatever tokenizer came with the checkpoint, and a
# converted model's chat format and stop tokens.
COPIED = ("params.json", "tokenizer*", RECORD_FILE)


def reshard(src: Path, dst: Path, mp: int, force: bool = False, quantize: Optional[str] = None) -> list[Path]:
    """Write src's checkpoint to dst as mp shards, one shard at a time; return the shard paths.

    quantize="int8" or "int4" quantizes a full-precision checkpoint's linear layers
    (checkpoint/quantized.py); a quantized checkpoint is only resharded.
    """
    src, dst = Path(src), Path(dst)
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ValueError(f"--mp must be a positive number of shards, found {mp!r}")
    check_storable(quantize)
    params = ModelArgs.load(src / "params.json")
    checkpoint = open_checkpoint(src, params)
    args = checkpoint.args
    args.check_model_parallel_size(mp)
    stored = checkpoint.quantization
    if quantize and stored and quantize != stored:
        raise ValueError(f"{src} is stored as {stored} already; reshard it without --quantize, or "
                         f"quantize its full-precision checkpoint with --quantize {quantize}")
    quantizing = quantize if stored is None else None
    if quantize or stored:
        check_split(args, mp, quantize or stored, fix="choose an --mp whose shards hold whole groups")
    n_shards = len(checkpoint.paths)
    if dst.resolve() == src.resolve():
        raise ValueError(f"DST_DIR {dst} is SRC_DIR; write the resharded checkpoint to another folder")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(
            f"DST_DIR {dst} is not empty; pass --force to overwrite its checkpoint, or choose an empty folder"
        )
    dst.mkdir(parents=True, exist_ok=True)
    for pattern in COPIED:
        for path in sorted(src.glob(pattern)):
            if path.is_file():
                _replace(dst / path.name, lambda tmp, path=path: shutil.copyfile(path, tmp))
    written = []
    for rank in tqdm(range(mp), desc=f"{n_shards} -> {mp} shards", unit="shard", file=sys.stderr):
        state = load_slice(checkpoint, rank, mp, torch.device("cpu"))
        if quantizing:
            state = _quantized(state, mp, quantizing)
        target = dst / f"consolidated.{rank:02d}.pth"
        _replace(target, lambda tmp: torch.save(state, tmp))
        written.append(target)
        del state
    # With --force, shards of an earlier, larger checkpoint would otherwise be loaded as ours.
    for stale in sorted(set(dst.glob("consolidated.*.pth")) - set(written)):
        stale.unlink()
    return written


def _quantized(state: dict[str, torch.Tensor], n_shards: int, quantize: str) -> dict[str, torch.Tensor]:
    """One shard's tensors as a `quantize` checkpoint of n_shards stores them, quantized one at a
    time: each full-precision slice is dropped as soon as it is quantized."""
    stored = {}
    for name in list(state):
        stored |= quantized_tensors(name, state.pop(name), n_shards, quantize)
    return stored


def _replace(target: Path, write) -> None:
    """Write through a temporary name, then rename: an interrupted run never leaves a half file."""
    tmp = target.with_name(target.name + ".tmp")
    write(tmp)
    os.replace(tmp, target)


def main(src: str, dst: str, mp: int, force: bool = False, quantize: Optional[str] = None) -> None:
    """Reshard the Meta-layout checkpoint in src into mp shards in dst.

    Args:
        src: folder with params.json and consolidated.XX.pth (and possibly tokenizer.model).
        dst: folder to write; must be empty or missing unless force is given.
        mp: number of shards to write (the model-parallel size that will load them).
        force: overwrite the checkpoint in a non-empty dst.
        quantize: "int8" stores the linear layers as grouped int8 (1.25 bytes per weight), "int4"
            as grouped 4-bit (0.625 bytes per weight; the output head int8), which llama_tp
            loads as they are; a quantized checkpoint stays as it is without it.
    """
    written = reshard(Path(str(src)), Path(str(dst)), mp, force, quantize)  # fire turns a name like 13 into an int
    print(f"wrote {len(written)} shards to {dst}")


if __name__ == "__main__":
    run(main)
