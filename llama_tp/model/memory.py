"""How much memory each process needs, before anything is loaded (python -m llama_tp.plan prints it).

The figures count exactly what llama_tp allocates per process: its slice of every weight matrix
(int8 and int4 layers with their scales and zeros or mins), the replicated norms, and the KV cache (KV heads are
copied when there are more processes than KV heads). Activations and the framework's own
overhead come on top. Weights and cache are allocated at load, whatever the prompts: a job
whose weights and cache exceed the memory free on its machine is refused before loading.
"""

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..kernels import int4
from ..kernels.int8 import group_size
from .args import ModelArgs
from .attention import local_kv_heads
from .kv_cache import BLOCK_POSITIONS, blocks_for
from .quantize import check_quantize, layer_quantization

GIB = 1024**3
# On a GPU, without --kv_cache_memory: the share of the memory free once the weights are loaded that
# the KV cache takes (vLLM's --gpu-memory-utilization, but of what is free, not of the whole GPU),
# less a pass's activations (MemoryPlan.activation_bytes); the rest is for CUDA graphs, the
# compiled kernels' workspaces and the allocator's slack (--kv_cache_fraction).
KV_CACHE_FRACTION = 0.9
# The widest pass whose activations the margin counts: a batch job's prompt chunk (the engine's
# JOB_PREFILL_TOKENS; the server's are half as wide).
ACTIVATION_TOKENS = 512
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    args: ModelArgs
    world_size: int
    max_batch_size: int
    max_seq_len: int
    dtype_bytes: int
    params_total: int
    params_per_rank: int
    kv_heads_per_rank: int
    quantize: Optional[str] = None  # of the linear layers: "int8", "int4" or "int8_dynamic"
    cache_positions: Optional[int] = None  # the KV cache's; None: max_batch_size rows of max_seq_len

    @property
    def weight_bytes(self) -> int:
        if self.quantize is None:
            return self.params_per_rank * self.dtype_bytes
        linear = linear_params_per_rank(self.args, self.world_size)
        quantized = sum(_quantized_bytes(width, n, layer_quantization(name, self.quantize)) for name, width, n in linear)
        return (self.params_per_rank - sum(n for _, _, n in linear)) * self.dtype_bytes + quantized

    @property
    def kv_cache_positions(self) -> int:
        """The positions of the KV cache's blocks (kv_cache.py): cache_positions, by default
        blocks enough for max_batch_size rows of max_seq_len positions."""
        if self.cache_positions is None:
            return self.max_batch_size * blocks_for(self.max_seq_len) * BLOCK_POSITIONS
        return blocks_for(self.cache_positions) * BLOCK_POSITIONS

    @property
    def position_bytes(self) -> int:
        """The keys and values of one position in every layer, local kv heads x head_dim each."""
        return 2 * self.args.n_layers * self.kv_heads_per_rank * self.args.head_dim * self.dtype_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's blocks and its scratch block (kv_cache.py)."""
        return (self.kv_cache_positions + BLOCK_POSITIONS) * self.position_bytes

    def positions_in(self, gib: float) -> int:
        """The positions of the KV cache that gib GiB a process hold, in whole blocks."""
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, found {gib!r}")
        return int(gib * GIB) // (self.position_bytes * BLOCK_POSITIONS) * BLOCK_POSITIONS

    @property
    def activation_bytes(self) -> int:
        """The margin a pass needs beside the weights and the cache, left out of a KV cache sized
        from free memory: a prompt chunk of ACTIVATION_TOKENS tokens' fp32 logits over the whole
        vocabulary and their log-softmax (a prompt's own log probabilities), and the feed-forward's
        three widest hidden states."""
        return ACTIVATION_TOKENS * (2 * 4 * self.args.vocab_size + 3 * self.dtype_bytes * self.args.ffn_hidden_dim)

    def positions_free(self, free: int, fraction: float) -> int:
        """The KV cache positions, in whole blocks, that fraction of free bytes holds beside a
        pass's activations (activation_bytes) and the pool's scratch block."""
        usable = int(fraction * free) - self.activation_bytes
        return max(0, usable // (self.position_bytes * BLOCK_POSITIONS) - 1) * BLOCK_POSITIONS

    def describe_cache(self) -> str:
        """The KV cache as a user weighs it: "N tokens of KV cache: about M conversations of max_seq_len"."""
        positions = self.kv_cache_positions
        return (f"{positions} tokens of KV cache: about {positions / self.max_seq_len:.1f} conversations of "
                f"max_seq_len {self.max_seq_len}")

    @property
    def logits_bytes(self) -> int:
        """The largest activation: fp32 logits over the whole vocabulary for a full-length prompt."""
        return self.max_batch_size * self.max_seq_len * self.args.vocab_size * 4


def _quantized_bytes(width: int, n: int, quantization: str) -> int:
    """Bytes of n weights of a linear layer `width` inputs wide (on this rank), quantized so."""
    if quantization == "int8":  # a byte per weight, fp32 scales and zeros per group of a slice's inputs
        return n + 8 * n // group_size(width)
    if quantization == "int4":  # half a byte per weight, fp16 scales and mins per group of 32
        return n // 2 + 4 * n // int4.GROUP_SIZE
    return n  # fbgemm's packed int8, whose per-output-channel scales are negligible


def params_per_rank(args: ModelArgs, world_size: int) -> int:
    """Parameters one of world_size processes holds: its slice of each split matrix plus the norms
    (and the routers of a mixture of experts, whole on every rank)."""
    linear = sum(n for _, _, n in linear_params_per_rank(args, world_size))
    embedding = args.vocab_size * args.dim // world_size
    norms = (2 * args.n_layers + 1) * args.dim  # two per layer and the last
    routers = (args.n_layers - args.dense_layers) * (args.n_experts or 0) * args.dim
    return linear + embedding + norms + routers


def linear_params_per_rank(args: ModelArgs, world_size: int) -> list[tuple[str, int, int]]:
    """(name, input width on one of world_size processes, parameters there) of the linear layers."""
    q, kv = args.n_heads * args.head_dim // world_size, local_kv_heads(args, world_size) * args.head_dim
    ffn = args.ffn_hidden_dim // world_size
    dense = args.dense_layers
    layers = [
        ("wq, wk, wv", args.dim, args.n_layers * args.dim * (q + 2 * kv)),
        ("wo", q, args.n_layers * args.dim * q),
        ("w1, w3", args.dim, dense * args.dim * 2 * ffn),
        ("w2", ffn, dense * args.dim * ffn),
    ]
    if args.n_experts is not None:  # every rank holds its slice of every expert (feed_forward.py)
        swiglus = (args.n_layers - dense) * (args.n_experts + args.shared_expert)
        hidden = args.expert_hidden_dim // world_size
        layers += [("experts' w1, w3", args.dim, swiglus * args.dim * 2 * hidden),
                   ("experts' w2", hidden, swiglus * args.dim * hidden)]
    return layers + [("output", args.dim, args.vocab_size * args.dim // world_size)]


def active_params(args: ModelArgs) -> int:
    """The parameters a token goes through, all ranks together: a mixture of experts' chosen ones only."""
    if args.n_experts is None:
        return params_per_rank(args, 1)
    unused = args.n_experts - args.experts_per_token
    return params_per_rank(args, 1) - (args.n_layers - args.dense_layers) * unused * 3 * args.dim * args.expert_hidden_dim


def plan(args: ModelArgs, world_size: int, max_batch_size: int, max_seq_len: int,
         dtype: "str | torch.dtype", quantize: Optional[str] = None) -> MemoryPlan:
    """The per-process memory of args split over world_size processes with these runtime limits,
    the linear layers quantized as given."""
    check_quantize(quantize)
    if args.vocab_size < 1:
        raise ValueError("the vocabulary size must be known to plan memory; fill it from the tokenizer")
    for name, value in (("world_size", world_size), ("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, found {value!r}")
    if isinstance(dtype, torch.dtype):
        dtype_bytes = dtype.itemsize
    elif dtype in DTYPE_BYTES:
        dtype_bytes = DTYPE_BYTES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return MemoryPlan(args, world_size, max_batch_size, max_seq_len, dtype_bytes,
                      params_per_rank(args, 1), params_per_rank(args, world_size), local_kv_heads(args, world_size),
                      quantize)


def report(memory: MemoryPlan) -> str:
    """The plan as a few lines for people."""
    args, world_size = memory.args, memory.world_size
    total = memory.weight_bytes + memory.kv_cache_bytes + memory.logits_bytes
    weights = f"{memory.dtype_bytes}-byte weights"
    if memory.quantize:
        head = layer_quantization("output", memory.quantize)
        exception = f" (the output head {head})" if head != memory.quantize else ""
        weights = f"{memory.quantize} linear layers{exception}, other {weights}"
    lines = [
        f"Memory per process ({world_size} process{'es' * (world_size > 1)}, {weights}, "
        f"batch {memory.max_batch_size} x {memory.max_seq_len} tokens):",
        f"  weights   {memory.weight_bytes / GIB:9.2f} GiB  ({_count(memory.params_per_rank)} of "
        f"{_count(memory.params_total)} parameters)",
        f"  KV cache  {memory.kv_cache_bytes / GIB:9.2f} GiB  ({args.n_layers} layers x "
        f"{memory.kv_heads_per_rank} KV head{'s' * (memory.kv_heads_per_rank > 1)} here)",
        f"  logits    {memory.logits_bytes / GIB:9.2f} GiB  (fp32, for a prompt filling the context)",
        f"  total     {total / GIB:9.2f} GiB  plus activations and framework overhead",
    ]
    if args.n_experts is not None:
        lines.append(f"  {args.n_experts} experts{' and a shared one' * args.shared_expert} in "
                     f"{args.n_layers - args.dense_layers} layers, {args.experts_per_token} a token: "
                     f"{_count(active_params(args))} parameters active per token")
    if args.kv_heads < world_size and world_size % args.kv_heads == 0:
        lines.append(f"  each of the {args.kv_heads} KV heads is copied on {world_size // args.kv_heads} processes")
    if args.splits_over(world_size):
        lines.append(f"  {world_size} divides the {args.describe_splits()}: OK")
    else:
        working = [n for n in range(1, args.n_heads + 1) if args.splits_over(n)]
        lines.append(
            f"  {world_size} processes cannot split this model ({args.describe_splits()}); world sizes that "
            f"work: {', '.join(map(str, working))}"
        )
    return "\n".join(lines)


def check_fits(memory: MemoryPlan, device: torch.device, processes_here: int) -> None:
    """Refuse a plan whose weights and KV cache do not fit in the memory free for this process: its
    GPU's, or on CPU the machine's, shared by the job's processes_here processes on it."""
    per_process = memory.weight_bytes + memory.kv_cache_bytes
    sharing = processes_here if device.type == "cpu" else 1
    free, where = free_memory(device)
    if per_process * sharing <= free:
        return
    processes = f"{sharing} processes x " if sharing > 1 else ""
    raise ValueError(
        f"the weights and KV cache need {processes}{per_process / GIB:.2f} GiB ({memory.weight_bytes / GIB:.2f} + "
        f"{memory.kv_cache_bytes / GIB:.2f} for {memory.kv_cache_positions} tokens of KV cache), "
        f"but {where} has {free / GIB:.2f} GiB free; lower --kv_cache_memory (or --max_seq_len or "
        "--max_batch_size, whose product it is by default), quantize "
        "(--quantize int8 or int4), or split the model over more machines"
    )


def sizes_cache_from_free_memory(device: torch.device) -> bool:
    """Whether a KV cache whose memory is not given takes a share of the memory free after the
    weights (a GPU's, which the process has to itself), rather than max_batch_size x max_seq_len
    positions (a CPU's: the machine's memory, shared with everything else on it)."""
    return device.type == "cuda"


def cache_in_free_memory(memory: MemoryPlan, free: int, where: str, fraction: float) -> MemoryPlan:
    """The plan with a KV cache of fraction of the free bytes that where has after loading, less
    a pass's activations; refused if that cannot hold one sequence of max_seq_len."""
    positions = memory.positions_free(free, fraction)
    if positions < memory.max_seq_len:
        raise ValueError(
            f"after loading the weights {where} has {free / GIB:.2f} GiB free, whose share for the KV cache "
            f"(--kv_cache_fraction {fraction}, less {memory.activation_bytes / GIB:.2f} GiB for activations) "
            f"holds {positions} tokens, fewer than one sequence of max_seq_len {memory.max_seq_len}; lower "
            "--max_seq_len, quantize (--quantize int8 or int4), raise --kv_cache_fraction, or split the model "
            "over more GPUs")
    return replace(memory, cache_positions=positions)


def check_fraction(fraction: float) -> None:
    """A KV cache's share of free memory must be in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_fraction must be a number in (0, 1], the share of the GPU memory free after "
                         f"loading that the KV cache takes, found {fraction!r}")


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free for new allocations on device, and what to call it in a message."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what torch's allocator holds unused is free for the KV cache
        return torch.cuda.mem_get_info(device)[0], f"GPU {device.index}"
    try:  # Linux: what can be had without swapping, page cache included
        with open("/proc/meminfo") as meminfo:
            available = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(available.split()[1]) * 1024, "this machine"
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} billion" if n >= 1e8 else f"{n:,}"
