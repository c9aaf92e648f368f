"""Grouped int8 weights: rounding a weight to them, reading them back, and multiplying by them.

A weight [out, in] is held as int8 q with fp32 scales and zeros [out, groups], one per group of
32 inputs of an output channel (GROUP_SIZE, GGUF's block size): w ~= q * scale + zero. Each group
takes its own grid: 255 steps from its smallest value to its largest, or 255 steps symmetric
around zero where that grid fits the group better. Weights that come from GGUF's blocks of 32
(4-bit Q4_0 and Q4_1, 8-bit Q8_0, as the demo model's do) land on one of the two grids, so they
are kept almost exactly.

Products of a few rows (decoding) on CPUs with AVX-512 or AVX2 run our C++ kernel
(cpu_kernels.cpp, avx2_kernels.cpp: int8_product), which reads the weight in blocks of 16 output
channels stored input-major, laid out once at load (`blocks`). torch.compile's code for the same product (grouped_product)
converts the weight back with one chain of additions per output: in a decode step of the demo
model on this project's 2-core Intel Xeon machine it read 8-11 G weights per second, the kernel,
which widens 16 outputs' weights per load into 4 independent sums and asks for the weight 8 KB
ahead, 15-20 G (int8 decoding at batch 1: 32 -> 56 tokens per second).
"""

import math
from typing import Optional

import torch

# GGUF's quantization blocks hold 32 weights along the input dimension.
GROUP_SIZE = 32

# Rows quantized at a time: bounds the fp32 temporaries of a large matrix (an output head).
QUANTIZE_ROWS = 4096

LANES = 16  # output channels per block of the kernel's layout: one AVX-512 register of fp32

# Products of up to this many rows go to the kernel (at 128 rows both ways take as long); more
# (prompts) convert the weight back and multiply it through oneDNN.
MAX_ROWS = 64

# Where our kernel does not run (GPUs, other CPUs), products of a few rows read the weight as int8
# through grouped_product, compiled; more convert it back for the device's matrix product (cuBLAS,
# oneDNN), which reads 1.25 bytes a weight and writes and reads 2 more. Inductor's code for
# grouped_product converts each weight back once per row: on CPUs that pays for one row only
# (matmul.SUMMED_MAX_ROWS). A GPU converts int8 to fp32 at 16 a cycle per SM (a quarter or an
# eighth of its multiply-adds), so a row costs about 1.6 ms for a 7B model's 6.5 G weights on an
# H200, against about 3.5 ms for reading them in bf16 and 9 ms for converting them back: up to 4
# rows, estimated so, not measured yet (tools/bench_products.py measures it).
GPU_SUMMED_MAX_ROWS = 4


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


def summed_max_rows(device: torch.device) -> int:
    """Products of up to this many rows on `device` go to grouped_product (where our kernel does
    not run): GPU_SUMMED_MAX_ROWS on GPUs while torch.compile traces a step, else one. Eager
    products compile grouped_product on its own for each shape they meet, and dynamo stops
    compiling a function after 8 (its recompile_limit): one row keeps those to a model's 5 weight
    shapes."""
    return GPU_SUMMED_MAX_ROWS if device.type == "cuda" and torch.compiler.is_compiling() else 1


def blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int8's q [out, in], scales and zeros [out, groups] in the kernel's layout: q
    [blocks, in, LANES], scales and zeros [blocks, groups, LANES], the last block padded with zeros."""
    padding = -q.shape[0] % LANES

    def blocked(tensor: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(tensor, (0, 0, 0, padding))
        return padded.view(-1, LANES, tensor.shape[1]).transpose(1, 2).contiguous()  # blocks, columns, LANES

    return blocked(q), blocked(scales), blocked(zeros)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, out_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight [out_features, in] that blocked q, scales and zeros stand for, in dtype."""
    n_blocks, width, lanes = q.shape
    groups = scales.shape[1]
    weight = q.view(n_blocks, groups, -1, lanes).float() * scales[:, :, None] + zeros[:, :, None]
    weight = weight.view(n_blocks, width, lanes).transpose(1, 2).reshape(n_blocks * lanes, width)
    return weight[:out_features].to(dtype)


def product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            out_features: int) -> torch.Tensor:
    """x [..., in] times the blocked int8 weight, transposed: [..., out_features] in x's dtype
    (after cpu_kernels.load_decoding_kernels())."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # rows, in
    y = torch.ops.llama_tp.int8_product(rows, q, scales, zeros, out_features)
    return y.view(*x.shape[:-1], out_features).to(x.dtype)
