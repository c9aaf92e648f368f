"""Quantized linear layers, put in place of the model's at load time (or read from a quantized
checkpoint: checkpoint/quantized.py).

- "int8": weight-only, grouped int8 (kernels/int8.py): the demo model's greedy answers do not
  change, where one grid per output channel changed 7 of 10 (python -m
  llama_tp.tools.bench.answer_agreement). On a CPU with AVX-512 or AVX2, products of up to int8.MAX_ROWS rows
  (decoding) run our C++ kernel, which reads the int8 weight once. On other CPUs, a one-row
  product runs torch.compile's kernel for grouped_product, which does the same more slowly.
  Other products convert the weight back to the activations' dtype in one compiled pass and
  multiply it through oneDNN. All are compiled on first use (seconds; they need a C++ compiler,
  as --compile does). On GPUs the same compiled code runs (Triton's): in a compiled step, products
  of up to int8.GPU_SUMMED_MAX_ROWS rows read the weight as int8, converting it back as they read
  it, and more convert it back to the activations' dtype for cuBLAS. The loader quantizes each
  weight on the CPU before it moves to its device (checkpoint.load_into), so a model that fits in
  int8, not in bf16, loads.
- "int4": weight-only, grouped 4-bit (kernels/int4.py, GGUF's Q4_1 and Q4_0 arithmetic) in the
  transformer's layers, 0.625 bytes per weight; the output head grouped int8, as llama.cpp's
  4-bit files keep theirs at 6-8 bits (the demo model's is Q8_0). The demo model's greedy answers
  do not change (python -m llama_tp.tools.bench.answer_agreement --quantize int4). On CPUs with
  AVX-512 or AVX2 products of up to int4.MAX_ROWS rows (decoding) run our C++ kernel, which reads
  the 4-bit codes as they are stored, and prompts convert each weight back to fp32 with it and
  multiply through oneDNN; on other CPUs torch.compile's code does the same more slowly (a
  one-row product reading the codes, as int8's does). On GPUs of compute capability 8.0 or newer
  each layer is laid out once, as it loads, for torch's tinygemm kernel (TinygemmInt4Linear,
  kernels/tinygemm.py).
- "int8_dynamic": one grid per output channel, multiplied by fbgemm's int8 kernel, which also
  rounds each input row to int8 on the fly (dynamic quantization): 2-4x transformers' fp32 at
  batch 1, but its greedy answers drift from fp32's. CPU and fp32 only.
"""

import functools
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .. import parallel
from ..kernels import cpu_kernels, int4, int8, matmul, tinygemm
from ..kernels.int8 import dequantize, grouped_product, quantize_int8

# The model's linear layers, by attribute name: what quantization replaces and packing lays out.
LINEAR_LAYERS = ("wqkv", "wo", "w13", "w2", "output")

QUANTIZATIONS = ("int8", "int4", "int8_dynamic")
# The layer int4 keeps in int8: the output head, whose rounding moves every logit.
INT8_UNDER_INT4 = "output"


