"""int8 linear layers: the rounding is right, weights from GGUF blocks are kept, logits stay close
to fp32 and greedy answers do not change."""

import pytest
import torch

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels, int4, int8
from llama_tp.kernels.int8 import dequantize, quantize_int8
from llama_tp.model.quantize import DynamicInt8Linear, Int8Linear
from llama_tp.checkpoint.sharding import COLUMN_PARALLEL, ROW_PARALLEL
from distributed import run_world
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

PROMPTS = [[1, 319, 2], [1, 450, 6593, 310], [1, 15043], [1, 29871, 13, 13, 29901], [1, 1724, 338, 263]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    weights = full_weights(TINY_LLAMA2, 32000)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_LLAMA2, weights, n_shards=1, layout="dim")


def _on_q4_1_grid(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """weight with each group of 32 inputs moved onto a GGUF Q4_1 grid: d * (0..15) + m, with its
    own fp16 d and m, as llama.cpp's 4-bit blocks store it."""
    groups = weight.float().reshape(weight.shape[0], -1, 32)
    d = (groups.std(dim=-1, keepdim=True) / 4).half().float()
    m = (groups.amin(dim=-1, keepdim=True)).half().float()
    q = torch.randint(0, 16, groups.shape, generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # each block spans its whole range, as a block quantized from data does
    return (d * q + m).reshape(weight.shape)


def _on_q8_0_grid(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """weight with each group of 32 inputs on a GGUF Q8_0 grid: d * (-127..127), the largest reached."""
    groups = weight.float().reshape(weight.shape[0], -1, 32)
    d = (groups.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    q = torch.randint(-127, 128, groups.shape, generator=generator).float()
    q[..., 0] = 127
    return (d * q).reshape(weight.shape)


def test_quantize_int8_rounds_each_group_of_32_to_its_own_grid():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 96, generator=generator) * torch.tensor([0.01, 1.0, 100.0]).repeat_interleave(32)
    q, scales, zeros = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == (6, 96) and scales.shape == zeros.shape == (6, 3)
    error = (dequantize(q, scales, zeros, torch.float32) - weight).abs().reshape(6, 3, 32)
    # Each group's error is at most half of its own step, a step of a 255th of its range or less.
    groups = weight.reshape(6, 3, 32)
    span = groups.amax(dim=-1) - groups.amin(dim=-1)
    assert (error.amax(dim=-1) <= span / 255 / 2 * 1.0001).all()
    assert torch.equal(quantize_int8(torch.zeros(2, 64))[0], torch.zeros(2, 64, dtype=torch.int8))


def test_quantize_int8_keeps_weights_from_gguf_blocks_exactly():
    """Weights from 4-bit Q4_1 blocks fit the span grid (15 steps are 17 of its 255), Q8_0's fit the
    symmetric one: both come back to within fp32 rounding, where one grid per row would move them."""
    generator = torch.Generator().manual_seed(1)
    for weight in (_on_q4_1_grid(torch.randn(8, 128, generator=generator), generator),
                   _on_q8_0_grid(torch.randn(8, 128, generator=generator), generator)):
        q, scales, zeros = quantize_int8(weight)
        error = (dequantize(q, scales, zeros, torch.float32) - weight).abs().max()
        assert error <= 1e-6 * weight.abs().max()
        row_step = weight.abs().amax(dim=1) / 127
        assert error < row_step.min() / 100


def test_quantize_int8_groups_fewer_inputs_when_the_width_is_not_a_multiple_of_32():
    q, scales, zeros = quantize_int8(torch.randn(4, 48))  # a row-parallel slice may be this narrow
    assert scales.shape == (4, 3)  # groups of 16


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", [int8, int4], ids=["int8", "int4"])
def test_grouped_product_equals_the_dequantized_weights_product(rows, compiled, kind):
    """What int8 and int4 layers run for one row where our kernels do not."""
    generator = torch.Generator().manual_seed(2)
    weight = (quantize_int8 if kind is int8 else int4.quantize_int4)(torch.randn(40, 96, generator=generator))
    x = torch.randn(rows, 1, 96, generator=generator)
    expected = torch.nn.functional.linear(x.double(), kind.dequantize(*weight, torch.float64))
    product = torch.compile(kind.grouped_product, dynamic=False) if compiled else kind.grouped_product
    got = product(x, *weight)
    assert got.shape == (rows, 1, 40) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _build(ckpt, quantize):
    return Llama.build(str(ckpt), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=5, quantize=quantize)


@pytest.mark.parametrize("quantize, tolerance", [("int8", 0.02), ("int8_dynamic", 0.05)])
def test_int8_logits_close_and_greedy_unchanged(tiny_ckpt, quantize, tolerance):
    reference = _build(tiny_ckpt, None)
    quantized = _build(tiny_ckpt, quantize)
    layer = Int8Linear if quantize == "int8" else DynamicInt8Linear
    layers = [m for m in quantized.model.modules() if isinstance(m, layer)]
    assert len(layers) == 2 * 4 + 1  # wqkv, wo, w13, w2 per layer, and the output
    if quantize == "int8":  # through the C++ kernel wherever it runs
        assert all(m.blocked == cpu_kernels.decoding_kernels_run_on(torch.device("cpu")) for m in layers)
    greedy, _ = reference.generate(PROMPTS, max_gen_len=20, temperature=0, echo=True)
    width = max(map(len, greedy))
    tokens = torch.tensor([row + [3] * (width - len(row)) for row in greedy])  # bsz, width
    expected = reference.model.forward(tokens, 0)
    got = quantized.model.forward(tokens, 0)
    error = (got - expected).abs().max()
    assert error <= tolerance * expected.abs().max()
    # Greedy answers must agree except where fp32 itself nearly ties: a random model (unlike a
    # trained one) has such near-ties, and there the rounding may rightly tip the choice.
    top2 = expected.topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]  # bsz, width: fp32's lead of its choice for the next token
    quantized_greedy, _ = quantized.generate(PROMPTS, max_gen_len=20, temperature=0, echo=True)
    for row, (ours, theirs) in enumerate(zip(quantized_greedy, greedy)):
        first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first_difference is not None:
            assert margins[row, first_difference - 1] < 2 * error, (row, first_difference)


def _step_logits(folder: str, quantize) -> list[torch.Tensor]:
    """An 80-row prompt (int8 weights converted back) and one-token steps at batch 2 and 1."""
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=48, max_batch_size=2, quantize=quantize)
    tokens = torch.randint(3, 32000, (2, 45), generator=torch.Generator().manual_seed(5))
    logits = [llama.model.forward(tokens[:, :40], 0)]
    logits += [llama.model.forward(tokens[:, pos : pos + 1], pos) for pos in range(40, 44)]
    return logits + [llama.model.forward(tokens[:1, 44:45], 44)]


@pytest.mark.slow
def test_int8_over_two_processes_stays_close_to_fp32(checkpoints):
    """Each rank rounds its own slice of every weight (a row-parallel slice gets its own scales):
    both ranks agree exactly, and the logits stay as close to fp32 as one process's int8 does."""
    expected = _step_logits(str(checkpoints["llama2", 1]), None)
    ranks = run_world(2, _step_logits, str(checkpoints["llama2", 2]), "int8")
    for got, other, want in zip(ranks[0], ranks[1], expected, strict=True):
        assert torch.equal(got, other)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_unknown_quantization_is_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="quantize='int2'.*int8, int4, int8_dynamic"):
        _build(tiny_ckpt, "int2")


