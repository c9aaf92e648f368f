"""Plain int4 layers' eager decoding step in one C++ call (model/layer_step.py): the same logits
and caches, bit for bit, as the layers stepping module by module, for one row, rows at different
positions and several tokens a row; layers it cannot take step module by module."""

import pytest
import torch

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels
from llama_tp.model import layer_step, transformer
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_WIDE_HEADS, full_weights, write_checkpoint

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="our CPU kernels (AVX-512 or AVX2) are not built here")

VOCAB = 32000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    write_checkpoint(directory, TINY_WIDE_HEADS, full_weights(TINY_WIDE_HEADS, VOCAB), 1, "vocab")  # grouped KV heads of 16 channels
    return str(directory)


@pytest.fixture(scope="module")
def int4_llama(checkpoint) -> Llama:
    return Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=96, max_batch_size=4, quantize="int4")


def caches(model) -> list[torch.Tensor]:
    return [tensor.clone() for layer in model.layers for tensor in (layer.attention.cache.k, layer.attention.cache.v)]


def restore(model, saved: list[torch.Tensor]) -> None:
    pools = [tensor for layer in model.layers for tensor in (layer.attention.cache.k, layer.attention.cache.v)]
    for pool, tensor in zip(pools, saved):
        pool.copy_(tensor)


@pytest.mark.parametrize("starts, tokens", [([5], 1), ([5, 40, 17], 1), ([9, 2], 3)],
                         ids=["one row", "rows at their own positions", "three tokens a row"])
def test_one_call_gives_the_bits_of_the_layers_one_by_one(int4_llama, monkeypatch, starts, tokens):
    model = int4_llama.model
    generator = torch.Generator().manual_seed(len(starts) + tokens)
    for slot, start in enumerate(starts):  # each row's prompt, through the prompt's path
        model.forward(torch.randint(3, VOCAB, (1, start), generator=generator), 0, slots=[slot])
    step = torch.randint(3, VOCAB, (len(starts), tokens), generator=generator)
    before = caches(model)

    calls = []
    monkeypatch.setattr(layer_step.Int4LayersStep, "__call__",
                        lambda self, h, rows, call=layer_step.Int4LayersStep.__call__: calls.append(h.shape) or call(self, h, rows))
    in_one_call = model.forward(step, starts)
    after_one_call = caches(model)
    assert calls == [(len(starts), tokens, TINY_WIDE_HEADS["dim"])]  # the whole step went through the one call

    restore(model, before)
    monkeypatch.setattr(transformer, "int4_layers_step", lambda layers: None)
    one_by_one = model.forward(step, starts)
    assert torch.equal(in_one_call, one_by_one)
    for pool, expected in zip(after_one_call, caches(model)):
        assert torch.equal(pool, expected)


def test_greedy_answers_are_those_of_the_layers_one_by_one(int4_llama, monkeypatch):
    prompts = [[1, 306, 4658, 278, 6593], [1, 450, 4996]]
    in_one_call = int4_llama.generate(prompts, 24, temperature=0.0)[0]
    monkeypatch.setattr(transformer, "int4_layers_step", lambda layers: None)
    int4_llama.forget_prefixes()
    assert int4_llama.generate(prompts, 24, temperature=0.0)[0] == in_one_call


def test_layers_it_cannot_take_step_one_module_at_a_time(checkpoint, int4_llama):
    assert layer_step.int4_layers_step(int4_llama.model.layers) is not None
    int8 = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=1, quantize="int8")
    assert layer_step.int4_layers_step(int8.model.layers) is None
    fp32 = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=1, dtype="fp32")
    assert layer_step.int4_layers_step(fp32.model.layers) is None
