"""Packed linear weights: the loader packs them on CPU, and their products are F.linear's."""

import pytest
import torch
import torch.nn.functional as F

from llama_tp import Llama, matmul
from llama_tp.model import LINEAR_LAYERS

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (3, 5), (512,)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
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
def test_compiled_product_is_the_plain_product(rows, packed, mkl_max_rows, monkeypatch):
    """Compiled: one row by a plain weight summed by the compiler (or MKL's, on Intel), else oneDNN's product."""
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", mkl_max_rows)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=generator)
    x = torch.randn(*rows, 40, generator=generator)
    torch._dynamo.reset()
    compiled = torch.compile(matmul.linear, dynamic=True)
    got = compiled(x, matmul.pack(weight) if packed else weight, packed)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_packing_pays_eagerly_and_for_large_compiled_batches(monkeypatch):
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", 0)
    assert matmul.packing_pays(1, compiled=False) and matmul.packing_pays(64, compiled=False)
    assert not matmul.packing_pays(matmul.SUMMED_MAX_ROWS, compiled=True)
    assert matmul.packing_pays(matmul.SUMMED_MAX_ROWS + 1, compiled=True)


def test_few_row_jobs_keep_plain_weights_where_mkl_multiplies_few_rows_fastest(monkeypatch):
    monkeypatch.setattr(matmul, "MKL_MAX_ROWS", 3)
    assert not matmul.packing_pays(1, compiled=False) and not matmul.packing_pays(1, compiled=True)
    assert not matmul.packing_pays(3, compiled=False) and not matmul.packing_pays(3, compiled=True)
    assert matmul.packing_pays(4, compiled=False) and matmul.packing_pays(8, compiled=True)


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (4, 1), (512,)])
@pytest.mark.parametrize("mkl_max_rows", [0, 3])
def test_eager_product_by_a_plain_weight_is_the_plain_product(rows, mkl_max_rows, monkeypatch):
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
    for dtype in (torch.float32, torch.bfloat16):
        assert matmul.packable(cpu, dtype) == torch.backends.mkldnn.is_available()
    assert not matmul.packable(cpu, torch.float16)
    assert not matmul.packable(torch.device("meta"), torch.float32)


@needs_onednn
def test_loader_packs_every_linear_layer_and_nothing_else(checkpoints, tokenizer_path):
    llama = Llama.build(str(checkpoints["llama3", 2]), tokenizer_path, max_seq_len=16, max_batch_size=4)
    for name, tensor in llama.model.state_dict().items():
        assert tensor.is_mkldnn == (name.split(".")[-2] in LINEAR_LAYERS), name
    for name, module in llama.model.named_modules():
        assert getattr(module, "weight_packed", False) == (name.split(".")[-1] in LINEAR_LAYERS), name


@needs_onednn
def test_packed_weights_are_the_checkpoint_tensors_stacked_and_converted(checkpoints, tokenizer_path):
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
