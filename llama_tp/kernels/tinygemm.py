"""int4 on GPUs: torch's tinygemm kernel (torch.ops.aten._weight_int4pack_mm, as gpt-fast and
torchao use it) on our int4 weights (kernels/int4.py), converted once when the model loads.

Ours is GGUF's arithmetic, w = code * scale + min, codes 0..15 in groups of 32 inputs with fp16
scales and mins. Tinygemm's is w = (code - 8) * scale + zero with bf16 scales and zeros, so the
same codes and groups carry over with zero = min + 8 * scale (a Q4_0 block's zero is 0). The
weights then differ from ours by bf16's rounding alone: of scale and zero, and of each weight,
which the GPU kernel makes with one bf16 multiply-add before its tensor cores multiply (summing
in fp32).

The packed weight: torch's `_convert_weight_to_int4pack` takes codes in input order, two a byte
(the even input in the high four bits), and lays them out for the kernel's m16n8k16 tiles as
int32 [out / 8, in / (16 * inner_k_tiles), 32, inner_k_tiles / 2], the same 0.5 bytes a weight;
scales and zeros go in one bf16 tensor [in / 32, out, 2], the same 0.125.

Products of up to MAX_ROWS rows run tinygemm. Tinygemm multiplies 16 rows by 8 outputs a tile,
reading those rows again for every 8 outputs, so more rows (prompts) convert the weight back
(`dequantize`, compiled: one pass) and multiply it through cuBLAS.

On CPUs, torch's twins of both operators (`_convert_weight_to_int4pack_for_cpu`,
`_weight_int4pack_mm_for_cpu`) take the same scales and zeros in a packing of their own: the tests
multiply through them to check this conversion without a GPU. They are no CPU path: our kernel is
150 times faster (docs/int4.md).
"""

import torch

from . import int4

# Tinygemm takes groups of 32, 64, 128 or 256 inputs: ours are 32.
GROUP_SIZE = int4.GROUP_SIZE
# Tinygemm's codes count from -8: w = (code - 8) * scale + zero.
CODE_OFFSET = 8
# Outputs per tile of the packed weight: a layer's output count must be a multiple.
TILE_OUTPUTS = 8
# Inputs per k-tile of the kernel's m16n8k16 products.
TILE_INPUTS = 16

# Products of up to this many rows go to tinygemm; more convert the weight back for cuBLAS.
# Estimated from torchao's timings of tinygemm on an A6000 (its HQQ README: 4096 x 4096, 16 rows
# 0.038 ms, 32 0.065, 128 0.25: the weight and the rows read again for every 16 rows) against
# converting the weight back (2 bytes a weight written and read again); not measured here yet:
# tools/bench_products.py times both on a GPU.
MAX_ROWS = 32


def inner_k_tiles(width: int) -> int:
    """The k-tiles the kernel loads at once (8, 4 or 2: 16-, 8- or 4-byte loads) for a layer of
    `width` inputs: the most that divide it. Every int4 width (whole groups of 32) takes 2."""
    return next(tiles for tiles in (8, 4, 2) if width % (TILE_INPUTS * tiles) == 0)


def scales_and_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Our fp16 scales and mins [out, groups] as tinygemm's bf16 scales and zeros [groups, out, 2]."""
    scale = scales.float()
    zero = mins.float() + CODE_OFFSET * scale  # in fp32, then rounded to bf16 once
    return torch.stack((scale, zero), dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


def pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 weight (codes uint8 [out, in / 2] in GGUF's order, fp16 scales and mins [out, in /
    32]) as tinygemm's packed weight and scales_and_zeros, on the codes' device."""
    rows, width = codes.shape[0], 2 * codes.shape[1]
    if rows % TILE_OUTPUTS:
        raise ValueError(f"torch's int4 GPU kernel takes layers of a multiple of {TILE_OUTPUTS} outputs, not "
                         f"{rows}; load this model with quantize='int8' or unquantized")
    tiles = inner_k_tiles(width)
    if codes.is_cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack(paired(codes), tiles)
    else:  # the CPU twin, for the tests
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4.unpack(codes).int(), tiles)
    return packed, scales_and_zeros(scales, mins)


def paired(codes: torch.Tensor) -> torch.Tensor:
    """Our codes (uint8 [out, in / 2] in GGUF's order) as the CUDA packing takes them: in input
    order, two a byte, the even input in the high four bits."""
    ordered = int4.unpack(codes)  # out, in
    return (ordered[:, ::2] << 4) | ordered[:, 1::2]


def product(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the packed weight, transposed: [..., out] in x's dtype. The kernel takes
    and returns bf16 rows."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    multiply = torch.ops.aten._weight_int4pack_mm if packed.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    y = multiply(rows, packed, GROUP_SIZE, scales_and_zeros)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in dtype that a weight packed for CUDA stands for, each weight as the
    kernel makes it: (code - 8) * scale + zero, rounded to bf16 once. Written for inductor (one pass).

    The layout, read from the packing kernel (matrix_to_m16n8k16_Bint4_layout in torch's
    int4mm.cu): lane t = 4a + b of tile [n, k] holds, for the outputs n * 8 + a, the eight codes
    of inputs 32 c + 8 i + 2 b + h in its four bits number 4 h + i, where c = k * (inner_k_tiles
    / 2) + j counts 32-input chunks: the B operand of two m16n8k16 products."""
    n_tiles, k_tiles, lanes, pairs = packed.shape  # pairs of k-tiles: inner_k_tiles / 2
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # an int32's eight codes
    nibbles = (packed[..., None] >> shifts) & 0xF
    nibbles = nibbles.view(n_tiles, k_tiles, TILE_OUTPUTS, lanes // TILE_OUTPUTS, pairs, 2, 4)  # n, k, a, b, j, h, i
    codes = nibbles.permute(0, 2, 1, 4, 6, 3, 5).reshape(n_tiles * TILE_OUTPUTS, -1)  # out, in: (n, a), (k, j, i, b, h)
    rows, width = codes.shape
    groups = codes.view(rows, width // GROUP_SIZE, GROUP_SIZE).float() - CODE_OFFSET
    scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # out, groups each
    weight = (groups * scale[..., None] + zero[..., None]).to(torch.bfloat16)
    return weight.view(rows, width).to(dtype)
