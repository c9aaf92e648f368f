"""Benchmark: load time, prefill and decode speed, peak memory and this machine's memory-bandwidth
roofline, optionally interleaved with Hugging Face transformers on the same weights or with
llama.cpp on the same GGUF file (peers.py), or beside gpt-fast on a GPU (gpt_fast.py).

    python -m llama_tp.bench --ckpt_dir DIR [--compare hf] [--quantize int8|int4] [--json bench.json]
    python -m llama_tp.bench --quantize int4 --compare llamacpp    # the demo model and its GGUF
    python -m llama_tp.bench --ckpt_dir DIR --dtype bf16 --compile true --compare gpt-fast --gpt_fast_dir GPT_FAST
    torchrun --nproc_per_node 2 -m llama_tp.bench --ckpt_dir DIR

Works on token ids (random, seeded), so no tokenizer is needed unless params.json leaves
vocab_size to it. Without --ckpt_dir it benchmarks the demo model (SmolLM2-135M-Instruct).
"""

import json
import multiprocessing
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from functools import partial
from typing import Callable, Optional

import torch

from ... import parallel
from ...model.args import ModelArgs
from ...checkpoint import TOLERATED_EXTRA_KEYS, load_model, shard_paths
from ...generation import Llama, compile_decoding
from ...kernels import matmul
from ...model.quantize import check_quantize
from ...text.tokenizer import load_tokenizer
from .. import demo
from ..cli import run
from .gpt_fast import CASE as GPT_FAST_CASE
from .gpt_fast import SAMPLING as GPT_FAST_SAMPLING
from .gpt_fast import check_gpt_fast, gpt_fast_shape, print_side_by_side, run_gpt_fast, side_by_side
from .peers import PLAIN_GREEDY, Peer, check_peer, greedy_agreement, open_peer

PROMPT_SEED = 1234
DECODE_PROMPT_LEN = 16  # short, so the decode figures are decode and not prefill


class TokenIds:
    """A stand-in tokenizer for a benchmark on raw ids: no stop token, so nothing ends early."""

    def __init__(self, vocab_size: int):
        self.n_words = vocab_size
        self.bos_id, self.eos_id, self.pad_id = 0, -1, -1
        self.stop_tokens: set[int] = set()


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a tensor copy moves through the device's memory (each byte read once and
    written once)."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _best_seconds(lambda: dst.copy_(src), device, repeats)


def read_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second a plain read (a sum) draws from the device's memory: decoding only reads its
    weights, and a CPU core can wait on only so many reads at once, so this may fall short of the copy."""
    data = torch.ones(megabytes * 2**20 // 4, device=device)
    return data.numel() * data.element_size() / _best_seconds(data.sum, device, repeats)


def _best_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The shortest of repeats runs of work, each waited for (a GPU runs it after the call returns)."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up (a GPU's first kernel loads its code)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoded token reads on this rank: everything but the embedding table,
    fbgemm's packed int8 weights (int8_dynamic) included."""
    in_state = sum(
        tensor.numel() * tensor.element_size()
        for name, tensor in model.state_dict().items()
        if not name.startswith("tok_embeddings.")
    )
    return in_state + sum(getattr(module, "packed_bytes", 0) for module in model.modules())


def roofline(model: torch.nn.Module, world_size: int, device: torch.device) -> dict:
    """Decode tokens per second that memory bandwidth allows: weight bytes per token over copy
    bandwidth; and the same at the rate of a plain read.

    Every rank copies (then reads) at once, as every rank reads its weights at once when
    decoding; the slowest rank's weights over its share of the bandwidth bound the job.
    """
    parallel.broadcast_object(None)  # start together
    copy = copy_bandwidth(device)
    parallel.broadcast_object(None)
    read = read_bandwidth(device)
    measured = (copy, read, weight_bytes_per_token(model))
    per_rank = [parallel.broadcast_object(measured, src=rank) for rank in range(world_size)]
    return {
        "copy_bandwidth_bytes_per_s": sum(c for c, _, _ in per_rank),
        "weight_bytes_per_token": sum(w for _, _, w in per_rank),
        "decode_tokens_per_s": min(c / w for c, _, w in per_rank),
        "read_bandwidth_bytes_per_s": sum(r for _, r, _ in per_rank),
        "read_decode_tokens_per_s": min(r / w for _, r, w in per_rank),
    }


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far.

    On Linux, VmHWM of /proc/self/status, which starts afresh in a new program: getrusage's
    ru_maxrss does not, and in a process spawned by a large parent it reports the parent's size.
    """
    status = _proc_status("VmHWM")
    if status is not None:
        return status
    scale = 1 if platform.system() == "Darwin" else 1024  # macOS reports bytes, Linux kilobytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_bytes() -> int:
    """Resident memory now (Linux); the peak so far elsewhere."""
    status = _proc_status("VmRSS")
    return status if status is not None else peak_rss_bytes()


def _proc_status(field: str) -> Optional[int]:
    """A memory figure of /proc/self/status in bytes, or None where there is no such file."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def model_args(ckpt_dir: Path, tokenizer_path: Optional[str]) -> ModelArgs:
    """The checkpoint's architecture, with the vocabulary from the tokenizer if params.json leaves it out."""
    args = ModelArgs.load(Path(ckpt_dir) / "params.json")
    if args.vocab_size == -1:
        if tokenizer_path is None:
            raise ValueError(
                f"{ckpt_dir}/params.json leaves vocab_size to the tokenizer; pass --tokenizer_path"
            )
        args = args.with_vocab_size(load_tokenizer(tokenizer_path).n_words)
    return args


