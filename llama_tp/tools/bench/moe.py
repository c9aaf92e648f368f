"""Decode speed of a mixture of experts against a dense model of the same active parameters: what
routing each token to its chosen experts costs beyond their products.

    python -m llama_tp.tools.bench.moe [--dim 768 --n_layers 8 --n_experts 8 --experts_per_token 2]
    torchrun --nproc_per_node 2 -m llama_tp.tools.bench.moe

Both are random checkpoints written for the run (random_checkpoint.py): a Mixtral-shaped model
(experts of 3.5 x dim, as Mixtral 8x7B's 14336 at 4096) and a dense one whose SwiGLU is
experts_per_token experts wide, so that a token goes through as many weights in each. Their greedy
decoding runs interleaved (bench.interleaved). At batch 1 a token reads its own experts' weights
only, as many bytes as the dense model reads: the ratio is the routing's cost (at most 1.5x is the
aim). In a batch, tokens pick different experts and a layer reads up to all of them, as in any
engine's mixture of experts.
"""

import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from ... import parallel
from ...checkpoint import load_model
from ...generation import Llama
from ...kernels import matmul
from ...model.args import ModelArgs
from ..cli import run
from ..convert.writer import ffn_params
from .random_checkpoint import random_weights
from .speed import DECODE_PROMPT_LEN, PROMPT_SEED, TokenIds, generate_afresh, interleaved

# Mixtral 8x7B's expert size over its model width: 14336 / 4096.
EXPERT_WIDTH = 3.5


def shapes(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int, n_experts: int,
           experts_per_token: int) -> dict[str, dict]:
    """params.json of the mixture of experts and of the dense model with its active parameters."""
    hidden = int(EXPERT_WIDTH * dim)
    common = {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
              "vocab_size": vocab_size, "norm_eps": 1e-5, "rope_theta": 1e6}
    experts = common | ffn_params(dim, hidden) | {"n_experts": n_experts, "experts_per_token": experts_per_token,
                                                  "expert_hidden_dim": hidden, "normalize_expert_weights": True}
    return {"experts": experts, "dense": common | ffn_params(dim, experts_per_token * hidden)}


def main(dim: int = 768, n_layers: int = 8, n_heads: int = 12, n_kv_heads: int = 4, vocab_size: int = 32000,
         n_experts: int = 8, experts_per_token: int = 2, batch_sizes: tuple[int, ...] = (1, 8),
         new_tokens: int = 64, repeats: int = 3, dtype: str = "fp32", quantize: Optional[str] = None,
         threads: Optional[int] = None, json_path: str = "bench_moe.json"):
    """Write both random checkpoints, then time their greedy decoding interleaved; print and write JSON.

    Args:
        dim, n_layers, n_heads, n_kv_heads, vocab_size: the shape both models share.
        n_experts, experts_per_token: the mixture's experts (each 3.5 x dim wide) and its top-k;
            the dense model's SwiGLU is experts_per_token experts wide.
        batch_sizes: decode batch sizes.
        new_tokens: tokens generated per timed run.
        repeats: timed runs of each model per case (medians are reported).
        dtype, quantize: as Llama.build takes them.
        threads: torch threads per process; default: torch's choice. On a machine loaded beyond its
            cores, waking a second thread for each product costs milliseconds, and the experts make
            twice the dense model's products: one thread measures the weights' reading alone.
        json_path: where to write the results.
    """
    batch_sizes = (batch_sizes,) if isinstance(batch_sizes, int) else tuple(batch_sizes)
    if threads is not None:
        torch.set_num_threads(threads)
    placement = parallel.init()
    params = shapes(dim, n_layers, n_heads, n_kv_heads, vocab_size, n_experts, experts_per_token)
    torch_dtype = parallel.resolve_dtype(dtype, placement.device)
    llamas = {}
    with tempfile.TemporaryDirectory(prefix="llama_tp_bench_moe_") as scratch:
        for name, shape in params.items():
            args = ModelArgs.from_dict(shape)
            args.check_model_parallel_size(placement.world_size)
            folder = parallel.broadcast_object(str(Path(scratch) / name) if placement.is_main else None)
            if placement.is_main:
                Path(folder).mkdir()
                (Path(folder) / "params.json").write_text(json.dumps(shape))
                torch.save(random_weights(args, torch.device("cpu"), seed=0), Path(folder) / "consolidated.00.pth")
            parallel.broadcast_object(None)  # written before any rank reads it
            model = load_model(Path(folder), args, placement, torch_dtype, quantize,
                               pack=matmul.packing_pays(max(batch_sizes), False, torch_dtype))
            model.setup_caches(max(batch_sizes), DECODE_PROMPT_LEN + new_tokens, placement.device, torch_dtype)
            llamas[name] = Llama(model, TokenIds(vocab_size))
    prompts = torch.randint(1, vocab_size, (max(batch_sizes), DECODE_PROMPT_LEN),
                            generator=torch.Generator().manual_seed(PROMPT_SEED))
    cases = {f"decode_batch_{batch}": (batch * new_tokens, {
        name: partial(generate_afresh, llama, prompts[:batch].tolist(), new_tokens) for name, llama in llamas.items()})
        for batch in batch_sizes}
    parallel.print0(f"decoding {new_tokens} tokens, {n_experts} experts top-{experts_per_token} against dense "
                    f"(tokens per second, medians of interleaved runs):")
    results = interleaved(cases, repeats, reference="experts")
    for result in results.values():
        result["experts_cost_vs_dense"] = 1 / result["ratio_vs_dense"]
    report = {"command": {"params": params, "batch_sizes": batch_sizes, "new_tokens": new_tokens, "repeats": repeats,
                          "dtype": dtype, "quantize": quantize, "world_size": placement.world_size},
              "machine": {"torch_threads": torch.get_num_threads()}, "cases": results}
    if placement.is_main:
        Path(json_path).write_text(json.dumps(report, indent=2))
        for name, result in results.items():
            print(f"{name}: the experts' step costs {result['experts_cost_vs_dense']:.2f}x the dense one's")
        print(f"wrote {json_path}")


if __name__ == "__main__":
    run(main)
