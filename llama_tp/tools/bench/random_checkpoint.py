"""A Meta-layout checkpoint of random weights in a published Llama's shape, for benchmarks where the
real weights are not at hand (speed depends on the shapes, not on the values).

    python -m llama_tp.tools.bench.random_checkpoint --shape llama2-7b --out /tmp/llama2-7b
    python -m llama_tp.bench --ckpt_dir /tmp/llama2-7b --dtype bf16 --compile true
"""

import json
from pathlib import Path

import torch

from ...model.args import ModelArgs
from ..cli import run
from ..convert.writer import expected_shapes

# params.json of Meta's releases.
SHAPES = {
    "llama2-7b": {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05,
                  "vocab_size": 32000},
    "llama3-8b": {"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32, "n_kv_heads": 8,
                  "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
                  "vocab_size": 128256},
    # config.json of Mistral's Mixtral-8x7B-v0.1 as params.json: top 2 of 8 experts of 14336.
    "mixtral-8x7b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 32000,
                     "multiple_of": 1024, "ffn_dim_multiplier": 1.3125, "norm_eps": 1e-05, "rope_theta": 1000000.0,
                     "n_experts": 8, "experts_per_token": 2, "expert_hidden_dim": 14336,
                     "normalize_expert_weights": True},
}


def random_weights(args: ModelArgs, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Every weight of one unsharded checkpoint, bf16, on the CPU: normal with a small spread, so
    activations stay finite through every layer (norms 1, linear layers scaled by their width)."""
    generator = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(args).items():
        if len(shape) == 1:  # norms (and biases, with the model's q/k/v biases)
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        scale = 1.0 if name == "tok_embeddings.weight" else shape[1] ** -0.5
        weights[name] = (torch.randn(*shape, generator=generator, device=device) * scale).to(torch.bfloat16).cpu()
    return weights


def main(shape: str, out: str, seed: int = 0):
    """Write params.json and consolidated.00.pth of random weights in SHAPES[shape] to out.

    Args:
        shape: one of SHAPES' names.
        out: the folder to write (made if missing).
        seed: the random generator's seed.
    """
    if shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is not one of {', '.join(SHAPES)}")
    params = SHAPES[shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU draws them faster
    weights = random_weights(ModelArgs.from_dict(params), device, seed)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(params))
    torch.save(weights, folder / "consolidated.00.pth")
    print(f"wrote {sum(t.numel() for t in weights.values()) / 1e9:.2f}B random parameters in {shape}'s shape to {folder}")


if __name__ == "__main__":
    run(main)
