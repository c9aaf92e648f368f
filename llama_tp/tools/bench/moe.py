"""Decode speed of a mixture of experts against a dense model of the same active parameters: what
routing each token to its chosen experts costs beyond their products.

    python -m llama_tp.tools.bench.moe [--dim 768 --n_layers 8 --n_experts 8 --experts_per_token 2]
    torchrun --nproc_per_node 2 -m llama_tp.tools.bench.moe
    python -m llama_tp.tools.bench.moe --peer llama-bench --llama_cpp $(../shared/tools/build-llama-cpp.sh) \
        --tokenizer_path ../shared/data/llama2-tokenizer.model

Both are random checkpoints written for the run (random_checkpoint.py): a Mixtral-shaped model
(experts of 3.5 x dim, as Mixtral 8x7B's 14336 at 4096) and a dense one whose SwiGLU is
experts_per_token experts wide, so that a token goes through as many weights in each. Their greedy
decoding runs interleaved (bench.interleaved). At batch 1 a token reads its own experts' weights
only, as many bytes as the dense model reads: the ratio is the routing's cost (at most 1.5x is the
aim). In a batch, tokens pick different experts and a layer reads up to all of them, as in any
engine's mixture of experts.

With --peer llama-bench, llama.cpp runs the same two models beside ours: they are made as random
Hugging Face models (transformers' Mixtral and Llama), llama.cpp's own converter writes each one's
GGUF file (fp32), ours is converted from that file (`python -m llama_tp.convert --kind gguf`), and
`llama-bench` times llama.cpp's decoding of one sequence, a run of ours and one of its at a time.
"""

import json
import shutil
import statistics
import tempfile
import time
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
from ..convert.gguf import convert_gguf
from .llama_bench import LlamaCpp
from .random_checkpoint import random_weights
from .speed import DECODE_PROMPT_LEN, PROMPT_SEED, TokenIds, generate_afresh, interleaved

