"""The mixture-of-experts feed-forward (feed_forward.py) against a plain computation of every expert,
the routing rules, what ModelArgs accepts, and the memory plan of published mixtures of experts."""

import pytest
import torch

from llama_tp import parallel
from llama_tp.model.args import ModelArgs
from llama_tp.model.feed_forward import MixtureOfExperts, route
from llama_tp.model.memory import active_params, plan

TINY = {"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 64, "n_experts": 6, "experts_per_token": 2,
        "expert_hidden_dim": 24}


def test_softmax_routing_takes_the_k_most_probable_experts_and_renormalises_on_request():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 0.0, 4.0]])
    probabilities = logits.softmax(dim=-1)
    weights, experts = route(logits, 2, "softmax", normalize=False)
    assert experts.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, torch.stack([probabilities[0, [1, 2]], probabilities[1, [3, 0]]]))
    normalized, _ = route(logits, 2, "softmax", normalize=True)
    torch.testing.assert_close(normalized, weights / weights.sum(dim=-1, keepdim=True))


def test_sigmoid_routing_takes_the_k_largest_logits_each_through_a_sigmoid():
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0]])
    weights, experts = route(logits, 1, "sigmoid", normalize=False)
    assert experts.tolist() == [[1]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[3.0]])))


def random_experts(params: dict) -> MixtureOfExperts:
    parallel.init()
    torch.manual_seed(0)
    layer = MixtureOfExperts(ModelArgs.from_dict(params), model_parallel_size=1)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    return layer


