"""Meta's Llama 4 checkpoints (meta-llama/llama-models, models/llama4) as llama_tp reads them: its
params.json as ModelArgs' keys, and its shards' tensors under llama_tp's names.

Meta's shards hold fused tensors that its model's load hooks take apart: wq, wk and wv side by
side (attention.wqkv), a layer's norms inside the layer after them (wqkv.layer_norm_weight,
feed_forward.mlp.layer_norm_weight or feed_forward.norm), w1 and w3 side by side (mlp.fc1_weight),
and every expert of a layer in one tensor per projection, [experts * dim, hidden] for x times it
(experts.moe_w_in_eD_F). They may also hold TransformerEngine's `_extra_state` entries, pickled
io.BytesIO objects that plain weights-only loading refuses: EXTRA_STATE_GLOBALS lets them load,
and they are dropped by that name, as are the routers' training statistics and the vision
tower's tensors (llama_tp runs the text model).
"""

import codecs
import io
import math
import re

import torch

# What the pickled extra-state objects are made of (bytes: an empty one), allowed while loading a shard.
EXTRA_STATE_GLOBALS = [io.BytesIO, codecs.encode, bytes]
EXTRA_STATE = "._extra_state"
# Dropped by the ends of their names: extra states, and what the routers gathered in training.
DROPPED = (EXTRA_STATE, ".expert_activation_DE", "_stats_3E")
VISION_TOWER = ("vision_embeddings.", "vision_projection.")
# Keys only Meta's Llama 4 params.json has; "model" nests all of them in some copies.
LLAMA4_KEYS = ("moe_args", "use_qk_norm", "ffn_exp", "vision_args")
# Meta's keys that ModelArgs shares, and those that set up a run rather than describe the model.
SHARED_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
               "norm_eps", "rope_theta", "use_scaled_rope", "nope_layer_interval", "attention_chunk_size",
               "attn_temperature_tuning", "floor_scale", "attn_scale")
RUN_KEYS = ("max_batch_size", "max_seq_len")


def is_llama4_params(params: dict) -> bool:
    """Whether a params.json is Meta's Llama 4's (its own keys, maybe nested under "model")."""
    return isinstance(params.get("model"), dict) or any(key in params for key in LLAMA4_KEYS)