def check_quantize(quantize: Optional[str]) -> None:
    """Refuse an unknown quantization before any work is done."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(
            f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or leave it unset"
        )


def check_quantize_on(quantize: Optional[str], device: torch.device) -> None:
    """Refuse, before anything is loaded, a quantization the device cannot run: int4 without a
    kernel there, or int8 and int4 on a CPU without a C++ compiler for their compiled products."""
    check_quantize(quantize)
    if quantize == "int4":
        parallel.check_int4_device(device)
    if quantize in ("int8", "int4") and device.type == "cpu":
        parallel.require_cxx_compiler(f"quantize='{quantize}' on CPU", "use quantize='int8_dynamic' or none")


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
    def quantizing(cls, layer: nn.Module, weight: Optional[torch.Tensor] = None) -> "Int8Linear":
        """The layer with its weight (by default layer.weight: this rank's slice) quantized here
        (quantize_int8)."""
        return cls(*quantize_int8(_weight_of(layer, weight)), parallel.communication_after(layer))

    def use_kernel(self) -> None:
        """Lay the weight out for our int8 kernel, whose products it then takes."""
        cpu_kernels.load_decoding_kernels()
        self.weight, self.scales, self.zeros = int8.blocks(self.weight, self.scales, self.zeros)
        self.blocked = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            if x.shape[:-1].numel() <= int8.MAX_ROWS:
                return self.communicate(int8.product(x, self.weight, self.scales, self.zeros, self.out_features))
            weight = _run(int8.dequantize_blocks, self.weight, self.scales, self.zeros, self.out_features, x.dtype)
            return self.communicate(matmul.linear(x, weight))
        # Elsewhere (GPUs too) compiled code converts the weight back as it reads it, in one kernel:
        # eagerly that would be an fp32 and an x.dtype copy of every weight at every step.
        if x.shape[:-1].numel() <= int8.summed_max_rows(x.device):  # bound by reading the weight: read it as int8
            return self.communicate(_run(grouped_product, x, self.weight, self.scales, self.zeros))
        # Bound by arithmetic: the device's product (oneDNN, cuBLAS) on the weight converted back.
        # On CPUs eagerly: inductor's code for this conversion (torch 2.13, an AVX-512 Intel Xeon
        # without AMX) writes outside its buffers and glibc aborts the process at a later free.
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            weight = dequantize(self.weight, self.scales, self.zeros, x.dtype)
        else:
            weight = _run(dequantize, self.weight, self.scales, self.zeros, x.dtype)
        return self.communicate(matmul.linear(x, weight))


class Int4Linear(nn.Module):
    """A parallel linear layer holding its slice of the weight as grouped int4 (kernels/int4.py):
    codes (as `weight`, so that checkpoints name it as every layer's), scales and mins, built as
    Int8Linear is. On GPUs it becomes a TinygemmInt4Linear as the model loads (use_kernels)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 communicate: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.communicate = communicate
        # (codes, scales, mins) once our C++ kernel multiplies (use_kernel): plain attributes, read
        # in 0.1 us where each buffer's lookup through nn.Module takes 0.4, 120 times a step.
        self.operands: Optional[tuple[torch.Tensor, ...]] = None

    @classmethod
    def quantizing(cls, layer: nn.Module, weight: Optional[torch.Tensor] = None) -> "Int4Linear":
        """As Int8Linear.quantizing, with quantize_int4."""
        return cls(*int4.quantize_int4(_weight_of(layer, weight)), parallel.communication_after(layer))

    def use_kernel(self) -> None:
        """Multiply through our int4 kernel from now on (once the weights are loaded)."""
        cpu_kernels.load_decoding_kernels()
        self.operands = (self.weight, self.scales, self.mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        operands = self.operands
        if operands is None:  # a CPU without our kernel: torch.compile's code, as Int8Linear's
            if x.numel() == x.shape[-1]:  # one row, bound by reading the weight: read it as int4
                return self.communicate(_run(int4.grouped_product, x, self.weight, self.scales, self.mins))
            return self.communicate(matmul.linear(x, _run(int4.dequantize, self.weight, self.scales, self.mins, x.dtype)))
        if x.numel() <= int4.MAX_ROWS * x.shape[-1]:  # decoding: bound by reading the weight
            return self.communicate(int4.product(x, *operands))
        return self.communicate(matmul.linear(x, int4.weight(*operands).to(x.dtype)))


class TinygemmInt4Linear(nn.Module):
    """An Int4Linear laid out for torch's tinygemm kernel (kernels/tinygemm.py): int4 on GPUs.

    The same codes and groups in tinygemm's packing (as `weight`), with its bf16 scales and zeros,
    the same bytes as the Int4Linear it is packed from, whose communication it keeps."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                 communicate: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.communicate = communicate

    @classmethod
    def packing(cls, layer: Int4Linear) -> "TinygemmInt4Linear":
        """layer's weight packed on its device (tinygemm.pack)."""
        return cls(*tinygemm.pack(layer.weight, layer.scales, layer.mins), layer.communicate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Prompts: the weight converted back, for cuBLAS (tinygemm.MAX_ROWS). tinygemm.dequantize
        # reads the CUDA packing; torch's CPU twin, which stands in for the tests, takes every row.
        if x.is_cuda and x.numel() > tinygemm.MAX_ROWS * x.shape[-1]:
            weight = _run(tinygemm.dequantize, self.weight, self.scales_and_zeros, x.dtype)
            return self.communicate(matmul.linear(x, weight))
        return self.communicate(tinygemm.product(x, self.weight, self.scales_and_zeros))


def _weight_of(layer: nn.Module, weight: Optional[torch.Tensor]) -> torch.Tensor:
    return layer.weight.detach() if weight is None else weight


# The quantizations that the loader applies weight by weight, on the CPU, before the weights move
# to their device (checkpoint.load_into); int8_dynamic is CPU-only and replaces loaded layers.
QUANTIZED_AT_LOAD = {"int8": Int8Linear, "int4": Int4Linear}


# Without VNNI, fbgemm multiplies u8 activations by s8 weights in pairs summed into 16 bits,
# which saturate at full range (a product on an AVX2 CPU was 7-23% off). There the weights take
# 7 bits (levels -63..63), so that no pair can overflow; the activations keep their 8.
WEIGHT_LEVELS = 127 if torch.cpu._is_vnni_supported() else 63


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
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / WEIGHT_LEVELS
    q = torch.round(weight / scales[:, None]).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    with warnings.catch_warnings():  # quantized tensors are deprecated, but this kernel only takes them
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(
            q, scales.double(), torch.zeros(len(scales), dtype=torch.long), axis=0
        )
        return torch.ops.quantized.linear_prepack(qweight, None)


def replace_linear_layers(model: nn.Module, replacement: Callable[[str, nn.Module], nn.Module]) -> nn.Module:
    """Replace every linear layer of the model (attention, feed-forward, output) in place by
    replacement(its name in the model, the layer). Nothing else here holds a replaced layer, so
    each is freed as it goes."""
    parents = [(prefix, module) for prefix, module in model.named_modules()
               if any(name in LINEAR_LAYERS for name, _ in module.named_children())]
    for prefix, module in parents:
        for name in [name for name, _ in module.named_children() if name in LINEAR_LAYERS]:
            setattr(module, name, replacement(f"{prefix}.{name}".lstrip("."), getattr(module, name)))
    return model


def use_kernels(model: nn.Module) -> nn.Module:
    """Hand the model's int8 and int4 layers to the kernels that take them on their device: ours
    on a CPU with AVX-512 or AVX2, torch's tinygemm for int4 on a GPU."""
    for module in model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)) and cpu_kernels.decoding_kernels_run_on(module.weight.device):
            module.use_kernel()
    return use_tinygemm(model) if next(model.parameters()).is_cuda else model


def use_tinygemm(model: nn.Module) -> nn.Module:
    """Put TinygemmInt4Linear layers in place of the model's Int4Linear ones, packed on their
    device, each freed as it goes: on GPUs as the model loads (use_kernels); on a CPU, torch's twin
    of the kernel multiplies (the tests' stand-in for a GPU)."""
    return replace_linear_layers(model, lambda name, layer: TinygemmInt4Linear.packing(layer)
                                 if isinstance(layer, Int4Linear) else layer)


def layer_quantization(name: str, quantize: Optional[str]) -> Optional[str]:
    """What `quantize` makes of the linear layer `name` (its attribute or checkpoint name, e.g.
    output or layers.0.attention.wq): int4 keeps the output head in int8 (INT8_UNDER_INT4)."""
    if quantize == "int4" and name.split(".")[-1] == INT8_UNDER_INT4:
        return "int8"
    return quantize


def quantize_model(model: nn.Module, quantize: Optional[str]) -> nn.Module:
    """Quantize every linear layer of the model in place."""
    check_quantize(quantize)
    if quantize is None:
        return model
    check_quantize_on(quantize, next(model.parameters()).device)
    replacements = {"int8": Int8Linear.quantizing, "int4": Int4Linear.quantizing, "int8_dynamic": DynamicInt8Linear}
    # Each full-precision weight is freed as it goes.
    return replace_linear_layers(model, lambda name, layer: replacements[layer_quantization(name, quantize)](layer))
