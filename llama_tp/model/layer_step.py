"""Eager decoding steps of plain int4 or int8 layers in one C++ call (kernels/layer_step.cpp).

Where our CPU kernels attend and multiply (a step of a few tokens a row), TransformerBlock's step
is a dozen kernel calls and small operators a layer with Python between them;
quantized_layers_step makes the same calls in the same order in C++, the sums over model-parallel
ranks through the same C++ exchange in shared memory, so a step's logits are the same bits. Layers
it cannot take (biases, head norms, experts, fp32 weights, int4 beside int8) and ranks that sum
otherwise (gloo) step as before, one module at a time.
"""

import weakref
from typing import Optional

import torch
from torch import nn

from ..kernels import cpu_kernels, int4, int8
from ..parallel import all_gather_last_dim, all_reduce, model_parallel_size, native_sum_arguments
from .feed_forward import FeedForward
from .kv_cache import BLOCK_POSITIONS, CacheRows
from .quantize import Int4Linear, Int8Linear

# The exchange's arguments (buffer, rank, world size, capacity, timeout) of a single rank: no sums.
ONE_RANK = (None, 0, 1, 0, 0.0)


class QuantizedLayersStep:
    """The operands of consecutive plain layers of one kind (4 or 8 bits), gathered once for
    quantized_layers_step: each layer's two norms, then wqkv's, wo's, w13's and w2's three tensors."""

    def __init__(self, layers: nn.ModuleList, bits: int):
        self.bits, self.max_rows = bits, int4.MAX_ROWS if bits == 4 else int8.MAX_ROWS
        self.operands: list[torch.Tensor] = []
        self.out_features: list[int] = []
        for layer in layers:
            linears = _linears(layer)
            self.operands += [layer.attention_norm.weight, layer.ffn_norm.weight]
            self.operands += [operand for linear in linears for operand in _operands(linear)]
            self.out_features += [linear.out_features if bits == 8 else 0 for linear in linears]  # int8's alone
        self.attentions = [layer.attention for layer in layers]
        self.heads, self.eps = layers[0].attention.n_local_heads, layers[0].attention_norm.eps
        self.hidden = layers[0].feed_forward.local_widths[0]

    def __call__(self, h: torch.Tensor, rows: CacheRows) -> Optional[torch.Tensor]:
        """The layers' step of h [bsz, tokens, dim], or None where its products are not our
        kernel's (more rows than its MAX_ROWS) or, on several ranks, its sums do not go through
        the C++ exchange: every rank decides alike from the same shapes."""
        if h.dtype != torch.float32 or h.shape[0] * h.shape[1] > self.max_rows:
            return None
        exchange = ONE_RANK if model_parallel_size() == 1 else native_sum_arguments(h)
        if exchange is None:
            return None
        caches = [attention.cache for attention in self.attentions]
        return torch.ops.llama_tp.quantized_layers_step(
            h, self.operands, self.bits, self.out_features, [cache.k for cache in caches],
            [cache.v for cache in caches], rows.rotary, rows.tables, rows.kernel_starts, self.heads,
            BLOCK_POSITIONS, self.hidden, self.eps, *exchange)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2


def _operands(linear: Int4Linear | Int8Linear) -> tuple[torch.Tensor, ...]:
    """The three tensors our kernel multiplies by: an Int4Linear's codes, scales and mins, or a
    blocked Int8Linear's q, scales and zeros."""
    return linear.operands if isinstance(linear, Int4Linear) else (linear.weight, linear.scales, linear.zeros)


def _bits(linear: nn.Module) -> Optional[int]:
    """4 or 8 where our kernel takes this layer's products (quantize.use_kernels), else None."""
    if isinstance(linear, Int4Linear) and linear.operands is not None:
        return 4
    return 8 if isinstance(linear, Int8Linear) and linear.blocked else None


def _plain_bits(layer: nn.Module) -> Optional[int]:
    """The weights' bits where quantized_layers_step computes this TransformerBlock's step as it
    does itself, else None."""
    attention, feed_forward = layer.attention, layer.feed_forward
    plain_attention = (attention.qkv_bias is None and attention.q_norm is None and not attention.weightless_qk_norm
                       and attention.temperature is None and attention.rotates)
    if not plain_attention or not isinstance(feed_forward, FeedForward):
        return None
    linears = _linears(layer)
    kinds = {_bits(linear) for linear in linears}
    if len(kinds) != 1 or None in kinds:
        return None
    # wqkv's and w13's outputs stay split over the ranks; wo's and w2's are summed over them.
    split = all(linear.communicate not in (all_reduce, all_gather_last_dim) for linear in linears[::2])
    summed = all(linear.communicate is all_reduce for linear in linears[1::2])
    norms = layer.attention_norm.weight.dtype == torch.float32 and layer.ffn_norm.eps == layer.attention_norm.eps
    return kinds.pop() if split and summed and norms else None


# Each group of layers' step, or None where a layer is not plain: gathered at the group's first
# kernel step, once its weights are loaded and laid out for our kernels (quantize.use_kernels).
_steps: "weakref.WeakKeyDictionary[nn.ModuleList, Optional[QuantizedLayersStep]]" = weakref.WeakKeyDictionary()


def quantized_layers_step(layers: nn.ModuleList) -> Optional[QuantizedLayersStep]:
    """The one-call step of these layers, or None where they step one module at a time."""
    if layers not in _steps:
        cpu_kernels.load_decoding_kernels()
        kinds = {_plain_bits(layer) for layer in layers}
        _steps[layers] = QuantizedLayersStep(layers, kinds.pop()) if len(kinds) == 1 and None not in kinds else None
    return _steps[layers]
