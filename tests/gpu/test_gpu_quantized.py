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


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_logits_on_the_gpu_are_the_cpus(checkpoints, tokenizer_path, monkeypatch, quantize):
    """bf16 on the GPU against fp32 on the CPU, the same quantized weights: a 72-row prompt (int4's
    weight converted back for cuBLAS, int8's too), a 3-row step (tinygemm) and a 1-row step (int8
    read as it is stored)."""
    tokens = torch.randint(0, 32000, (3, 26), generator=torch.Generator().manual_seed(0))
    on_gpu = build(checkpoints["llama3", 1], tokenizer_path, dtype="bf16", quantize=quantize, compile=False).model
    if quantize == "int4":
        assert isinstance(on_gpu.layers[0].attention.wqkv, TinygemmInt4Linear)
    assert isinstance(on_gpu.output, Int8Linear) and on_gpu.output.weight.is_cuda
    gpu_logits = [on_gpu.forward(tokens[:, :24].to(CUDA), 0), on_gpu.forward(tokens[:, 24:25].to(CUDA), 24),
                  on_gpu.forward(tokens[:1, 25:].to(CUDA), 25)]
    monkeypatch.setenv("LLAMA_TP_DEVICE", "cpu")
    on_cpu = build(checkpoints["llama3", 1], tokenizer_path, dtype="fp32", quantize=quantize).model
    cpu_logits = [on_cpu.forward(tokens[:, :24], 0), on_cpu.forward(tokens[:, 24:25], 24),
                  on_cpu.forward(tokens[:1, 25:], 25)]
    for got, expected in zip(gpu_logits, cpu_logits, strict=True):
        error, largest = (got.float().cpu() - expected).abs().max().item(), expected.abs().max().item()
        assert error <= 0.03 * largest, (error, largest)

