"""The sums and gathers of a forward pass: through shared memory between the ranks of one x86 host,
through torch.distributed elsewhere, and as torch.library operators under torch.compile."""

import os
import platform
from typing import Optional

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fairscale_mp
from fairscale.nn.model_parallel import mappings as fairscale_mappings

from .group import accelerator_available, collective_timeout, model_parallel_rank, model_parallel_size
from .shared_memory import SharedMemorySum, new_buffer_path

def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the model-parallel ranks, identical on every rank.

    On CPU with every rank on this host, through shared memory: gloo's loopback TCP takes about
    250 us per call, and decoding one token makes two calls per layer. Elsewhere (NCCL, several
    hosts, tensors too large for the shared buffer) through torch.distributed.
    """
    if model_parallel_size() == 1:
        return x
    if torch.compiler.is_compiling() and not _native_exchange_for(x):
        return torch.ops.llama_tp.all_reduce(x)
    return _all_reduce(x)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every model-parallel rank's x [..., n] side by side in rank order: [..., world_size * n]."""
    if model_parallel_size() == 1:
        return x
    if torch.compiler.is_compiling() and not _native_exchange_for(x):
        return torch.ops.llama_tp.all_gather_last_dim(x)
    return _all_gather(x)


def vocab_argmax(local_logits: torch.Tensor) -> torch.Tensor:
    """Each row's best token over the whole vocabulary, from this rank's slice of the logits
    [bsz, vocab // world size] (Transformer.forward's vocab_slice): token ids [bsz], the first
    of equal best, as max over the whole row picks.

    Each rank's best logit and its index are exchanged, not the slices: at world size 2 and
    batch 8 a step then moves 64 bytes instead of 768 KB (the demo model's 49152 logits a row).
    """
    best, index = local_logits.max(dim=-1)  # bsz
    if model_parallel_size() == 1:
        return index
    index = index + model_parallel_rank() * local_logits.shape[-1]
    # The index rides beside its logit as a float32's bits: the exchange copies them as they are.
    pairs = torch.stack((best, index.to(torch.int32).view(torch.float32)), dim=-1)  # bsz, 2
    every_rank = all_gather_last_dim(pairs).view(len(pairs), model_parallel_size(), 2)
    winner = every_rank[..., 0].max(dim=-1, keepdim=True).indices  # the first rank with the best: its ids are lowest
    return every_rank[..., 1].gather(-1, winner).view(torch.int32).flatten().long()


def from_first_rank(x: torch.Tensor, always: bool = False) -> torch.Tensor:
    """Model-parallel rank 0's x on every rank: a step's choices (tokens, finish flags, log
    probabilities), so that ranks whose logits differ in the last bits (GPUs of different models
    or drivers, hosts with different CPUs) still take the same tokens and run the same steps
    instead of hanging.

    x [..., n] of a 4- or 8-byte dtype rides the forward pass's gather as float32 bits (copied as
    they are, as vocab_argmax's indices do). Not where every rank is a CPU process of one host
    (the shared-memory exchange): the same code on the same CPU and the same gathered logits
    choose the same bits, and the exchange, one more meeting of the ranks a step, cost 5% of a
    sampled batch-1 step on the loaded 2-core machine (docs/gpu.md). always: there too, where rank
    0 alone computed x's inputs (a step that runs Python's logits processors, on rank 0 only).
    """
    if model_parallel_size() == 1 or (_ranks_compute_alike() and not always):
        return x
    bits = x.contiguous().view(torch.float32)  # [..., n * itemsize / 4]
    width = bits.shape[-1]
    return all_gather_last_dim(bits)[..., :width].contiguous().view(x.dtype)


def _ranks_compute_alike() -> bool:
    """Whether every rank is a CPU process on this host, so that the same inputs give the same bits."""
    return _shared_sum() is not None


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    shared = _shared_memory_for(x)
    if shared is not None:
        return shared(x)
    total = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(total, group=fairscale_mp.get_model_parallel_group())
    return total


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    shared = _shared_memory_for(x)
    if shared is not None:
        return shared.gather(x)
    return fairscale_mappings.gather_from_model_parallel_region(x).contiguous()


# Registered as operators, opaque to torch.compile: a compiled step calls them without breaking
# its graph around host-side waiting it cannot trace (where the C++ exchange, itself an operator,
# does not serve the tensor). Eagerly the functions are called directly, which spares the
# operator dispatch (4-5 us a call, 62 calls a step).
_all_reduce_op = torch.library.custom_op("llama_tp::all_reduce", _all_reduce, mutates_args=())
_all_gather_op = torch.library.custom_op("llama_tp::all_gather_last_dim", _all_gather, mutates_args=())


@_all_reduce_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous whatever x's layout, as _all_reduce returns it


@_all_gather_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * model_parallel_size())


def native_sum_arguments(x: torch.Tensor) -> Optional[tuple]:
    """The C++ exchange's arguments after x (buffer, rank, world size, capacity, timeout) for
    torch.ops.llama_tp.shared_sum, where all_reduce(x) goes through it; else None."""
    shared = _shared_memory_for(x)
    return shared.native_args() if shared is not None and shared.native else None


def _native_exchange_for(x: torch.Tensor) -> bool:
    """Whether x goes through the C++ exchange, an operator that compiled steps call as it is."""
    shared = _shared_memory_for(x)
    return shared is not None and shared.native


def _shared_memory_for(x: torch.Tensor) -> Optional[SharedMemorySum]:
    """The shared buffer, if the ranks have one and x fits it."""
    shared = _shared_sum()
    if shared is not None and x.dtype == torch.float32 and x.numel() <= SharedMemorySum.CAPACITY:
        return shared
    return None


_shared: Optional[SharedMemorySum] = None
_shared_decided = False


def _shared_sum() -> Optional[SharedMemorySum]:
    """The shared buffer, or None where the ranks share no memory. Made on the first eager call
    (every rank makes its first all_reduce together); compiled code only reads it, as tracing
    must not talk to the other ranks."""
    global _shared, _shared_decided
    if not _shared_decided and not torch.compiler.is_compiling():
        _shared = _create_shared_sum() if _all_ranks_share_memory() else None
        _shared_decided = True
    return _shared


def forget_shared_sum() -> None:
    """Drop the buffer, with the process group it was made for."""
    global _shared, _shared_decided
    _shared, _shared_decided = None, False


def _all_ranks_share_memory() -> bool:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and not accelerator_available() and local == dist.get_world_size() == model_parallel_size()


def _create_shared_sum() -> SharedMemorySum:
    """Every rank calls this together; rank 0 names the buffer, all map it, then it is unlinked."""
    group = fairscale_mp.get_model_parallel_group()
    rank = model_parallel_rank()
    holder = [new_buffer_path() if rank == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    shared = SharedMemorySum(holder[0], rank, model_parallel_size(), collective_timeout().total_seconds())
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(holder[0])  # the mappings keep it alive; nothing is left behind on exit
    return shared
