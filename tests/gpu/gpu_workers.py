"""Functions the GPU tests run on every rank of a spawned world (they must be importable there)."""

from typing import Optional

import torch

from llama_tp import Llama, parallel

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 306, 4658], [1, 18637, 29892, 3186, 29991, 910, 338]]


def greedy(folder: str, tokenizer_path: str, dtype: Optional[str] = None, compile: bool = False) -> list[list[int]]:
    """Greedy tokens of PROMPTS on this rank, then leave the group cleanly."""
    llama = Llama.build(folder, tokenizer_path, max_seq_len=64, max_batch_size=3, dtype=dtype, compile=compile)
    tokens, _ = llama.generate(PROMPTS, max_gen_len=16, temperature=0)
    parallel.leave()
    return tokens


def argmax_of_my_slice(rows: torch.Tensor, slice_width: int) -> list[int]:
    """vocab_argmax on this rank's GPU slice of rows (ties across ranks included)."""
    placement = parallel.init()
    mine = rows[:, placement.rank * slice_width : (placement.rank + 1) * slice_width].to(placement.device)
    ids = parallel.vocab_argmax(mine)
    assert ids.device == placement.device
    result = ids.tolist()
    parallel.leave()
    return result