def test_int8_of_a_model_from_gguf_blocks_gives_fp32_logits(tmp_path):
    """A model whose linear weights lie on Q4_1 and Q8_0 grids (as the demo model's do) keeps its
    logits to fp32's rounding and its greedy answers exactly under int8."""
    generator = torch.Generator().manual_seed(3)
    weights = {}
    for name, tensor in full_weights(TINY_LLAMA2, 32000).items():
        module = name.split(".")[-2]  # layers.0.attention.wq.weight -> wq
        grid = _on_q8_0_grid if module == "output" else _on_q4_1_grid if module in COLUMN_PARALLEL + ROW_PARALLEL else None
        weights[name] = tensor.float() if grid is None else grid(tensor, generator)
    ckpt = write_checkpoint(tmp_path, TINY_LLAMA2, weights, n_shards=1, layout="dim")
    reference, quantized = _build(ckpt, None), _build(ckpt, "int8")
    tokens = torch.tensor(PROMPTS[1:2] * 2)
    expected = reference.model.forward(tokens, 0)
    torch.testing.assert_close(quantized.model.forward(tokens, 0), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())
    greedy, _ = reference.generate(PROMPTS, max_gen_len=20, temperature=0)
    assert quantized.generate(PROMPTS, max_gen_len=20, temperature=0)[0] == greedy
