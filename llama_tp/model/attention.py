"""Attention, with each rank holding its slice of the heads: queries, keys and values in one
product, the KV cache written and read as the step's rows say (kv_cache.py), and attention through
our CPU kernel, FlexAttention's block masks (a GPU's whole steps) or torch's own kernels."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_kernels
from ..parallel import column_parallel_linear, row_parallel_linear
from .args import ModelArgs
from .block_attention import attend_own_blocks
from .kv_cache import BLOCK_POSITIONS, CacheRows, KVCache
from .norm import RMSNorm
from .rotary import apply_rotary


def local_kv_heads(args: ModelArgs, model_parallel_size: int) -> int:
    """KV heads per rank; with more ranks than KV heads each rank keeps a copy of the one it needs."""
    return max(1, args.kv_heads // model_parallel_size)


class Attention(nn.Module):
    # wq, wk and wv of the checkpoint, held side by side in one weight: one product per step
    # instead of three (fewer, larger kernel calls, and one pass over x).
    FUSED = ("wqkv", ("wq", "wk", "wv"))

    def __init__(self, args: ModelArgs, model_parallel_size: int, layer: int = 0):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = local_kv_heads(args, model_parallel_size)
        stored_kv_heads = self.n_local_kv_heads * model_parallel_size
        self.local_widths = (self.n_local_heads * self.head_dim,) + 2 * (self.n_local_kv_heads * self.head_dim,)
        self.qk_v_widths = (self.local_widths[0] + self.local_widths[1], self.local_widths[2])
        self.wqkv = column_parallel_linear(args.dim, (args.n_heads + 2 * stored_kv_heads) * self.head_dim,
                                           gather_output=False)
        self.wo = row_parallel_linear(args.n_heads * self.head_dim, args.dim)
        # Qwen2's biases of wq, wk and wv, side by side as wqkv's rows (checkpoint_layout): held
        # here, not in wqkv, so that quantizing or packing wqkv leaves them as they are.
        self.qkv_bias = nn.Parameter(torch.empty(sum(self.local_widths))) if args.qkv_bias else None
        # Qwen3's RMSNorm over each head's queries and keys: one weight for all heads, on every rank.
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        # Llama 4: rotary layers normalise queries and keys without a weight and attend within their
        # chunk; the others (NoPE) rotate nothing, attend to every position and scale their queries.
        self.rotates = args.rotates(layer)
        self.weightless_qk_norm = args.weightless_qk_norm and self.rotates
        self.norm_eps = args.norm_eps
        self.chunked = args.attention_chunk_size is not None and self.rotates
        self.temperature = (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and not self.rotates else None
        self.cache: Optional[KVCache] = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The queries, keys and values of x side by side, [bsz, seqlen, sum(local_widths)], with the
        bias and head norms of the models that have them; not yet rotated."""
        qkv = self.wqkv(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        if self.q_norm is not None or self.weightless_qk_norm:
            q, k, v = qkv.split(self.local_widths, dim=-1)
            q = self._head_norm(q.unflatten(-1, (-1, self.head_dim)), self.q_norm)  # bsz, seqlen, heads, head_dim
            k = self._head_norm(k.unflatten(-1, (-1, self.head_dim)), self.k_norm)  # bsz, seqlen, kv heads, head_dim
            qkv = torch.cat((q.flatten(-2), k.flatten(-2), v), dim=-1)
        return qkv

    def _head_norm(self, x: torch.Tensor, norm: Optional[RMSNorm]) -> torch.Tensor:
        """Each head of x RMS-normalised: by Qwen3's norm, or Llama 4's without a weight (before the
        rotation where Llama 4 normalises after it: a rotation keeps a head's norm)."""
        if norm is not None:
            return norm(x.contiguous())
        return F.rms_norm(x.float(), (self.head_dim,), eps=self.norm_eps).type_as(x)

    def scaled_queries(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's NoPE queries q [bsz, seqlen, heads, head_dim] at positions [1 or bsz, seqlen],
        scaled by a temperature that grows with the position (1 below floor_scale - 1)."""
        floor_scale, attn_scale = self.temperature
        scales = 1 + attn_scale * torch.log1p(torch.floor((positions.float() + 1) / floor_scale))
        return (q.float() * scales[..., None, None]).type_as(q)

    def forward(self, x: torch.Tensor, rows: CacheRows) -> torch.Tensor:
        return self.wo(self.attend_projected(self.project(x), rows))

    def attend_projected(self, qkv: torch.Tensor, rows: CacheRows) -> torch.Tensor:
        """The attention of projected queries, keys and values [bsz, seqlen, sum(local_widths)]
        placed in the cache as rows says, before wo: [bsz, seqlen, local heads x head_dim].

        Eagerly, where our CPU kernel attends (rows.kernel_starts), all of it is one call of that
        kernel: 12 us a layer at batch 1, 36 at batch 8, against 59 and 103 for the 20 or so small
        operations below (compiled, they are fused)."""
        if rows.kernel_starts is not None and not torch.compiler.is_compiling():
            return cpu_kernels.decode_step_attention(qkv.contiguous(), rows.rotary, self.cache.k, self.cache.v,
                                                     rows.tables, rows.kernel_starts, self.n_local_heads,
                                                     BLOCK_POSITIONS)
        bsz, seqlen, _ = qkv.shape
        one_token_through_kernel = seqlen == 1 and self.cache.kernel_attends
        qk, v = qkv.split(self.qk_v_widths, dim=-1)
        qk = qk.view(bsz, seqlen, -1, self.head_dim)  # bsz, seqlen, heads + kv heads, head_dim
        if self.rotates:  # queries and keys rotate alike: one rotation for both heads' worth
            qk = apply_rotary(qk, rows.rotary)
        q, k = qk.split((self.n_local_heads, self.n_local_kv_heads), dim=2)
        if self.temperature is not None:
            q = self.scaled_queries(q, rows.positions)
        v = v.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        # bsz, heads, seqlen, head_dim: the layout the cache and attention kernels want
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        self.cache.write(rows, k, v)
        mask, block_mask = rows.mask, rows.block_mask
        if self.chunked and (rows.chunk_mask is not None or rows.chunk_block_mask is not None):
            mask, block_mask = rows.chunk_mask, rows.chunk_block_mask
        if block_mask is not None:  # a step of Transformer.decode_step: each row reads what it holds
            out = attend_own_blocks(q, self.cache.k, self.cache.v, block_mask)
        elif one_token_through_kernel:  # compiled: each row reads its cache row up to its own position
            lengths = (rows.positions[:, 0] + 1).expand(bsz)
            out = cpu_kernels.decode_attention(q, self.cache.k, self.cache.v, rows.tables, lengths, BLOCK_POSITIONS)
        else:
            # Without a mask, a prompt from position 0 is plainly causal (the kernel skips the
            # masked half), and a single new token sees everything cached up to end.
            keys, values = self.cache.read(rows)
            out = attend(q, keys, values, mask)
        return out.transpose(1, 2).reshape(bsz, seqlen, self.n_local_heads * self.head_dim)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Attention of q [bsz, heads, seqlen, head_dim] to keys and values [bsz, kv heads, end, head_dim],
    query head h reading KV head h // (heads // kv heads); causal from position 0 without a mask,
    else each query sees where mask [1 or bsz, 1, seqlen, end] is True.

    On GPUs, torch's fast kernels (flash, memory-efficient, cuDNN) refuse a mask together with
    enable_gqa, which would leave only the math kernel: there a masked step folds its groups
    (folded_attention). CPUs' flash kernel takes both, and runs faster than on folded queries."""
    grouped = q.shape[1] != keys.shape[1]
    if mask is not None and grouped and q.device.type != "cpu":
        return folded_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                                          enable_gqa=grouped)


def folded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """attend's masked grouped attention with each KV head's group of query heads folded into the
    query axis, as if one head asked all their queries: no enable_gqa, which every kernel takes."""
    bsz, heads, seqlen, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    folded = q.reshape(bsz, kv_heads, group * seqlen, head_dim)  # the group's queries one after another
    mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).flatten(2, 3)  # 1 or bsz, 1, group * seqlen, end
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)  # bsz, kv heads, group * seqlen, head_dim
    return out.reshape(bsz, heads, seqlen, head_dim)
