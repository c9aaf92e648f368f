"""gpt-fast beside ours on the same GPU (`bench --compare gpt-fast`): pytorch-labs' gpt-fast times its
compiled batch-1 decoding on random weights of the checkpoint's published shape, in a process of
its own (its bench_random.py, beside gpt-fast's files in --gpt_fast_dir), after ours has run the
same decoding: batch 1, the same prompt length and new tokens, sampled as gpt-fast samples
(temperature 0.8, top-k 200), bf16 or both quantized alike. Both figures are also a share of the
copy bandwidth measured on the GPU: tokens/s x bytes a token reads / bytes/s.

gpt-fast is a peer only: nothing here imports it, and its folder is a benchmark's argument.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from ..args import ModelArgs
from .random_checkpoint import SHAPES

# ../shared/peers/gpt-fast beside the project folder, where the development machines keep it.
DEFAULT_DIR = Path(__file__).resolve().parents[3] / "shared" / "peers" / "gpt-fast"
DRIVER = "bench_random.py"
# Our random_checkpoint shapes under gpt-fast's names (its model.py's transformer_configs).
SHAPE_NAMES = {"llama2-7b": "7B", "llama3-8b": "llama-3-8b"}
# Our --quantize under gpt-fast's --quant.
QUANT_NAMES = {None: "none", "int8": "int8", "int4": "int4"}
# What gpt-fast's benchmark does each step after the logits (its generate.py's defaults).
SAMPLING = dict(temperature=0.8, top_k=200, top_p=1.0, repetition_penalty=1.0)
CASE = "decode_batch_1_sampled"  # the case of the report both engines run


def check_gpt_fast(folder: Optional[str], device: torch.device, dtype: torch.dtype, quantize: Optional[str]) -> Path:
    """gpt-fast's folder, once everything --compare gpt-fast needs is known to be there; refused
    before anything loads otherwise."""
    if device.type != "cuda":
        raise ValueError(f"--compare gpt-fast times gpt-fast's CUDA graphs on a GPU, but this job runs on {device}; "
                         "run it where CUDA sees a GPU")
    if dtype != torch.bfloat16:
        raise ValueError(f"--compare gpt-fast runs gpt-fast's bf16 model, not {dtype}; pass --dtype bf16")
    if quantize not in QUANT_NAMES:
        raise ValueError(f"--compare gpt-fast quantizes gpt-fast alike, which has no {quantize!r}; "
                         "use --quantize int8, int4 or leave it out")
    folder_path = Path(folder) if folder is not None else DEFAULT_DIR
    if not (folder_path / DRIVER).is_file():
        raise ValueError(f"--compare gpt-fast runs {DRIVER} beside gpt-fast's files, and {folder_path} has no "
                         f"{DRIVER}; pass --gpt_fast_dir with the folder that holds them (../shared/peers/gpt-fast "
                         "beside the project)")
    return folder_path


def gpt_fast_shape(args: ModelArgs, ckpt_dir: Path) -> str:
    """gpt-fast's name for the published shape the checkpoint has: its sizes are what decides speed."""
    for ours, theirs in SHAPE_NAMES.items():
        if _sizes(ModelArgs.from_dict(SHAPES[ours])) == _sizes(args):
            return theirs
    raise ValueError(
        f"--compare gpt-fast runs a published shape, and {ckpt_dir} is none of {', '.join(SHAPE_NAMES)} (dim "
        f"{args.dim}, {args.n_layers} layers, {args.n_heads} heads, vocabulary {args.vocab_size}); make one with "
        "python -m llama_tp.tools.random_checkpoint --shape llama2-7b --out DIR"
    )


def _sizes(args: ModelArgs) -> tuple[int, ...]:
    return args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim, args.vocab_size


def run_gpt_fast(folder: Path, shape: str, quantize: Optional[str], prompt_len: int, new_tokens: int,
                 repeats: int, device: torch.device) -> dict:
    """gpt-fast's figures for one shape, from the JSON line its driver prints: its median tokens/s
    over `repeats` runs after one that compiles, its weights' GB, the device and its torch."""
    command = [sys.executable, DRIVER, "--shape", shape, "--quant", QUANT_NAMES[quantize],
               "--prompt_len", str(prompt_len), "--new_tokens", str(new_tokens), "--repeats", str(repeats),
               "--device", str(device)]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        last = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"gpt-fast's {DRIVER} failed (exit {done.returncode}) in {folder}:\n{last}")
    for line in reversed(done.stdout.splitlines()):
        try:
            figures = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(figures, dict) and figures.get("peer") == "gpt-fast":
            return figures | {"command": " ".join(command), "folder": str(folder)}
    raise RuntimeError(f"gpt-fast's {DRIVER} printed no line of figures; its output ended:\n{done.stdout[-500:]}")


def side_by_side(ours_tokens_per_s: float, our_bytes_per_token: int, figures: dict, args: ModelArgs,
                 copy_bandwidth: float) -> dict:
    """Both engines' tokens/s, ours over theirs, and each as a share of the copy bandwidth: tokens/s
    x the bytes a token reads / bytes/s. gpt-fast's weights count its embedding table (bf16, never
    quantized), which a token does not read: it is left out, as ours is."""
    their_bytes_per_token = figures["weights_gb"] * 1e9 - args.vocab_size * args.dim * 2
    return {
        "tokens_per_s": {"llama_tp": ours_tokens_per_s, "gpt-fast": figures["tokens_per_s"]},
        "ratio_vs_gpt-fast": ours_tokens_per_s / figures["tokens_per_s"],
        "bytes_per_token": {"llama_tp": our_bytes_per_token, "gpt-fast": their_bytes_per_token},
        "share_of_copy_bandwidth": {
            "llama_tp": ours_tokens_per_s * our_bytes_per_token / copy_bandwidth,
            "gpt-fast": figures["tokens_per_s"] * their_bytes_per_token / copy_bandwidth,
        },
        "gpt_fast": figures,
    }


def print_side_by_side(comparison: dict) -> None:
    """The comparison as two lines beneath bench's table."""
    speeds, shares = comparison["tokens_per_s"], comparison["share_of_copy_bandwidth"]
    print(f"gpt-fast ({comparison['gpt_fast']['shape']}, {comparison['gpt_fast']['quant']}), batch 1 sampled: "
          f"llama_tp {speeds['llama_tp']:.1f} tok/s, gpt-fast {speeds['gpt-fast']:.1f} tok/s, "
          f"ratio {comparison['ratio_vs_gpt-fast']:.2f}")
    print(f"  share of the copy bandwidth: llama_tp {100 * shares['llama_tp']:.0f}%, "
          f"gpt-fast {100 * shares['gpt-fast']:.0f}%")
