"""Plain int4 and int8 layers' eager decoding step in one C++ call (model/layer_step.py): the same
logits and caches, bit for bit, as the layers stepping module by module, for one row, rows at
different positions and several tokens a row, on one rank and on two; layers it cannot take step
module by module."""

import pytest
import torch

from llama_tp import Llama
from llama_tp.kernels import cpu_kernels
from llama_tp.model import layer_step, transformer
from llama_tp.model.quantize import Int4Linear
from distributed import run_world
from tiny_checkpoint import LLAMA2_TOKENIZER, TINY_WIDE_HEADS, full_weights, write_checkpoint

pytestmark = pytest.mark.skipif(not cpu_kernels.decoding_kernels_run_on(torch.device("cpu")),
                                reason="our CPU kernels (AVX-512 or AVX2) are not built here")

VOCAB = 32000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    # grouped KV heads of 16 channels
    write_checkpoint(directory, TINY_WIDE_HEADS, full_weights(TINY_WIDE_HEADS, VOCAB), 1, "vocab")
    return str(directory)


@pytest.fixture(scope="module")
def two_shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny2")
    write_checkpoint(directory, TINY_WIDE_HEADS, full_weights(TINY_WIDE_HEADS, VOCAB), 2, "vocab")
    return str(directory)


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_llama(request, checkpoint) -> Llama:
    return Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=96, max_batch_size=4, quantize=request.param)


def caches(model) -> list[torch.Tensor]:
    return [tensor.clone() for layer in model.layers for tensor in (layer.attention.cache.k, layer.attention.cache.v)]


def restore(model, saved: list[torch.Tensor]) -> None:
    pools = [tensor for layer in model.layers for tensor in (layer.attention.cache.k, layer.attention.cache.v)]
    for pool, tensor in zip(pools, saved):
        pool.copy_(tensor)


def step_both_ways(model, starts: list[int], tokens: int, patch) -> tuple[int, bool, bool]:
    """Rows with prompts at starts, then a step of `tokens` tokens a row through the one call and
    again (the caches as before it) module by module: the one call's calls, and whether the
    logits and the caches are the same bits."""
    generator = torch.Generator().manual_seed(len(starts) + tokens)
    for slot, start in enumerate(starts):  # each row's prompt, through the prompt's path
        model.forward(torch.randint(3, VOCAB, (1, start), generator=generator), 0, slots=[slot])
    step = torch.randint(3, VOCAB, (len(starts), tokens), generator=generator)
    before = caches(model)
    calls = []
    patch(layer_step.QuantizedLayersStep, "__call__",
          lambda self, h, rows, call=layer_step.QuantizedLayersStep.__call__: calls.append(h.shape) or call(self, h, rows))
    in_one_call = model.forward(step, starts)
    after_one_call = caches(model)
    restore(model, before)
    patch(transformer, "quantized_layers_step", lambda layers: None)
    one_by_one = model.forward(step, starts)
    same_caches = all(torch.equal(pool, expected) for pool, expected in zip(after_one_call, caches(model)))
    return calls, torch.equal(in_one_call, one_by_one), same_caches


@pytest.mark.parametrize("starts, tokens", [([5], 1), ([5, 40, 17], 1), ([9, 2], 3)],
                         ids=["one row", "rows at their own positions", "three tokens a row"])
def test_one_call_gives_the_bits_of_the_layers_one_by_one(quantized_llama, monkeypatch, starts, tokens):
    calls, same_logits, same_caches = step_both_ways(quantized_llama.model, starts, tokens, monkeypatch.setattr)
    assert calls == [(len(starts), tokens, TINY_WIDE_HEADS["dim"])]  # the whole step went through the one call
    assert same_logits and same_caches


def _on_a_rank_of_two(folder: str, quantize: str) -> tuple:
    llama = Llama.build(folder, str(LLAMA2_TOKENIZER), max_seq_len=96, max_batch_size=4, quantize=quantize)
    return step_both_ways(llama.model, [5, 40, 17], 2, setattr)


@pytest.mark.slow  # two spawned processes
@pytest.mark.skipif(not cpu_kernels.ON_THIS_CPU, reason="the C++ exchange between ranks is built with the AVX-512 kernels")
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_two_ranks_sum_through_the_exchange_in_the_one_call(two_shards, quantize):
    for calls, same_logits, same_caches in run_world(2, _on_a_rank_of_two, two_shards, quantize):
        assert calls == [(3, 2, TINY_WIDE_HEADS["dim"])]
        assert same_logits and same_caches


def test_greedy_answers_are_those_of_the_layers_one_by_one(quantized_llama, monkeypatch):
    prompts = [[1, 306, 4658, 278, 6593], [1, 450, 4996]]
    in_one_call = quantized_llama.generate(prompts, 24, temperature=0.0)[0]
    monkeypatch.setattr(transformer, "quantized_layers_step", lambda layers: None)
    quantized_llama.forget_prefixes()
    assert quantized_llama.generate(prompts, 24, temperature=0.0)[0] == in_one_call


def test_layers_it_cannot_take_step_one_module_at_a_time(checkpoint, quantized_llama):
    step = layer_step.quantized_layers_step(quantized_llama.model.layers)
    assert step is not None and step.bits == (4 if isinstance(quantized_llama.model.layers[0].attention.wqkv, Int4Linear) else 8)
    fp32 = Llama.build(checkpoint, str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=1, dtype="fp32")
    assert layer_step.quantized_layers_step(fp32.model.layers) is None
    mixed = quantized_llama.model.layers[:1].extend([fp32.model.layers[1]])  # a new list: a quantized layer, an fp32 one
    assert layer_step.quantized_layers_step(mixed) is None
