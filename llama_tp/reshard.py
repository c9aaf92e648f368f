"""Rewrite a Meta-layout checkpoint with another number of shards.

    python -m llama_tp.reshard SRC_DIR DST_DIR --mp N [--force]

Loading already reshards on the fly; a resharded copy saves that work (and the reading of
other ranks' files) at every start. With N above the model's KV heads, each shard holds a copy
of the KV head its query heads use, which is the layout llama_tp loads at world size N.
"""

import os
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .args import ModelArgs
from .checkpoint import load_slice, open_checkpoint
from .cli import run

# Copied beside the shards: the architecture, and whatever tokenizer came with the checkpoint.
COPIED = ("params.json", "tokenizer*")


def reshard(src: Path, dst: Path, mp: int, force: bool = False) -> list[Path]:
    """Write src's checkpoint to dst as mp shards, one shard at a time; return the shard paths."""
    src, dst = Path(src), Path(dst)
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 1:
        raise ValueError(f"--mp must be a positive number of shards, found {mp!r}")
    params = ModelArgs.load(src / "params.json")
    paths, args, _ = open_checkpoint(src, params)
    args.check_model_parallel_size(mp)
    n_shards = len(paths)
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
        state, _, _ = load_slice(src, params, rank, mp, torch.device("cpu"))
        target = dst / f"consolidated.{rank:02d}.pth"
        _replace(target, lambda tmp: torch.save(state, tmp))
        written.append(target)
        del state
    # With --force, shards of an earlier, larger checkpoint would otherwise be loaded as ours.
    for stale in sorted(set(dst.glob("consolidated.*.pth")) - set(written)):
        stale.unlink()
    return written


def _replace(target: Path, write) -> None:
    """Write through a temporary name, then rename: an interrupted run never leaves a half file."""
    tmp = target.with_name(target.name + ".tmp")
    write(tmp)
    os.replace(tmp, target)


def main(src: str, dst: str, mp: int, force: bool = False) -> None:
    """Reshard the Meta-layout checkpoint in src into mp shards in dst.

    Args:
        src: folder with params.json and consolidated.XX.pth (and possibly tokenizer.model).
        dst: folder to write; must be empty or missing unless force is given.
        mp: number of shards to write (the model-parallel size that will load them).
        force: overwrite the checkpoint in a non-empty dst.
    """
    written = reshard(Path(str(src)), Path(str(dst)), mp, force)  # fire turns a name like 13 into an int
    print(f"wrote {len(written)} shards to {dst}")


if __name__ == "__main__":
    run(main)
