"""int4 for GPUs through torch's tinygemm kernel (kernels/tinygemm.py), checked without a GPU: torch's
CPU twins of the kernel, which read scales and zeros as the GPU's does, multiply GGUF's Q4_0 and
Q4_1 blocks and a converted GGUF model as our own dequantisation does; the weight converted back
from the CUDA packing (prompts) is read in the layout of torch's packing kernel, transcribed here
from its source; GPUs without the kernel are refused by name."""

import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from llama_tp import Llama
from llama_tp.kernels import int4, tinygemm
from llama_tp.parallel import check_int4_device
from llama_tp.quantize import Int4Linear, Int8Linear, TinygemmInt4Linear, use_tinygemm
from llama_tp.tools.convert.gguf_blocks import quantized_weight
from test_int4_checkpoint import gguf_models  # noqa: F401  (a fixture: a tiny GGUF model in Q4_0 and Q4_1, converted)
from test_int4_checkpoint import gguf_tensor


def gguf_blocks(tmp_path, kind: Q, rows: int, width: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A weight in GGUF's blocks of `kind` read as our int4 (codes, scales, mins), with gguf's own
    fp32 dequantisation of it."""
    tensor = gguf_tensor(tmp_path / "t.gguf", rows, width, kind)
    weight = quantized_weight(tensor)
    dequantised = torch.from_numpy(gguf_dequantize(tensor.data, kind))
    return tuple(weight.tensors[part] for part in ("weight", "scales", "mins")), dequantised


def bf16_rounding_bound(x: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """How far a product by tinygemm's weights may be from one by ours, for each output of x: its
    scale and zero rounded to bf16 (each within 2^-9 of itself), and the bf16 result."""
    scale = scales.float().repeat_interleave(int4.GROUP_SIZE, dim=1)  # out, in
    zero = (mins.float() + 8 * scales.float()).repeat_interleave(int4.GROUP_SIZE, dim=1)
    worst = 8 * scale.abs() + zero.abs()  # |code - 8| <= 8
    return 2 ** -8 * (x.abs().double() @ worst.double().t())


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_gguf_blocks_multiply_through_tinygemm_as_dequantised(tmp_path, kind, rows):
    (codes, scales, mins), dequantised = gguf_blocks(tmp_path, kind, 48, 256)
    packed, scales_and_zeros = tinygemm.pack(codes, scales, mins)
    assert scales_and_zeros.shape == (8, 48, 2) and scales_and_zeros.dtype == torch.bfloat16
    if kind == Q.Q4_0:  # min = -8 d: tinygemm's zero is 0
        assert scales_and_zeros[..., 1].abs().max() == 0
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = tinygemm.product(x, packed, scales_and_zeros)
    assert got.shape == (rows, 48) and got.dtype == torch.bfloat16
    expected = x.double() @ dequantised.double().t()
    error = (got.double() - expected).abs()
    assert (error <= bf16_rounding_bound(x, scales, mins) + 2 ** -8 * expected.abs()).all()


def test_grids_exact_in_bf16_give_exact_products():
    """Scales that are powers of two and mins whole steps from zero are exact in bf16, so only the
    result's rounding remains: a code read from the wrong input or group could not hide."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 128), generator=generator, dtype=torch.uint8)
    scales = (2.0 ** -torch.randint(2, 8, (32, 4), generator=generator)).half()
    mins = (-torch.randint(0, 16, (32, 4), generator=generator) * scales.float()).half()  # Q4_1 and Q4_0 (-8) alike
    packed = int4.pack(codes)
    x = torch.randint(-2, 3, (3, 128), generator=generator).to(torch.bfloat16)
    expected = x.double() @ int4.dequantize(packed, scales, mins, torch.float64).t()
    got = tinygemm.product(x, *tinygemm.pack(packed, scales, mins))
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=0)