PEERS = ("llama-bench",)

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
         threads: Optional[int] = None, peer: Optional[str] = None, llama_cpp: Optional[str] = None,
         tokenizer_path: Optional[str] = None, json_path: str = "bench_moe.json"):
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
        peer: "llama-bench": llama.cpp beside ours on the same GGUF files (batch 1; world size 1).
        llama_cpp: with peer, the folder build-llama-cpp.sh prints (llama-bench, and its sources'
            convert_hf_to_gguf.py beside them).
        tokenizer_path: with peer, a Llama tokenizer.model, which the converters write beside the
            weights (the models' vocabulary is its size).
        json_path: where to write the results.
    """
    batch_sizes = (batch_sizes,) if isinstance(batch_sizes, int) else tuple(batch_sizes)
    if threads is not None:
        torch.set_num_threads(threads)
    peer_tools = _check_peer(peer, llama_cpp, tokenizer_path)
    placement = parallel.init()
    if peer is not None and placement.world_size != 1:
        raise ValueError(f"--peer {peer} runs at world size 1, not {placement.world_size}; drop --peer or torchrun")
    if peer is not None:
        import sentencepiece

        vocab_size = sentencepiece.SentencePieceProcessor(model_file=tokenizer_path).vocab_size()
    params = shapes(dim, n_layers, n_heads, n_kv_heads, vocab_size, n_experts, experts_per_token)
    torch_dtype = parallel.resolve_dtype(dtype, placement.device)
    llamas, ggufs = {}, {}
    scratch_dir = tempfile.TemporaryDirectory(prefix="llama_tp_bench_moe_")
    scratch = Path(scratch_dir.name)
    for name, shape in params.items():
        folder = Path(parallel.broadcast_object(str(scratch / name) if placement.is_main else None))
        if peer_tools is not None:  # llama.cpp's GGUF of a Hugging Face model, and ours converted from it
            hf = hf_model(scratch / f"hf-{name}", shape, tokenizer_path)
            ggufs[name] = scratch / f"{name}.gguf"
            peer_tools.convert(hf, ggufs[name], "f32")
            convert_gguf(str(ggufs[name]), str(folder))
            shape = json.loads((folder / "params.json").read_text())
        elif placement.is_main:
            folder.mkdir()
            (folder / "params.json").write_text(json.dumps(shape))
            torch.save(random_weights(ModelArgs.from_dict(shape), torch.device("cpu"), seed=0),
                       folder / "consolidated.00.pth")
        parallel.broadcast_object(None)  # written before any rank reads it
        args = ModelArgs.from_dict(shape)
        args.check_model_parallel_size(placement.world_size)
        model = load_model(folder, args, placement, torch_dtype, quantize,
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
    if peer_tools is not None:
        threads = torch.get_num_threads()
        report["llama_cpp"] = llama_cpp_beside_ours(peer_tools, ggufs, llamas, prompts, new_tokens, repeats, threads)
        report["command"] |= {"peer": peer, "llama_cpp": peer_tools.version()}
    scratch_dir.cleanup()
    if placement.is_main:
        Path(json_path).write_text(json.dumps(report, indent=2))
        for name, result in results.items():
            print(f"{name}: the experts' step costs {result['experts_cost_vs_dense']:.2f}x the dense one's")
        if peer_tools is not None:
            theirs = report["llama_cpp"]
            print(f"llama.cpp, one sequence: the experts' step costs {theirs['experts_cost_vs_dense']:.2f}x the dense "
                  f"one's; ours over llama.cpp's: experts {theirs['ours_over_theirs']['experts']:.2f}x, dense "
                  f"{theirs['ours_over_theirs']['dense']:.2f}x")
        print(f"wrote {json_path}")


def _check_peer(peer: Optional[str], llama_cpp: Optional[str], tokenizer_path: Optional[str]) -> Optional[LlamaCpp]:
    """The peer's tools, or a refusal naming the option to fix, before anything is made."""
    if peer is None:
        return None
    if peer not in PEERS:
        raise ValueError(f"--peer {peer!r} is not one of {', '.join(PEERS)}")
    if llama_cpp is None or tokenizer_path is None:
        raise ValueError(f"--peer {peer} needs --llama_cpp (the folder ../shared/tools/build-llama-cpp.sh prints) and "
                         "--tokenizer_path (a Llama tokenizer.model)")
    if not Path(tokenizer_path).is_file():
        raise FileNotFoundError(f"--tokenizer_path {tokenizer_path} is not a file; pass a Llama tokenizer.model")
    return LlamaCpp(llama_cpp)


def hf_model(folder: Path, shape: dict, tokenizer_path: str) -> Path:
    """A random Hugging Face model of shape (params.json's keys: transformers' Mixtral with experts,
    Llama without), saved in folder with the tokenizer.model the converter reads."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    args = ModelArgs.from_dict(shape)
    common = dict(hidden_size=args.dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                  num_key_value_heads=args.kv_heads, vocab_size=args.vocab_size, rms_norm_eps=args.norm_eps,
                  rope_theta=args.rope_theta, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    if args.n_experts:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=args.expert_hidden_dim, num_local_experts=args.n_experts,
                                                 num_experts_per_tok=args.experts_per_token, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=args.ffn_hidden_dim, **common))
    model.save_pretrained(folder)
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    return folder


def llama_cpp_beside_ours(tools: LlamaCpp, ggufs: dict[str, Path], llamas: dict[str, Llama], prompts: torch.Tensor,
                          new_tokens: int, repeats: int, threads: int) -> dict:
    """Decoding one sequence, llama-bench's and ours on the same GGUF files, one run of each model
    by each engine in turn; medians of tokens per second."""
    runs: dict[str, dict[str, list[float]]] = {"llama_cpp": {}, "ours": {}}
    for name in ggufs:
        generate_afresh(llamas[name], prompts[:1].tolist(), new_tokens)  # warm
    for _ in range(repeats):
        for name, gguf in ggufs.items():
            start = time.perf_counter()
            generate_afresh(llamas[name], prompts[:1].tolist(), new_tokens)
            runs["ours"].setdefault(name, []).append(new_tokens / (time.perf_counter() - start))
            runs["llama_cpp"].setdefault(name, []).append(tools.decode_speed(gguf, new_tokens, threads))
    speeds = {engine: {name: statistics.median(values) for name, values in by_model.items()}
              for engine, by_model in runs.items()}
    theirs, ours = speeds["llama_cpp"], speeds["ours"]
    return {"tokens_per_s": theirs, "ours_tokens_per_s": ours, "runs": runs,
            "experts_cost_vs_dense": theirs["dense"] / theirs["experts"],
            "ours_over_theirs": {name: ours[name] / theirs[name] for name in theirs}}


if __name__ == "__main__":
    run(main)
