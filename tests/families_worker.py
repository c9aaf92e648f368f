"""Load converted checkpoints of the Llama family's cousins at several world sizes; save what each gives.

    python tests/families_worker.py MANIFEST.json

The manifest lists cases {"name", "ckpt", "quantize", "world_sizes"} (and "tokenizer" where it is
not the folder's tokenizer.json), the prompt tokens and an output folder; world size W writes OUT/world{W}.pt holding, per case, fp32 logits of the tokens
and greedy tokens of the first row's prompt. The ranks of each world size are forked from this
process (gloo, a fresh rendezvous each), as tests/reshard_worker.py does.
"""

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from distributed import rendezvous
from llama_tp import Llama, parallel


def rank_main(rank: int, world_size: int, environment: dict[str, str], manifest: dict) -> None:
    """run_cases, saying on stderr which rank of which world failed and where: torch's spawn
    reports one failed rank only, and a crash (a signal) with no Python stack at all."""
    faulthandler.enable()
    try:
        run_cases(rank, world_size, environment, manifest)
    except BaseException:
        sys.stderr.write(f"RANK {rank} OF WORLD {world_size} FAILED:\n{traceback.format_exc()}")
        raise


def run_cases(rank: int, world_size: int, environment: dict[str, str], manifest: dict) -> None:
    os.environ.update(environment, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two cores shared by several ranks
    tokens = torch.tensor(manifest["tokens"])
    prompt = manifest["prompt"]
    results = {}
    for case in manifest["cases"]:
        if world_size not in case["world_sizes"]:
            continue
        ckpt = case["ckpt"]
        tokenizer = case.get("tokenizer") or str(Path(ckpt) / "tokenizer.json")
        llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=2, dtype="fp32", quantize=case["quantize"])
        logits = llama.model.forward(tokens, 0)
        generated, _ = llama.generate([prompt], max_gen_len=manifest["steps"], temperature=0.0)
        results[case["name"]] = {"logits": logits, "tokens": generated[0]}
    if rank == 0:
        torch.save(results, Path(manifest["out"]) / f"world{world_size}.pt")
    parallel.leave()  # with the other ranks, as run_world's workers do (distributed.py)


def main(manifest_path: str) -> None:
    manifest = json.loads(Path(manifest_path).read_text())
    for world_size in sorted({w for case in manifest["cases"] for w in case["world_sizes"]}):
        with rendezvous() as environment:
            mp.start_processes(rank_main, args=(world_size, environment, manifest), nprocs=world_size,
                               start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