def cuda_packing(paired: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """What torch's _convert_weight_to_int4pack does on a GPU, transcribed loop for loop from its
    kernel (matrix_to_m16n8k16_Bint4_layout in aten/src/ATen/native/cuda/int4mm.cu): paired
    uint8 [n, k / 2] -> int32 [n / 8, k / (16 inner_k_tiles), 32, inner_k_tiles / 2]."""
    source = paired.numpy().astype(np.int64)
    n, half_k = source.shape
    out = np.zeros((n // 8, 2 * half_k // (16 * inner_k_tiles), 32, inner_k_tiles // 2), dtype=np.int64)
    for n_tile in range(out.shape[0]):
        for k_outer in range(out.shape[1]):
            for t in range(32):
                for inner in range(0, inner_k_tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    k_base0 = (k_outer * inner_k_tiles + inner) * 16 // 2
                    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4, k_base0 + 8 + t % 4, k_base0 + 8 + t % 4 + 4]
                    v = [source[n0, k] for k in ks]
                    out[n_tile, k_outer, t, inner // 2] = (
                        (v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 | (v[0] & 0xF) << 16
                        | (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32))


@pytest.mark.parametrize("width, tiles", [(256, 8), (64, 4), (96, 2)])
@pytest.mark.parametrize("compiled", [False, True])
def test_dequantize_reads_the_cuda_packing(width, tiles, compiled):
    generator = torch.Generator().manual_seed(width)
    codes, scales, mins = int4.quantize_int4(torch.randn(24, width, generator=generator))
    assert tinygemm.inner_k_tiles(width) == tiles
    packed = cuda_packing(tinygemm.paired(codes), tiles)
    scales_and_zeros = tinygemm.scales_and_zeros(scales, mins)
    dequantize = torch.compile(tinygemm.dequantize, fullgraph=True, dynamic=False) if compiled else tinygemm.dequantize
    got = dequantize(packed, scales_and_zeros, torch.bfloat16).float()  # the dtype that prompts on GPUs ask
    # As the kernel makes each weight: (code - 8) * scale + zero, in bf16.
    scale, zero = (part.float().t().repeat_interleave(int4.GROUP_SIZE, dim=1) for part in scales_and_zeros.unbind(-1))
    expected = ((int4.unpack(codes).float() - 8) * scale + zero).to(torch.bfloat16).float()
    assert torch.equal(got, expected)
    ours = int4.dequantize(codes, scales, mins, torch.float32)  # within bf16's rounding of ours
    assert ((got - ours).abs() <= 2 ** -7 * (8 * scale.abs() + zero.abs())).all()


def test_tinygemm_layers_give_a_converted_gguf_models_logits(gguf_models):
    """The demo model's make-up (Q4_0 and Q4_1 layers, a Q8_0 head) through tinygemm's arithmetic:
    logits within bf16's rounding of the model's fp32 dequantisation, prompts and steps alike, and
    greedy tokens the same."""
    root = gguf_models["root"]
    tokenizer = str(root / "q4-fp32" / "tokenizer.json")
    fp32 = Llama.build(str(root / "q4-fp32"), tokenizer, max_seq_len=64, max_batch_size=2)
    int4_model = Llama.build(str(root / "q4-int4"), tokenizer, max_seq_len=64, max_batch_size=2)
    use_tinygemm(int4_model.model)
    assert isinstance(int4_model.model.layers[0].attention.wqkv, TinygemmInt4Linear)
    assert not any(isinstance(m, Int4Linear) for m in int4_model.model.modules())
    assert isinstance(int4_model.model.output, Int8Linear)  # the head stays int8, as on CPUs
    tokens = torch.randint(0, fp32.model.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = fp32.model.forward(tokens, 0)
    for got in (int4_model.model.forward(tokens, 0), int4_model.model.forward(tokens[:1, :1], 0)):
        reference = expected[: got.shape[0], : got.shape[1]]
        assert (got - reference).abs().max() <= 0.02 * reference.abs().max()
    prompts = tokens[:, :5].tolist()
    assert int4_model.generate(prompts, 12, temperature=0)[0] == fp32.generate(prompts, 12, temperature=0)[0]


def test_each_int4_layer_is_freed_as_its_packing_replaces_it(checkpoints, tokenizer_path, monkeypatch):
    """On a GPU the packing happens there: one layer's codes and its packing at a time, not two
    copies of every weight."""
    model = Llama.build(str(checkpoints["llama2", 1]), tokenizer_path, 32, 1, quantize="int4").model
    packed_before = []
    packing = TinygemmInt4Linear.packing.__func__

    def watched(cls, layer: Int4Linear) -> TinygemmInt4Linear:
        assert all(before() is None for before in packed_before)  # the layers packed before are gone
        packed_before.append(weakref.ref(layer))
        return packing(cls, layer)

    monkeypatch.setattr(TinygemmInt4Linear, "packing", classmethod(watched))
    use_tinygemm(model)
    assert len(packed_before) == 2 * 4 and all(before() is None for before in packed_before)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_tinygemm_layer_compiles_whole(rows):
    """What a compiled decoding step (CUDA graphs on GPUs) needs of the layer: one graph, no breaks."""
    codes, scales, mins = int4.quantize_int4(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))
    layer = TinygemmInt4Linear.packing(Int4Linear(codes, scales, mins, communicate=lambda y: y))
    x = torch.randn(rows, 1, 64, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_int4_runs_on_gpus_of_compute_capability_8_and_newer(monkeypatch):
    for name, capability in (("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H200", (9, 0))):
        fake_gpu(monkeypatch, name, capability)
        check_int4_device(torch.device("cuda", 0))
    check_int4_device(torch.device("cpu"))


def test_int4_is_refused_where_no_kernel_takes_it(monkeypatch):
    fake_gpu(monkeypatch, "Tesla T4", (7, 5))
    with pytest.raises(ValueError, match=r"quantize='int4' runs on GPUs through torch's tinygemm kernel, which needs "
                                         r"compute capability 8\.0 \(Ampere\) or newer; cuda:1 is a Tesla T4 of compute "
                                         r"capability 7\.5: leave quantize unset or use quantize='int8'"):
        check_int4_device(torch.device("cuda", 1))
    with pytest.raises(ValueError, match=r"quantize='int4' runs on CPUs and on CUDA GPUs of compute capability 8\.0 "
                                         r"or newer, not on mps; leave quantize unset or use quantize='int8'"):
        check_int4_device(torch.device("mps"))