def llama4_params(params: dict, source: str) -> dict:
    """ModelArgs' keys for Meta's Llama 4 params.json: the experts' hidden size as Meta's MoE
    computes it, Llama 4 Scout's rope scaling defaults, and the routing Llama 4 does."""
    params = dict(params.get("model", params))
    for key in ("quantization_args", "lora_args"):
        if params.get(key):
            raise ValueError(f"{source}: {key} is set; llama_tp loads Meta's bf16 Llama 4 checkpoints, not "
                             "its quantized or LoRA ones")
    moe = params.get("moe_args") or {}
    unknown = set(params) - set(SHARED_KEYS) - set(RUN_KEYS) - {
        "head_dim", "use_qk_norm", "ffn_exp", "moe_args", "vision_args", "quantization_args", "lora_args",
        "rope_scaling_factor", "rope_high_freq_factor"}
    if unknown:
        raise ValueError(f"{source}: unknown Llama 4 key {sorted(unknown)[0]!r}; is this a Llama 4 params.json?")
    args = {key: params[key] for key in SHARED_KEYS if params.get(key) is not None}
    if params.get("head_dim") not in (None, params["dim"] // params["n_heads"]):
        raise ValueError(f"{source}: head_dim {params['head_dim']} is not dim / n_heads, which Meta's Llama 4 "
                         "attention uses whatever head_dim says")
    args["weightless_qk_norm"] = bool(params.get("use_qk_norm"))
    if params.get("use_scaled_rope"):  # Meta's defaults, which only Llama 4 Scout uses
        args |= {"rope_scaling_factor": float(params.get("rope_scaling_factor") or 16.0),
                 "rope_high_freq_factor": float(params.get("rope_high_freq_factor") or 1.0),
                 "rope_low_freq_factor": 1.0, "rope_original_context": 8192}
    if moe:
        args |= {"n_experts": moe["num_experts"], "experts_per_token": moe.get("top_k", 1),
                 "expert_hidden_dim": expert_hidden_dim(params, moe),
                 "moe_layer_interval": moe.get("interleave_moe_layer_step", 1),
                 "router_scoring": "sigmoid", "expert_weights_on_input": True, "shared_expert": True}
    return args


def expert_hidden_dim(params: dict, moe: dict) -> int:
    """Meta's MoE hidden size: two thirds of ffn_exp * dim, times ffn_dim_multiplier, divided by
    capacity_factor + 1 (auto_scale_F: as many active parameters as a dense layer), rounded up."""
    hidden = int(2 * int(params.get("ffn_exp", 4) * params["dim"]) / 3)
    hidden = int(params["ffn_dim_multiplier"] * hidden)
    if moe.get("auto_scale_F", True):
        hidden = int(hidden / (moe.get("capacity_factor", 1.0) + 1))
    return math.ceil(hidden / params["multiple_of"]) * params["multiple_of"]


def llama_tp_names(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A shard's tensors under llama_tp's names (Meta's fused tensors taken apart as views, no copy),
    without extra states and vision tensors; a shard of any other checkpoint comes back as it is."""
    if not any(name.endswith(("attention.wqkv.weight", "feed_forward.router_DE", EXTRA_STATE)) for name in shard):
        return shard
    renamed = {}
    for name, tensor in shard.items():
        if name.endswith(DROPPED) or name.startswith(VISION_TOWER):
            continue
        layer = re.fullmatch(r"(layers\.\d+\.)(.+)", name)
        parts = _layer_tensors(layer.group(1), layer.group(2), tensor, shard) if layer else None
        renamed |= parts if parts is not None else {name: tensor}
    return renamed


def _layer_tensors(prefix: str, name: str, tensor: torch.Tensor, shard: dict) -> "dict[str, torch.Tensor] | None":
    """Our tensors for a layer's tensor of Meta's name (None: the name is ours already)."""
    renames = {"attention.wqkv.layer_norm_weight": "attention_norm.weight",
               "feed_forward.mlp.layer_norm_weight": "ffn_norm.weight", "feed_forward.norm.weight": "ffn_norm.weight",
               "feed_forward.mlp.fc2_weight": "feed_forward.w2.weight",
               "feed_forward.w_in_shared_FD.weight": "feed_forward.shared_expert.w1.weight",
               "feed_forward.w_swiglu_FD.weight": "feed_forward.shared_expert.w3.weight",
               "feed_forward.w_out_shared_DF.weight": "feed_forward.shared_expert.w2.weight"}
    if name in renames:
        return {prefix + renames[name]: tensor}
    if name == "attention.wqkv.weight":  # this shard's query heads, then its KV heads' keys and values
        queries = shard[prefix + "attention.wo.weight"].shape[1]
        kv = (tensor.shape[0] - queries) // 2
        return dict(zip((prefix + f"attention.{w}.weight" for w in ("wq", "wk", "wv")), tensor.split((queries, kv, kv))))
    if name == "feed_forward.mlp.fc1_weight":
        return dict(zip((prefix + "feed_forward.w1.weight", prefix + "feed_forward.w3.weight"), tensor.chunk(2)))
    if name == "feed_forward.router_DE":  # dim, experts
        return {prefix + "feed_forward.router.weight": tensor.T}
    projections = {"moe_w_in_eD_F": "w1", "moe_w_swiglu_eD_F": "w3", "moe_w_out_eF_D": "w2"}
    kind = name.removeprefix("feed_forward.experts.")
    if kind in projections:
        experts = shard[prefix + "feed_forward.router_DE"].shape[1]
        dim = shard[prefix + "feed_forward.router_DE"].shape[0]
        # in: [experts * dim, hidden]; out: [experts * hidden, dim]; each expert's as a linear weight [out, in]
        by_expert = tensor.view(experts, dim, -1).transpose(1, 2) if kind != "moe_w_out_eF_D" \
            else tensor.view(experts, -1, dim).transpose(1, 2)
        return {prefix + f"feed_forward.experts.{expert}.{projections[kind]}.weight": by_expert[expert]
                for expert in range(experts)}
    return None
