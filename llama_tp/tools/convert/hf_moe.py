"""What Hugging Face's mixtures of experts add to the Llama family's conversion (hf.py): Mixtral,
Qwen3-MoE and Llama 4's text model, their configs as params.json keys (args.py) and their expert
tensors under our names (feed_forward.py: feed_forward.router, feed_forward.experts.N.w1/w2/w3,
feed_forward.shared_expert.w1/w2/w3)."""

import re
from pathlib import Path
from typing import Callable, Optional

import torch

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "llama4", "llama4_text")
# A multimodal Llama 4 folder's tensors outside its text model, by their names' beginnings: left out.
VISION_TOWER = ("vision_model.", "multi_modal_projector.")
# The text model's tensors in a multimodal Llama 4 folder begin with this.
TEXT_MODEL = "language_model."

# Hugging Face's module names within a layer, as regular expressions, to ours: an expert's number
# and a projection (w1, w2, w3 or gate, down, up) carried over.
PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}
EXPERT_MODULES = {
    r"block_sparse_moe\.gate": "feed_forward.router",  # Mixtral
    r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<projection>w[123])": "feed_forward.experts.{expert}.{projection}",
    r"mlp\.gate": "feed_forward.router",  # Qwen3-MoE
    r"mlp\.experts\.(?P<expert>\d+)\.(?P<projection>gate|up|down)_proj": "feed_forward.experts.{expert}.{projection}",
    r"feed_forward\.router": "feed_forward.router",  # Llama 4
    r"feed_forward\.shared_expert\.(?P<projection>gate|up|down)_proj": "feed_forward.shared_expert.{projection}",
    r"feed_forward\.(?P<projection>gate|up|down)_proj": "feed_forward.{projection}",  # Llama 4's dense layers
}

def text_config(config: dict, where: Path) -> dict:
    """A config's text model: a multimodal Llama 4's text_config (its vision tower is left out), else itself."""
    if config.get("model_type") != "llama4":
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: model_type 'llama4' without a text_config; is the config complete?")
    return text | {"model_type": "llama4"}


def moe_params(config: dict, model_type: str, where: Path) -> dict:
    """params.json's mixture-of-experts keys for a Mixtral, Qwen3-MoE or Llama 4 config."""
    if model_type == "mixtral":
        return {"n_experts": config["num_local_experts"], "experts_per_token": config["num_experts_per_tok"],
                "expert_hidden_dim": config["intermediate_size"], "normalize_expert_weights": True}
    if model_type == "qwen3_moe":
        if config.get("mlp_only_layers"):
            raise ValueError(f"{where}: mlp_only_layers is {config['mlp_only_layers']!r}; llama_tp's Qwen3-MoE "
                             "has experts in every decoder_sparse_step-th layer, with no exceptions")
        # transformers 5 writes num_local_experts where published Qwen3 configs say num_experts.
        experts = config.get("num_experts") or config["num_local_experts"]
        return {"n_experts": experts, "experts_per_token": config["num_experts_per_tok"],
                "expert_hidden_dim": config["moe_intermediate_size"],
                "moe_layer_interval": config.get("decoder_sparse_step", 1),
                "normalize_expert_weights": bool(config.get("norm_topk_prob"))}
    return llama4_params(config, where)


def llama4_params(config: dict, where: Path) -> dict:
    """params.json's keys for a Llama 4 text config: experts, NoPE layers, chunked attention."""
    n_layers = config["num_hidden_layers"]
    step = config.get("interleave_moe_layer_step", 1)
    _check_every(config, "moe_layers", [layer for layer in range(n_layers) if (layer + 1) % step == 0], where)
    interval = config.get("no_rope_layer_interval", 4)
    rotary = [int((layer + 1) % interval != 0) for layer in range(n_layers)]
    _check_every(config, "no_rope_layers", rotary, where)
    chunk = config.get("attention_chunk_size")
    kinds = ["chunked_attention" if rotates and chunk else "full_attention" for rotates in rotary]
    _check_every(config, "layer_types", kinds, where)
    return {
        "n_experts": config["num_local_experts"], "experts_per_token": config.get("num_experts_per_tok", 1),
        "expert_hidden_dim": config["intermediate_size"], "moe_layer_interval": step,
        "router_scoring": "sigmoid", "expert_weights_on_input": True, "shared_expert": True,
        "nope_layer_interval": interval, "attention_chunk_size": chunk,
        "weightless_qk_norm": bool(config.get("use_qk_norm", True)),
        "attn_temperature_tuning": bool(config.get("attn_temperature_tuning", True)),
        "floor_scale": float(config.get("floor_scale", 8192)), "attn_scale": float(config.get("attn_scale", 0.1)),
    }


def _check_every(config: dict, key: str, expected: list, where: Path) -> None:
    """Refuse a per-layer list that is not the regular pattern llama_tp computes."""
    if config.get(key) is not None and list(config[key]) != expected:
        raise ValueError(f"{where}: {key} is {config[key]!r}; llama_tp runs Llama 4's regular pattern, {expected}")


def dense_hidden_dim(config: dict, model_type: str) -> int:
    """The hidden size of the layers without experts (Llama 4 names it apart)."""
    return config.get("intermediate_size_mlp", config["intermediate_size"]) if model_type.startswith("llama4") \
        else config["intermediate_size"]


def expert_module(module: str) -> Optional[str]:
    """Our name for a Hugging Face module of a layer's mixture of experts (e.g. block_sparse_moe.gate),
    or None if it is not one."""
    for pattern, target in EXPERT_MODULES.items():
        match = re.fullmatch(pattern, module)
        if match:
            found = match.groupdict()
            if "projection" in found:
                found["projection"] = PROJECTIONS[found["projection"]]
            return target.format(**found)
    return None


def fused_expert_loaders(name: str, layer: str, handle) -> Optional[dict[str, Callable[[], torch.Tensor]]]:
    """Llama 4's experts held together in one tensor: gate_up_proj [experts, dim, 2 * hidden]
    (x times it), down_proj [experts, hidden, dim]. A loader for each expert's w1, w3 or w2 under our
    names (as linear weights: [out, in]), reading only that expert's slab; None for another tensor."""
    kind = name.rsplit(".", 1)[-1]
    if not name.endswith(f"feed_forward.experts.{kind}") or kind not in ("gate_up_proj", "down_proj"):
        return None
    experts, _, width = handle.get_slice(name).get_shape()
    loaders = {}
    for expert in range(experts):
        prefix = f"layers.{layer}.feed_forward.experts.{expert}"
        if kind == "down_proj":
            loaders[f"{prefix}.w2.weight"] = lambda expert=expert: handle.get_slice(name)[expert].T.contiguous()
            continue
        for part, target in enumerate(("w1", "w3")):  # gate, then up
            loaders[f"{prefix}.{target}.weight"] = lambda expert=expert, part=part: (
                handle.get_slice(name)[expert].T[part * width // 2 : (part + 1) * width // 2].contiguous())
    return loaders
