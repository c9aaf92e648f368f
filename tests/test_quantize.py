"""int8 linear layers: the rounding is right, logits stay close to fp32 and greedy answers do not change."""

import pytest
import torch

from llama_tp import Llama
from llama_tp.quantize import LOW_TERM_SCALE, Int8Linear, int8_product, quantize_int8
from distributed import run_world
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_LLAMA2, full_weights, write_checkpoint

PROMPTS = [[1, 319, 2], [1, 450, 6593, 310], [1, 15043], [1, 29871, 13, 13, 29901], [1, 1724, 338, 263]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    weights = full_weights(TINY_LLAMA2, 32000)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TINY_LLAMA2, weights, n_shards=1, layout="dim")


def test_quantize_int8_rounds_each_row_to_its_own_grid():
    weight = torch.tensor([[0.5, -1.0, 0.25], [127.0, 3.0, -0.4]])
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and scales.shape == (2, 1)
    torch.testing.assert_close(scales.flatten(), torch.tensor([1.0 / 127, 1.0]))
    assert q.tolist() == [[64, -127, 32], [127, 3, 0]]
    assert (q * scales - weight).abs().max() <= scales.max() / 2


@pytest.mark.parametrize("shape", [(1, 1, 96), (3, 5, 96), (2, 7)])
def test_int8_product_equals_the_dequantized_weights_product(shape):
    """Activations split into two int8 terms keep about 15 bits: the integer product is the
    dequantized weight's fp32 product to within 1/64516 of each row's largest activation per term."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 3
    x.view(-1)[5] = 50.0  # an outlier sets its row's grid
    q, scales = quantize_int8(torch.randn(40, shape[-1], generator=generator))
    expected = torch.nn.functional.linear(x, q.float()) * scales.flatten()
    got = int8_product(x, q, scales.flatten())
    assert got.shape == expected.shape and got.dtype == x.dtype
    largest = x.abs().amax(dim=-1, keepdim=True)  # ..., 1
    bound = largest / (2 * 127 * LOW_TERM_SCALE) * (q.float().abs() * scales).sum(dim=1)  # every activation off by its bound
    assert ((got - expected).abs() <= bound * 1.01 + 1e-6).all()
    assert (got - expected).abs().max() > 0  # integer arithmetic, not a float product in disguise
    assert int8_product(torch.zeros(shape), q, scales.flatten()).eq(0).all()


def _build(ckpt, quantize):
    return Llama.build(str(ckpt), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=5, quantize=quantize)


@pytest.mark.parametrize("quantize, tolerance", [("int8", 0.02), ("int8_dynamic", 0.05)])
def test_int8_logits_close_and_greedy_unchanged(tiny_ckpt, quantize, tolerance):
    reference = _build(tiny_ckpt, None)
    quantized = _build(tiny_ckpt, quantize)
    assert sum(isinstance(m, Int8Linear) for m in quantized.model.modules()) == 2 * 4 + 1  # wqkv, wo, w13, w2 per layer, and the output
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
    """A 24-row prompt (weights converted) and one-token steps (integer products) at batch 2."""
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=2, quantize=quantize)
    tokens = torch.randint(3, 32000, (2, 16), generator=torch.Generator().manual_seed(5))
    logits = [llama.model.forward(tokens[:, :12], 0)]
    return logits + [llama.model.forward(tokens[:, pos : pos + 1], pos) for pos in range(12, 16)]


def test_int8_over_two_processes_stays_close_to_fp32(checkpoints):
    """Each rank rounds its own slice of every weight (a row-parallel slice gets its own scales):
    both ranks agree exactly, and the logits stay as close to fp32 as one process's int8 does."""
    expected = _step_logits(str(checkpoints["llama2", 1]), None)
    ranks = run_world(2, _step_logits, str(checkpoints["llama2", 2]), "int8")
    for got, other, want in zip(ranks[0], ranks[1], expected, strict=True):
        assert torch.equal(got, other)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_unknown_quantization_is_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="quantize='int4'.*int8, int8_dynamic"):
        _build(tiny_ckpt, "int4")
