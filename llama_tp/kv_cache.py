"""Each layer's keys and values, kept for the tokens to come, and where a pass's tokens sit in them."""

from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from .kernels import cpu_kernels


# Eagerly, a step of up to this many tokens a row attends through our CPU kernel, token after
# token as in steps of their own (guesses to verify, a short chunk of prompt); longer prompts
# through torch's flash attention, which takes many queries at a time.
MAX_KERNEL_STEP_TOKENS = 16


class CacheRows(NamedTuple):
    """Where a forward pass's tokens sit in the KV caches, and which cached positions each one sees.

    Meta's schedule runs a batch as cache rows 0, 1, ... all at one position; a server's batch
    (continuous batching) holds rows anywhere in the cache, each at its own position.
    """

    slots: torch.Tensor  # [bsz] int64: each row's cache row
    positions: torch.Tensor  # [1 or bsz, seqlen] int64: each token's position (1: the same in every row)
    rotary: torch.Tensor  # [1 or bsz, seqlen, head_dim // 2, 2]: the cos and sin of each token's angles
    end: int  # keys and values below this position are read (the farthest row's end)
    # [1 or bsz, 1, seqlen, end] which of them each query sees; None: a prompt from position 0
    # (causal), or one token a row with every row at the same position (all below end).
    mask: Optional[torch.Tensor]
    first_slot: Optional[int]  # the rows are cache rows first_slot, first_slot + 1, ...: a view
    # [bsz] each row's first position, where an eager step attends through our kernel
    # (step_through_kernel; rotary is contiguous then); else None.
    kernel_starts: Optional[torch.Tensor]
    # Where one token a row reads its cache row only up to its own position (Transformer.decode_step,
    # block_attention.py): which blocks of positions each cache row sees; mask and end are unused then.
    block_mask: Optional[BlockMask] = None
    # Llama 4's chunked layers (Attention.chunked): mask and block_mask for them, each query seeing
    # only its own chunk's positions; None where chunks hide nothing (mask and block_mask then serve).
    chunk_mask: Optional[torch.Tensor] = None
    chunk_block_mask: Optional[BlockMask] = None


class KVCache(nn.Module):
    """Preallocated keys and values of one layer: [cache rows, local kv heads, max_seq_len, head_dim]."""

    def __init__(self, cache_rows: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype, kernel_fits: bool = True):
        super().__init__()
        shape = (cache_rows, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        for buffer in (self.k, self.v):
            # A compiled step (CUDA graphs above all) then writes the cache in place, never a copy.
            torch._dynamo.mark_static_address(buffer)
        # Whether one new token attends through our CPU kernel (attention_kernel.cpp): fp32, and
        # heads a whole number of its registers wide, and attention of the kind it computes
        # (kernel_fits: no sliding window or chunks, as it reads each row from position 0, and
        # rotary embeddings in every layer). Decided here, not at every layer's step.
        self.kernel_attends = (cpu_kernels.decoding_kernels_run_on(device) and dtype == torch.float32
                               and head_dim % cpu_kernels.ATTENTION_LANES == 0 and kernel_fits)
        self.register_buffer("heads", torch.arange(n_kv_heads, device=device), persistent=False)

    def write(self, rows: CacheRows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [bsz, heads, seqlen, head_dim] at the rows' cache rows and positions."""
        if rows.first_slot is not None and len(rows.positions) == 1 and not torch.compiler.is_compiling():
            # Eagerly the cheapest write (6 us against index_put_'s 21 for one token).
            block = slice(rows.first_slot, rows.first_slot + len(k))
            self.k[block].index_copy_(2, rows.positions[0], k)
            self.v[block].index_copy_(2, rows.positions[0], v)
            return
        # Indexing the whole buffer: compiled, a write into a slice of it copies the whole cache.
        where = (rows.slots[:, None, None], self.heads[None, :, None], rows.positions[:, None, :])
        self.k.index_put_(where, k)
        self.v.index_put_(where, v)

    def copy_positions(self, source: int, dest: int, start: int, end: int) -> None:
        """Row dest takes row source's keys and values at positions [start, end)."""
        self.k[dest, :, start:end] = self.k[source, :, start:end]
        self.v[dest, :, start:end] = self.v[source, :, start:end]

    def read(self, rows: CacheRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values at positions [0, rows.end): [bsz, heads, end, head_dim]."""
        if rows.first_slot is not None:
            block = slice(rows.first_slot, rows.first_slot + len(rows.slots))
            return self.k[block, :, : rows.end], self.v[block, :, : rows.end]
        return self.k[rows.slots, :, : rows.end], self.v[rows.slots, :, : rows.end]  # gathered: a copy


def step_through_kernel(seqlen: int, cache: KVCache) -> bool:
    """Whether an eager step of seqlen tokens a row attends through our CPU kernel."""
    return seqlen <= MAX_KERNEL_STEP_TOKENS and cache.kernel_attends
