"""The linear layers' products: our fp32 kernel's, MKL's and oneDNN's on packed weights are all
F.linear's, and the loader packs weights only where that pays."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels, matmul
from llama_tp.model.quantize import LINEAR_LAYERS

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
needs_kernel = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                  reason="our kernel needs AVX-512 or AVX2")


@pytest.fixture
def without_our_kernel(monkeypatch):
    """Products and packing as on CPUs where our fp32 kernel does not run."""
    monkeypatch.setattr(matmul, "FLOAT_KERNEL", False)


# 37 inputs: two AVX-512 registers (four AVX2 ones) and a tail of 5; 7 outputs: with AVX-512 a
# group of 4, then 2, then 1 (for one row, one at a time), with AVX2 a block of 4, then 3 one at a
# time. Past KERNEL_MAX_ROWS rows are a prompt's, beside our kernel: MKL's product on Intel CPUs,
# oneDNN's on the plain weight elsewhere.
PROMPT_ROWS = matmul.KERNEL_MAX_ROWS + 8


@needs_kernel
@pytest.mark.parametrize("rows, intel", [((1, 1), False), ((2, 1), False), ((3, 1), False), ((8, 1), False),
                                         ((3, 3), False), ((16, 1), False), ((17, 1), False), ((33, 1), False),
                                         ((PROMPT_ROWS, 1), False), ((PROMPT_ROWS, 1), True)])
@pytest.mark.parametrize("compiled", [False, True])
def test_our_kernel_product_is_the_plain_product(rows, intel, compiled, monkeypatch):
    monkeypatch.setattr(matmul, "FLOAT_KERNEL", True)
    monkeypatch.setattr(matmul, "_INTEL", intel)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(7, 37, generator=generator)
    x = torch.randn(*rows, 37, generator=generator)
    cpu_kernels.load_decoding_kernels()
    torch._dynamo.reset()
    linear = torch.compile(matmul.linear, dynamic=True, fullgraph=True) if compiled else matmul.linear
    got = linear(x, weight)
    assert got.shape == (*rows, 7)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().t(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_transposed_weight_view_is_multiplied_too(monkeypatch):
    monkeypatch.setattr(matmul, "FLOAT_KERNEL", True)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 7, generator=generator).t()  # 7 x 37, not contiguous
    x = torch.randn(2, 37, generator=generator)
    torch.testing.assert_close(matmul.linear(x, weight), x @ weight.t())


@needs_kernel
@pytest.mark.parametrize("width", [576, 37])
def test_our_kernel_sums_each_output_alike_whatever_the_rows_and_threads(width):
    """Each output is one thread's sum in a fixed order: a row's result does not depend on the
    rows beside it or on how the outputs are split between threads."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(102, width, generator=generator)
    x = torch.randn(9, width, generator=generator)
    alone = torch.cat([cpu_kernels.float_product(row[None], weight) for row in x])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = cpu_kernels.float_product(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_kernels.float_product(x, weight), alone) and torch.equal(one_thread, alone)


def test_our_kernels_are_left_out_when_the_environment_says_so():
    script = "from llama_tp.kernels import cpu_kernels, matmul; import torch; print(matmul.FLOAT_KERNEL, cpu_kernels.runs_on(torch.device('cpu')))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "LLAMA_TP_CPU_KERNELS": "0"})
    assert result.stdout.split() == ["False", "False"]


def test_a_failed_build_names_the_way_out(monkeypatch):
    from torch.utils import cpp_extension

    def broken(**options):
        raise RuntimeError("Error building extension 'llama_tp_cpu_kernels'")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="building llama_tp's CPU kernels failed.*LLAMA_TP_CPU_KERNELS=0"):
        cpu_kernels.load.__wrapped__()  # past the cache of the build that worked


def test_our_kernel_keeps_fp32_weights_plain_and_leaves_bf16_to_packing(monkeypatch):
    monkeypatch.setattr(matmul, "FLOAT_KERNEL", True)
    assert not any(matmul.packing_pays(rows, compiled, torch.float32) for rows in (1, 8, 64) for compiled in (False, True))
    bf16_packs = matmul.packable(torch.device("cpu"), torch.bfloat16)
    assert matmul.packing_pays(8, False, torch.bfloat16) == (bf16_packs and matmul.MKL_MAX_ROWS < 8)