def load_ours(ckpt_dir: Path, args: ModelArgs, placement: parallel.Placement, dtype: torch.dtype,
              quantize: Optional[str], pack: bool) -> torch.nn.Module:
    """llama_tp's loader, as Llama.build runs it."""
    return load_model(ckpt_dir, args, placement, dtype, quantize, pack)


def load_meta_reference(ckpt_dir: Path, placement: parallel.Placement, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta's reference loader: the whole shard read into memory, then copied into the model.

    Meta's model keeps wq, wk, wv (and w1, w3) apart and its fairscale layers leave their weights
    uninitialised, so it stands here as one uninitialised tensor per checkpoint tensor, filled
    as its load_state_dict fills them.
    """
    path = shard_paths(ckpt_dir)[placement.rank]
    checkpoint = torch.load(path, map_location="cpu")
    parameters = {name: torch.empty(tensor.shape, dtype=dtype, device=placement.device)
                  for name, tensor in checkpoint.items() if name not in TOLERATED_EXTRA_KEYS}
    for name, parameter in parameters.items():
        parameter.copy_(checkpoint[name])
    return parameters


def _load_trial(loader: str, ckpt_dir: str, args: ModelArgs, dtype: torch.dtype,
                quantize: Optional[str], pack: bool, results: "multiprocessing.Queue") -> None:
    """In a fresh process: seconds to load, and peak resident memory above what it held before."""
    placement = parallel.init()
    before = current_rss_bytes()
    start = time.perf_counter()
    if loader == "llama_tp":
        load_ours(Path(ckpt_dir), args, placement, dtype, quantize, pack)
    else:
        load_meta_reference(Path(ckpt_dir), placement, dtype)
    results.put((time.perf_counter() - start, peak_rss_bytes() - before))


def compare_loading(ckpt_dir: Path, args: ModelArgs, dtype: torch.dtype, quantize: Optional[str],
                    pack: bool, repeats: int) -> dict:
    """Ours (packing the weights or not, as the timed model is) against Meta's reference loader,
    each in fresh processes, interleaved; medians."""
    context = multiprocessing.get_context("spawn")
    runs: dict[str, list[tuple[float, int]]] = {"llama_tp": [], "meta_reference": []}
    for _ in range(repeats):
        for loader in runs:
            results = context.Queue()
            process = context.Process(target=_load_trial, args=(loader, str(ckpt_dir), args, dtype, quantize, pack, results))
            process.start()
            runs[loader].append(results.get())
            process.join()
    summary = {}
    for loader, trials in runs.items():
        summary[loader] = {
            "seconds": statistics.median(t for t, _ in trials),
            "peak_rss_increase_bytes": statistics.median(m for _, m in trials),
            "runs_seconds": [t for t, _ in trials],
        }
    summary["speedup"] = summary["meta_reference"]["seconds"] / summary["llama_tp"]["seconds"]
    return summary


def interleaved(cases: dict[str, tuple[int, dict[str, Callable[[], object]]]], repeats: int,
                reference: str = "llama_tp") -> dict[str, dict]:
    """Run each case's engines A B A B after one warm-up each; tokens per second, medians and the
    reference engine's speed over each other's.

    A case is the number of tokens it processes and, per engine, a callable doing the work.
    """
    results = {}
    for name, (tokens, engines) in cases.items():
        for engine in engines.values():
            engine()  # warm-up: first-call allocations, lazy initialisation, compilation
        runs: dict[str, list[float]] = {engine: [] for engine in engines}
        for _ in range(repeats):
            for engine, work in engines.items():
                start = time.perf_counter()
                work()
                runs[engine].append(tokens / (time.perf_counter() - start))
        result = {"tokens_per_s": {e: statistics.median(r) for e, r in runs.items()}, "runs": runs}
        for peer in set(runs) - {reference}:
            result[f"ratio_vs_{peer}"] = result["tokens_per_s"][reference] / result["tokens_per_s"][peer]
        results[name] = result
        parallel.print0(f"  {name}: " + ", ".join(f"{e} {v:.1f} tok/s" for e, v in result["tokens_per_s"].items()))
    return results


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    compare: Optional[str] = None,
    gguf: Optional[str] = None,
    quantize: Optional[str] = None,
    dtype: str = "fp32",
    json_path: str = "bench.json",
    repeats: int = 3,
    load_repeats: int = 3,
    new_tokens: int = 128,
    batch_sizes: tuple[int, ...] = (1, 8),
    prefill_lengths: tuple[int, ...] = (128, 512),
    threads: Optional[int] = None,
    compile: bool = False,
    gpt_fast_dir: Optional[str] = None,
):
    """Measure loading, prefill and decode, print a table and write it as JSON.

    Args:
        ckpt_dir: Meta-layout checkpoint folder; default: the demo model (SmolLM2-135M-Instruct).
        tokenizer_path: only needed when params.json has no vocab_size.
        compare: "hf" to interleave Hugging Face transformers' generate on the same weights, or
            "llamacpp" llama.cpp on the same GGUF file (batch 1 only), in a process of its own
            (world size 1; needs the llamacpp extra: pip install "llama-tp[llamacpp]"), or
            "gpt-fast" gpt-fast's compiled batch-1 decoding on random weights of the checkpoint's
            published shape, on the same GPU in a process of its own (bf16 or int8/int4 alike).
        gguf: the GGUF file llama.cpp runs; default: the demo model's, when benchmarking it.
        gpt_fast_dir: the folder with gpt-fast's files and bench_random.py; default:
            ../shared/peers/gpt-fast beside the project.
        quantize: "int8" or "int4" (weight-only) or "int8_dynamic" (fbgemm) linear layers; see model/quantize.py.
        dtype: compute dtype of both engines.
        json_path: where to write the results.
        repeats: timed repetitions of each case (medians are reported).
        load_repeats: fresh-process loads of each loader (world size 1; 0 skips the comparison).
        new_tokens: tokens generated per decode case (greedy, no early stop).
        batch_sizes: decode batch sizes.
        prefill_lengths: prompt lengths of the prefill cases (batch 1).
        threads: torch threads per process; default: torch's choice.
        compile: compile decoding steps, as Llama.build(compile=True) does.
    """
    check_quantize(quantize)
    if repeats < 1 or new_tokens < 1:
        raise ValueError(f"repeats and new_tokens must be at least 1, found {repeats} and {new_tokens}")
    # fire reads "--batch_sizes 1" as an int and "--batch_sizes 1,8" as a tuple
    batch_sizes = (batch_sizes,) if isinstance(batch_sizes, int) else tuple(batch_sizes)
    prefill_lengths = (prefill_lengths,) if isinstance(prefill_lengths, int) else tuple(prefill_lengths)
    if not batch_sizes:
        raise ValueError("--batch_sizes names no batch size; give at least one, e.g. --batch_sizes 1")
    if threads is not None:
        torch.set_num_threads(threads)
    placement = parallel.init()
    check_peer(compare, placement.world_size)
    if ckpt_dir is None:
        ckpt_dir, _ = demo.model_paths(None, None)
        if compare == "llamacpp" and gguf is None:
            gguf = str(demo.demo_gguf())
    ckpt_dir = Path(ckpt_dir)
    args = model_args(ckpt_dir, tokenizer_path)
    args.check_model_parallel_size(placement.world_size)
    torch_dtype = parallel.resolve_dtype(dtype, placement.device)
    if compare == "gpt-fast":  # refused before anything loads
        gpt_fast = check_gpt_fast(gpt_fast_dir, placement.device, torch_dtype, quantize), gpt_fast_shape(args, ckpt_dir)
    max_seq_len = max([length + 1 for length in prefill_lengths] + [DECODE_PROMPT_LEN + new_tokens])
    report: dict = {
        "command": {"ckpt_dir": str(ckpt_dir), "compare": compare, "quantize": quantize, "dtype": dtype,
                    "repeats": repeats, "new_tokens": new_tokens, "compile": compile},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "world_size": placement.world_size, "load_average": os.getloadavg(),
                    "torch": torch.__version__},
    }

    pack = matmul.packing_pays(max(batch_sizes), compile, torch_dtype)  # as Llama.build decides
    if load_repeats > 0 and placement.world_size == 1:
        parallel.print0("loading: llama_tp and Meta's reference, in fresh processes")
        report["load"] = compare_loading(ckpt_dir, args, torch_dtype, quantize, pack, load_repeats)
    start = time.perf_counter()
    model = load_ours(ckpt_dir, args, placement, torch_dtype, quantize, pack)
    report["load_seconds_in_process"] = time.perf_counter() - start
    if compile:
        compile_decoding(model, placement.device)
    model.setup_caches(max(batch_sizes), max_seq_len, placement.device, torch_dtype)
    llama = Llama(model, TokenIds(args.vocab_size))

    rooflines = [roofline(model, placement.world_size, placement.device)]
    peer = None
    if compare in ("hf", "llamacpp"):
        peer, versions = open_peer(compare, ckpt_dir, gguf and Path(gguf), args, max_seq_len, torch_dtype,
                                   placement.device)
        report["machine"] |= versions

    prompts = torch.randint(1, args.vocab_size, (max(batch_sizes), max_seq_len),
                            generator=torch.Generator().manual_seed(PROMPT_SEED))
    cases = timing_cases(llama, peer, prompts, prefill_lengths, batch_sizes, new_tokens)
    if compare == "gpt-fast":  # ours as gpt-fast decodes: batch 1, sampled
        ours = partial(generate_afresh, llama, prompts[:1, :DECODE_PROMPT_LEN].tolist(), new_tokens, GPT_FAST_SAMPLING)
        cases[GPT_FAST_CASE] = (new_tokens, {"llama_tp": ours})
    parallel.print0("timing (tokens per second, medians of interleaved runs):")
    report["cases"] = interleaved(cases, repeats)
    if compare == "gpt-fast":
        folder, shape = gpt_fast
        parallel.print0(f"gpt-fast: {shape}, {repeats} runs after one that compiles, in a process of its own")
        figures = run_gpt_fast(folder, shape, quantize, DECODE_PROMPT_LEN, new_tokens, repeats, placement.device)
    # Bandwidth drifts on a shared machine: measured before and after the timing, averaged.
    rooflines.append(roofline(model, placement.world_size, placement.device))
    report["roofline"] = {key: statistics.mean(r[key] for r in rooflines) for key in rooflines[0]}
    report["roofline"] |= {"weight_bytes_per_token": rooflines[0]["weight_bytes_per_token"], "samples": rooflines}
    if compare == "gpt-fast":
        case = report["cases"][GPT_FAST_CASE]
        report["gpt_fast"] = side_by_side(case["tokens_per_s"]["llama_tp"], report["roofline"]["weight_bytes_per_token"],
                                          figures, args, report["roofline"]["copy_bandwidth_bytes_per_s"])
        case["tokens_per_s"]["gpt-fast"] = figures["tokens_per_s"]
        case["ratio_vs_gpt-fast"] = report["gpt_fast"]["ratio_vs_gpt-fast"]
    if "decode_batch_1" in report["cases"]:
        for bound, key in (("decode_tokens_per_s", "decode_batch_1_fractions"),
                           ("read_decode_tokens_per_s", "decode_batch_1_fractions_of_read")):
            report["roofline"][key] = {engine: speed / report["roofline"][bound]
                                       for engine, speed in report["cases"]["decode_batch_1"]["tokens_per_s"].items()}
    if peer is not None:
        report[f"greedy_agreement_with_{peer.name}"] = greedy_agreement(llama, peer, prompts[:, :DECODE_PROMPT_LEN],
                                                                        new_tokens)
        peer.close()
    report["peak_rss_bytes_per_rank"] = [
        parallel.broadcast_object(peak_rss_bytes(), src=rank) for rank in range(placement.world_size)
    ]
    if placement.device.type == "cuda":
        report["peak_gpu_bytes_per_rank"] = [  # the peer's too, where it ran beside ours
            parallel.broadcast_object(torch.cuda.max_memory_allocated(placement.device), src=rank)
            for rank in range(placement.world_size)
        ]
    if placement.is_main:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print_table(report)
        print(f"wrote {json_path}")


def timing_cases(llama: Llama, peer: Optional[Peer], prompts: torch.Tensor,
                 prefill_lengths: tuple[int, ...], batch_sizes: tuple[int, ...],
                 new_tokens: int) -> dict[str, tuple[int, dict[str, Callable[[], object]]]]:
    """Each case's token count and, per engine, the call that does its work (the peer's in the
    cases whose batch it takes).

    Prefill is timed to the first token and counts prompt tokens; decode counts generated ones.
    """
    # name -> (batch, prompt length, tokens generated, tokens counted)
    shapes = {f"prefill_{length}": (1, length, 1, length) for length in prefill_lengths}
    shapes |= {f"decode_batch_{batch}": (batch, DECODE_PROMPT_LEN, new_tokens, batch * new_tokens)
               for batch in batch_sizes}
    cases = {}
    for name, (batch, length, generated, counted) in shapes.items():
        rows = prompts[:batch, :length]
        engines = {"llama_tp": partial(generate_afresh, llama, rows.tolist(), generated)}
        if peer is not None and batch <= peer.max_batch:
            engines[peer.name] = partial(peer.generate, rows, generated)
        cases[name] = (counted, engines)
    return cases


def generate_afresh(llama: Llama, prompts: list[list[int]], new_tokens: int,
                    options: dict = PLAIN_GREEDY) -> list[list[int]]:
    """Continuations (plain greedy, or as options say) with every prompt token prefilled: the cache
    forgets the run before, which held the same prompts (a peer's run resets its cache alike)."""
    llama.forget_prefixes()
    return llama.generate(prompts, new_tokens, **options)[0]


def print_table(report: dict) -> None:
    """The results as a plain-text table."""
    peer = report["command"]["compare"] or "peer"
    print(f"{'case':<18}{'llama_tp tok/s':>16}{peer + ' tok/s':>16}{'ratio':>8}")
    for name, result in report["cases"].items():
        speeds = result["tokens_per_s"]
        theirs = f"{speeds[peer]:.1f}" if peer in speeds else "-"
        print(f"{name:<18}{speeds['llama_tp']:>16.1f}{theirs:>16}{result.get(f'ratio_vs_{peer}', float('nan')):>8.2f}")
    for key in sorted(k for k in report if k.startswith("greedy_agreement_with_")):
        print(f"greedy tokens the same as {key.removeprefix('greedy_agreement_with_')}'s: {100 * report[key]:.0f}%")
    roofline = report["roofline"]
    fractions = ", ".join(
        f"{engine} at {100 * fraction:.0f}% ({100 * roofline['decode_batch_1_fractions_of_read'][engine]:.0f}% of the read's)"
        for engine, fraction in roofline.get("decode_batch_1_fractions", {}).items()
    )
    print(f"roofline: {roofline['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s copy, "
          f"{roofline['weight_bytes_per_token'] / 1e6:.0f} MB of weights per token -> "
          f"{roofline['decode_tokens_per_s']:.1f} tok/s (a plain read: {roofline['read_bandwidth_bytes_per_s'] / 1e9:.1f} "
          f"GB/s -> {roofline['read_decode_tokens_per_s']:.1f} tok/s); decode batch 1: {fractions or '-'}")
    if "gpt_fast" in report:
        print_side_by_side(report["gpt_fast"])
    if "load" in report:
        load = report["load"]
        print(f"load: llama_tp {load['llama_tp']['seconds']:.2f} s, Meta's reference "
              f"{load['meta_reference']['seconds']:.2f} s ({load['speedup']:.2f}x); peak memory above "
              f"start {load['llama_tp']['peak_rss_increase_bytes'] / 1e6:.0f} MB vs "
              f"{load['meta_reference']['peak_rss_increase_bytes'] / 1e6:.0f} MB")
    print("peak resident memory per rank: " + ", ".join(f"{m / 1e6:.0f} MB" for m in report["peak_rss_bytes_per_rank"]))
    if "peak_gpu_bytes_per_rank" in report:
        print("peak GPU memory per rank: " + ", ".join(f"{m / 1e9:.1f} GB" for m in report["peak_gpu_bytes_per_rank"]))


if __name__ == "__main__":
    run(main)
