"""int8 quantization of the linear layers, applied at load time (or once, into an int8
checkpoint: int8_checkpoint.py).

- "int8": weight-only, in groups of 32 inputs of one output channel (GROUP_SIZE), each group on
  its own grid: 255 steps from its smallest value to its largest, or 255 steps symmetric around
  zero where that grid fits the group better. Weights that come from GGUF's blocks of 32 (4-bit
  Q4_0 and Q4_1, 8-bit Q8_0, as the demo model's do) land on one of the two grids, so they are
  kept almost exactly: the demo model's greedy answers do not change, where one grid per output
  channel changed 7 of 10 (python -m llama_tp.answer_agreement).
  On a CPU with AVX-512, products of up to int8_kernel.MAX_ROWS rows (decoding) run our C++
  kernel, which reads the int8 weight once (int8_kernel.py, cpu_kernels.py). On other CPUs, a
  one-row product runs torch.compile's kernel for grouped_product, which does the same more
  slowly. Other products convert the weight back to the activations' dtype in one compiled pass
  and multiply it through oneDNN. All are compiled on first use (seconds; they need a C++
  compiler, as --compile does). Elsewhere the weight is converted back on the fly: that saves
  memory, not time.
- "int8_dynamic": one grid per output channel, multiplied by fbgemm's int8 kernel, which also
  rounds each input row to int8 on the fly (dynamic quantization): 2-4x transformers' fp32 at
  batch 1, but its greedy answers drift from fp32's. CPU and fp32 only.
"""

import functools
import math
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from . import cpu_kernels, int8_kernel, matmul, parallel
from .model import LINEAR_LAYERS

QUANTIZATIONS = ("int8", "int8_dynamic")

# GGUF's quantization blocks hold 32 weights along the input dimension.
GROUP_SIZE = 32

# Rows quantized at a time: bounds the fp32 temporaries of a large matrix (an output head).
QUANTIZE_ROWS = 4096


