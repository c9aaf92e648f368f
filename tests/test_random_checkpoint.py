"""Random checkpoints in a published Llama's shape (the GPU benchmarks' stand-in weights)."""

import json

import pytest
import torch

from llama_tp import Llama
from llama_tp.model.args import ModelArgs
from llama_tp.model.memory import plan
from llama_tp.tools.bench import random_checkpoint
from llama_tp.tools.bench.random_checkpoint import SHAPES, random_weights
from tiny_checkpoint import LLAMA2_TOKENIZER


@pytest.mark.parametrize("shape, parameters", [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248)])
def test_shapes_hold_the_published_parameter_counts(shape, parameters):
    args = ModelArgs.from_dict(SHAPES[shape])
    per_layer = 2 * args.dim * args.dim + 2 * args.kv_heads * args.head_dim * args.dim + 3 * args.dim * args.ffn_hidden_dim
    assert 2 * args.vocab_size * args.dim + args.n_layers * (per_layer + 2 * args.dim) + args.dim == parameters


def test_the_mixtral_shape_holds_its_published_parameter_count():
    assert plan(ModelArgs.from_dict(SHAPES["mixtral-8x7b"]), 1, 1, 1, "bf16").params_total == 46_702_792_704


@pytest.mark.parametrize("experts", [{}, {"n_experts": 4, "experts_per_token": 2, "expert_hidden_dim": 96}])
def test_a_written_checkpoint_loads_and_decodes_finite_logits(tmp_path, monkeypatch, experts):
    tiny = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-5,
            "vocab_size": 32000, **experts}
    monkeypatch.setitem(SHAPES, "tiny", tiny)
    random_checkpoint.main("tiny", str(tmp_path))
    assert json.loads((tmp_path / "params.json").read_text()) == tiny
    llama = Llama.build(str(tmp_path), str(LLAMA2_TOKENIZER), max_seq_len=32, max_batch_size=1, dtype="fp32")
    logits = llama.model.forward(torch.tensor([[1, 450, 4996]]), 0)
    assert logits.shape == (1, 3, 32000) and torch.isfinite(logits).all() and logits.std() > 0.1
    weights = random_weights(ModelArgs.from_dict(tiny), torch.device("cpu"), seed=0)
    assert all(tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" for tensor in weights.values())


def test_an_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama2-7b, llama3-8b, mixtral-8x7b"):
        random_checkpoint.main("llama2-70b", str(tmp_path))
