"""Grouped int8 products on CPUs with AVX-512, by our C++ kernel (cpu_kernels.py: int8_product).

torch.compile's code for the same product (quantize.grouped_product) converts the weight back
with one chain of additions per output. In a decode step of the demo model on this project's
2-core Intel Xeon machine, it read 8-11 G weights per second; the kernel, which widens 16
outputs' weights per load into 4 independent sums and asks for the weight 8 KB ahead, reads
15-20 G per second (int8 decoding at batch 1: 32 -> 56 tokens per second). Its layout, blocks of
16 output channels stored input-major, is made once at load (`blocks`).
"""

import torch

LANES = 16  # output channels per block: one AVX-512 register of fp32

# Products of up to this many rows go to the kernel (at 128 rows both ways take as long); more
# (prompts) convert the weight back and multiply it through oneDNN.
MAX_ROWS = 64


def blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int8's q [out, in], scales and zeros [out, groups] in the kernel's layout: q
    [blocks, in, LANES], scales and zeros [blocks, groups, LANES], the last block padded with zeros."""
    padding = -q.shape[0] % LANES

    def blocked(tensor: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(tensor, (0, 0, 0, padding))
        return padded.view(-1, LANES, tensor.shape[1]).transpose(1, 2).contiguous()  # blocks, columns, LANES

    return blocked(q), blocked(scales), blocked(zeros)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, out_features: int,
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
    (after cpu_kernels.load())."""
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # rows, in
    y = torch.ops.llama_tp.int8_product(rows, q, scales, zeros, out_features)
    return y.view(*x.shape[:-1], out_features).to(x.dtype)