@needs_onednn
@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (3, 5), (512,)])
@pytest.mark.parametrize("dtype, tolerance", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN's bf16 products need AVX-512 here")),
])
def test_packed_product_is_the_plain_product(rows, dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=generator).to(dtype)
    x = torch.randn(*rows, 40, generator=generator).to(dtype)
    packed = matmul.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    got = matmul.linear(x, packed)
    assert got.shape == (*rows, 96) and got.dtype == dtype
    torch.testing.assert_close(got, F.linear(x, weight), atol=tolerance, rtol=tolerance)
    assert torch.equal(packed.to_dense(), weight)


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (2, 2), (5, 1), (2, 8)])
@pytest.mark.parametrize("packed", [False, True] if torch.backends.mkldnn.is_available() else [False])
@pytest.mark.parametrize("mkl_max_rows", [0, 3])
def test_compiled_product_is_the_plain_product(rows, packed, mkl_max_rows, monkeypatch, without_our_kernel):
    """Compiled: one row by a plain weight summed by the compiler (or MKL's, on Intel), else oneDNN's product."""
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", mkl_max_rows)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=generator)
    x = torch.randn(*rows, 40, generator=generator)
    torch._dynamo.reset()
    compiled = torch.compile(matmul.linear, dynamic=True)
    got = compiled(x, matmul.pack(weight) if packed else weight, packed)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_packing_pays_eagerly_and_for_large_compiled_batches(monkeypatch, without_our_kernel):
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", 0)
    fp32 = torch.float32
    assert matmul.packing_pays(1, False, fp32) and matmul.packing_pays(64, False, fp32)
    assert not matmul.packing_pays(matmul.SUMMED_MAX_ROWS, True, fp32)
    assert matmul.packing_pays(matmul.SUMMED_MAX_ROWS + 1, True, fp32)


def test_few_row_jobs_keep_plain_weights_where_mkl_multiplies_few_rows_fastest(monkeypatch, without_our_kernel):
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", 3)
    fp32 = torch.float32
    assert not matmul.packing_pays(1, False, fp32) and not matmul.packing_pays(1, True, fp32)
    assert not matmul.packing_pays(3, False, fp32) and not matmul.packing_pays(3, True, fp32)
    assert matmul.packing_pays(4, False, fp32) and matmul.packing_pays(8, True, fp32)


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (4, 1), (512,)])
@pytest.mark.parametrize("mkl_max_rows", [0, 3])
def test_eager_product_by_a_plain_weight_is_the_plain_product(rows, mkl_max_rows, monkeypatch, without_our_kernel):
    """MKL's for up to 3 rows on Intel, oneDNN's otherwise where oneDNN is built in: the same product."""
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", mkl_max_rows)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=generator)
    x = torch.randn(*rows, 40, generator=generator)
    torch.testing.assert_close(matmul.linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)



@needs_onednn
def test_batch_1_compiled_keeps_plain_weights(checkpoints, tokenizer_path):
    torch._dynamo.reset()
    llama = Llama.build(str(checkpoints["llama3", 1]), tokenizer_path, max_seq_len=16, max_batch_size=1,
                        compile=True)
    assert not any(tensor.is_mkldnn for tensor in llama.model.state_dict().values())
    assert not any(getattr(module, "weight_packed", False) for module in llama.model.modules())


def test_only_cpu_fp32_and_bf16_weights_are_packed():
    cpu = torch.device("cpu")
    assert matmul.packable(cpu, torch.float32) == torch.backends.mkldnn.is_available()
    assert matmul.packable(cpu, torch.bfloat16) == (torch.backends.mkldnn.is_available()
                                                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not matmul.packable(cpu, torch.float16)
    assert not matmul.packable(torch.device("meta"), torch.float32)


@needs_onednn
def test_loader_packs_every_linear_layer_and_nothing_else(checkpoints, tokenizer_path, without_our_kernel):
    llama = Llama.build(str(checkpoints["llama3", 2]), tokenizer_path, max_seq_len=16, max_batch_size=4)
    for name, tensor in llama.model.state_dict().items():
        assert tensor.is_mkldnn == (name.split(".")[-2] in LINEAR_LAYERS), name
    for name, module in llama.model.named_modules():
        assert getattr(module, "weight_packed", False) == (name.split(".")[-1] in LINEAR_LAYERS), name


@needs_onednn
def test_packed_weights_are_the_checkpoint_tensors_stacked_and_converted(checkpoints, tokenizer_path,
                                                                        without_our_kernel):
    """wq/wk/wv and w1/w3 stacked in one reused buffer per loading thread, bf16 turned into the
    model's dtype, then packed: every packed weight must still be exactly its checkpoint parts."""
    folder = checkpoints["llama3", 1]
    llama = Llama.build(str(folder), tokenizer_path, max_seq_len=16, max_batch_size=4)
    shard = torch.load(folder / "consolidated.00.pth", weights_only=True)
    state = llama.model.state_dict()
    packed = [name for name in state if state[name].is_mkldnn]
    assert packed
    for name in packed:
        parts = [shard[part] for part, _ in llama.model.checkpoint_layout()[name]]
        dense = state[name].to_dense()
        assert torch.equal(dense, torch.cat(parts).to(dense.dtype)), name


@needs_onednn
def test_quantized_layers_are_not_packed(checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, max_seq_len=16, max_batch_size=1,
                        quantize="int8")
    assert not any(tensor.is_mkldnn for tensor in llama.model.state_dict().values())
