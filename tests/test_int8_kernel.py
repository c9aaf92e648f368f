"""The C++ int8 kernel: its products equal the grouped int8 weight's exact product, for every row
count, partial block and group width; its layout converts back to the same weight; and an int8
layer gives the same outputs through it, eager and compiled, as through torch.compile's kernel."""

import pytest
import torch

from llama_tp.kernels import cpu_kernels, int8
from llama_tp.kernels.int8 import dequantize, quantize_int8
from llama_tp.model.quantize import Int8Linear

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="the kernel needs AVX-512 or AVX2")


def _weight(rows: int, width: int, seed: int):
    return quantize_int8(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))


# 40 outputs: two full blocks and a partial one; 30 inputs: groups of 2, narrower than the
# kernel's 4 partial sums; 48: groups of 16.
@pytest.mark.parametrize("out_features, width", [(40, 96), (16, 48), (7, 30), (96, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_product_equals_the_exact_product_of_the_grouped_weight(out_features, width, rows):
    q, scales, zeros = _weight(out_features, width, seed=rows)
    cpu_kernels.load_decoding_kernels()
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(100 + rows))
    expected = x.double() @ dequantize(q, scales, zeros, torch.float64).t()
    got = int8.product(x, *int8.blocks(q, scales, zeros), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6 * width)  # fp32 sums of `width` terms


def test_blocks_convert_back_to_the_same_weight():
    q, scales, zeros = _weight(40, 96, seed=0)
    blocked = int8.blocks(q, scales, zeros)
    assert blocked[0].shape == (3, 96, 16) and blocked[1].shape == (3, 3, 16)
    assert torch.equal(int8.dequantize_blocks(*blocked, 40, torch.float32), dequantize(q, scales, zeros, torch.float32))


@pytest.mark.parametrize("rows", [1, 8, int8.MAX_ROWS + 1])  # the last converts the weight back
@pytest.mark.parametrize("compiled", [False, True])
def test_int8_layer_gives_the_same_outputs_through_the_kernel(rows, compiled):
    q, scales, zeros = _weight(40, 96, seed=1)
    plain = Int8Linear(q, scales, zeros, communicate=lambda y: y)
    kernel = Int8Linear(q, scales, zeros, communicate=lambda y: y)
    kernel.use_kernel()
    assert kernel.blocked and kernel.weight.shape == (3, 96, 16)
    x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()
    forward = torch.compile(kernel, fullgraph=True, dynamic=False) if compiled else kernel
    got = forward(x)
    assert got.shape == (rows, 1, 40)
    torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)

