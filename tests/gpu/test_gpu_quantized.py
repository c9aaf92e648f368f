"""int8 and int4 on a GPU: torch's int4 packing is the layout tinygemm.dequantize reads (as the CPU
suite's transcription of its kernel has it), tinygemm's products are the dequantised weight's, and
quantized models give their CPU twins' logits. (test_gpu_model.py compiles decoding with them.)"""

import pytest
import torch

from llama_tp import Llama
from llama_tp.kernels import int4, tinygemm
from llama_tp.quantize import Int8Linear, TinygemmInt4Linear
from test_tinygemm import cuda_packing

CUDA = torch.device("cuda")


def build(folder, tokenizer_path, **options) -> Llama:
    return Llama.build(str(folder), tokenizer_path, max_seq_len=64, max_batch_size=3, **options)


@pytest.mark.parametrize("width", [256, 64, 96])  # inner k-tiles 8, 4 and 2
def test_torchs_int4_packing_is_the_layout_dequantize_reads(width):
    generator = torch.Generator().manual_seed(width)
    codes, scales, mins = (part.to(CUDA) for part in int4.quantize_int4(torch.randn(48, width, generator=generator)))
    packed, scales_and_zeros = tinygemm.pack(codes, scales, mins)
    tiles = tinygemm.inner_k_tiles(width)
    assert torch.equal(packed.cpu(), cuda_packing(tinygemm.paired(codes).cpu(), tiles))
    weight = tinygemm.dequantize(packed, scales_and_zeros, torch.bfloat16)
    ours = int4.dequantize(codes, scales, mins, torch.float32)
    assert (weight.float() - ours).abs().max() <= 2 ** -6 * ours.abs().max()  # bf16's rounding alone
    for rows in (1, 5, 33):
        x = torch.randn(rows, width, device=CUDA, dtype=torch.bfloat16)
        expected = x.float() @ weight.float().t()  # the kernel's own weights, summed in fp32
        got = tinygemm.product(x, packed, scales_and_zeros)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())


# How far quantized logits may be from unquantized ones, as a share of the largest: on the CPU in
# fp32, this model's int8 logits were within 1.1% of its own, its int4 ones within 15% (random
# weights round to 4 bits less well than trained ones); on the GPU bf16 adds its own.
FROM_UNQUANTIZED = {"int8": 0.05, "int4": 0.3}


def logits(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """A 72-row prompt (int4's weight converted back for cuBLAS, int8's too), a 3-row step
    (tinygemm) and a 1-row step (int8 read as it is stored), brought to the CPU in fp32."""
    device = model.output.weight.device
    steps = [model.forward(tokens[:, :24].to(device), 0), model.forward(tokens[:, 24:25].to(device), 24),
             model.forward(tokens[:1, 25:].to(device), 25)]
    return [step.float().cpu() for step in steps]


def assert_within(got: list[torch.Tensor], expected: list[torch.Tensor], share: float) -> None:
    for got_step, expected_step in zip(got, expected, strict=True):
        error, largest = (got_step - expected_step).abs().max().item(), expected_step.abs().max().item()
        assert error <= share * largest, (error, largest)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_logits_on_the_gpu(checkpoints, tokenizer_path, monkeypatch, quantize):
    """bf16 on the GPU: near the CPU's fp32 logits with the same quantized weights (bf16's rounding
    alone apart), and near the GPU's unquantized bf16 ones (the quantization's error too)."""
    tokens = torch.randint(0, 32000, (3, 26), generator=torch.Generator().manual_seed(0))
    folder = checkpoints["llama3", 1]
    on_gpu = build(folder, tokenizer_path, dtype="bf16", quantize=quantize, compile=False).model
    if quantize == "int4":
        assert isinstance(on_gpu.layers[0].attention.wqkv, TinygemmInt4Linear)
    assert isinstance(on_gpu.output, Int8Linear) and on_gpu.output.weight.is_cuda
    quantized = logits(on_gpu, tokens)
    assert_within(quantized, logits(build(folder, tokenizer_path, dtype="bf16", compile=False).model, tokens),
                  FROM_UNQUANTIZED[quantize])
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cpu")
    assert_within(quantized, logits(build(folder, tokenizer_path, dtype="fp32", quantize=quantize).model, tokens), 0.03)