def check_quantize(quantize: Optional[str]) -> None:
    """Refuse an unknown quantization before any work is done."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or leave it unset"
        )


def group_size(width: int) -> int:
    """Inputs per group for a weight `width` inputs wide: GROUP_SIZE, or fewer where width is not a multiple."""
    return math.gcd(width, GROUP_SIZE)


def quantize_int8(weight: torch.Tensor, size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped int8: weight [out, in] ~= q [out, in] * scales + zeros, with scales and zeros
    [out, groups] in fp32, one per group of `size` inputs (by default group_size(in)).

    Each group is rounded on its own, so a slice of whole groups gives exactly its part of the
    whole weight's q, scales and zeros."""
    rows, width = weight.shape
    size = size or group_size(width)
    parts = [_quantize_groups(chunk.float().view(chunk.shape[0], width // size, size))
             for chunk in weight.split(QUANTIZE_ROWS)]
    q, scales, zeros = (torch.cat(tensors) for tensors in zip(*parts))
    return q.view(rows, width), scales, zeros


def _quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups [rows, n, size] in fp32 -> q [rows, n, size] int8, scales and zeros [rows, n]."""
    tiny = torch.finfo(torch.float32).tiny
    low, high = groups.aminmax(dim=-1, keepdim=True)
    # From low to high in 255 steps, stored as -128..127 around zero = low + 128 steps.
    span_step = ((high - low) / 255).clamp_(min=tiny)
    span_zero = low + 128 * span_step
    span_q = ((groups - span_zero) / span_step).round_().clamp_(-128, 127)
    # Symmetric: -127..127 steps of the largest magnitude / 127.
    symmetric_step = (torch.maximum(low.abs(), high.abs()) / 127).clamp_(min=tiny)
    symmetric_q = (groups / symmetric_step).round_().clamp_(-127, 127)
    span_error = (span_q * span_step + span_zero - groups).abs_().amax(dim=-1, keepdim=True)
    symmetric_error = (symmetric_q * symmetric_step - groups).abs_().amax(dim=-1, keepdim=True)
    symmetric = symmetric_error <= span_error  # on a tie, the grid without an offset
    q = torch.where(symmetric, symmetric_q, span_q).to(torch.int8)
    scales = torch.where(symmetric, symmetric_step, span_step).squeeze(-1)
    zeros = torch.where(symmetric, 0.0, span_zero).squeeze(-1)
    return q, scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] that grouped int8 q, scales and zeros stand for, in dtype."""
    rows, width = q.shape
    groups = q.view(rows, scales.shape[1], -1).float() * scales[..., None] + zeros[..., None]
    return groups.view(rows, width).to(dtype)


def grouped_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the grouped int8 weight, transposed, converting each weight back as it is
    read. Written for inductor, which makes it one pass over q: on this project's CPU, 1.2-1.7x
    faster than summing each group's products first and scaling the sums."""
    rows, width = q.shape
    n_groups = scales.shape[1]
    x_groups = x.reshape(-1, n_groups, width // n_groups).float()  # r, n, size
    weight = q.view(rows, 1, n_groups, -1).float() * scales[:, None, :, None] + zeros[:, None, :, None]
    product = (weight * x_groups).sum((-1, -2))  # out, r
    return product.t().reshape(*x.shape[:-1], rows).type_as(x)


@functools.cache
def _compiled(kernel: Callable) -> Callable:
    """kernel compiled for each shape it meets; compiled once per process, on first use."""
    return torch.compile(kernel, dynamic=False)


def _run(kernel: Callable, *args: torch.Tensor) -> torch.Tensor:
    """kernel traced into the graph being compiled, if any; else through its own compiled version."""
    return (kernel if torch.compiler.is_compiling() else _compiled(kernel))(*args)


class Int8Linear(nn.Module):
    """A parallel linear layer holding its slice of the weight as grouped int8 (see quantize_int8).

    Built from q, scales and zeros (as an int8 checkpoint stores them) and the communication of
    the layer it replaces (parallel.communication_after), so it talks to the other ranks exactly
    as that layer did.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 communicate: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.communicate = communicate
        self.out_features = q.shape[0]
        self.blocked = False  # weight, scales and zeros in int8_kernel's layout (use_kernel)

    @classmethod
    def quantizing(cls, layer: nn.Module) -> "Int8Linear":
        """The layer with its weight quantized here (quantize_int8 of this rank's slice)."""
        return cls(*quantize_int8(layer.weight.detach()), parallel.communication_after(layer))

    def use_kernel(self) -> None:
        """Lay the weight out for int8_kernel, whose products it then takes."""
        cpu_kernels.load()
        self.weight, self.scales, self.zeros = int8_kernel.blocks(self.weight, self.scales, self.zeros)
        self.blocked = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            if x.shape[:-1].numel() <= int8_kernel.MAX_ROWS:
                return self.communicate(int8_kernel.product(x, self.weight, self.scales, self.zeros, self.out_features))
            weight = _run(int8_kernel.dequantize, self.weight, self.scales, self.zeros, self.out_features, x.dtype)
            return self.communicate(matmul.linear(x, weight))
        if x.device.type != "cpu":
            return self.communicate(matmul.linear(x, dequantize(self.weight, self.scales, self.zeros, x.dtype)))
        if x.shape[:-1].numel() == 1:  # bound by reading the weight: read it as int8
            return self.communicate(_run(grouped_product, x, self.weight, self.scales, self.zeros))
        # Bound by arithmetic: oneDNN's fp32 product on the weight converted back.
        weight = _run(dequantize, self.weight, self.scales, self.zeros, x.dtype)
        return self.communicate(matmul.linear(x, weight))


class DynamicInt8Linear(nn.Module):
    """A parallel linear layer multiplied by fbgemm's dynamic int8 kernel: one grid per output
    channel for the weight, one per row for the activations, fp32 on CPU only."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        weight = layer.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"quantize='int8_dynamic' runs fbgemm's CPU kernel on fp32 activations, not {weight.dtype} on "
                f"{weight.device.type}; use quantize='int8' there"
            )
        self.packed = _fbgemm_pack(weight)
        # Hidden in the opaque handle, out of the state dict: int8 weights, a scale per channel.
        self.packed_bytes = weight.numel() + 4 * weight.shape[0]
        self.communicate = parallel.communication_after(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.communicate(torch.ops.quantized.linear_dynamic(x, self.packed))


def _fbgemm_pack(weight: torch.Tensor) -> object:
    """weight [out, in] rounded to int8 per output channel, in fbgemm's packed layout (an opaque handle)."""
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    with warnings.catch_warnings():  # quantized tensors are deprecated, but this kernel only takes them
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            q, scales.double(), torch.zeros(len(scales), dtype=torch.long), axis=0
        )
        return torch.ops.quantized.linear_prepack(qweight, None)


def replace_linear_layers(model: nn.Module, replacement: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Replace every linear layer of the model (attention, feed-forward, output) in place by replacement(layer)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in LINEAR_LAYERS:
                setattr(module, name, replacement(child))
    return model


def use_int8_kernel(model: nn.Module) -> nn.Module:
    """Hand the model's int8 layers to int8_kernel, where it runs (a CPU with AVX-512)."""
    for module in model.modules():
        if isinstance(module, Int8Linear) and cpu_kernels.runs_on(module.weight.device):
            module.use_kernel()
    return model


def quantize_model(model: nn.Module, quantize: Optional[str]) -> nn.Module:
    """Quantize every linear layer of the model in place."""
    check_quantize(quantize)
    if quantize is None:
        return model
    if quantize == "int8" and next(model.parameters()).device.type == "cpu":
        parallel.require_cxx_compiler("quantize='int8' on CPU", "use quantize='int8_dynamic' or none")
    replacement = Int8Linear.quantizing if quantize == "int8" else DynamicInt8Linear
    return replace_linear_layers(model, replacement)  # each full-precision weight is freed as it goes
