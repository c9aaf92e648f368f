"""Eager decoding steps of plain int4 layers in one C++ call (kernels/layer_step.cpp).

Where our CPU kernels attend and multiply (a step of a few tokens a row), TransformerBlock's step
is a dozen kernel calls and small operators a layer with Python between them; int4_layers_step
makes the same calls in the same order in C++, the sums over model-parallel ranks through the same
C++ exchange in shared memory, so a step's logits are the same bits. Layers it cannot take
(biases, head norms, experts, int8 or fp32 weights) and ranks that sum otherwise (gloo) step as
before, one module at a time.
"""

import weakref
from typing import Optional

import torch
from torch import nn

from ..kernels import cpu_kernels, int4
from ..parallel import all_gather_last_dim, all_reduce, model_parallel_size, native_sum_arguments
from .feed_forward import FeedForward
from .kv_cache import BLOCK_POSITIONS, CacheRows

# A layer's operands in int4_layers_step's order: its two norms, then wqkv's, wo's, w13's and w2's
# codes, scales and mins.
PRODUCTS = ("wqkv", "wo", "w13", "w2")


class Int4LayersStep:
    """The operands of consecutive plain int4 layers, gathered once for int4_layers_step."""

    def __init__(self, layers: nn.ModuleList):
        first = layers[0].attention
        self.operands: list[torch.Tensor] = []
        for layer in layers:
            linears = (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
            self.operands += [layer.attention_norm.weight, layer.ffn_norm.weight]
            self.operands += [operand for linear in linears for operand in linear.operands]
        self.attentions = [layer.attention for layer in layers]
        self.heads, self.eps = first.n_local_heads, layers[0].attention_norm.eps
        self.hidden = layers[0].feed_forward.local_widths[0]

    def takes(self, h: torch.Tensor) -> bool:
        """Whether a step of h [bsz, tokens, dim] goes through our int4 kernel's products
        (int4.MAX_ROWS) and, on several ranks, its sums through the C++ exchange."""
        fits = h.dtype == torch.float32 and h.shape[0] * h.shape[1] <= int4.MAX_ROWS
        return fits and (model_parallel_size() == 1 or native_sum_arguments(h) is not None)

    def __call__(self, h: torch.Tensor, rows: CacheRows) -> torch.Tensor:
        caches = [attention.cache for attention in self.attentions]
        exchange = (None, 0, 1, 0, 0.0) if model_parallel_size() == 1 else native_sum_arguments(h)
        return torch.ops.llama_tp.int4_layers_step(
            h, self.operands, [cache.k for cache in caches], [cache.v for cache in caches], rows.rotary,
            rows.tables, rows.kernel_starts, self.heads, BLOCK_POSITIONS, self.hidden, self.eps, *exchange)


def _plain_int4(layer: nn.Module) -> bool:
    """Whether int4_layers_step computes this TransformerBlock's step as it does itself."""
    attention, feed_forward = layer.attention, layer.feed_forward
    plain_attention = (attention.qkv_bias is None and attention.q_norm is None and not attention.weightless_qk_norm
                       and attention.temperature is None and attention.rotates)
    if not plain_attention or not isinstance(feed_forward, FeedForward):
        return False
    linears = (attention.wqkv, attention.wo, feed_forward.w13, feed_forward.w2)
    if not all(getattr(linear, "operands", None) is not None for linear in linears):  # quantize.Int4Linear's
        return False
    # wqkv's and w13's outputs stay split over the ranks; wo's and w2's are summed over them.
    split = all(linear.communicate not in (all_reduce, all_gather_last_dim) for linear in linears[::2])
    summed = all(linear.communicate is all_reduce for linear in linears[1::2])
    return (split and summed and layer.attention_norm.weight.dtype == torch.float32
            and layer.ffn_norm.eps == layer.attention_norm.eps)


# Each group of layers' step, or None where a layer is not plain int4: gathered at the group's
# first kernel step, once its weights are loaded and laid out for our kernel (quantize.use_kernels).
_steps: "weakref.WeakKeyDictionary[nn.ModuleList, Optional[Int4LayersStep]]" = weakref.WeakKeyDictionary()


def int4_layers_step(layers: nn.ModuleList) -> Optional[Int4LayersStep]:
    """The one-call step of these layers, or None where they step one module at a time."""
    if layers not in _steps:
        cpu_kernels.load_decoding_kernels()
        _steps[layers] = Int4LayersStep(layers) if all(_plain_int4(layer) for layer in layers) else None
    return _steps[layers]
