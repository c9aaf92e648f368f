"""Quantized linear layers, put in place of the model's at load time (or read from an int8
checkpoint: checkpoint/int8.py).

- "int8": weight-only, grouped int8 (kernels/int8.py): the demo model's greedy answers do not
  change, where one grid per output channel changed 7 of 10 (python -m
  llama_tp.tools.answer_agreement). On a CPU with AVX-512, products of up to int8.MAX_ROWS rows
  (decoding) run our C++ kernel, which reads the int8 weight once. On other CPUs, a one-row
  product runs torch.compile's kernel for grouped_product, which does the same more slowly.
  Other products convert the weight back to the activations' dtype in one compiled pass and
  multiply it through oneDNN. All are compiled on first use (seconds; they need a C++ compiler,
  as --compile does). Elsewhere the weight is converted back on the fly: that saves memory, not
  time.
- "int8_dynamic": one grid per output channel, multiplied by fbgemm's int8 kernel, which also
  rounds each input row to int8 on the fly (dynamic quantization): 2-4x transformers' fp32 at
  batch 1, but its greedy answers drift from fp32's. CPU and fp32 only.
"""

import functools
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from . import parallel
from .kernels import cpu_kernels, int8, matmul
from .kernels.int8 import dequantize, grouped_product, quantize_int8
from .model import LINEAR_LAYERS

QUANTIZATIONS = ("int8", "int8_dynamic")


def check_quantize(quantize: Optional[str]) -> None:
    """Refuse an unknown quantization before any work is done."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or leave it unset"
        )


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
        self.blocked = False  # weight, scales and zeros in our kernel's layout (use_kernel)

    @classmethod
    def quantizing(cls, layer: nn.Module) -> "Int8Linear":
        """The layer with its weight quantized here (quantize_int8 of this rank's slice)."""
        return cls(*quantize_int8(layer.weight.detach()), parallel.communication_after(layer))

    def use_kernel(self) -> None:
        """Lay the weight out for our int8 kernel, whose products it then takes."""
        cpu_kernels.load()
        self.weight, self.scales, self.zeros = int8.blocks(self.weight, self.scales, self.zeros)
        self.blocked = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            if x.shape[:-1].numel() <= int8.MAX_ROWS:
                return self.communicate(int8.product(x, self.weight, self.scales, self.zeros, self.out_features))
            weight = _run(int8.dequantize_blocks, self.weight, self.scales, self.zeros, self.out_features, x.dtype)
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
    """Hand the model's int8 layers to our int8 kernel, where it runs (a CPU with AVX-512)."""
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
