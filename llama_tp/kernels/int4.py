"""Grouped 4-bit weights (GGUF's Q4_1 and Q4_0 arithmetic): rounding a weight to them, reading them
back, and multiplying by them.

A weight [out, in] is held as codes, uint8 [out, in / 2] (two 4-bit codes 0..15 a byte), with
fp16 scales and mins [out, in / 32], one per group of 32 inputs (GROUP_SIZE): w = code * scale +
min. Within a group, byte j holds input j in its low four bits and input j + 16 in its high four:
GGUF's own order. So a Q4_1 block (d, m, 16 bytes) comes in as scale d, min m and its bytes as
they are, and a Q4_0 block (d, 16 bytes, w = (code - 8) * d) as scale d, min -8 d. Both are exact:
code * d needs at most 15 of fp32's 24 bits, so code * scale + min rounds once, as GGUF's
dequantisation does. 0.625 bytes per weight, Q4_1's size.

Our own rounding (quantize_int4) gives each group the better of two grids: Q4_1's, 15 steps from
its smallest to its largest value, and Q4_0's, the value of largest magnitude at code 0 and steps
of it / -8. Scale and min are rounded to fp16 first and the codes taken against them, so weights
dequantised from Q4_1 or Q4_0 blocks round back to their own codes.

Products of up to MAX_ROWS rows (decoding) on CPUs with AVX-512 or AVX2 run our C++ kernel
(int4_kernel.cpp, avx2_kernels.cpp: int4_product), which reads this layout as it is stored; more
rows (prompts) convert the weight back to fp32 with its int4_weight and multiply through oneDNN.
"""

import torch

from . import cpu_kernels

# GGUF's blocks hold 32 weights along the input dimension; int4 needs whole groups of them.
GROUP_SIZE = 32
CODES = 16  # 4 bits
# Q4_0 puts the value of largest magnitude at code 0 and steps of it / -8 from there.
SYMMETRIC_STEPS = -8

# Rows quantized at a time: bounds the fp32 temporaries of a large matrix (an output head).
QUANTIZE_ROWS = 4096

# Products of up to this many rows go to the kernel, which from 5 rows on converts each weight
# once for a pass of up to 32 rows. On an Intel Xeon with AVX-512 (2 threads, the demo's 30
# layers) products of 64 rows took 73 ms against 77 through oneDNN on the weight converted back,
# of 80 rows 91 against 86. On AVX2 CPUs (avx2_kernels.cpp) up to 128: there products of 64
# rows took 139 ms against 181, of 128 294 against 299 (of 256, 636 against 509). A decoding
# step that takes in a prompt (Transformer.forward_segments) has its rows and the prompt's.
MAX_ROWS = 128 if cpu_kernels.AVX2_KERNELS else 64

