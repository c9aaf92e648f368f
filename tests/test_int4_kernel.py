"""int4 weights: our rounding keeps GGUF's Q4_0 and Q4_1 blocks to their codes, the C++ kernel's
products equal the converted-back weight's for every row count up to its limit, and an int4
layer gives the same outputs through the kernel (eager, compiled, prompts) as through torch;
int4 and int8 layers give bf16 activations back in bf16."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from llama_tp.kernels import cpu_kernels, int4, int8
from llama_tp.model.quantize import Int4Linear, Int8Linear

needs_kernel = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                  reason="the kernel needs AVX-512 or AVX2")


def _weight(rows: int, width: int, seed: int):
    return int4.quantize_int4(torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
def test_quantize_int4_rounds_gguf_blocks_back_to_their_own_bytes(kind):
    """Weights dequantised from GGUF's 4-bit blocks (gguf's own quantizer and dequantiser) round
    back to the blocks' fp16 scales, minimums and code bytes, byte for byte."""
    values = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 0.05
    blocks = gguf_quantize(values, kind).reshape(8, 8, -1)  # rows, groups, block bytes
    codes, scales, mins = int4.quantize_int4(torch.from_numpy(gguf_dequantize(blocks.reshape(8, -1), kind)))
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    assert torch.equal(scales, d)
    if kind == Q.Q4_1:
        assert torch.equal(mins, torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]))
    else:
        assert torch.equal(mins, d * -8)
    assert torch.equal(codes, torch.from_numpy(blocks[..., -16:].copy()).view(8, 128))


def test_quantize_int4_takes_the_closer_grid_within_half_a_step():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 96, generator=generator) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)
    codes, scales, mins = int4.quantize_int4(weight)
    assert codes.shape == (6, 48) and codes.dtype == torch.uint8
    assert scales.shape == mins.shape == (6, 3) and scales.dtype == mins.dtype == torch.float16
    error = (int4.dequantize(codes, scales, mins, torch.float32) - weight).abs().reshape(6, 3, 32).amax(dim=-1)
    groups = weight.reshape(6, 3, 32)
    span_step = (groups.amax(dim=-1) - groups.amin(dim=-1)) / 15
    assert (error <= span_step / 2 * 1.01).all()  # no worse than Q4_1's grid (fp16 rounding aside)
    assert torch.equal(int4.unpack(int4.pack(int4.unpack(codes))), int4.unpack(codes))
    assert torch.equal(int4.dequantize(*int4.quantize_int4(torch.zeros(2, 64)), torch.float32), torch.zeros(2, 64))


def test_quantize_int4_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="width is a multiple of 32 inputs, not 48; use int8"):
        int4.quantize_int4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="magnitude 1e\\+06 does not fit int4's fp16 scales"):
        int4.quantize_int4(torch.full((2, 32), 1e6))


@needs_kernel
# 1, 7 and 17 outputs: odd counts; 2080 inputs: 65 groups, past the kernel's chunks of 64.
@pytest.mark.parametrize("out_features, width", [(1, 32), (7, 96), (17, 576), (40, 2080)])
def test_product_equals_the_converted_back_weights_product_for_every_row_count_it_takes(out_features, width):
    codes, scales, mins = _weight(out_features, width, seed=width)
    cpu_kernels.load_decoding_kernels()
    x = torch.randn(int4.MAX_ROWS, width, generator=torch.Generator().manual_seed(3))
    weight = int4.dequantize(codes, scales, mins, torch.float64)
    for rows in range(1, int4.MAX_ROWS + 1):
        got = int4.product(x[:rows], codes, scales, mins)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        # fp32 sums of `width` terms, in another order than float64's
        torch.testing.assert_close(got.double(), x[:rows].double() @ weight.t(), rtol=1e-5, atol=2e-6 * width ** 0.5)


@pytest.mark.skipif(not cpu_kernels.ON_THIS_CPU, reason="the AVX-512 kernel's sums are fixed; the AVX2 one splits 1-2 rows' sums")
def test_avx512_product_of_a_row_is_the_same_alone_and_among_many_rows_and_threads():
    """The direct passes (up to 4 rows) and those through the buffer (more rows) sum each output
    in the same order: a row's result does not depend on the rows beside it or on the threads."""
    codes, scales, mins = _weight(70, 1600, seed=5)  # 50 groups: chunks of 24 and a last of 2
    cpu_kernels.load_decoding_kernels()
    x = torch.randn(int4.MAX_ROWS, 1600, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([int4.product(row[None], codes, scales, mins) for row in x])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = int4.product(x, codes, scales, mins)
    finally:
        torch.set_num_threads(threads)
    for rows in (3, 4, 5, 7, 32, 33, int4.MAX_ROWS):
        assert torch.equal(int4.product(x[:rows], codes, scales, mins), alone[:rows]), rows
    assert torch.equal(one_thread, alone)


@needs_kernel
def test_kernel_converts_back_exactly_the_weight_torch_does():
    codes, scales, mins = _weight(33, 2080, seed=4)
    cpu_kernels.load_decoding_kernels()
    assert torch.equal(int4.weight(codes, scales, mins), int4.dequantize(codes, scales, mins, torch.float32))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, int4.MAX_ROWS + 1])  # the last converts the weight back (a prompt)
@pytest.mark.parametrize("compiled", [False, True])
def test_int4_layer_gives_the_same_outputs_through_the_kernel(rows, compiled):
    codes, scales, mins = _weight(40, 96, seed=5)
    plain = Int4Linear(codes, scales, mins, communicate=lambda y: y)
    kernel = Int4Linear(codes, scales, mins, communicate=lambda y: y)
    kernel.use_kernel()
    x = torch.randn(rows, 1, 96, generator=torch.Generator().manual_seed(6))
    forward = torch.compile(kernel, fullgraph=True, dynamic=False) if compiled else kernel
    got = forward(x)
    assert got.shape == (rows, 1, 40)
    torch.testing.assert_close(got, plain(x), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("layer, grid, dequantize", [(Int4Linear, int4.quantize_int4, int4.dequantize),
                                                     (Int8Linear, int8.quantize_int8, int8.dequantize)],
                         ids=["int4", "int8"])
def test_bf16_activations_come_back_in_bf16(layer, grid, dequantize):
    weight = grid(torch.randn(16, 64, generator=torch.Generator().manual_seed(7)))
    quantized = layer(*weight, communicate=lambda y: y)
    quantized.use_kernel()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    got = quantized(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), x.double() @ dequantize(*weight, torch.float64).t(), rtol=2e-2, atol=2e-2)
