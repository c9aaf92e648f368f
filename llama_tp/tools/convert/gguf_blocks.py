"""GGUF's 4- and 8-bit blocks kept as they are: Q4_0 and Q4_1 tensors become int4 layers and Q8_0
ones int8 layers (checkpoint/quantized.py), codes and fp16 scales byte for byte, with nothing
dequantised and rounded again.

A GGUF row is blocks of 32 weights: Q4_1 is fp16 d, fp16 m and 16 bytes, w = code * d + m; Q4_0
is fp16 d and 16 bytes, w = (code - 8) * d, which is int4's code * d + (-8 d); Q8_0 is fp16 d and
32 int8 q, w = q * d, int8's grid with scale d and zero 0. Byte j of the 16 holds weight j in its
low four bits and weight j + 16 in its high four, as int4 stores them.
"""

import numpy as np
import torch

from ...checkpoint.quantized import QuantizedWeight
from ...kernels import int4

# The GGUF types each quantization keeps as they are.
KEPT_TYPES = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}
BLOCK = 32  # weights per block, int4's group and int8's for widths that are multiples of 32


def kept(type_name: str, kind: str) -> bool:
    """Whether a tensor of this GGUF type comes into a `kind` layer as it is."""
    return type_name in KEPT_TYPES.get(kind, ())


def quantized_weight(tensor) -> QuantizedWeight:
    """A Q4_0, Q4_1 or Q8_0 GGUF tensor as the int4 or int8 layer that holds exactly its weights."""
    width, rows = (int(n) for n in tensor.shape)  # GGUF lists dimensions fastest first
    blocks = np.asarray(tensor.data).reshape(rows, width // BLOCK, -1)  # rows, groups, bytes of a block
    kind = tensor.tensor_type.name
    scales = _fp16(blocks, 0)  # rows, groups
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, width)
        tensors = {"weight": q, "scales": scales.astype(np.float32), "zeros": np.zeros(scales.shape, np.float32)}
        return QuantizedWeight("int8", _torch(tensors), (rows, width))
    if kind == "Q4_1":
        mins, codes = _fp16(blocks, 2), blocks[..., 4:]
    else:  # Q4_0: -8 d is exact in fp16
        mins, codes = scales * np.float16(int4.SYMMETRIC_STEPS), blocks[..., 2:]
    tensors = {"weight": np.ascontiguousarray(codes).reshape(rows, width // 2), "scales": scales, "mins": mins}
    return QuantizedWeight("int4", _torch(tensors), (rows, width))


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block: [rows, groups]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]


def _torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