# The largest finite fp16: scales and mins are stored in fp16, as GGUF stores them.
FP16_MAX = torch.finfo(torch.float16).max


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped int4: weight [out, in] ~= codes * scales + mins, returned as codes uint8 [out, in / 2]
    (packed as GGUF packs them) and fp16 scales and mins [out, in / GROUP_SIZE].

    Each group is rounded on its own, so a slice of whole groups gives exactly its part of the
    whole weight's codes, scales and mins. The width must be a multiple of GROUP_SIZE
    (checkpoint.quantized.check_split says so for a model)."""
    rows, width = weight.shape
    if width % GROUP_SIZE:
        raise ValueError(f"int4 needs weights whose width is a multiple of {GROUP_SIZE} inputs, not {width}; use int8")
    largest = weight.abs().max().item() if weight.numel() else 0.0
    if largest > FP16_MAX:
        raise ValueError(f"a weight of magnitude {largest:g} does not fit int4's fp16 scales and mins "
                         f"(at most {FP16_MAX:g}); use int8")
    parts = [_quantize_groups(chunk.float().view(chunk.shape[0], width // GROUP_SIZE, GROUP_SIZE))
             for chunk in weight.split(QUANTIZE_ROWS)]
    codes, scales, mins = (torch.cat(tensors) for tensors in zip(*parts))
    return pack(codes.view(rows, width)), scales, mins


def _quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """groups [rows, n, 32] in fp32 -> codes [rows, n, 32] uint8 (unpacked), fp16 scales and mins [rows, n]."""
    low, high = groups.aminmax(dim=-1, keepdim=True)
    span = _grid(groups, ((high - low) / (CODES - 1)).half(), low.half())
    largest = torch.where(low.abs() >= high.abs(), low, high)  # the value of largest magnitude, signed
    step = (largest / SYMMETRIC_STEPS).half()
    symmetric = _grid(groups, step, step * SYMMETRIC_STEPS)  # exact in fp16: a power of two
    use_symmetric = symmetric[3] <= span[3]  # on a tie, Q4_0's grid
    codes, scales, mins = (torch.where(use_symmetric, s, a) for s, a in zip(symmetric[:3], span[:3]))
    return codes.to(torch.uint8), scales.squeeze(-1), mins.squeeze(-1)


def _grid(groups: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    """Codes of groups on the grid code * scale + minimum (fp16 [rows, n, 1] each), with the grid and
    each group's largest error."""
    scale32, min32 = scale.float(), minimum.float()
    steps = ((groups - min32) / torch.where(scale32 == 0, 1.0, scale32)).round_().clamp_(0, CODES - 1)
    error = (steps * scale32 + min32 - groups).abs_().amax(dim=-1, keepdim=True)
    return steps, scale, minimum, error


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] (0..15, in a multiple of GROUP_SIZE) two a byte in GGUF's order: [out, in / 2] uint8."""
    rows, width = codes.shape
    halves = codes.to(torch.uint8).view(rows, width // GROUP_SIZE, 2, GROUP_SIZE // 2)  # rows, groups, low/high, 16
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(rows, width // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's codes back: [out, in] uint8, 0..15."""
    rows, half_width = packed.shape
    groups = packed.view(rows, -1, GROUP_SIZE // 2)  # rows, groups, 16
    return torch.stack((groups & 0xF, groups >> 4), dim=2).view(rows, 2 * half_width)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] that packed codes, scales and mins stand for, in dtype."""
    rows = codes.shape[0]
    groups = unpack(codes).view(rows, scales.shape[1], GROUP_SIZE).float()
    weight = groups * scales.float()[..., None] + mins.float()[..., None]
    return weight.view(rows, -1).to(dtype)


def grouped_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the int4 weight, transposed, converting each weight back as it is read:
    written for inductor (one pass over the codes), where our kernel does not run."""
    rows, groups = scales.shape
    x_groups = x.reshape(-1, 1, groups, 2, GROUP_SIZE // 2).float()  # r, 1, groups, low/high, 16
    packed = codes.view(1, rows, groups, 1, GROUP_SIZE // 2)
    steps = torch.cat((packed & 0xF, packed >> 4), dim=3).float()  # 1, out, groups, low/high, 16
    weight = steps * scales.float()[None, :, :, None, None] + mins.float()[None, :, :, None, None]
    product = (weight * x_groups).sum((-1, -2, -3))  # r, out
    return product.reshape(*x.shape[:-1], rows).type_as(x)


def product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the int4 weight, transposed: [..., out] in x's dtype (after cpu_kernels.load_decoding_kernels())."""
    if x.dtype == torch.float32:  # decoding's case: no conversions to dispatch, 120 times a step
        return torch.ops.llama_tp.int4_product(x.contiguous(), codes, scales, mins)
    return torch.ops.llama_tp.int4_product(x.float().contiguous(), codes, scales, mins).to(x.dtype)


def weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The weight in fp32 [out, in], converted back by our kernel (after cpu_kernels.load_decoding_kernels())."""
    return torch.ops.llama_tp.int4_weight(codes, scales, mins)
