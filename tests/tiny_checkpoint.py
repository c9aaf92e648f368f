"""Tiny random Llama checkpoints in Meta's layout, written the way Meta's shards are."""

import json
import os
from pathlib import Path
from typing import Optional

import torch

from llama_tp.args import ModelArgs

# Beside the project; LLAMA_TP_TEST_DATA names it where the tests run from a copy (mutmut's mutants/).
SHARED_DATA = Path(os.environ.get("LLAMA_TP_TEST_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
LLAMA2_TOKENIZER = SHARED_DATA / "llama2-tokenizer.model"

TINY_LLAMA2 = {"dim": 64, "n_layers": 2, "n_heads": 4, "multiple_of": 32, "norm_eps": 1e-5, "vocab_size": -1}
# Grouped-query attention, a vocab-split embedding and Llama 3.1's rope scaling.
TINY_LLAMA3 = {
    "dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "multiple_of": 32,
    "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 500000.0, "use_scaled_rope": True,
    "vocab_size": 32000,
}
# TINY_LLAMA3 with heads of 16 channels, the narrowest FlexAttention takes: the GPU's decoding steps
# (Transformer.decode_step, through block masks) need them.
TINY_WIDE_HEADS = TINY_LLAMA3 | {"dim": 128}


def full_weights(params: dict, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unsharded random weights named as in Meta's checkpoints, in bf16."""
    args = ModelArgs.from_dict(params).with_vocab_size(vocab_size)
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    def norm(dim: int) -> torch.Tensor:
        return (1 + torch.randn(dim, generator=generator) * 0.1).to(torch.bfloat16)

    kv_dim = args.kv_heads * args.head_dim
    weights = {"tok_embeddings.weight": randn(args.vocab_size, args.dim, scale=1.0)}
    for i in range(args.n_layers):
        prefix = f"layers.{i}."
        weights |= {
            prefix + "attention.wq.weight": randn(args.dim, args.dim, scale=0.1),
            prefix + "attention.wk.weight": randn(kv_dim, args.dim, scale=0.1),
            prefix + "attention.wv.weight": randn(kv_dim, args.dim, scale=0.1),
            prefix + "attention.wo.weight": randn(args.dim, args.dim, scale=0.1),
            prefix + "feed_forward.w1.weight": randn(args.ffn_hidden_dim, args.dim, scale=0.1),
            prefix + "feed_forward.w2.weight": randn(args.dim, args.ffn_hidden_dim, scale=0.1),
            prefix + "feed_forward.w3.weight": randn(args.ffn_hidden_dim, args.dim, scale=0.1),
            prefix + "attention_norm.weight": norm(args.dim),
            prefix + "ffn_norm.weight": norm(args.dim),
        }
    weights["norm.weight"] = norm(args.dim)
    weights["output.weight"] = randn(args.vocab_size, args.dim, scale=0.1)
    return weights


def split_dim(name: str, layout: str) -> Optional[int]:
    """The dimension Meta's shards split tensor `name` along (None: every shard holds it whole).
    Written out here, not taken from llama_tp.checkpoint.sharding: shards the tests make the
    library's way would hide a mistake in the library's rule."""
    module = name.split(".")[-2]  # layers.0.attention.wq.weight -> wq
    if module == "tok_embeddings":
        return 1 if layout == "dim" else 0
    if module in ("wq", "wk", "wv", "w1", "w3", "output"):  # fairscale's ColumnParallelLinear: output rows
        return 0
    return 1 if module in ("wo", "w2") else None  # RowParallelLinear: input columns; norms whole


def write_checkpoint(directory: Path, params: dict, weights: dict[str, torch.Tensor],
                     n_shards: int, layout: str) -> Path:
    """Split weights into n_shards Meta-layout shards in directory, with params.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "params.json").write_text(json.dumps(params))
    args = ModelArgs.from_dict(params)
    rope_freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
    for rank in range(n_shards):
        shard = {}
        for name, tensor in weights.items():
            dim = split_dim(name, layout)
            shard[name] = tensor if dim is None else tensor.chunk(n_shards, dim=dim)[rank].clone()
        shard["rope.freqs"] = rope_freqs.to(torch.bfloat16)  # as real Llama 2 shards carry it
        torch.save(shard, directory / f"consolidated.{rank:02d}.pth")
    return directory


def successor_weights(params: dict, vocab_size: int, successor: dict[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of a model whose greedy choice after token t is successor[t], to force known output.

    Every block's output projections are zero, so each position's state is its own token's
    embedding; the output row of successor[t] points along t's embedding.
    """
    weights = full_weights(params, vocab_size, seed)
    for name in weights:
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            weights[name] = torch.zeros_like(weights[name])
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(weights[name])
    embeddings = weights["tok_embeddings.weight"].float()
    output = torch.zeros_like(embeddings)
    for token, following in successor.items():
        output[following] = 4.0 * embeddings[token] / embeddings[token].norm()
    weights["output.weight"] = output.to(torch.bfloat16)
    return weights
