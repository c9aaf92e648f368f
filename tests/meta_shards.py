"""Meta-layout shards written independently of llama_tp's resharding, for checking it."""

import json
from pathlib import Path

import torch

from llama_tp.model.args import ModelArgs
from tiny_checkpoint import split_dim


def meta_shards(weights: dict[str, torch.Tensor], args: ModelArgs, layout: str, n: int,
                head_copies: bool = True) -> list[dict]:
    """Split whole weights n ways as Meta does; above the KV head count, each shard keeps a copy
    of the head its query heads use (the layout llama_tp runs with at that world size), or, without
    head_copies, an even share of wk's and wv's rows, as a tool that splits every tensor alike does."""
    shards = []
    for rank in range(n):
        shard = {}
        for name, tensor in weights.items():
            dim = split_dim(name, layout)
            if name.split(".")[-2] in ("wk", "wv") and n > args.kv_heads and head_copies:
                head = rank * args.kv_heads // n
                shard[name] = tensor[head * args.head_dim : (head + 1) * args.head_dim].clone()
            else:
                shard[name] = tensor if dim is None else tensor.chunk(n, dim=dim)[rank].clone()
        shards.append(shard)
    return shards


def write_shards(directory: Path, params: dict, shards: list[dict]) -> Path:
    """params.json and consolidated.XX.pth files for these shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "params.json").write_text(json.dumps(params))
    for rank, shard in enumerate(shards):
        torch.save(shard, directory / f"consolidated.{rank:02d}.pth")
    return directory