def every_expert(layer: MixtureOfExperts, x: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The layer's output computed plainly in fp64: every expert on every token, each token's
    output the weighted sum of its chosen ones', independently of the layer's grouping."""
    def swiglu(expert, tokens):
        w1, w3 = expert.w13.weight.double().split(expert.local_widths)
        return torch.nn.functional.silu(tokens @ w1.T) * (tokens @ w3.T) @ expert.w2.weight.double().T

    x = x.double()
    logits = x @ layer.router.weight.double().T
    out = torch.zeros_like(x)
    for token in range(len(x)):
        if args.router_scoring == "sigmoid":
            top = logits[token].topk(args.experts_per_token)
            chosen = zip(top.indices.tolist(), torch.sigmoid(top.values).tolist())
        else:
            top = logits[token].softmax(dim=-1).topk(args.experts_per_token)
            values = top.values / top.values.sum() if args.normalize_expert_weights else top.values
            chosen = zip(top.indices.tolist(), values.tolist())
        for expert, weight in chosen:
            if args.expert_weights_on_input:
                out[token] += swiglu(layer.experts[expert], weight * x[token])
            else:
                out[token] += weight * swiglu(layer.experts[expert], x[token])
        if layer.shared_expert is not None:
            out[token] += swiglu(layer.shared_expert, x[token])
    return out


@pytest.mark.parametrize("twists", [
    {"normalize_expert_weights": True},  # Mixtral
    {"experts_per_token": 3},  # Qwen3-MoE without norm_topk_prob
    {"experts_per_token": 1, "router_scoring": "sigmoid", "expert_weights_on_input": True, "shared_expert": True},  # Llama 4
])
def test_each_token_goes_through_its_chosen_experts_only_and_gets_their_weighted_sum(twists):
    params = TINY | twists
    args = ModelArgs.from_dict(params)
    layer = random_experts(params)
    rows = {expert: 0 for expert in range(args.n_experts)}
    for index, expert in enumerate(layer.experts):
        expert.register_forward_hook(lambda module, inputs, output, index=index: rows.__setitem__(
            index, rows[index] + inputs[0].shape[0]))
    x = torch.randn(3, 7, args.dim, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    torch.testing.assert_close(out.double(), every_expert(layer, x.flatten(0, 1), args).view_as(out), atol=1e-5, rtol=0)
    _, chosen = route(layer.router(x.flatten(0, 1)), args.experts_per_token, args.router_scoring, False)
    assert rows == {expert: int((chosen == expert).sum()) for expert in range(args.n_experts)}
    assert sum(rows.values()) == 21 * args.experts_per_token  # never every token through every expert


def test_a_tokens_output_does_not_depend_on_what_else_is_in_the_batch():
    layer = random_experts(TINY)
    x = torch.randn(9, TINY["dim"], generator=torch.Generator().manual_seed(2))
    together = layer(x[None])[0]
    for token in range(len(x)):
        # Up to fp32 rounding: torch's own products (without our kernels) block a batch of one
        # row otherwise than one of nine; another choice of experts would differ by far more.
        torch.testing.assert_close(layer(x[token : token + 1][None])[0, 0], together[token], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"expert_hidden_dim": None}, "n_experts is 6 but expert_hidden_dim is missing"),
    ({"experts_per_token": 7}, "experts_per_token must be 1 to n_experts \\(6\\), found 7"),
    ({"router_scoring": "softplus"}, "router_scoring must be one of softmax, sigmoid, found 'softplus'"),
    ({"n_experts": 0}, "n_experts must be positive or null, found 0"),
    ({"moe_layer_interval": 0}, "moe_layer_interval must be positive, found 0"),
    ({"attention_chunk_size": -8}, "attention_chunk_size must be positive or null"),
    ({"qk_norm": True, "weightless_qk_norm": True}, "qk_norm .* and weightless_qk_norm .* exclude each other"),
    ({"router_scoring": 1}, "router_scoring must be str, found 1"),
])
def test_expert_and_llama4_keys_are_checked_naming_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(TINY | change)


def test_world_sizes_must_split_every_experts_hidden_size():
    args = ModelArgs.from_dict(TINY | {"n_heads": 8, "expert_hidden_dim": 12})
    assert args.splits_over(4) and not args.splits_over(8)
    with pytest.raises(ValueError, match="expert size 12.*world sizes that work: 1, 2, 4$"):
        args.check_model_parallel_size(8)


# Published shapes: Mixtral 8x7B (config.json) and Llama 4 Scout's text model (its text_config).
MIXTRAL_8X7B = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 32000,
                "multiple_of": 1024, "ffn_dim_multiplier": 1.3125, "n_experts": 8, "experts_per_token": 2,
                "expert_hidden_dim": 14336, "normalize_expert_weights": True}
LLAMA4_SCOUT = {"dim": 5120, "n_layers": 48, "n_heads": 40, "n_kv_heads": 8, "vocab_size": 202048,
                "multiple_of": 2048, "ffn_dim_multiplier": 1.2, "n_experts": 16, "experts_per_token": 1,
                "expert_hidden_dim": 8192, "shared_expert": True, "router_scoring": "sigmoid",
                "expert_weights_on_input": True, "nope_layer_interval": 4, "attention_chunk_size": 8192}


def test_the_memory_plan_counts_every_expert_and_the_active_ones():
    """Mixtral 8x7B: 46.7 billion parameters, 12.9 billion active; Llama 4 Scout's text model: 107.8
    billion, 17.2 billion active (its 109 billion count its vision tower too). Every rank holds its
    slice of every expert; the routers are whole on each."""
    for params, total, active in ((MIXTRAL_8X7B, 46.70e9, 12.88e9), (LLAMA4_SCOUT, 107.77e9, 17.17e9)):
        args = ModelArgs.from_dict(params)
        memory = plan(args, 8, 1, 4096, "bf16")
        assert memory.params_total == pytest.approx(total, rel=1e-3)
        assert active_params(args) == pytest.approx(active, rel=1e-3)
        routers = args.n_layers * args.n_experts * args.dim
        norms = (2 * args.n_layers + 1) * args.dim
        assert memory.params_per_rank - routers - norms == (memory.params_total - routers - norms) // 8
    int4 = plan(ModelArgs.from_dict(MIXTRAL_8X7B), 2, 1, 4096, "bf16", "int4")
    assert int4.weight_bytes < 0.32 * plan(ModelArgs.from_dict(MIXTRAL_8X7B), 2, 1, 4096, "bf16").weight_bytes
