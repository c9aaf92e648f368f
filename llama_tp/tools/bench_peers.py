"""The engines the benchmark times beside ours: Hugging Face transformers on the same weights
(bench_hf.py) or llama.cpp on the same GGUF file (bench_llamacpp.py), interleaved with ours; and
gpt-fast on a GPU, which times itself in a process of its own (bench_gpt_fast.py)."""

from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from ..args import ModelArgs
from ..checkpoint import load_shard, shard_paths
from ..generation import Llama

PEERS = ("hf", "llamacpp", "gpt-fast")
# Greedy choices with nothing else applied, whatever the model recommends (the demo records a
# repetition penalty): what the peers' greedy runs do.
PLAIN_GREEDY = dict(temperature=0, repetition_penalty=1.0)


class Peer(NamedTuple):
    """Another engine: its name, its greedy continuation of prompts [rows, length] by a number of
    new tokens, the most rows it takes at once, and how to let it go."""

    name: str
    generate: Callable[[torch.Tensor, int], list[list[int]]]
    max_batch: int
    close: Callable[[], None]


def check_peer(compare: Optional[str], world_size: int) -> None:
    """Refuse an unknown --compare, or one above world size 1, before anything is loaded."""
    if compare not in (None, *PEERS):
        raise ValueError(f"--compare {compare!r} is not supported; use --compare hf, --compare llamacpp, "
                         "--compare gpt-fast or leave it out")
    if compare and world_size != 1:
        raise ValueError(f"--compare {compare} runs at world size 1, not {world_size}; drop --compare or torchrun")


def open_peer(compare: str, ckpt_dir: Path, gguf: Optional[Path], args: ModelArgs, max_seq_len: int,
              dtype: torch.dtype, device: torch.device) -> tuple[Peer, dict]:
    """The peer `compare` names, ready to time, with its version for the report; transformers runs
    on our device (llama.cpp on the CPU)."""
    if compare == "hf":
        import transformers

        from .bench_hf import build_hf_model, hf_generate

        model = build_hf_model(full_weights(ckpt_dir), args, max_seq_len, dtype).to(device)
        peer = Peer("hf", lambda rows, new: hf_generate(model, rows, new).tolist(), max_batch=2**31, close=lambda: None)
        return peer, {"transformers": transformers.__version__}
    from .bench_llamacpp import LlamaCpp

    if gguf is None:
        raise ValueError(f"--compare llamacpp runs a GGUF file beside {ckpt_dir}: pass --gguf with the file "
                         "this checkpoint was converted from")
    engine = LlamaCpp(gguf, torch.get_num_threads(), max_seq_len)
    peer = Peer("llamacpp", lambda rows, new: [engine.generate(row, new) for row in rows.tolist()], max_batch=1,
                close=engine.close)
    return peer, {"llama_cpp_python": engine.version, "gguf": str(gguf)}


def full_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The unsharded weights of a one-shard checkpoint, memory-mapped."""
    paths = shard_paths(ckpt_dir)
    if len(paths) != 1:
        raise ValueError(
            f"--compare hf needs a one-shard checkpoint, found {len(paths)} shards in {ckpt_dir}; "
            "compare on a one-shard copy (the reshard tool makes one)"
        )
    return load_shard(paths[0])


def greedy_agreement(llama: Llama, peer: Peer, prompts: torch.Tensor, new_tokens: int) -> float:
    """The fraction of greedy tokens that match the peer's, position by position, over as many
    prompts as it takes at once (a check that both engines run the same model)."""
    prompts = prompts[: peer.max_batch]
    ours, _ = llama.generate(prompts.tolist(), max_gen_len=new_tokens, **PLAIN_GREEDY)
    theirs = peer.generate(prompts, new_tokens)
    same = sum(a == b for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))
    return same / sum(len(row) for row in theirs)
