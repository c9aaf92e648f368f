"""Load every checkpoint of a manifest through Llama.build at world sizes 1, 2 and 4; save what each gives.

    python tests/reshard_worker.py MANIFEST.json

The manifest names the checkpoints, the tokenizer and an output folder; world size W writes
OUT/world{W}.pt holding, per checkpoint, fp32 logits of a fixed batch and greedy tokens.
torch is imported once here and the ranks of each world size are forked from this process
(gloo, a fresh rendezvous each): three launches of torchrun would pay for the import in 10 processes.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from distributed import rendezvous
from llama_tp import Llama, parallel

PROMPTS = [[1, 450, 4996, 17354, 1701, 29916], [1, 18637, 29892, 920, 29871, 13]]
WORLD_SIZES = (1, 2, 4)


def rank_main(rank: int, world_size: int, environment: dict[str, str], manifest: dict) -> None:
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two cores shared by several ranks
    results = {}
    for name, ckpt_dir in manifest["checkpoints"].items():
        llama = Llama.build(ckpt_dir, manifest["tokenizer"], max_seq_len=32, max_batch_size=2, dtype="fp32")
        logits = llama.model.forward(torch.tensor(PROMPTS), 0)
        tokens, _ = llama.generate(PROMPTS, max_gen_len=8, temperature=0.0)
        results[name] = {"logits": logits, "tokens": tokens}
    if rank == 0:
        torch.save(results, Path(manifest["out"]) / f"world{world_size}.pt")
    parallel.leave()  # with the other ranks, as run_world's workers do (distributed.py)


def main(manifest_path: str) -> None:
    manifest = json.loads(Path(manifest_path).read_text())
    for world_size in WORLD_SIZES:
        with rendezvous() as environment:
            mp.start_processes(rank_main, args=(world_size, environment, manifest), nprocs=world_size,
                               start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
