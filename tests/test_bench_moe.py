"""The mixture-of-experts benchmark: its two models have the same active parameters, and a tiny run
reports both models' speeds and their ratio."""

import json

import pytest
import torch

from llama_tp.model.args import ModelArgs
from llama_tp.model.memory import active_params
from llama_tp.tools.bench import moe as bench_moe


@pytest.mark.parametrize("experts_per_token", [1, 2])
def test_the_dense_model_has_the_experts_active_parameters_but_the_routers(experts_per_token):
    params = bench_moe.shapes(768, 8, 12, 4, 32000, 8, experts_per_token)
    experts, dense = (ModelArgs.from_dict(params[name]) for name in ("experts", "dense"))
    assert experts.expert_hidden_dim == 2688 and dense.ffn_hidden_dim == experts_per_token * 2688
    assert active_params(experts) - active_params(dense) == 8 * 8 * 768  # each layer's router


def test_a_tiny_run_times_both_models_interleaved(tmp_path):
    out = tmp_path / "bench_moe.json"
    threads = torch.get_num_threads()
    try:
        bench_moe.main(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, batch_sizes=(1, 2), new_tokens=2,
                       repeats=2, threads=1, json_path=str(out))
    finally:
        torch.set_num_threads(threads)  # the rest of the session's
    report = json.loads(out.read_text())
    for batch in (1, 2):
        case = report["cases"][f"decode_batch_{batch}"]
        assert set(case["tokens_per_s"]) == {"experts", "dense"} and len(case["runs"]["dense"]) == 2
        assert case["experts_cost_vs_dense"] == pytest.approx(case["tokens_per_s"]["dense"] / case["tokens_per_s"]["experts"])
